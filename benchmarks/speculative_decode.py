"""Speculative decoding's speed on the GPU: tokens/s with `--speculative auto` against off,
on a random-weight MoE of a real shape, with the drafts' acceptance replayed from a real
measurement.

    python benchmarks/speculative_decode.py --layers 16 --strategies fused,hybrid \
        --cache 8GiB --batches 1,4 --out results.md

A random model answers noise, so its drafts can't come from its own text. Two workloads:
- `edit`: a coding agent's edit turn, replayed. A first run without drafts records each
  request's greedy tokens; the drafted run's drafter offers those tokens, each right with the
  probability `--acceptance` (the real-weights measurement: the MoE made of Qwen2.5-Coder-0.5B
  writing back a file with one rename kept 157 of 157 drafted tokens, 4.83 tokens a verify
  step: benchmarks/results/2026-12-05-speculative-cpu.md), wrong (another id) otherwise.
- `random`: sampled tokens (temperature 1 over the whole vocabulary): prompt lookup finds
  next to nothing to draft; auto should cost nothing against off.
Routing is by position (so a verify step's tokens route as they would one by one, and the two
runs' greedy tokens agree up to the sums' rounding between a one-token and a several-token
step), not the random router's (which sends every token to the same experts):
- `--routing uniform`: each position's experts a fixed uniform random top-k per layer. Under
  offload that is the worst case for a verify step: its n tokens share almost no experts.
- `--routing trace:FILE`: position p routes as token p of a real routing trace, requests back
  to back (moe/trace.py; `../shared/traces/gpt-oss-20b-decode.npz` with `--shape gpt-oss-20b`,
  whose routing it recorded): consecutive tokens of a request share experts as trained
  routers' do, so a verify step's union of experts is the real one.
The sequences of a batch start `SPACING` positions apart (their prompts differ in length), so
they route as different requests rather than all alike. In `edit` the greedy token at each
position is fixed too (`PositionHolder.steer`: a large logit added at a token chosen by
position, after all the model's work): a random model's near-ties otherwise tip one way or the
other with the rounding of the step's shape or of hybrid's CPU share, and the replayed drafts
(the run without drafts' tokens) stop matching: on an H100, gpt-oss-20b's shape kept 15% of
the tokens.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median, median_high

import torch
from decode_offload import (
    SHAPES,
    mispredicted,
    predicting,
    random_model,
    read_trace,
    report,
    sync,
    tiny,
    way_medians_ms,
)

from freetoken.config import MoEOptions
from freetoken.engine.draft_policy import auto_policy
from freetoken.engine.generate import LLMEngine
from freetoken.engine.runner import ModelRunner
from freetoken.engine.sampling import SamplingParams
from freetoken.engine.speculative import PromptLookup

MAX_POSITIONS = 8192
SPACING = 384  # positions between the starts of a batch's sequences (more than a trace request)


class PositionRouter(torch.nn.Module):
    """Router logits by position: a fixed [positions, experts] table per layer, read at the
    step's positions (`positions.now`, the batch's tensor: a CUDA graph captures it). A
    prefetch's prediction (`predicting`) misses each chosen expert with probability
    1 - `recall`, as decode_offload.py's UniformRouter's does."""

    def __init__(self, table: torch.Tensor, positions: PositionHolder, top_k: int, recall: float):
        super().__init__()
        self.table, self.positions, self.top_k, self.recall = table, positions, top_k, recall
        self.predicting = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.table.index_select(0, self.positions.now).to(x.dtype)
        if self.predicting:
            return logits.masked_fill(mispredicted(logits, self.top_k, self.recall), -1e4)
        return logits


@dataclass
class PositionHolder:
    now: torch.Tensor | None = None
    steer: torch.Tensor | None = None  # (1: the steered token's logit raised; 0: not)


def routing_tables(loaded, device, routing: str) -> list[torch.Tensor]:
    """Each MoE layer's [MAX_POSITIONS, experts] router logits: uniform random draws, or a
    trace's choices (its router probabilities' logs; the others far below), token p of the
    trace at position p, MoE layer l as the trace's layer l mod its layers."""
    moe = loaded.config.moe
    layers = sum(hasattr(layer, "moe") for layer in loaded.model.layers)
    if routing == "uniform":
        gen = torch.Generator(device="cpu").manual_seed(0)
        return [
            torch.randn(MAX_POSITIONS, moe.num_experts, generator=gen).to(device)
            for _ in range(layers)
        ]
    if not routing.startswith("trace:"):
        raise SystemExit(f"unknown --routing {routing!r}: uniform or trace:FILE")
    experts, probs = read_trace(loaded, routing.removeprefix("trace:"))  # (on the model's device)
    rows = torch.arange(MAX_POSITIONS, device=experts.device) % experts.shape[0]
    tables = []
    for layer in range(layers):
        traced = layer % experts.shape[1]
        table = torch.full((MAX_POSITIONS, moe.num_experts), -1e4, device=experts.device)
        tables.append(table.scatter_(1, experts[rows, traced], probs[rows, traced].log()))
    return tables


