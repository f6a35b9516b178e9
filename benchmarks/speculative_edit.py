"""Prompt-lookup drafts on a code-editing turn: a model asked to write back a file from its
context with one rename, greedy, decoded with drafting off, n-gram (every draft whole) and
auto (interleaved, in one process): tokens/s, drafts verified and kept, and whether the
tokens are the same.

    python benchmarks/speculative_edit.py MODEL [--dtype bfloat16] [--tokens 200]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from freetoken.config import EngineConfig
from freetoken.engine.draft_policy import auto_policy
from freetoken.engine.generate import LLMEngine
from freetoken.engine.sampling import SamplingParams
from freetoken.engine.speculative import PromptLookup

FILE = Path(__file__).resolve().parents[1] / "src/freetoken/engine/speculative.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    engine = LLMEngine.from_config(
        EngineConfig(
            model=args.model,
            device="cpu",
            dtype=args.dtype,
            kv_cache_tokens=8192,
            max_model_len=8192,
            speculative="off",
        )
    )
    tok = engine.tokenizer
    ask = (
        "Here is a file:\n```python\n" + FILE.read_text()[:3000] + "\n```\nRewrite it exactly, "
        "but rename the class NgramIndex to SuffixIndex. Output the whole file."
    )
    ids = tok.encode(tok.render_chat([{"role": "user", "content": ask}]))
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.0)
    outputs = {}
    for _ in range(args.rounds):
        for mode in ("off", "ngram", "auto"):
            engine.drafter = PromptLookup() if mode != "off" else None
            # (auto: as much of each draft as its cost model says pays, measured as it goes)
            engine.draft_policy = auto_policy(engine.runner, 4) if mode == "auto" else None
            engine.drafted = engine.accepted = engine.verified = 0
            start = time.perf_counter()
            out = engine.generate([ids], params)[0]
            seconds = time.perf_counter() - start
            outputs.setdefault(mode, []).append(out.output_ids)
            per_step = (
                f"{(engine.accepted + engine.verified) / engine.verified:.2f} tokens each"
                if engine.verified
                else "-"
            )
            print(
                f"{mode:5s} {len(out.output_ids)} tokens in {seconds:.2f} s "
                f"({len(out.output_ids) / seconds:.1f} tok/s, prefill of {len(ids)} included), "
                f"drafted {engine.drafted}, accepted {engine.accepted}, verify steps "
                f"{engine.verified} ({per_step})"
            )
    same = all(o == outputs["off"][0] for runs in outputs.values() for o in runs)
    print("same tokens with and without drafts:", same)


if __name__ == "__main__":
    main()
