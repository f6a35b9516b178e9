"""A newcomer's mistakes (issue 42): every bad invocation is one line on stderr naming the flag,
exit status 2, no traceback, found before anything loads; the help names every flag's default
and choices; a busy port fails at once; Ctrl-C in `ft shell` stops a reply, not the shell."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from freetoken import __version__
from freetoken.cli.main import build_parser, main

FT = shutil.which("ft") or ""
needs_ft = pytest.mark.skipif(not FT, reason="the ft console script is not installed")


@pytest.fixture
def not_a_gguf(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return str(path)


# (arguments, what the one line must name)
BAD = [
    (["serve", "--dtype", "float64"], "--dtype"),
    (["serve", "--moe-cache-size", "lots"], "--moe-cache-size"),
    (["serve", "--moe-cache-size", "0"], "--moe-cache-size"),
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--port", "0"], "--port"),
    (["serve", "--port", "http"], "--port"),
    (["serve", "--max-model-len", "-5"], "--max-model-len"),
    (["serve", "--kv-cache-tokens", "0"], "--kv-cache-tokens"),
    (["serve", "--moe-policy", "bogus"], "--moe-policy"),
    (["serve", "--moe-strategy", "bogus"], "--moe-strategy"),
    (["serve", "--max-running-requests", "0"], "--max-running-requests"),
    (["serve", "--max-queued-requests", "-1"], "--max-queued-requests"),
    (["serve", "--template-timeout", "0"], "--template-timeout"),
    (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["serve", "--cpu-threads", "0"], "--cpu-threads"),
    (["serve", "--cpu-spin-us", "-1"], "--cpu-spin-us"),
    (["serve", "--state-anchors", "-1"], "--state-anchors"),
    (["serve", "--prefill-stream-threshold", "-1"], "--prefill-stream-threshold"),
    (["serve", "--moe-hybrid-max-fetch", "0"], "--moe-hybrid-max-fetch"),
    (["serve", "--device", "tpu"], "--device"),
    (["generate", "--prompt", "x", "--model", "/no/such/checkpoint"], "--model"),
    (["generate", "--prompt", "x", "--model", "NOT_A_GGUF"], "--model"),
    (["generate", "--prompt", "x", "--top-p", "1.5"], "--top-p"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["generate", "--prompt", "x", "--temperature", "nan"], "--temperature"),
    (["generate", "--prompt", "x", "--top-k", "-1"], "--top-k"),
    (["generate", "--prompt", "x", "--min-p", "2"], "--min-p"),
    (["generate", "--prompt", "x", "--repetition-penalty", "0"], "--repetition-penalty"),
    (["generate", "--prompt", "x", "--seed", "-1"], "--seed"),
    (["generate", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "--prompt", "x", "--stop", ""], "--stop"),
    (["generate"], "--prompt"),
    (["shell", "--max-tokens", "lots"], "--max-tokens"),
    (["launch"], "client"),
    (["launch", "vim"], "client"),
    (["launch", "--max-output-tokens", "0", "claude"], "--max-output-tokens"),
    (["bench", "bw", "--seconds", "0"], "--seconds"),
    (["bench", "cache", "--trace", "t.npz", "--capacity", "2"], "--capacity"),
    (["bench", "cache", "--trace", "t.npz", "--policy", "bogus"], "--policy"),
    (["ctl", "cache", "--experts", "lots"], "--experts"),
    (["checkpoint", "convert", "/no/such/checkpoint", "out"], "src"),
    (["frobnicate"], "COMMAND"),
    (["serve", "--frobnicate"], "--frobnicate"),
]


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(("argv", "flag"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_invocation_is_one_line_and_exit_2(argv, flag, capsys, not_a_gguf):
    argv = [not_a_gguf if a == "NOT_A_GGUF" else a for a in argv]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    out = capsys.readouterr()
    line = _one_line(out.err)
    assert line.startswith("ft") and "error:" in line and flag in line
    assert not out.out
    if argv[0] == "launch" and len(argv) == 1:
        assert "client_args" not in line  # (optional: argparse named it among the missing)


def test_what_a_flag_takes_is_said(capsys, not_a_gguf):
    for argv, said in (
        (["serve", "--port", "99999"], "1 to 65535"),
        (["serve", "--moe-policy", "bogus"], "reuse-density"),
        (["serve", "--dtype", "float64"], "bfloat16"),
        (["serve", "--moe-cache-size", "lots"], "8GiB"),
        (["generate", "--prompt", "x", "--model", not_a_gguf], "not a GGUF file"),
        (["generate", "--prompt", "x", "--model", "/no/such"], "does not exist"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert said in capsys.readouterr().err, argv


def test_a_gpu_that_cannot_be_used_is_refused_by_name(capsys, monkeypatch):
    """`--device cuda` where this install or machine cannot run it: one line saying why (a CPU
    build of torch, no driver, or every GPU hidden), before torch is imported."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for device in ("cuda", "cuda:0"):
        with pytest.raises(SystemExit) as stop:
            main(["generate", "--prompt", "x", "--device", device])
        assert stop.value.code == 2
        line = _one_line(capsys.readouterr().err)
        assert "--device" in line and ("CPU build" in line or "GPU" in line)


