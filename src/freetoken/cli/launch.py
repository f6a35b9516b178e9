"""`ft launch claude|codex|opencode [ARGS...]`: a coding agent pointed at a local freetoken.

Reuses the `ft serve` answering at `--url` (default http://127.0.0.1:1919) or starts one with
the engine options given (and stops it when the client exits, unless `--keep-server`), then
runs the client with its settings pointed there. Nothing of the user's is written: Claude Code
gets environment variables, Codex `-c` overrides of a `freetoken` provider, OpenCode its
config as `OPENCODE_CONFIG_CONTENT` (merged over the user's own). `--print` shows the settings
instead, for running the client by hand. docs/agents.md says per client what works.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.error import HTTPError, URLError
from urllib.parse import urlparse
from urllib.request import Request, urlopen

from freetoken import settings
from freetoken.cli.args import integer
from freetoken.cli.options import add_engine_args
from freetoken.errors import FreetokenError
from freetoken.paths import cache_dir

DEFAULT_URL = "http://127.0.0.1:1919"
# The key a client sends when the server needs none (clients insist on having one).
NO_KEY = "freetoken"
STARTUP_TIMEOUT_S = 1800.0  # a large checkpoint can take minutes to load
# How long Claude Code waits for a reply's first event (its stream watchdog; the keep-alives of
# a long prefill do not count) and for a whole request. Its defaults, 300 s and 600 s, are cut
# for a hosted API: Qwen2.5-Coder-1.5B's prefill of Claude Code's 19k-token first prompt took
# longer than 300 s on a loaded 2-core CPU, and Claude Code gave up and asked again.
CLAUDE_WAIT_MS = "1800000"


class LaunchError(FreetokenError):
    """The client cannot be launched (not installed, or the server did not come up)."""


@dataclass(frozen=True)
class Server:
    url: str  # without a trailing slash or /v1
    model: str
    context: int  # tokens of prompt + output the server takes
    api_key: str | None = None
    output_limit: int | None = None  # what clients are told to ask for at most

    @property
    def key(self) -> str:
        return self.api_key or NO_KEY

    @property
    def max_output(self) -> int:
        """The output limit clients are told: --max-output-tokens, else a quarter of the
        context, at most 32k (the server cuts any request to the room its prompt leaves)."""
        return self.output_limit or max(1, min(32000, self.context // 4))


@dataclass
class ClientSetup:
    """How to run one client against the server: environment to set and to drop, and
    arguments that go before the user's own."""

    executable: str
    env: dict[str, str] = field(default_factory=dict)
    defaults: dict[str, str] = field(default_factory=dict)  # set only where the user has not
    unset: tuple[str, ...] = ()
    args: list[str] = field(default_factory=list)
    install: str = ""  # how to install the client, for the error when it is missing


def claude_setup(server: Server) -> ClientSetup:
    """Claude Code: its documented gateway variables, every model alias mapped to the served
    model, the context window of the served model (its default for an unknown model is
    Anthropic's 200k), no traffic to Anthropic's services, and time limits that a slow local
    prefill fits in. ANTHROPIC_API_KEY is dropped for the child so a cloud key is neither sent
    here nor in conflict with the token."""
    model = server.model
    env = {
        "ANTHROPIC_BASE_URL": server.url,
        "ANTHROPIC_AUTH_TOKEN": server.key,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(server.context),
    }
    for alias in ("OPUS", "SONNET", "HAIKU", "FABLE"):
        env[f"ANTHROPIC_DEFAULT_{alias}_MODEL"] = model
    defaults = {
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(server.max_output),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": CLAUDE_WAIT_MS,
        "API_TIMEOUT_MS": CLAUDE_WAIT_MS,
    }
    return ClientSetup(
        "claude",
        env,
        defaults,
        unset=("ANTHROPIC_API_KEY",),
        install="npm install -g @anthropic-ai/claude-code",
    )


