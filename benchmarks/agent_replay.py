"""Time to first token per turn of a coding-agent conversation that grows past 32k tokens, with
and without prefix reuse (and, for a hybrid model, with and without anchor checkpoints).

    python benchmarks/agent_replay.py --family qwen3_moe --layers 16 --cache 8GiB --out a.md
    python benchmarks/agent_replay.py --family qwen3_next --layers 16 --cache 8GiB --out b.md
    python benchmarks/agent_replay.py --family kimi_linear --layers 16 --cache 8GiB --out c.md

Random-weight models of Qwen3-30B-A3B's, Qwen3-Next-80B-A3B's or Kimi-Linear-48B-A3B's shape
(fewer layers) behind the real Qwen3 tokenizer and chat template. Each turn the agent appends a
reply (a thinking block and a tool call) and a tool output of `--tool-tokens` tokens, and strips
the thinking of earlier replies (as OpenClaw does), so every turn edits the conversation as well
as extending it. Each engine sees the turns in order; TTFT is the time from `add_request` to the
first token, the prefill of everything not reused.

Each turn is checked against the bound prefix reuse promises (`recompute_bound`): the tokens it
recomputes are at most its new suffix (past its common prefix with what the previous turn's
sequence was fed) plus the distance back from that common prefix to the deepest point the model
can resume at (an anchor for a hybrid model, a page boundary otherwise). The script exits 1 when
a turn of the reusing mode (with anchors, for a hybrid model) recomputes more.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from decode_offload import (
    kimi_linear_48b_a3b,
    qwen3_30b_a3b,
    qwen3_next_80b_a3b,
    random_model,
    report,
    sync,
    tiny,
    use_uniform_routing,
)

from freetoken.config import MoEOptions
from freetoken.engine.generate import LLMEngine
from freetoken.engine.runner import ModelRunner
from freetoken.engine.sampling import SamplingParams
from freetoken.kv.anchors import anchor_positions, boundary_tokens
from freetoken.qwen_vocab import write_qwen_tokenizer
from freetoken.tokenizer import Tokenizer

WORDS = ["def", "class", "return", "import", "self", "value", "path", "file", "test", "error"]


def conversation(turns: int, tool_tokens: int) -> list[list[dict]]:
    """The messages the agent sends at each turn (OpenClaw's edit: thinking kept only in the
    latest reply)."""
    rng = random.Random(0)
    outputs = [" ".join(rng.choice(WORDS) for _ in range(tool_tokens)) for _ in range(turns)]
    sent = []
    for turn in range(turns):
        messages = [
            {"role": "system", "content": "You are a coding agent. Use the tools."},
            {"role": "user", "content": "Make the test suite pass."},
        ]
        for t in range(turn + 1):
            thinking = f"<think>step {t}: read file_{t}.py</think>" if t == turn else ""
            arguments = f'{{"path": "file_{t}.py"}}'
            call = f'<tool_call>{{"name": "read", "arguments": {arguments}}}</tool_call>'
            messages.append({"role": "assistant", "content": thinking + call})
            messages.append({"role": "tool", "content": outputs[t]})
        sent.append(messages)
    return sent


def recompute_bound(prompt: list[int], previous: list[int], points: list[int]) -> int:
    """The most tokens of `prompt` a turn may recompute: its new suffix past its common prefix
    with `previous` (what the previous turn's sequence was fed: prompt and output, the last
    output token unfed) plus the distance back from that common prefix to the deepest of
    `points` (the positions of `previous` the model can resume at) at or before it. At least
    one token is always computed (its logits give the first new token)."""
    common = 0
    for a, b in zip(prompt, previous, strict=False):
        if a != b:
            break
        common += 1
    limit = min(common, len(prompt) - 1)
    deepest = max((p for p in points if p <= limit), default=0)
    return (len(prompt) - common) + (common - deepest)


def resume_points(engine: LLMEngine, fed: list[int], boundaries: dict[int, int]) -> list[int]:
    """Where a later request can resume from a sequence fed `fed` once it has ended: a hybrid
    model's recurrent state only at its anchors (kv/anchors.py: at its edit boundaries, kept on
    the pages the prefix cache holds: full ones), a full-attention model at every full page."""
    page = engine.runner.kv.page_size
    full = len(fed) // page * page
    if engine.runner.config.has_recurrent_state:
        return [p for p in anchor_positions(boundaries, fed) if p <= full]
    return list(range(page, full + 1, page))


def replay(engine: LLMEngine, prompts: list[list[int]], device, skip=frozenset()) -> list:
    """Each prompt in turn (but the turns in `skip`), to its fourth token; per turn its TTFT,
    reused and recomputed tokens, the anchor it resumed at, and the bound its recomputed tokens
    are checked against (relative to the last turn this engine ran); None for a skipped turn."""
    rows, fed = [], []
    boundaries = boundary_tokens(engine.tokenizer)
    for turn, prompt in enumerate(prompts):
        if turn in skip:
            rows.append(None)
            continue
        bound = recompute_bound(prompt, fed, resume_points(engine, fed, boundaries))
        sync(device)
        start = time.perf_counter()
        req = engine.add_request(prompt, SamplingParams(max_new_tokens=4, temperature=0))
        ttft = None
        while not req.finished:
            engine.step()
            if ttft is None and req.output_ids:
                sync(device)
                ttft = time.perf_counter() - start
        rows.append(
            dict(
                tokens=len(prompt),
                ttft=ttft,
                reused=req.cached_tokens,
                recomputed=req.recomputed_tokens,
                bound=bound,
                anchor=req.anchor,
            )
        )
        fed = (prompt + req.output_ids)[:-1]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--family", choices=("qwen3_moe", "qwen3_next", "kimi_linear"), default="qwen3_moe"
    )
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--cache", default="8GiB")
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--tool-tokens", type=int, default=1400)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes, for a smoke test")
    ap.add_argument(
        "--recompute-turns",
        type=int,
        help="the modes that recompute every prompt (no reuse; a hybrid model's reuse without "
        "anchors, which has nothing to resume at) run only the first N turns and the last "
        "(default: all): on 2 CPU cores a 34k-token prompt from scratch takes minutes",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.family == "qwen3_moe":
        raw = tiny(args.layers) if args.tiny else qwen3_30b_a3b(args.layers)
    elif args.family == "kimi_linear":
        raw = kimi_linear_48b_a3b(args.layers)
        if args.tiny:
            raw.update(
                tiny(args.layers),
                architectures=["KimiLinearForCausalLM"],
                num_key_value_heads=4,
                kv_lora_rank=32,
                qk_nope_head_dim=16,
                qk_rope_head_dim=8,
                v_head_dim=16,
                num_experts=32,
                num_experts_per_token=4,
                intermediate_size=256,
                linear_attn_config={**raw["linear_attn_config"], "num_heads": 4, "head_dim": 16},
            )
    else:
        raw = qwen3_next_80b_a3b(args.layers)
        if args.tiny:
            raw.update(
                tiny(args.layers),
                architectures=["Qwen3NextForCausalLM"],
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                shared_expert_intermediate_size=64,
            )
    raw["vocab_size"] = 151936  # the real tokenizer's ids
    loaded = random_model(raw, device)
    use_uniform_routing(loaded)
    tokenizer_dir = Path(tempfile.mkdtemp(prefix="ft-agent-replay-"))
    write_qwen_tokenizer(tokenizer_dir)
    tokenizer = Tokenizer(tokenizer_dir)
    prompts = [
        tokenizer.encode(tokenizer.render_chat(messages))
        for messages in conversation(args.turns, args.tool_tokens)
    ]
    hybrid = loaded.config.linear_attention is not None
    modes = {"reuse": (True, 16), "no reuse": (False, 0)}
    if hybrid:
        modes = {
            "reuse + anchors": (True, 16),
            "reuse, no anchors": (True, 0),
            "no reuse": (False, 0),
        }
    results = {}
    for name, (prefix_cache, anchors) in modes.items():
        runner = ModelRunner(
            loaded,
            kv_cache_tokens=2 * (len(prompts[-1]) + 64),
            moe=MoEOptions(cache_size=args.cache, prefill_stream_threshold=128),
            state_anchors=anchors,
        )
        engine = LLMEngine(runner, tokenizer, prefix_cache=prefix_cache)
        skip = frozenset()
        if args.recompute_turns is not None and not (prefix_cache and (anchors or not hybrid)):
            skip = frozenset(range(args.recompute_turns, args.turns - 1))
        results[name] = replay(engine, prompts, device, skip)
        ran = [(round(r["ttft"], 3), r["recomputed"]) for r in results[name] if r is not None]
        print(name, ran, flush=True)
        if runner.moe is not None and runner.moe.cpu is not None:
            runner.moe.cpu.shutdown()
        del engine, runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    names = list(results)
    checked = names[0]  # the mode that reuses the prefix (with anchors, for a hybrid model)
    point = "anchor" if hybrid else "page boundary"
    lines = [
        f"# agent replay: {args.family} shape, {args.layers} layers, cache {args.cache}",
        "",
        f"- device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
        f"torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- {args.turns} turns, {args.tool_tokens}-word tool outputs, thinking stripped from "
        "earlier replies; TTFT in seconds; recomputed = prompt tokens whose KV (and state) did "
        "not come from earlier turns; bound = the new suffix (past the common prefix with the "
        "prompt and output of the previous turn the mode ran) plus the distance back to the "
        f"deepest {point} at or before that common prefix; - = a turn the mode skipped",
    ]
    failed = {}
    for n in names:
        ran = [(t + 1, r) for t, r in enumerate(results[n]) if r is not None]
        failed[n] = [t for t, r in ran if r["recomputed"] > r["bound"]]
        verdict = f"failed on turns {failed[n]}" if failed[n] else "held"
        role = " (checked)" if n == checked else ""
        within = f"{len(ran) - len(failed[n])} of {len(ran)} turns run within it"
        lines.append(f"- bound, {n}{role}: {verdict} ({within})")
    lines += [
        "",
        "| turn | prompt tokens | "
        + " | ".join(f"TTFT {n} | recomputed ({n}) | bound ({n})" for n in names)
        + " |",
        "|---|---|" + "---|---|---|" * len(names),
    ]
    for t in range(args.turns):
        rows = [results[n][t] for n in names]
        cells = [
            "- | - | -" if r is None else f"{r['ttft']:.3f} | {r['recomputed']} | {r['bound']}"
            for r in rows
        ]
        lines.append(f"| {t + 1} | {len(prompts[t])} | " + " | ".join(cells) + " |")
    report(lines, args.out)
    if failed[checked]:
        print(f"{checked}: recomputed more than the bound on turns {failed[checked]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
