"""README.md starts with the two commands that work on a fresh machine; CI runs the second."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```bash\n")[1:3]
    return [b.split("```")[0].strip() for b in blocks]


def test_readme_starts_with_run_and_test_commands():
    run, test = readme_commands()
    assert run.endswith("ft serve") and "pip install -e ." in run
    assert "'.[dev]'" in test and "ruff format --check" in test
    # the suite in one process per core, a file's tests in one of them (its module fixtures
    # built once)
    assert test.endswith("pytest -n auto --dist loadfile")


def test_ci_runs_the_readme_test_command():
    _, test = readme_commands()
    assert test in (ROOT / ".ci" / "run").read_text().splitlines()