def codex_setup(server: Server) -> ClientSetup:
    """Codex CLI: a `freetoken` model provider on the Responses API, given as `-c` overrides,
    so the user's CODEX_HOME (login, history, config) is used as it is. Codex sends no output
    limit (the server's default applies) and has no setting for one."""
    provider = {"name": "freetoken", "base_url": server.url + "/v1", "wire_api": "responses"}
    env = {}
    if server.api_key:
        provider["env_key"] = settings.API_KEY.name
        env[settings.API_KEY.name] = server.api_key
    table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in provider.items())
    overrides = {
        "model_providers.freetoken": "{" + table + "}",
        "model_provider": json.dumps("freetoken"),
        "model": json.dumps(server.model),
        "model_context_window": str(server.context),
    }
    args = [a for key, value in overrides.items() for a in ("-c", f"{key}={value}")]
    return ClientSetup("codex", env, args=args, install="npm install -g @openai/codex")


def opencode_config(server: Server) -> dict:
    """An opencode.json provider for the server (OpenAI-compatible chat completions)."""
    name = server.model
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "freetoken": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "freetoken",
                "options": {"baseURL": server.url + "/v1", "apiKey": server.key},
                "models": {
                    name: {
                        "name": f"{name} (freetoken)",
                        "tool_call": True,
                        "limit": {"context": server.context, "output": server.max_output},
                    }
                },
            }
        },
        "model": f"freetoken/{name}",
        "small_model": f"freetoken/{name}",
    }


def opencode_setup(server: Server) -> ClientSetup:
    """OpenCode: the provider as inline config, which OpenCode merges over the user's own."""
    env = {"OPENCODE_CONFIG_CONTENT": json.dumps(opencode_config(server))}
    return ClientSetup("opencode", env, install="npm install -g opencode-ai")


CLIENTS: dict[str, Callable[[Server], ClientSetup]] = {
    "claude": claude_setup,
    "codex": codex_setup,
    "opencode": opencode_setup,
}


# -- the server ---------------------------------------------------------------------------


def _get_json(url: str, headers: dict[str, str], timeout: float) -> dict:
    with urlopen(Request(url, headers=headers), timeout=timeout) as response:
        return json.load(response)


