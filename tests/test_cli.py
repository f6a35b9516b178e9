"""`ft generate`, `ft shell` and `ft serve` on the random demo model (`--model random-demo`,
which needs no download), run as a user would: a subprocess of the installed console script,
with a fresh cache directory so the model is built on first use. The default demo, a real
model, is tests/test_demo_model.py's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

FT = shutil.which("ft") or ""
pytestmark = pytest.mark.skipif(not FT, reason="the ft console script is not installed")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {
        **os.environ,
        "FREETOKEN_CACHE_DIR": str(tmp_path_factory.mktemp("cache")),
        "CUDA_VISIBLE_DEVICES": "",
    }


def ft(env, *args, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`ft COMMAND ...` on the random demo (unless the arguments name a model)."""
    if "--model" not in args and args[0] != "-v" and "--help" not in args:
        args = (args[0], "--model", "random-demo", *args[1:])
    elif args[0] == "-v":
        args = ("-v", args[1], "--model", "random-demo", *args[2:])
    return subprocess.run(
        [FT, *args], input=stdin, env=env, capture_output=True, text=True, timeout=300
    )


def test_generate_streams_on_demo_model(env):
    first = ft(env, "generate", "--prompt", "Hello", "--max-tokens", "6", "--temperature", "0")
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip()
    # Greedy decoding of the same seeded demo weights is reproducible across processes.
    again = ft(env, "generate", "--prompt", "Hello", "--max-tokens", "6", "--temperature", "0")
    assert again.stdout == first.stdout


def test_generate_matches_library_greedy(env, monkeypatch):
    """What the CLI prints is the engine's greedy completion, text for text."""
    from freetoken.config import EngineConfig
    from freetoken.demo import demo_checkpoint
    from freetoken.engine.generate import LLMEngine
    from freetoken.engine.sampling import SamplingParams

    out = ft(env, "generate", "--prompt", "The sky is", "--max-tokens", "5", "--temperature", "0")
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", env["FREETOKEN_CACHE_DIR"])
    engine = LLMEngine.from_config(EngineConfig(model=demo_checkpoint(), device="cpu"))
    ids = engine.tokenizer.encode("The sky is")
    [done] = engine.generate([ids], SamplingParams(max_new_tokens=5, temperature=0))
    assert out.stdout == done.text + "\n"


def test_shell_chats_through_stdin(env):
    out = ft(
        env, "shell", "--max-tokens", "4", "--seed", "0", stdin="Hi\nHow are you?\n/reset\nBye\n"
    )
    assert out.returncode == 0, out.stderr
    assert "(conversation cleared)" in out.stdout
    replies = out.stdout.split("(conversation cleared)")
    assert replies[0].count("\n") == 2  # one streamed reply line per user line
    assert replies[1].strip()


def test_bad_model_path_is_a_clear_error(env, tmp_path):
    out = ft(env, "generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert out.returncode == 2
    assert "error:" in out.stderr and "does not exist" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_sampling_flag_is_a_clear_error(env):
    out = ft(env, "generate", "--prompt", "x", "--top-p", "1.5")
    assert out.returncode == 2
    assert "--top-p: expects a number in (0, 1], got 1.5" in out.stderr


def test_module_entry_point_matches_console_script(env):
    out = subprocess.run(
        [sys.executable, "-m", "freetoken.cli.main", "--help"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "generate" in out.stdout and "shell" in out.stdout


def test_serve_answers_on_the_random_demo_model(env):
    """`ft serve --model random-demo` serves the random demo (offline)."""
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [FT, "serve", "--model", "random-demo", "--port", str(port), "--device", "cpu"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {
            "model": "random-demo",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "Hello"}],
        }
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert f"{base}/v1" in err and "curl" in err  # the ready message with an example
    assert '"max_tokens": 64' in err  # (a random model's replies never end by themselves)


def test_verbose_lines_are_timed_from_the_process_start(env):
    """`ft -v`: each log line begins with the seconds since the process began (a start's
    timeline), the engine's load in order after the interpreter's own start."""
    done = ft(env, "-v", "generate", "--prompt", "Hi", "--max-tokens", "1", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    times = [
        float(line.split()[0][:-1])
        for line in done.stderr.splitlines()
        if line.split() and line.split()[0].endswith("s") and " DEBUG " in line
    ]
    assert len(times) >= 3
    assert times[0] > 0 and times == sorted(times) and times[-1] < 300
