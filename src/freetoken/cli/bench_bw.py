"""`ft bench bw`: measure B_P, B_H and both at once; save the profile the runtime starts from."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from freetoken.devices import resolve_device
from freetoken.models.loading import expert_storage, resolve_dtype
from freetoken.moe.bandwidth import measure, save_profile
from freetoken.moe.store import ExpertShape
from freetoken.progress import waiting
from freetoken.weights.expert_format import expert_format


def expert_shape(args: argparse.Namespace) -> ExpertShape:
    if args.model is not None:
        from freetoken.models.families import family_for
        from freetoken.weights.safetensors_dir import CheckpointDir

        ckpt = CheckpointDir(args.model)
        family = family_for(ckpt.config)
        cfg = family.parse_config(ckpt.config)
        if cfg.moe is None:
            raise SystemExit(f"error: {args.model} is not a MoE model")
        if args.expert_format is not None:
            raise SystemExit(
                "error: --expert-format is for the default shape; with --model the experts are "
                "profiled as the engine holds them (--dequantize-experts: dense)"
            )
        dtype = resolve_dtype(args.dtype, cfg.torch_dtype)
        fmt, _, down = expert_storage(ckpt, family, cfg, args.dequantize_experts)  # (as served)
        return ExpertShape.of(cfg, dtype, fmt, down)
    dtype = resolve_dtype(args.dtype, "bfloat16")
    fmt = expert_format(args.expert_format or "dense")
    return ExpertShape(args.hidden, args.intermediate, dtype, format=fmt)


def gbps(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e9:6.1f} GB/s"


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    shape = expert_shape(args)
    with waiting("measuring bandwidths (B_P, B_H, both together)"):
        profile = measure(
            shape,
            device,
            pool_bytes=int(args.pool_gib * 2**30),
            seconds=args.seconds,
            threads=args.cpu_threads,
            spin_us=args.cpu_spin_us,
        )
    path = save_profile(profile)
    if args.json:
        print(json.dumps({**asdict(profile), "fill_fraction": profile.fill_fraction}))
        return 0
    print(f"expert format   {profile.expert_format} ({shape.nbytes / 2**20:.1f} MiB per expert)")
    print(f"CPU             {profile.cpu}")
    print(f"GPU             {profile.gpu or 'none'}")
    print(f"B_P  (PCIe fill, alone)        {gbps(profile.pcie)}")
    print(f"B_H  (CPU experts, alone)      {gbps(profile.cpu_experts)}")
    print(f"B_P' (PCIe fill, both running) {gbps(profile.pcie_concurrent)}")
    print(f"B_H' (CPU experts, both)       {gbps(profile.cpu_concurrent)}")
    if profile.gpu is None:
        print("No GPU: measured B_H only. `auto` runs every expert on this CPU (fused).")
    else:
        share = profile.fill_fraction
        print(
            f"auto: fused when every expert fits the VRAM cache, otherwise hybrid, filling "
            f"{share:.0%} of each layer's misses over PCIe and running the rest on the CPU"
        )
    print(f"profile saved to {path}")
    return 0
