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


def replay(engine: LLMEngine, prompts: list[list[int]], device) -> list[dict]:
    rows = []
    for prompt in prompts:
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
            dict(tokens=len(prompt), ttft=ttft, reused=req.cached_tokens, anchor=req.anchor)
        )
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
        results[name] = replay(engine, prompts, device)
        print(name, [round(r["ttft"], 3) for r in results[name]], flush=True)
        if runner.moe is not None and runner.moe.cpu is not None:
            runner.moe.cpu.shutdown()
        del engine, runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    names = list(results)
    lines = [
        f"# agent replay: {args.family} shape, {args.layers} layers, cache {args.cache}",
        "",
        f"- device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
        f"torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- {args.turns} turns, {args.tool_tokens}-word tool outputs, thinking stripped from "
        "earlier replies; TTFT in seconds; reused = prompt tokens whose KV (and state) came "
        "from earlier turns",
        "",
        "| turn | prompt tokens | " + " | ".join(f"TTFT {n} | reused ({n})" for n in names) + " |",
        "|---|---|" + "---|---|" * len(names),
    ]
    for t in range(args.turns):
        cells = [f"{results[n][t]['ttft']:.3f} | {results[n][t]['reused']}" for n in names]
        lines.append(f"| {t + 1} | {results[names[0]][t]['tokens']} | " + " | ".join(cells) + " |")
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