def test_cuda_problem_reads_the_torch_build_without_importing_it():
    code = "import sys; from freetoken.cli.args import cuda_problem; cuda_problem(); "
    code += "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def _parsers(parser: argparse.ArgumentParser, prog: str = "ft"):
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def test_every_flag_has_help_with_its_default_and_choices():
    for prog, parser in _parsers(build_parser()):
        text = "".join(parser.format_help().split())  # (unwrapped)
        for action in parser._actions:
            if isinstance(
                action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)
            ):
                continue
            name = action.option_strings[-1] if action.option_strings else action.dest
            assert action.help, f"{prog} {name}: no help"
            if action.option_strings and not action.required and name != "--verbose":
                assert "default" in action.help, f"{prog} {name}: its default is not said"
            for choice in action.choices or ():
                assert str(choice) in text, f"{prog} {name}: choice {choice} not shown"


def test_policy_names_are_the_policies():
    from freetoken.config import POLICIES as NAMES
    from freetoken.moe.policy import POLICIES, default_policy

    assert set(NAMES) == set(POLICIES) and NAMES[0] == default_policy().name


def test_bare_ft_prints_the_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr()
    assert "usage: ft" in out.out and "serve" in out.out and not out.err


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"ft {__version__} (freetoken-moe)"


@needs_ft
def test_the_console_script_says_a_mistake_in_one_line():
    out = subprocess.run([FT, "serve", "--port", "99999"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "--port" in _one_line(out.stderr)


@needs_ft
def test_a_busy_port_fails_at_once_without_loading(tmp_path):
    """With the port taken, `ft serve` says so in one line within 2 s and exits non-zero,
    before it fetches, converts or loads anything (its cache directory stays empty)."""
    cache = tmp_path / "cache"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "FREETOKEN_CACHE_DIR": str(cache)}
        started = time.monotonic()
        out = subprocess.run(
            [FT, "serve", "--port", str(port)], env=env, capture_output=True, text=True, timeout=60
        )
        seconds = time.monotonic() - started
    assert out.returncode != 0
    line = _one_line(out.stderr)
    assert "in use" in line and str(port) in line and "--port" in line
    assert seconds < 2.0, seconds
    assert not cache.exists() or not any(cache.iterdir())


@needs_ft
def test_ctrl_c_in_the_shell_stops_the_reply_and_the_next_prompt_works(tmp_path):
    """Ctrl-C (SIGINT) while a reply streams ends that reply with "(stopped)"; the shell reads
    the next line and answers it; Ctrl-D (end of input) then leaves with status 0."""
    env = {**os.environ, "FREETOKEN_CACHE_DIR": str(tmp_path / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(
        [FT, "shell", "--model", "random-demo", "--max-tokens", "100000", "--seed", "0"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    seen: list[str] = []

    def read() -> None:
        while ch := proc.stdout.read(1):
            seen.append(ch)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def wait_for(predicate, what: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not predicate("".join(seen)):
            assert proc.poll() is None, f"the shell left before {what}: {proc.stderr.read()}"
            assert time.monotonic() < deadline, f"no {what}: {''.join(seen)!r}"
            time.sleep(0.05)

    try:
        proc.stdin.write("Hello\n")
        proc.stdin.flush()
        wait_for(lambda s: len(s.strip()) > 20, "first reply")
        proc.send_signal(signal.SIGINT)
        wait_for(lambda s: "(stopped)" in s, "stopped reply")
        time.sleep(0.5)
        assert proc.poll() is None  # still there
        after = len("".join(seen))
        proc.stdin.write("And again\n")
        proc.stdin.flush()
        wait_for(lambda s: len(s[after:].strip()) > 20, "second reply")
        proc.send_signal(signal.SIGINT)
        wait_for(lambda s: s.count("(stopped)") == 2, "second stop")
        proc.stdin.close()  # Ctrl-D
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    assert "Traceback" not in proc.stderr.read()
