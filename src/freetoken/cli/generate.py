"""`ft generate`: complete one prompt."""

from __future__ import annotations

import argparse
import sys

from freetoken.cli.common import load_engine, sampling_params, stream_to


def run(args: argparse.Namespace) -> int:
    engine = load_engine(args)
    params = sampling_params(args, engine)
    text = args.prompt
    if args.chat:
        text = engine.tokenizer.render_chat([{"role": "user", "content": args.prompt}])
    stream_to(sys.stdout, engine, engine.tokenizer.encode(text), params)
    sys.stdout.write("\n")
    return 0
