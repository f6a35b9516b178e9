"""The GPU benchmark scripts run end to end on small shapes on the CPU, so they do not rot
between the sessions that have a GPU to run them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str, tmp_path: Path) -> str:
    result = subprocess.run(
        [sys.executable, script, "--tiny", "--device", "cpu", *args],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "FREETOKEN_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_decode_offload_table(tmp_path):
    out = tmp_path / "decode.md"
    run("decode_offload.py", "--layers", "2", "--steps", "2", "--warmup", "1", "--batch", "1",
        "--cache", "all", "--cache", "40", "--strategy", "offload", "--strategy", "hybrid",
        "--cpu-threads", "1", "--cpu-threads", "2", "--out", str(out),
        tmp_path=tmp_path)  # fmt: skip
    table = out.read_text()
    for strategy in ("fused", "offload", "hybrid"):
        for team in ("t1", "t2"):  # each strategy with each CPU team size
            assert f"| {strategy}/{team} | 1 |" in table
    header = next(line for line in table.splitlines() if line.startswith("| cache | strategy"))
    column = [c.strip() for c in header.split("|")].index("host ms")
    width = header.count("|")  # (the phase table below has fewer columns)
    rows = [line.split("|") for line in table.splitlines()
            if "/t1 | 1 |" in line and line.count("|") == width]  # fmt: skip
    assert rows and all(float(row[column]) > 0 for row in rows)  # the host's time per step


def test_host_step_table(tmp_path):
    out = tmp_path / "host.md"
    result = subprocess.run(
        [sys.executable, "host_step.py", "--layers", "2", "--experts", "8", "--top-k", "2",
         "--hidden", "64", "--steps", "3", "--warmup", "1", "--strategy", "hybrid",
         "--strategy", "static", "--batch", "1", "--out", str(out)],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r.split("|")[1].strip(): r.split("|")[3:-1] for r in out.read_text().splitlines()
            if r.startswith(("| hybrid", "| static"))}  # fmt: skip
    assert set(rows) == {"hybrid", "static"}
    hybrid, static = ([float(c) for c in rows[name]] for name in ("hybrid", "static"))
    plan, policy, step, hit_rate = hybrid[0], hybrid[3], hybrid[4], hybrid[5]
    assert plan > 0 and step > plan and 0.0 <= hit_rate <= 1.0
    assert policy > static[3]  # only hybrid has a policy to update


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_agent_replay_reuses_earlier_turns(tmp_path, family):
    out = tmp_path / "replay.md"
    run("agent_replay.py", "--family", family, "--layers", "4", "--turns", "3",
        "--tool-tokens", "60", "--cache", "40", "--out", str(out), tmp_path=tmp_path)  # fmt: skip
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()[-3:]]
    reused_with_cache = [int(row[3]) for row in rows]
    reused_without = [int(row[-1]) for row in rows]
    assert reused_with_cache[-1] > 0 and reused_without == [0, 0, 0]


def test_soak_counts_answers_and_memory(tmp_path):
    out = tmp_path / "soak.md"
    result = subprocess.run(
        [sys.executable, "soak.py", "--minutes", "0.25", "--clients", "3", "--warmup-s", "2",
         "--sample-s", "1", "--kv-cache-tokens", "4096", "--out", str(out)],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    row = next(r for r in out.read_text().splitlines() if r.startswith("| ") and "---" not in r
               and not r.startswith("| requests"))  # fmt: skip
    cells = [c.strip() for c in row.strip("|").split("|")]
    requests, errors, cancelled = int(cells[0]), int(cells[1]), int(cells[2])
    assert requests > 0 and errors == 0 and 0 <= cancelled <= requests
    assert cells[-2:] == ["0", "0"]  # nothing left running, no KV page held
