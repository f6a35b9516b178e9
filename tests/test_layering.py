"""The package's import contract (pyproject.toml, [tool.importlinter]): imports run down the
layers and no package's modules import each other in a cycle. Checked here on the source, and
shown to break on a deliberately wrong import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = shutil.which("lint-imports")
pytestmark = pytest.mark.skipif(LINT is None, reason="import-linter is not installed")


def lint(cwd: Path, source: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(source)}
    return subprocess.run(
        [LINT, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_source_keeps_the_contracts():
    done = lint(ROOT, ROOT / "src")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 kept, 0 broken" in done.stdout


@pytest.fixture()
def copy(tmp_path):
    """A copy of the package and its contract, to break."""
    shutil.copytree(ROOT / "src" / "freetoken", tmp_path / "src" / "freetoken")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_import(copy: Path, module: str, line: str) -> None:
    path = copy / "src" / Path(*module.split(".")).with_suffix(".py")
    path.write_text(path.read_text() + f"\n{line}\n")


def test_an_import_up_the_layers_breaks_the_contract(copy):
    add_import(copy, "freetoken.kv.paged", "from freetoken.engine import generate  # noqa")
    done = lint(copy, copy / "src")
    assert done.returncode != 0
    assert "imports run down the layers BROKEN" in done.stdout
    assert "freetoken.kv.paged -> freetoken.engine.generate" in done.stdout


def test_an_import_between_independent_siblings_breaks_the_contract(copy):
    add_import(copy, "freetoken.moe.store", "from freetoken.layers import norm  # noqa")
    done = lint(copy, copy / "src")
    assert done.returncode != 0 and "freetoken.moe.store -> freetoken.layers.norm" in done.stdout


def test_a_cycle_inside_a_package_breaks_the_contract(copy):
    # server.core imports server.events; an import back closes a cycle within one layer.
    add_import(copy, "freetoken.server.events", "from freetoken.server import core  # noqa")
    done = lint(copy, copy / "src")
    assert done.returncode != 0
    assert "no import cycles between the modules of a package BROKEN" in done.stdout


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def imported(importtime_log: str) -> set[str]:
    return {
        line.split("|")[-1].strip()
        for line in importtime_log.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def test_ft_help_imports_no_torch():
    done = run_python("import sys; from freetoken.cli.main import main; sys.exit(main(['--help']))")
    assert done.returncode == 0 and "launch" in done.stdout
    modules = imported(done.stderr)
    assert "freetoken.cli.main" in modules
    assert not {m for m in modules if m.split(".")[0] in ("torch", "numpy", "triton")}


def test_bench_cache_starts_no_cuda_and_no_triton(tmp_path):
    import json

    import numpy as np

    trace = tmp_path / "trace.npz"
    meta = {"num_layers": 3, "num_experts": 8, "top_k": 2, "requests": [{"index": 0}]}
    experts = np.random.default_rng(0).integers(0, 8, size=(30, 3, 2))
    np.savez(
        trace, meta_json=np.frombuffer(json.dumps(meta).encode(), np.uint8), experts_0000=experts
    )
    done = run_python(
        "import sys, torch\n"
        "from freetoken.cli.main import main\n"
        "code = main(['bench', 'cache', '--trace', sys.argv[1], '--capacity', '0.5'])\n"
        "print('cuda initialised:', torch.cuda.is_initialized())\n"
        "print('triton:', 'triton' in sys.modules)\n"
        "sys.exit(code)\n",
        str(trace),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cuda initialised: False" in done.stdout and "triton: False" in done.stdout
    assert not {m for m in imported(done.stderr) if m.startswith("freetoken.kernels")}
