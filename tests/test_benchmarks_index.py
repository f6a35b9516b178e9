"""benchmarks/README.md names every script in benchmarks/ (and none that is gone)."""

import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_benchmark_script_is_listed_once():
    listed = re.findall(
        r"^\| `([\w.]+\.(?:py|sh))` \|", (BENCHMARKS / "README.md").read_text(), flags=re.M
    )
    scripts = sorted(p.name for p in BENCHMARKS.iterdir() if p.suffix in (".py", ".sh"))
    assert sorted(listed) == scripts
