"""Times the grouped expert decode kernels on the GGUF formats of real small models: GPU time per
kernel call (gate/up, down) for 1 and 4 tokens x 2 routes, beside bf16 dense banks of the same
shape and the bytes-over-bandwidth floor, after checking each result against the torch reference.

    PYTHONPATH=src python benchmarks/legacy_tiles_bench.py            # the formats' defaults
    ... --sweep                                                       # also other tile shapes

Shapes: Qwen2.5-Coder-0.5B made into an MoE (H 896, I 4864; gate/up Q5_0, down k_mixed Q4_K /
Q6_K, as its Q4_K_M file) and SmolLM2-135M (H 576, I 1536; all Q4_1). Banks are random bytes of
each format (weights/expert_format.py's fill_random_) over 64 experts, more than the 60 MB of
L2, and each call routes to the next experts of a rotation, so weights come from HBM. Kernel
times are the profiler's GPU times averaged over the calls (launch gaps excluded). The floor
counts each call's distinct experts' bytes (codes and scales) at `--bandwidth` bytes/s.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

import freetoken.kernels.grouped_launch as gl
from freetoken.kernels.grouped_reference import reference_grouped_experts
from freetoken.weights.expert_format import QuantizedBank, expert_format, fill_random_

MODELS = {  # name: (H, I, gate/up format, down format)
    "qwen2.5-0.5b": (896, 4864, "q5_0", "k_mixed"),
    "smollm2-135m": (576, 1536, "q4_1", "q4_1"),
    "qwen3-30b-a3b-q4_k": (2048, 768, "q4_k", "q4_k"),  # (not a model of this issue: q4_k alone)
}
EXPERTS = 64
ROUTES = 2
# candidate tiles (BLOCK_N, BLOCK_K, warps), one projection's at a time, the other's at its default
SWEEP = {
    "GATE_UP": [
        (16, 256, 4),
        (8, 256, 4),
        (16, 128, 4),
        (32, 128, 4),
        (32, 256, 8),
        (8, 256, 2),
        (16, 128, 2),
        (64, 128, 8),
    ],
    "DOWN": [
        (16, 256, 4),
        (8, 256, 2),
        (8, 512, 4),
        (16, 512, 8),
        (4, 512, 4),
        (16, 128, 4),
        (32, 256, 8),
        (8, 128, 2),
    ],
}
# the down kernel's split-K (DOWN_SPLIT_STEPS: BLOCK_K steps a split, 0 unsplit) at its default
# tiles, and at 16 x 128 tiles (twice the steps, half the registers)
SPLIT_SWEEP = [
    (0, None),
    (2, None),
    (3, None),
    (4, None),
    (6, None),
    (8, None),
    (4, (16, 128, 4)),
    (8, (16, 128, 4)),
]


def bank(fmt_name: str, n: int, k: int, gen: torch.Generator) -> QuantizedBank:
    fmt = expert_format(fmt_name)
    parts = fmt.parts(n, k, torch.bfloat16)
    tensors = []
    for part in ("w", "s", "g"):
        if part in parts:
            shape, dtype = parts[part]
            t = torch.empty((EXPERTS, *shape), dtype=dtype)
            tensors.append(fill_random_(fmt, part, t, gen).cuda())
    return QuantizedBank(fmt, *tensors)


def rotating_call(x, slot_sets, weights, gate_up, down, c: int) -> None:
    """Call c of a rotation: the next slot set's experts."""
    gl.triton_grouped_expert_forward(x, slot_sets[c % len(slot_sets)], weights, gate_up, down)


