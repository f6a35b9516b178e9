"""Runs tests with some of the GPU decode kernels switched off, each configuration in a fresh
process, to find which kernel a CUDA test's failure comes from (the torch code each replaces
stays the definition, so a configuration with a kernel off runs that part in torch):

    python benchmarks/kernel_switches.py --off none --off attention --off streams,mix \
        -- tests/test_device_numerics.py -k "deepseek_v4 and cuda and bf16"

Switches: attention (kernels/compressed_decode.py: DeepSeek-V4's RoPE, pooling and decode
attention), streams (kernels/hyper_mix.py: the hyper-connections' norm, collapse and merge),
normed, collapse, merge (each of those three alone), mix (hyper_mix's Sinkhorn mixing), router
(norm_rope's sqrtsoftplus and sigmoid routing), norm_rope (the RMSNorm and RoPE kernels every family
uses).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types

SWITCHES = ("attention", "streams", "normed", "collapse", "merge", "mix", "router", "norm_rope")


def switch_off(names: list[str]) -> None:
    """Point the named kernels' "runs here" tests at False in this process."""
    from freetoken.kernels import compressed_decode, hyper_mix, norm_rope
    from freetoken.layers import moe

    never = lambda *args, **kwargs: False
    for name in names:
        if name == "attention":
            compressed_decode.kernel_takes = never
        elif name == "streams":
            hyper_mix.streams_kernel_takes = never
        elif name in ("normed", "collapse", "merge"):
            _streams_kernel_off(name)
        elif name == "mix":
            hyper_mix.kernel_takes = never
        elif name == "router":  # moe.py's own view of norm_rope, without the router kernels
            moe.norm_rope = types.SimpleNamespace(available=never)
        elif name == "norm_rope":
            norm_rope.available = never
        else:
            raise SystemExit(f"unknown switch {name!r}: one of {', '.join(SWITCHES)}")


def _streams_kernel_off(name: str) -> None:
    """One of the hyper-connections' stream kernels replaced by its torch code (the layer's
    own, run with the stream kernels off for the call)."""
    from freetoken.kernels import hyper_mix
    from freetoken.layers import hyper_connections as hc

    torch_code = {
        "normed": hc._normed,
        "collapse": hc._collapsed,
        "merge": hc.HyperConnection.merge,
    }
    kernel_takes = hyper_mix.streams_kernel_takes

    def in_torch(*args):
        hyper_mix.streams_kernel_takes = lambda *a: False
        try:
            return torch_code[name](*args)
        finally:
            hyper_mix.streams_kernel_takes = kernel_takes

    setattr(
        hyper_mix,
        {"normed": "hc_normed", "collapse": "hc_collapse", "merge": "hc_merge"}[name],
        in_torch,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--off", action="append", help="comma-separated switches, or none")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    pytest_args = [a for a in args.pytest_args if a != "--"]
    if args.child is not None:
        import pytest

        switch_off([n for n in args.child.split(",") if n and n != "none"])
        return pytest.main(["-q", "-rA", "-p", "no:cacheprovider", "--tb=short", *pytest_args])
    failed = 0
    for off in args.off or ["none"]:
        cmd = [sys.executable, __file__, "--child", off, "--", *pytest_args]
        run = subprocess.run(cmd, capture_output=True, text=True)
        lines = (run.stdout + run.stderr).strip().splitlines()
        print(f"## off: {off}  (exit {run.returncode})")
        marks = ("E ", "FAILED", "PASSED", "ERROR")
        print("\n".join(line for line in lines if line.startswith(marks))[:4000], flush=True)
        failed += run.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
