"""`ft serve`: the OpenAI- and Anthropic-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import sys

from freetoken.cli.common import load_engine

API_KEY_ENV = "FREETOKEN_API_KEY"


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from freetoken.engine.scheduler import Scheduler
    from freetoken.server.app import create_app
    from freetoken.server.core import GenerationCore

    engine = load_engine(args)
    engine.max_prefill_chunk = args.max_prefill_chunk
    name = args.served_model_name or (args.model.name if args.model else "freetoken-demo")
    scheduler = Scheduler(engine, args.max_running_requests, args.max_queued_requests)
    core = GenerationCore(scheduler, engine.tokenizer, name)
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    app = create_app(core, api_key)
    url = f"http://{args.host}:{args.port}"
    auth = ' -H "Authorization: Bearer $FREETOKEN_API_KEY"' if api_key else ""
    print(
        f"freetoken serving {name} at {url}/v1 (OpenAI) and {url}/v1/messages (Anthropic)\n"
        f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"""-d '{{"model": "{name}", "max_tokens": 64, """
        f""""messages": [{{"role": "user", "content": "Hello"}}]}}'\n"""
        f"context: {engine.max_context} tokens; coding agents: ft launch claude|codex|opencode",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    scheduler.shutdown()
    return 0