def kernel_times(fn, calls: int) -> dict[str, float]:
    """GPU microseconds per call of each kernel fn launches (the profiler's averages)."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(i)
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        name = e.key
        for short in ("_gate_up_act_kernel", "_down_kernel", "_sum_routes_kernel"):
            if name.startswith(short):
                total = getattr(e, "device_time_total", None) or e.cuda_time_total
                out[short] = total / e.count
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--bandwidth", type=float, default=4.0e12)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    results = []
    for model, (h, i, gu_name, d_name) in MODELS.items():
        gu, dn = bank(gu_name, 2 * i, h, gen), bank(d_name, h, i, gen)
        dense_gu = torch.randn(EXPERTS, 2 * i, h, dtype=torch.bfloat16, device="cuda") * 0.02
        dense_dn = torch.randn(EXPERTS, h, i, dtype=torch.bfloat16, device="cuda") * 0.02
        per_expert = {
            "gate_up": sum(t[0].numel() * t.element_size() for t in gu.tensors),
            "down": sum(t[0].numel() * t.element_size() for t in dn.tensors),
        }
        for tokens in (1, 4):
            x = torch.randn(tokens, h, dtype=torch.bfloat16, device="cuda")
            # call c routes token t to experts distinct within the call, rotating over the pool
            slot_sets = [
                (torch.arange(tokens * ROUTES, device="cuda").view(tokens, ROUTES) * 7 + 3 * c)
                % EXPERTS
                for c in range(64)
            ]
            weights = torch.full((tokens, ROUTES), 0.5, device="cuda")
            distinct = len(set(slot_sets[0].flatten().tolist()))
            floor = {p: distinct * b / args.bandwidth * 1e6 for p, b in per_expert.items()}
            # correctness: against the torch reference on the dequantized experts
            s = slot_sets[0]
            used = s.flatten().unique()
            got = gl.triton_grouped_expert_forward(x, s, weights, gu, dn)
            remap = torch.full((EXPERTS,), -1, dtype=torch.long, device="cuda")
            remap[used] = torch.arange(len(used), device="cuda")
            ref = reference_grouped_experts(
                x,
                remap[s],
                weights,
                gu.dequantize(used, torch.bfloat16),
                dn.dequantize(used, torch.bfloat16),
            )
            rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()

            q_call = functools.partial(rotating_call, x, slot_sets, weights, gu, dn)
            d_call = functools.partial(rotating_call, x, slot_sets, weights, dense_gu, dense_dn)

            base = {
                "model": model,
                "tokens": tokens,
                "routes": ROUTES,
                "rel_err": rel,
                "floor_gate_up_us": floor["gate_up"],
                "floor_down_us": floor["down"],
            }
            results.append({**base, "what": "bf16", **kernel_times(d_call, args.calls)})
            gu_p, d_p = gl.launch_params(gu_name), gl.launch_params(d_name)
            configs = [None]
            if args.sweep:
                configs += [("GATE_UP", c) for c in SWEEP["GATE_UP"]]
                configs += [("DOWN", c) for c in SWEEP["DOWN"]]
                configs += [("DOWN_SPLIT", c) for c in SPLIT_SWEEP]
            saved = dict(gu_p), dict(d_p)
            for cfg in configs:
                if cfg is not None and cfg[0] == "DOWN_SPLIT":
                    steps, tiles = cfg[1]
                    d_p["DOWN_SPLIT_STEPS"] = steps
                    if tiles is not None:
                        cfg = ("DOWN", tiles, steps)
                if cfg is not None and cfg[0] != "DOWN_SPLIT":
                    proj, (bn, bk, warps) = cfg[:2]
                    (gu_p if proj == "GATE_UP" else d_p).update(
                        {f"{proj}_BLOCK_N": bn, f"{proj}_BLOCK_K": bk, f"{proj}_WARPS": warps}
                    )
                try:
                    q = gl.triton_grouped_expert_forward(x, s, weights, gu, dn)
                    ok = ((q.float() - ref.float()).norm() / ref.float().norm()).item()
                    again = gl.triton_grouped_expert_forward(x, s, weights, gu, dn)
                    if not torch.equal(q, again):  # (a race: results that move)
                        ok = -ok
                    t = kernel_times(q_call, args.calls)
                except Exception as e:  # (a tile the compiler refuses: named, not fatal)
                    t, ok = {"error": f"{type(e).__name__}: {str(e)[:200]}"}, float("nan")
                label = "default" if cfg is None else json.dumps(cfg)
                results.append({**base, "what": f"{gu_name}/{d_name} {label}", "rel_err": ok, **t})
                gu_p.clear(), gu_p.update(saved[0])
                d_p.clear(), d_p.update(saved[1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(
        f"{'model':14} {'T':>2} {'what':44} {'gate_up':>8} {'down':>8} {'reduce':>8} "
        f"{'floor gu':>8} {'floor dn':>8} {'rel_err':>8}"
    )
    for r in results:
        reduce = r.get("_sum_routes_kernel", float("nan"))
        print(
            f"{r['model']:14} {r['tokens']:>2} {r['what'][:44]:44} "
            f"{r.get('_gate_up_act_kernel', float('nan')):8.1f} "
            f"{r.get('_down_kernel', float('nan')):8.1f} {reduce:8.1f} "
            f"{r['floor_gate_up_us']:8.1f} "
            f"{r['floor_down_us']:8.1f} {r['rel_err']:8.1e} {r.get('error', '')}"
        )


if __name__ == "__main__":
    main()
