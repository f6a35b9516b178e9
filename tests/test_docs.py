"""The docs stay maps (issue 44): docs/architecture.md and README.md within their word budgets,
and what docs/architecture.md points at exists: source paths, classes it names, the import
layers of pyproject.toml, and the files and sections the docs link to."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "freetoken"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def words(path: Path) -> int:
    return len(path.read_text().split())


def test_architecture_is_a_map_within_its_budget():
    # measurements live in benchmarks/results/, a module's internals in its docstring
    assert words(ARCHITECTURE) <= 3200


def test_readme_within_its_budget():
    assert words(ROOT / "README.md") <= 1300


# a path with a file suffix (kernels/cpu_experts.c, schemas.py) or a folder (server/parsers/)
SOURCE_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|c)|(?:[\w-]+/)+)(?![\w/])")


def source_paths(text: str) -> set[str]:
    """Paths the page names, links left out (test_links checks them)."""
    text = re.sub(r"\]\([^)]*\)", "]", text)  # (a link's target)
    return {p for p in SOURCE_PATH.findall(text) if not p.startswith(("http", "../"))}


def exists(path: str) -> bool:
    """As written from the repository or the package (`moe/split.py`), or a bare module name
    anywhere in the package (`schemas.py`)."""
    if any((base / path).exists() for base in (ROOT, PACKAGE)):
        return True
    return "/" not in path and any(PACKAGE.rglob(path))


def test_source_paths_in_architecture_exist():
    named = source_paths(ARCHITECTURE.read_text())
    assert {"moe/runtime.py", "layers/compressed_attention.py", "server/parsers/"} <= named
    assert sorted(p for p in named if not exists(p)) == []


CLASS = r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*"  # (CamelCase: not README, not V3)


def test_classes_in_architecture_exist():
    """Every `Class` the page names in backticks, and every Class.member it names, is in the
    source."""
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    text = ARCHITECTURE.read_text()
    named = set(re.findall(rf"`({CLASS})()`", text))
    named |= set(re.findall(rf"\b({CLASS})\.([A-Za-z_]\w*)", text))
    assert len(named) > 20
    missing = [
        f"{cls}.{member}" if member else cls
        for cls, member in sorted(named)
        if not re.search(rf"^(class {cls}\b|{cls} = )", source, re.M)
        or (member and not re.search(rf"\b{member}\b", source))
    ]
    assert missing == []


def test_architecture_draws_every_import_layer():
    """The drawing shows each module of the import contract's layers (pyproject.toml)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    block = re.search(r'id = "layers".*?layers = \[(.*?)\]', pyproject, re.S).group(1)
    modules = {m for layer in re.findall(r'"([^"]+)"', block) for m in layer.split(" | ")}
    text = ARCHITECTURE.read_text()
    drawing = text.split("## Layers and the import contract")[1].split("```")[1]
    drawn = {line.split()[0] for line in drawing.splitlines() if line.strip()}
    drawn |= {m for line in drawing.splitlines() for m in re.findall(r"\| (\w+)", line)}
    assert len(modules) > 20
    assert sorted(modules - drawn) == []


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links(doc: Path):
    """Relative links in README.md and docs/ reach a file, and a section of it that exists."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"\w+:", target):
            continue  # (https:, mailto:)
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
            if anchor not in {slug(h) for h in headings}:
                broken.append(target)
    assert broken == []