def probe(url: str, api_key: str | None, timeout: float = 2.0) -> Server | None:
    """The server answering at `url`, or None when nothing does."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        _get_json(url + "/health", {}, timeout)
        models = _get_json(url + "/v1/models", headers, timeout)
    except HTTPError as e:
        if e.code == 401:
            raise LaunchError(
                f"the server at {url} needs an API key: pass --api-key or set "
                f"{settings.API_KEY.name}"
            ) from e
        return None
    except (URLError, OSError, ValueError):
        return None  # nothing there (yet), or not a freetoken server
    model = models["data"][0]
    return Server(url, model["id"], int(model.get("max_model_len") or 8192), api_key)


def serve_args(args: argparse.Namespace) -> list[str]:
    """The `ft serve` options to start a server with: the engine options given on the command
    line (those that differ from their defaults), and the address of --url."""
    out: list[str] = []
    for action in args.engine_actions:
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        out += [flag] if action.nargs == 0 else [flag, str(value)]  # nargs 0: a switch
    address = urlparse(args.url)
    out += ["--host", address.hostname or "127.0.0.1", "--port", str(address.port or 80)]
    if args.served_model_name:
        out += ["--served-model-name", args.served_model_name]
    if args.api_key:
        out += ["--api-key", args.api_key]
    return out


def start_server(args: argparse.Namespace) -> tuple[Server, subprocess.Popen]:
    address = urlparse(args.url)
    if address.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise LaunchError(
            f"nothing answers at {args.url}, and ft launch starts servers only on "
            "this machine (127.0.0.1)"
        )
    log_path = cache_dir() / "launch" / f"serve-{address.port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "freetoken.cli.main", "serve", *serve_args(args)]
    print(
        f"ft launch: starting ft serve ({' '.join(command[3:])}); log: {log_path}",
        file=sys.stderr,
        flush=True,
    )
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
            raise LaunchError(f"ft serve exited with status {process.returncode}:\n{tail}")
        server = probe(args.url, args.api_key, timeout=1.0)
        if server is not None:
            return server, process
        time.sleep(0.5)
    stop(process)
    raise LaunchError(f"ft serve did not answer at {args.url} within {STARTUP_TIMEOUT_S:.0f} s")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- the command --------------------------------------------------------------------------


def describe(setup: ClientSetup, server: Server, client_args: list[str]) -> str:
    """The settings, for people who run the client themselves."""
    lines = [
        f"# {setup.executable} against freetoken at {server.url} ({server.model}, "
        f"{server.context} tokens of context)"
    ]
    lines += [f"unset {name}" for name in setup.unset]
    for key, value in (setup.env | setup.defaults).items():
        if key == "OPENCODE_CONFIG_CONTENT":
            lines.append("# or put this in opencode.json:")
            lines += ["# " + line for line in json.dumps(json.loads(value), indent=2).splitlines()]
        lines.append(f"export {key}={shlex.quote(value)}")
    lines.append(shlex.join([setup.executable, *setup.args, *client_args]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    args.url = args.url.rstrip("/").removesuffix("/v1")
    args.api_key = args.api_key or settings.api_key()
    make = CLIENTS[args.client]
    process = None
    server = probe(args.url, args.api_key)
    if server is None:
        if args.print:
            raise LaunchError(f"nothing answers at {args.url}: start `ft serve` first")
        server, process = start_server(args)
    elif not args.print:
        print(f"ft launch: using the server at {args.url} ({server.model})", file=sys.stderr)
    setup = make(dataclasses.replace(server, output_limit=args.max_output_tokens))
    if args.print:
        print(describe(setup, server, args.client_args))
        return 0
    executable = shutil.which(setup.executable)
    if executable is None:
        if process is not None:
            stop(process)
        raise LaunchError(f"{setup.executable} is not on PATH; install it with: {setup.install}")
    env = setup.defaults | settings.for_child(drop=setup.unset) | setup.env
    argv = [executable, *setup.args, *args.client_args]
    if process is None:
        os.execvpe(executable, argv, env)  # nothing of ours to clean up afterwards
    # Ctrl-C belongs to the client while it runs; the server started here stops after it.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return subprocess.call(argv, env=env)
    finally:
        signal.signal(signal.SIGINT, previous)
        if args.keep_server:
            print(
                f"ft launch: ft serve keeps running at {args.url} (pid {process.pid})",
                file=sys.stderr,
            )
        else:
            stop(process)


def add_parser(sub) -> None:
    """`ft launch`."""
    p = sub.add_parser(
        "launch",
        help="run Claude Code, Codex or OpenCode against a local freetoken server",
        description=__doc__.split("\n\n")[1],
        usage="ft launch [OPTIONS] {claude,codex,opencode} [CLIENT ARGS...]",
    )
    p.add_argument("client", choices=sorted(CLIENTS), help="the coding agent to run")
    rest = p.add_argument(
        "client_args", nargs=argparse.REMAINDER, help="passed to the client (default: none)"
    )
    rest.required = False  # (argparse would name it among the missing with the client)
    p.add_argument("--url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    p.add_argument(
        "--api-key", help=f"the server's key (default: ${settings.API_KEY.name}, if set)"
    )
    p.add_argument(
        "--served-model-name",
        help="a started server's model name (default: the checkpoint directory's name)",
    )
    p.add_argument(
        "--max-output-tokens",
        type=integer(1),
        help="the output limit the client asks for (default: a quarter of the context, at most "
        "32000; the demo model's noise never ends a reply)",
    )
    p.add_argument(
        "--print",
        action="store_true",
        help="print the client's settings, run nothing (default: run)",
    )
    p.add_argument(
        "--keep-server",
        action="store_true",
        help="leave a server started here running (default: stopped when the client exits)",
    )
    # The engine options are those of `ft serve`, for a server this command starts.
    p.set_defaults(func="freetoken.cli.launch:run", engine_actions=add_engine_args(p))
