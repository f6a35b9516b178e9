"""`ft launch`, with fake client executables that record what they were started with."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import httpx
import pytest

from server_fixtures import MODEL, running_server

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
FT = shutil.which("ft") or ""
pytestmark = pytest.mark.skipif(not FT, reason="the ft console script is not installed")

FAKE_CLIENT = textwrap.dedent(
    """\
    #!{python}
    import json, os, sys
    with open(os.environ["FAKE_CLIENT_LOG"], "w") as f:
        json.dump({{"argv": sys.argv, "env": dict(os.environ)}}, f)
    sys.exit(7)
    """
)


@pytest.fixture()
def fake_clients(tmp_path):
    """A PATH whose claude, codex and opencode record their argv and environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("claude", "codex", "opencode"):
        path = bin_dir / name
        path.write_text(FAKE_CLIENT.format(python=sys.executable))
        path.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(home),
        "FAKE_CLIENT_LOG": str(tmp_path / "client.json"),
        "FREETOKEN_CACHE_DIR": str(tmp_path / "cache"),
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.pop("FREETOKEN_API_KEY", None)
    return env, tmp_path / "client.json", home


def launch(env, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [FT, "launch", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def served(engine):
    with running_server(engine, MODEL) as (base, core):
        yield base, core


def test_claude_code_gets_the_gateway_environment(served, fake_clients):
    base, core = served
    env, log, home = fake_clients
    env = {**env, "ANTHROPIC_API_KEY": "sk-ant-cloud", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "99"}
    done = launch(env, "--url", base, "claude", "-p", "hello", "--continue")
    assert done.returncode == 7, done.stderr  # the client's own exit status
    record = json.loads(log.read_text())
    assert record["argv"][1:] == ["-p", "hello", "--continue"]
    got = record["env"]
    assert got["ANTHROPIC_BASE_URL"] == base and got["ANTHROPIC_AUTH_TOKEN"] == "freetoken"
    assert "ANTHROPIC_API_KEY" not in got  # the cloud key is neither sent here nor in conflict
    for name in (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_SMALL_FAST_MODEL",
        "CLAUDE_CODE_SUBAGENT_MODEL",
    ):
        assert got[name] == MODEL
    assert got["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(core.max_context)
    assert got["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "99"  # the user's own setting stays
    # a first reply may take longer than Claude Code's 300 s stream watchdog on a CPU
    assert got["CLAUDE_STREAM_IDLE_TIMEOUT_MS"] == got["API_TIMEOUT_MS"] == "1800000"
    assert list(home.iterdir()) == []  # nothing written to the user's home


def test_codex_gets_a_provider_as_overrides(served, fake_clients):
    base, core = served
    env, log, home = fake_clients
    assert launch(env, "--url", base + "/v1/", "codex", "exec", "hi").returncode == 7
    argv = json.loads(log.read_text())["argv"][1:]
    assert argv[-2:] == ["exec", "hi"]
    pairs = argv[:-2]
    assert pairs[::2] == ["-c"] * (len(pairs) // 2)
    # Each override is a TOML key = value, as Codex parses it.
    config = {}
    for item in pairs[1::2]:
        key, value = item.split("=", 1)
        config[key] = tomllib.loads(f"v = {value}")["v"]
    provider = config["model_providers.freetoken"]
    assert provider["base_url"] == base + "/v1" and provider["wire_api"] == "responses"
    assert config["model_provider"] == "freetoken" and config["model"] == MODEL
    assert config["model_context_window"] == core.max_context
    assert list(home.iterdir()) == []


def test_opencode_gets_an_inline_provider(served, fake_clients):
    base, core = served
    env, log, _ = fake_clients
    assert (
        launch(env, "--url", base, "--max-output-tokens", "64", "opencode", "run", "x").returncode
        == 7
    )
    record = json.loads(log.read_text())
    config = json.loads(record["env"]["OPENCODE_CONFIG_CONTENT"])
    provider = config["provider"]["freetoken"]
    assert provider["options"]["baseURL"] == base + "/v1"
    assert provider["models"][MODEL]["limit"] == {"context": core.max_context, "output": 64}
    assert config["model"] == f"freetoken/{MODEL}"
    assert record["argv"][1:] == ["run", "x"]


def test_print_shows_the_settings_and_runs_nothing(served, fake_clients):
    base, _ = served
    env, log, _ = fake_clients
    done = launch(env, "--url", base, "--print", "claude", "-p", "hi")
    assert done.returncode == 0 and not log.exists()
    assert f"export ANTHROPIC_BASE_URL={base}" in done.stdout
    assert "unset ANTHROPIC_API_KEY" in done.stdout and done.stdout.rstrip().endswith(
        "claude -p hi"
    )


def test_a_missing_client_says_how_to_install_it(served, fake_clients, tmp_path):
    base, _ = served
    env, _, _ = fake_clients
    (tmp_path / "bin" / "codex").unlink()
    env = {**env, "PATH": str(tmp_path / "bin")}
    done = launch(env, "--url", base, "codex")
    assert done.returncode == 2 and "npm install -g @openai/codex" in done.stderr


def test_a_server_with_a_key_needs_it(fresh_engine, fake_clients):
    env, log, _ = fake_clients
    with running_server(fresh_engine, MODEL, api_key="s3cret") as (base, _):
        refused = launch(env, "--url", base, "claude")
        assert refused.returncode == 2 and "needs an API key" in refused.stderr
        assert (
            launch({**env, "FREETOKEN_API_KEY": "s3cret"}, "--url", base, "claude").returncode == 7
        )
    assert json.loads(log.read_text())["env"]["ANTHROPIC_AUTH_TOKEN"] == "s3cret"


def test_a_server_is_started_when_none_answers_and_stopped_after(fake_clients):
    env, log, _ = fake_clients
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    done = launch(
        env,
        "--url",
        url,
        "--model",
        "random-demo",
        "--kv-cache-tokens",
        "4096",
        "--served-model-name",
        "freetoken-demo",
        "opencode",
        timeout=600,
    )
    assert done.returncode == 7, done.stderr
    assert "starting ft serve" in done.stderr and "--kv-cache-tokens 4096" in done.stderr
    config = json.loads(json.loads(log.read_text())["env"]["OPENCODE_CONFIG_CONTENT"])
    assert config["provider"]["freetoken"]["models"]["freetoken-demo"]["limit"]["context"] == 4096
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)  # it went with the client
