"""`ft shell`: chat with the model in the terminal (or through a pipe)."""

from __future__ import annotations

import argparse
import sys

from freetoken.cli.common import load_engine, sampling_params, stream_to

HELP = "Commands: /reset clears the conversation, /exit quits (so does Ctrl-D)."


def run(args: argparse.Namespace) -> int:
    engine = load_engine(args)
    params = sampling_params(args, engine)
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    if interactive:
        print(HELP)
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = list(system)
            print("(conversation cleared)")
            continue
        messages.append({"role": "user", "content": line})
        prompt = engine.tokenizer.encode(engine.tokenizer.render_chat(messages))
        reply = stream_to(sys.stdout, engine, prompt, params)
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})
    return 0
