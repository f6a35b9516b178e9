"""`ft shell`: chat with the model in the terminal (or through a pipe)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from freetoken.cli.common import load_engine, sampling_params, stream_to

HELP = (
    "Commands: /reset clears the conversation, /exit quits (so do Ctrl-D and Ctrl-C at the "
    "prompt); Ctrl-C during a reply stops it."
)
STOPPED = "(stopped)"


def reply(engine, prompt: list[int], params) -> str:
    """Stream one reply to stdout; Ctrl-C (SIGINT) stops it after the token in hand, with the
    conversation kept (the engine is never interrupted inside a step). Returns what was said."""
    stop = threading.Event()
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    except ValueError:  # (not the main thread: no handler of ours)
        previous = None
    try:
        text = stream_to(sys.stdout, engine, prompt, params, stop=stop)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if stop.is_set():
        print(f" {STOPPED}", end="")
    return text


def run(args: argparse.Namespace) -> int:
    engine = load_engine(args)
    params = sampling_params(args, engine)
    interactive = sys.stdin.isatty()
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    if interactive:
        print(HELP)
    while True:
        try:
            if interactive:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
        except KeyboardInterrupt:  # (Ctrl-C at the prompt leaves)
            print()
            break
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
        text = reply(engine, prompt, params)
        print(flush=True)
        messages.append({"role": "assistant", "content": text})
    return 0
