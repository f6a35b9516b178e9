"""One configuration channel (issue 44): every environment variable is declared and read in
settings.py alone, and docs/configuration.md's table is its declarations; every flag of the
real parser is in docs/cli.md, in its command's section; the CLI is built a command at a time
and nothing imports its entry point back."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
from pathlib import Path

import pytest

from freetoken import settings
from freetoken.cli.parser import build_parser

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "freetoken"
SETTINGS = PACKAGE / "settings.py"
CLI_MD = (ROOT / "docs" / "cli.md").read_text()
CONFIGURATION_MD = (ROOT / "docs" / "configuration.md").read_text()
# The argument groups several commands share: documented once, in cli.md's shared section.
SHARED_GROUPS = ("model and engine", "expert placement (MoE models)", "sampling")
SHARED_SECTION = "Options shared by serve, generate, shell and launch"
# What reads or writes the process's environment (os.environ, os.getenv, ...).
ENVIRON = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != SETTINGS)


# -- the environment ------------------------------------------------------------------------


def row(v: settings.Variable) -> str:
    return f"| `{v.name}` | {v.default} | {v.meaning} | {v.read} |"


def test_the_configuration_table_is_the_declared_variables():
    declared = {v.name for v in settings.VARIABLES}
    assert len(declared) == len(settings.VARIABLES), "a variable declared twice"
    lines = CONFIGURATION_MD.splitlines()
    for v in settings.VARIABLES:
        assert row(v) in lines, f"docs/configuration.md lacks (or differs from) this row:\n{row(v)}"
    tabled = {m[1] for line in lines if (m := re.match(r"\| `([A-Z_]+)` \|", line))}
    assert tabled == declared, f"rows of no declared variable: {tabled - declared}"


def test_every_freetoken_variable_the_docs_name_is_declared():
    declared = {v.name for v in settings.VARIABLES}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        named = set(re.findall(r"FREETOKEN_[A-Z_]*[A-Z](?![A-Z_*])", doc.read_text()))
        assert named <= declared, f"{doc.name} names undeclared {named - declared}"


def environ_uses(tree: ast.AST) -> list[int]:
    """Lines that touch the process's environment (`os.environ`, `getenv`, ... in any form)."""
    found = []
    for node in ast.walk(tree):
        if (
            (isinstance(node, ast.Attribute) and node.attr in ENVIRON)
            or (isinstance(node, ast.Name) and node.id in ENVIRON)
            or (isinstance(node, ast.ImportFrom) and {a.name for a in node.names} & ENVIRON)
        ):
            found.append(node.lineno)
    return found


def test_only_settings_reads_the_environment_or_names_a_variable():
    names = {v.name for v in settings.VARIABLES}
    for path in modules():
        text = path.read_text()
        where = path.relative_to(ROOT)
        assert "FREETOKEN_" not in text, f"{where} names a variable: settings.py's to name"
        tree = ast.parse(text)
        assert not environ_uses(tree), f"{where}:{environ_uses(tree)} reads the environment"
        spelled = {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names
        }
        assert not spelled, f"{where} spells {spelled}: use settings.<VARIABLE>.name"


def test_the_check_finds_a_read_of_the_environment():
    assert environ_uses(ast.parse("import os\nx = os.environ.get('A')")) == [2]
    assert environ_uses(ast.parse("from os import getenv\nx = getenv('A')")) == [1, 2]
    assert environ_uses(ast.parse("import os\nx = os.environ['A']")) == [2]
    assert not environ_uses(ast.parse("from freetoken import settings\nx = settings.fla()"))


def test_switches_turn_off_at_0_only(monkeypatch):
    for variable, on in (
        (settings.NATIVE, settings.native),
        (settings.FLA, settings.fla),
        (settings.PRELOAD, settings.preload),
        (settings.EARLY_MAP, settings.early_map),
        (settings.EARLY_LOCK, settings.early_lock),
    ):
        monkeypatch.delenv(variable.name, raising=False)
        assert on()
        monkeypatch.setenv(variable.name, "1")
        assert on()
        monkeypatch.setenv(variable.name, "0")
        assert not on()


