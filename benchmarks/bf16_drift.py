"""How far our bf16 decode drifts from the fp32 truth beside transformers' own bf16 run, over
many prompts, with some decode kernels switched off (kernel_switches.py's names): the question
a single prompt of tests/test_device_numerics.py cannot answer, whether one configuration is
further from the truth or a prompt's near-tie tipped the other way.

    python benchmarks/bf16_drift.py --family deepseek_v4 --prompts 8 --off none --off streams

Per prompt and configuration: the median of ours' per-step RMS distance to the truth over
transformers' (1.0: as close), and the steps more than 5x further than transformers' (the
test allows 2 in 32).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def run_config(family: str, prompts: int, steps: int, device: str) -> list[tuple[float, int]]:
    import transformers

    from freetoken.engine.runner import ModelRunner
    from freetoken.models.loading import load_model
    from test_device_numerics import greedy_reference, logits_fed
    from tiny_models import FAMILIES, build

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = build(family, Path(tmp) / family, dtype=torch.bfloat16)
        reference = getattr(transformers, FAMILIES[family][1])
        hf = reference.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
        hf32 = reference.from_pretrained(path, dtype=torch.float32).to(device).eval()
        vocab = hf.config.get_text_config().vocab_size
        for seed in range(prompts):
            gen = torch.Generator().manual_seed(seed)
            prompt = torch.randint(0, vocab, (32,), generator=gen).tolist()
            tokens, theirs = greedy_reference(hf, prompt, steps)
            runner = ModelRunner(load_model(path, dtype="bfloat16", device=device), 256)
            ours = logits_fed(runner, prompt, tokens).to(theirs.device)
            with torch.no_grad():
                fed = torch.tensor([prompt + tokens], device=device)
                truth = hf32(fed).logits[0, len(prompt) - 1 : -1].float()
            ours_rms = (ours - truth).pow(2).mean(-1).sqrt()
            theirs_rms = (theirs - truth).pow(2).mean(-1).sqrt()
            ratio = (ours_rms.median() / theirs_rms.median()).item()
            outliers = int((ours_rms > 5 * theirs_rms + 1e-3).sum())
            results.append((ratio, outliers))
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="deepseek_v4")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--off", action="append", help="kernel_switches.py's names, or none")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        from kernel_switches import switch_off

        switch_off([n for n in args.child.split(",") if n and n != "none"])
        for ratio, outliers in run_config(args.family, args.prompts, args.steps, args.device):
            print(f"ROW {ratio:.3f} {outliers}", flush=True)
        return 0
    print(f"# bf16 drift: {args.family}, {args.prompts} prompts of 32 tokens, {args.steps} steps")
    print("\n| kernels off | median ratio per prompt | outliers per prompt | mean outliers |")
    print("|---|---|---|---|")
    for off in args.off or ["none"]:
        cmd = [sys.executable, __file__, "--child", off, *sys.argv[1:]]
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent)
        rows = [line.split()[1:] for line in run.stdout.splitlines() if line.startswith("ROW ")]
        if run.returncode or not rows:
            print(f"| {off} | failed: {(run.stderr or run.stdout).strip()[-400:]} | | |")
            continue
        ratios = " ".join(r[0] for r in rows)
        outliers = [int(r[1]) for r in rows]
        mean = statistics.mean(outliers)
        print(f"| {off} | {ratios} | {' '.join(map(str, outliers))} | {mean:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