STEER = 1e4  # (far above a random model's logits: the steered token is every step's argmax)


def steered_token(positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The token `route_by_position` makes greedy at each position while steering."""
    return (positions * 7919 + 13) % vocab


def route_by_position(
    loaded, device, routing: str = "uniform", recall: float = 1.0
) -> PositionHolder:
    """Every MoE layer routed by position (`routing_tables`), and each position's greedy token
    fixed while the returned holder's `steer` is 1 (a device tensor, so that CUDA graphs read
    it; 0, as it starts: the model's own logits)."""
    holder = PositionHolder(steer=torch.zeros((), device=device))
    tables = iter(routing_tables(loaded, device, routing))
    for layer in loaded.model.layers:
        if hasattr(layer, "moe"):
            block = layer.moe
            block.router = PositionRouter(next(tables), holder, loaded.config.moe.top_k, recall)
            block.prefetch = predicting(block.prefetch, block.router)
    forward = loaded.model.forward
    vocab = loaded.config.vocab_size

    def with_positions(batch, *args, **kwargs):
        holder.now = batch.positions
        out = forward(batch, *args, **kwargs)
        logits = out[0] if isinstance(out, tuple) else out
        # (rows: every token's, or each sequence's last; as many rows as tokens means each row
        # is a last one or all were asked for)
        rows = batch.positions
        if logits.shape[0] != rows.shape[0]:
            rows = rows[batch.last_index]
        raised = (holder.steer * STEER).expand(logits.shape[0], 1).to(logits.dtype)
        logits = logits.scatter_add(1, steered_token(rows, vocab)[:, None], raised)
        return (logits, *out[1:]) if isinstance(out, tuple) else logits

    loaded.model.forward = with_positions
    return holder


class Ids:
    """The least of a tokenizer the engine needs."""

    def __init__(self, vocab: int):
        self.vocab_size, self.eos_token_ids = vocab, ()

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


@dataclass
class Replayed:
    """A drafter that offers each request's recorded tokens, each right with probability
    `acceptance` (else a different id)."""

    recorded: dict[tuple[int, ...], list[int]]
    acceptance: float
    vocab: int
    max_draft: int = 4
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    @dataclass
    class State:
        tokens: list[int]
        reference: list[int]

    def start(self, tokens):
        ref = next(v for k, v in self.recorded.items() if tuple(tokens[: len(k)]) == k)
        return self.State(list(tokens), ref)

    def draft(self, state, room):
        n = len(state.tokens)
        ahead = state.reference[n : n + min(room, self.max_draft)]
        return [t if self.rng.random() < self.acceptance else (t + 1) % self.vocab for t in ahead]

    def observe(self, state, token):
        state.tokens.append(token)

    def record(self, state, drafted, accepted):
        pass


def run(
    engine: LLMEngine, prompts, params, device, steps: list[float] | None = None
) -> tuple[float, list[list[int]]]:
    """Tokens/s of generating `prompts`, and the tokens; each engine step's seconds appended to
    `steps` (a step ends with its tokens on the host)."""
    engine.drafted = engine.accepted = engine.verified = 0
    step = engine.step
    if steps is not None:

        def timed():
            begin = time.perf_counter()
            out = step()
            steps.append(time.perf_counter() - begin)
            return out

        engine.step = timed
    sync(device)
    start = time.perf_counter()
    try:
        outputs = engine.generate(prompts, params)
    finally:
        engine.step = step
    sync(device)
    seconds = time.perf_counter() - start
    return sum(len(o.output_ids) for o in outputs) / seconds, [o.output_ids for o in outputs]


def step_summary(steps: list[float]) -> dict:
    """Engine steps' ms: the median, the slowest, and the share of the run's time in steps
    over 3x the median (stalls, as against a uniformly slow step)."""
    middle = median_high(steps)
    stalls = sum(t for t in steps if t > 3 * middle)
    return dict(
        steps=len(steps),
        median_ms=round(middle * 1e3, 2),
        max_ms=round(max(steps) * 1e3, 2),
        stall_share=round(stalls / sum(steps), 3),
    )


def plain_step_ways(runner: ModelRunner, batch: int) -> dict | None:
    """Hybrid's way for the batch's plain decode step (StepModes keys steps by their tokens):
    the way in use, its trials, each way's median ms in the last one."""
    if runner.moe is None or not runner.moe.step_modes.trials(batch):
        return None  # (no hybrid, or no trial yet)
    modes = runner.moe.step_modes
    return dict(
        way=modes.current(batch), trials=modes.trials(batch), ms=way_medians_ms(modes, batch)
    )


def measure(loaded, options, batch, args, device, holder: PositionHolder) -> list[dict]:
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    lengths = [args.prompt + i * SPACING for i in range(batch)]  # (each its own positions)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    if max(lengths) + 2 * args.tokens + 8 > MAX_POSITIONS:
        raise SystemExit(f"prompts and answers reach past the routing's {MAX_POSITIONS} positions")
    runner = ModelRunner(
        loaded, kv_cache_tokens=sum(lengths) + batch * (2 * args.tokens + 64), moe=options
    )
    engine = LLMEngine(runner, Ids(vocab), max_batch_size=batch)
    rows = []
    for workload in ("edit", "random"):
        sampled = workload == "random"
        holder.steer.fill_(0.0 if sampled else 1.0)  # (edit: greedy tokens fixed by position)
        params = SamplingParams(
            max_new_tokens=args.tokens,
            temperature=1.0 if sampled else 0.0,
            top_k=0,
            ignore_eos=True,
            seed=1 if sampled else None,
        )
        engine.drafter = engine.draft_policy = None
        # warm-up: graphs of every batch size; twice, so that the prefill of a prompt behind
        # its cached prefix, which every later run starts with, is compiled too (gpt-oss-20b's
        # trace on an H100 spent 3.6 s of its first off run there, at 128 tokens 84% of it)
        for _ in range(2):
            run(engine, prompts, params, device)
        off_steps: list[float] = []
        off, reference = run(engine, prompts, params, device, off_steps)
        if sampled:
            drafter = PromptLookup()
        else:
            recorded = {tuple(p): p + r for p, r in zip(prompts, reference, strict=True)}
            drafter = Replayed(recorded, args.acceptance, vocab)
        engine.drafter, engine.draft_policy = drafter, auto_policy(runner, drafter.max_draft)
        run(engine, prompts, params, device)  # warm-up: verify shapes captured and measured
        auto, tokens = run(engine, prompts, params, device)
        counts = dict(
            drafted=engine.drafted, accepted=engine.accepted, verify_steps=engine.verified
        )
        # off once more, after, then `--rounds` - 1 more pairs, auto and off in turns. auto/off
        # is the ratio of their medians, and the off runs' spread says what a difference
        # smaller than it means: nothing (at 128-256 tokens a run, two off runs of the same
        # work moved 1-17% on an H100).
        after_steps: list[float] = []
        offs, autos = [off], [auto]
        for i in range(args.rounds):
            engine.drafter = None
            offs.append(run(engine, prompts, params, device, None if i else after_steps)[0])
            engine.drafter = drafter
            if i + 1 < args.rounds:
                autos.append(run(engine, prompts, params, device)[0])
        same = sum(
            a == b
            for x, y in zip(tokens, reference, strict=True)
            for a, b in zip(x, y, strict=False)
        )
        rows.append(
            dict(
                workload=workload,
                off=off,
                off_after=offs[1],
                auto=auto,
                ratio=median(autos) / median(offs),
                spread=(max(offs) - min(offs)) / median(offs),
                runs=dict(off=[round(x, 1) for x in offs], auto=[round(x, 1) for x in autos]),
                **counts,
                same_tokens=None if sampled else same / sum(map(len, reference)),
                costs_ms={
                    f"{s}x{t}": round(c * 1e3, 2) for (s, t), c in engine.draft_policy.costs.items()
                },
                ways=plain_step_ways(runner, batch),
                off_steps=step_summary(off_steps),
                off_after_steps=step_summary(after_steps),
            )
        )
        print(options.strategy, batch, rows[-1], flush=True)
    if runner.moe is not None and runner.moe.cpu is not None:
        runner.moe.cpu.shutdown()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument(
        "--routing",
        default="uniform",
        help="uniform, or trace:FILE (a real routing trace whose top-k fits the shape's)",
    )
    ap.add_argument("--strategies", default="fused,hybrid")
    ap.add_argument("--cache", default="8GiB")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--acceptance", type=float, default=1.0)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="off runs after the first auto one, with an auto run between each two: the "
        "medians are compared",
    )
    ap.add_argument(
        "--prefetch",
        type=int,
        default=0,
        help="offload and hybrid: experts prefetched a layer ahead (moe/prefetch.py), a "
        "verify step's draft tokens' too",
    )
    ap.add_argument("--prediction-recall", type=float, default=0.8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes, for a smoke test")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    raw = tiny(args.layers) if args.tiny else SHAPES[args.shape](args.layers)
    loaded = random_model(raw, device)
    holder = route_by_position(loaded, device, args.routing, args.prediction_recall)
    lines = [
        f"# speculative decoding, auto vs off: {'tiny' if args.tiny else args.shape} shape, "
        f"{args.layers} layers, routing {args.routing}",
        "",
        f"- device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; "
        f"torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- prompts of {args.prompt} random tokens (+{SPACING} a sequence of a batch), "
        f"{args.tokens} new tokens a request; edit: "
        f"drafts replayed at acceptance {args.acceptance}; random: sampled, prompt lookup"
        + (
            f"; prefetch {args.prefetch} a layer, predictions right {args.prediction_recall:.0%}"
            if args.prefetch
            else ""
        ),
        "",
        "| strategy | batch | workload | off tok/s | auto tok/s | off after | auto/off (medians) "
        "| off runs' spread | drafted | kept | verify steps | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy in args.strategies.split(","):
        cache = args.cache if strategy != "fused" else None
        options = MoEOptions(strategy)
        if cache:
            options = MoEOptions(strategy, cache, prefetch_experts=args.prefetch)
        for batch in map(int, args.batches.split(",")):
            for r in measure(loaded, options, batch, args, device, holder):
                same = "-" if r["same_tokens"] is None else f"{r['same_tokens']:.3f}"
                lines.append(
                    f"| {strategy} | {batch} | {r['workload']} | {r['off']:.1f} | "
                    f"{r['auto']:.1f} | {r['off_after']:.1f} | {r['ratio']:.3f} | "
                    f"{r['spread']:.1%} | {r['drafted']} | {r['accepted']} | "
                    f"{r['verify_steps']} | {same} |"
                )
                lines.append(f"<!-- tok/s of each run, in turns: {r['runs']} -->")
                lines.append(f"<!-- costs (ms by sequences x tokens): {r['costs_ms']} -->")
                steps = f"{r['off_steps']}, after: {r['off_after_steps']}"
                lines.append(f"<!-- off runs' engine steps: {steps} -->")
                if r["ways"]:
                    lines.append(f"<!-- hybrid's plain-step way: {r['ways']} -->")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