def test_typed_reads(monkeypatch, tmp_path):
    for value, wanted in ((None, None), ("0", False), ("1", True), ("yes", None)):
        if value is None:
            monkeypatch.delenv(settings.EARLY_READ.name, raising=False)
        else:
            monkeypatch.setenv(settings.EARLY_READ.name, value)
        assert settings.early_read() is wanted
    monkeypatch.setenv(settings.EARLY_READERS.name, "3")
    assert settings.early_readers() == 3
    monkeypatch.setenv(settings.EARLY_READERS.name, "many")
    with pytest.raises(ValueError, match=settings.EARLY_READERS.name):
        settings.early_readers()
    monkeypatch.setenv(settings.EARLY_READERS.name, "")
    assert settings.early_readers() is None
    monkeypatch.setenv(settings.NATIVE_FLAGS.name, "-mno-avx512f  -DX='a b'")
    assert settings.native_flags() == ["-mno-avx512f", "-DX=a b"]
    monkeypatch.setenv(settings.CACHE_DIR.name, "")
    assert settings.cache_dir() is None
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path))
    assert settings.cache_dir() == tmp_path
    for value, hidden in (("", True), ("-1", True), ("0", False)):
        monkeypatch.setenv(settings.CUDA_VISIBLE_DEVICES.name, value)
        assert settings.gpus_hidden() is hidden
    monkeypatch.delenv(settings.CUDA_VISIBLE_DEVICES.name)
    assert not settings.gpus_hidden()


def test_a_childs_environment(monkeypatch):
    monkeypatch.setenv("FT_TEST_KEEP", "1")
    monkeypatch.setenv("FT_TEST_DROP", "1")
    env = settings.for_child(drop=("FT_TEST_DROP",), FT_TEST_SET="2")
    assert env["FT_TEST_KEEP"] == "1" and env["FT_TEST_SET"] == "2" and "FT_TEST_DROP" not in env


# -- the command line -----------------------------------------------------------------------


def sections(text: str) -> dict[str, str]:
    """cli.md's sections by heading, backticks dropped (`ft serve`, ...)."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)[1:]
    return {parts[i].replace("`", "").strip(): parts[i + 1] for i in range(0, len(parts), 2)}


def commands(parser: argparse.ArgumentParser, prog: str = "ft"):
    """(prog, parser) of `ft` and each command that runs (those with subcommands left out)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if prog == "ft" or not subs:
        yield prog, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from commands(sub, f"{prog} {name}")


def flags(parser: argparse.ArgumentParser):
    """(flag, whether its group is a shared one) for each option but --help."""
    for group in parser._action_groups:
        shared = group.title.startswith(SHARED_GROUPS)
        for action in group._group_actions:
            if not isinstance(action, argparse._HelpAction):
                yield from ((flag, shared) for flag in action.option_strings)


def documented(flag: str, text: str) -> bool:
    """`flag` is in `text` as itself (not inside a longer flag)."""
    return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text) is not None


def test_every_command_and_flag_is_in_the_cli_reference():
    docs = sections(CLI_MD)
    assert SHARED_SECTION in docs
    for prog, parser in commands(build_parser()):
        assert prog in docs, f"docs/cli.md has no section `## \\`{prog}\\``"
        for flag, shared in flags(parser):
            where = SHARED_SECTION if shared else prog
            assert documented(flag, docs[where]), f"docs/cli.md, {where}: no `{flag}` ({prog})"


def test_the_check_finds_a_missing_flag():
    parser = argparse.ArgumentParser(prog="ft")
    parser.add_argument("--present")
    parser.add_argument("--absent")
    text = "## `ft`\n`ft --present X` and `--absent-minded`, `x--absent`\n"
    assert [documented(f, sections(text)["ft"]) for f, _ in flags(parser)] == [True, False]


def test_each_command_names_a_function_that_runs_it():
    for prog, parser in commands(build_parser()):
        if prog == "ft":
            continue
        module, function = parser.get_default("func").split(":")
        assert callable(getattr(importlib.import_module(module), function)), prog


def test_nothing_imports_the_entry_point():
    """`cli/main.py` runs a command through its `func` (importlib): a module it reaches that
    imported main back would close a cycle the import contract cannot see."""
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "freetoken.cli.main":
                pytest.fail(f"{path.relative_to(ROOT)} imports freetoken.cli.main")
            if isinstance(node, ast.ImportFrom) and node.module == "freetoken.cli":
                assert "main" not in {a.name for a in node.names}, path
            if isinstance(node, ast.Import):
                assert "freetoken.cli.main" not in {a.name for a in node.names}, path


def test_the_clis_functions_are_short():
    for path in [*sorted((PACKAGE / "cli").glob("*.py")), SETTINGS]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                assert lines <= 80, f"{path.name}: {node.name} is {lines} lines"


def test_strategies_are_named_once():
    """config.STRATEGIES names them (the CLI's choices); moe/strategies.py says what each but
    `auto` (resolved at load) does."""
    from freetoken.config import STRATEGIES
    from freetoken.moe.strategies import KINDS

    assert set(KINDS) == set(STRATEGIES) - {"auto"}
