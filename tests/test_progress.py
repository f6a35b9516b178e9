"""Waits say so from their first moment and every few seconds after, also off a terminal
(issue 42): the helper itself, and `ft bench bw`'s measurement and a weight load through it."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import time

import pytest

from freetoken.progress import waiting

FT = shutil.which("ft") or ""


def test_waiting_says_at_once_then_periodically_then_done():
    out = io.StringIO()
    with waiting("fitting", every=0.05, out=out):
        assert out.getvalue() == "fitting...\n"  # (before any of the work)
        time.sleep(0.28)
    lines = out.getvalue().splitlines()
    assert lines[0] == "fitting..."
    assert sum("s so far" in line for line in lines) >= 3
    assert lines[-1].startswith("fitting: done in ")


def test_a_short_wait_is_one_line():
    out = io.StringIO()
    with waiting("quick", every=5, out=out):
        pass
    assert out.getvalue() == "quick...\n"


@pytest.mark.skipif(not FT, reason="the ft console script is not installed")
def test_bench_bw_and_a_load_say_what_they_wait_for(tmp_path):
    env = {**os.environ, "FREETOKEN_CACHE_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(
        [FT, "bench", "bw", "--device", "cpu", "--seconds", "0.2", "--pool-gib", "0.05"],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    started = time.monotonic()
    first = proc.stderr.readline()
    assert time.monotonic() - started < 20  # (the imports; the measurement takes longer)
    assert first.startswith("measuring bandwidths")
    proc.communicate(timeout=300)
    assert proc.returncode == 0
    out = subprocess.run(
        [FT, "generate", "--model", "random-demo", "--prompt", "Hi", "--max-tokens", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "loading weights..." in out.stderr
