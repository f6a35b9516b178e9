"""How well a layer-ahead prefetch predicts routes (moe/prefetch.py) on real hidden states: greedy
decode of a code prompt with `offload` and the prefetch on (the cache tier on the CPU), each
MoE layer's predicted experts (its router over its norm of the stream the layer before left)
set beside the experts it then routes to. Reports recall (the share of routed experts that were
predicted) per layer and overall, and what chance gives (k / E).

    python benchmarks/prefetch_recall.py qwen2.5-coder-0.5b-instruct [--tokens 64] [--out F]

A packaged model's name (packaged_models.py) is made into its MoE (moe_from_dense: every expert
a copy of the MLP, routers that cluster the layer's inputs), so the hidden states are a trained
model's; a checkpoint directory or GGUF file is read as it is.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from freetoken import packaged_models
from freetoken.config import MoEOptions
from freetoken.engine.runner import ModelRunner
from freetoken.models import gguf, moe_from_dense
from freetoken.models.loading import load_model
from freetoken.tokenizer import Tokenizer

PROMPT_FILE = Path(__file__).resolve().parents[1] / "src/freetoken/moe/prefetch.py"


def model_dir(name: str) -> Path:
    """A packaged model's MoE, or the checkpoint at `name`."""
    if Path(name).exists():
        return gguf.resolve(name)
    return gguf.resolve(moe_from_dense.cached(packaged_models.fetch(name)))


def record_routes(model) -> tuple[dict, dict]:
    """Wrap every MoE block: its predicted ids and its routed ids, per layer, in call order."""
    predicted, routed = defaultdict(list), defaultdict(list)
    for layer in model.layers:
        block = getattr(layer, "moe", None)
        if block is None:
            continue
        state = {"predicting": False}

        def prefetch(*args, _original=block.prefetch, _state=state, **kwargs):
            _state["predicting"] = True
            try:
                _original(*args, **kwargs)
            finally:
                _state["predicting"] = False

        def route(x, *args, _original=block.route, _state=state, _layer=block.moe_layer, **kw):
            weights, ids = _original(x, *args, **kw)
            (predicted if _state["predicting"] else routed)[_layer].append(ids.clone())
            return weights, ids

        block.prefetch, block.route = prefetch, route
    return predicted, routed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    path = model_dir(args.model)
    loaded = load_model(path, dtype="float32")
    moe = loaded.config.moe
    tokenizer = Tokenizer(path)
    prompt = tokenizer.encode(PROMPT_FILE.read_text())[: args.prompt_tokens]
    options = MoEOptions(strategy="offload", cache_size="64", prefetch_experts=moe.top_k)
    runner = ModelRunner(loaded, kv_cache_tokens=4096, page_size=16, moe=options)
    predicted, routed = record_routes(loaded.model)
    seq = runner.new_sequence()
    start = time.perf_counter()
    logits = runner.forward([seq], [prompt])
    for layer in routed:
        routed[layer].clear()  # (the prompt's calls: decided on the host, none predicted)
    for _ in range(args.tokens):
        logits = runner.forward([seq], [[int(logits.argmax(-1)[0])]])
    seconds = time.perf_counter() - start
    rows, hits, total = [], 0, 0
    for layer in sorted(routed):
        pred, real = predicted.get(layer, []), routed[layer]
        if len(pred) != len(real):  # the first MoE layer has no layer before it
            continue
        same = sum(
            len(set(p.flatten().tolist()) & set(r.flatten().tolist()))
            for p, r in zip(pred, real, strict=True)
        )
        count = sum(r.numel() for r in real)
        rows.append((layer, same / count))
        hits, total = hits + same, total + count
    lines = [
        f"# Prefetch recall: {args.model}",
        "",
        f"- date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {len(prompt)} prompt "
        f"tokens ({PROMPT_FILE.name}), {args.tokens} greedy decode tokens, fp32 on the CPU "
        f"({seconds:.0f} s)",
        f"- {moe.num_experts} experts a layer, top-{moe.top_k}: chance recall "
        f"{moe.top_k / moe.num_experts:.2f}",
        f"- **recall over the predicted layers: {hits / max(total, 1):.3f}**",
        "",
        "| MoE layer | recall |",
        "|---|---|",
        *(f"| {layer} | {recall:.3f} |" for layer, recall in rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
