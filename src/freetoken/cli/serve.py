"""`ft serve`: the OpenAI- and Anthropic-compatible HTTP server."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time

from freetoken import early_start, settings
from freetoken.cli.common import load_engine
from freetoken.cli.listen import bind
from freetoken.config import ServerConfig
from freetoken.models import demo_model

log = logging.getLogger(__name__)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server's settings from its flags; refuses an empty key, which would read as "no
    auth" where the operator meant to set one."""
    api_key = args.api_key if args.api_key is not None else settings.api_key()
    if api_key is not None and not api_key.strip():
        source = "--api-key" if args.api_key is not None else f"${settings.API_KEY.name}"
        raise SystemExit(
            f"error: {source} is empty; give a key, or leave it out to serve without one"
        )
    return ServerConfig(
        api_key=api_key,
        max_request_bytes=args.max_request_bytes,
        allow_request_chat_template=args.allow_request_chat_template,
        template_timeout_s=args.template_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
    )


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to tell an operator who serves other machines without a key."""
    loopback = host in ("localhost", "::1") or host.startswith("127.")
    if loopback or api_key:
        return None
    return (
        f"warning: serving on {host} without an API key: anyone who can reach this port "
        f"can use the model (set --api-key or ${settings.API_KEY.name})"
    )


def show_access_log() -> None:
    """Each request's line (server/access_log.py) on stderr, timestamped, at any verbosity."""
    access = logging.getLogger("freetoken.server.access_log")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False


def make_server(app, core, host: str, port: int, config: ServerConfig):
    """A uvicorn server whose SIGTERM (or first Ctrl-C) drains: no new requests, those in
    flight may finish within the shutdown timeout, then the rest are ended (streams with their
    API's error event) and the process exits."""
    import contextlib

    import uvicorn

    from freetoken.server.core import shutdown_reserve

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            log.debug("listening")

        def handle_exit(self, sig, frame) -> None:
            core.begin_shutdown(config.shutdown_timeout_s)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                # Drained: exit normally, after the caller's cleanup, instead of uvicorn
                # raising the signal again on the way out.
                self._captured_signals.clear()

    # uvicorn's own deadline is the backstop, half-way into the reserve the engine keeps
    # past the drain: ended streams need a moment to send their last event.
    timeout = config.shutdown_timeout_s
    return DrainingServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=timeout - shutdown_reserve(timeout) / 2,
        )
    )


def run(args: argparse.Namespace) -> int:
    log.debug("engine modules imported")
    from freetoken.engine.scheduler import Scheduler
    from freetoken.server.app import create_app
    from freetoken.server.core import GenerationCore
    from freetoken.server.sandbox import TemplateSandbox

    log.debug("server modules imported")
    config = server_config(args)
    if warning := exposure_warning(args.host, config.api_key):
        print(warning, file=sys.stderr)
    # (bound by `ft`'s main before the imports; here for callers that came another way)
    sock = getattr(args, "socket", None) or bind(args.host, args.port)
    engine = load_engine(args)
    name = args.served_model_name or (args.model.name if args.model else demo_model.NAME)
    # (the start's garbage is freed once the engine first idles: a pass over everything, which
    # no request then waits on)
    scheduler = Scheduler(
        engine, max_queued=args.max_queued_requests, on_idle=early_start.collect_start_garbage
    )
    sandbox = None
    if config.allow_request_chat_template:
        sandbox = TemplateSandbox(engine.tokenizer.path, config.template_timeout_s)
    core = GenerationCore(scheduler, engine.tokenizer, name, template_sandbox=sandbox)
    app = create_app(core, config)
    log.debug("app made")
    url = f"http://{args.host}:{args.port}"
    auth = ""
    if config.api_key:  # (the key as it was given: the example works as printed)
        header = f"Authorization: Bearer {args.api_key}" if args.api_key is not None else None
        auth = (
            f" -H {shlex.quote(header)}"
            if header
            else f' -H "Authorization: Bearer ${settings.API_KEY.name}"'
        )
    # (the example is greedy: the APIs sample a request without a temperature at 1.0, their
    # documented default, which a small model answers with noise more often than not)
    print(
        f"freetoken serving {name} at {url}/v1 (OpenAI) and {url}/v1/messages (Anthropic)\n"
        f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"""-d '{{"model": "{name}", "max_tokens": 64, "temperature": 0, """
        f""""messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'\n"""
        f"context: {engine.max_context} tokens; coding agents: ft launch claude|codex|opencode",
        file=sys.stderr,
        flush=True,
    )
    show_access_log()
    try:
        make_server(app, core, args.host, args.port, config).run(sockets=[sock])
    finally:
        # Within the shutdown deadline when there is one (the engine thread is a daemon: a
        # step still running past it does not hold the exit).
        deadline = core.shutdown_deadline
        left = 10.0 if deadline is None else max(0.0, deadline - time.monotonic() - 0.2)
        scheduler.shutdown(timeout=left)
        if sandbox is not None:
            sandbox.close()
    if deadline is not None:
        # Everything we own is released; the interpreter's own teardown (freeing torch and
        # the model, ~1 s) would overrun the deadline the operator set.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
