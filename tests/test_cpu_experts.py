"""The native CPU expert kernel (kernels/cpu_experts.c, a part of the native library
cpu_native.c) against the torch reference, the library's build cache, and the fallback to torch
when it cannot be built."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from freetoken import settings
from freetoken.activations import glu
from freetoken.kernels import native
from freetoken.kernels.cpu_banks import bf16_scaled_codes, decode_expert
from freetoken.kernels.cpu_experts import (
    NativeCPUExperts,
    row_dots,
    torch_cpu_experts,
)
from freetoken.kernels.cpu_team import library
from freetoken.moe.cpu import CPUExpertExecutor, CPUJob
from freetoken.weights.expert_format import (
    K_FAMILY,
    K_MIXED,
    K_QUANTS,
    LEGACY,
    MIXED_K_TAG,
    MIXED_K_WIDTH,
    MXFP4,
    NVFP4,
    Q8_0,
    ExpertWeights,
    QuantizedBank,
    fill_random_,
    fp8_format,
)

pytestmark = pytest.mark.skipif(native.load("cpu_native") is None, reason="no C compiler")


def banks(dtype, pairs=12, hidden=200, inter=72, seed=0):
    # Sizes off the kernel's 64-wide steps and 16-row blocks, so every tail runs.
    gen = torch.Generator().manual_seed(seed)
    w_gate_up = (torch.randn(pairs, 2 * inter, hidden, generator=gen) * 0.1).to(dtype)
    w_down = (torch.randn(pairs, hidden, inter, generator=gen) * 0.1).to(dtype)
    return w_gate_up, w_down


def job(tokens=3, hidden=200, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    # Several routes share experts (5 and 3) and rows; expert order differs from route order.
    rows = torch.tensor([0, 0, 1, 1, 2, 2, 0, 2])
    pairs = torch.tensor([5, 3, 5, 7, 3, 11, 9, 0])
    weights = torch.rand(8, generator=gen)
    return x, rows, pairs, weights


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "relu"])
def test_fp32_matches_torch(act):
    w_gate_up, w_down = banks(torch.float32)
    kernel = NativeCPUExperts.create(w_gate_up, w_down, act, threads=2)
    x, rows, pairs, weights = job()
    got = kernel(x, rows, pairs, weights)
    want = torch_cpu_experts(x, rows, pairs, weights, w_gate_up, w_down, act)
    assert got.shape == want.shape == (3, 200)
    assert (got - want).abs().max().item() < 1e-5


def plain_experts(x, rows, pairs, weights, w_gate_up, w_down, b_gate_up=None, act="swiglu_oai"):
    """Route by route in the banks' dtype, as transformers writes it: h = x W^T + b, the gated
    unit, y = a Wd^T, the weighted y summed per token in fp32."""
    unit = glu(act)
    out = torch.zeros(x.shape[0], w_down.shape[1])
    i = w_down.shape[2]
    x = x.to(w_gate_up.dtype)
    for r, p, w in zip(rows.tolist(), pairs.tolist(), weights.tolist(), strict=True):
        h = F.linear(x[r], w_gate_up[p])
        if b_gate_up is not None:
            h = h + b_gate_up[p]
        out[r] += (F.linear(unit(h[:i], h[i:]), w_down[p]) * w).float()
    return out


def biased_banks(dtype):
    """gpt-oss-like banks: large enough weights that gate and up pass the clamp at 7, and a
    distinct random bias row per pair (so a bias read at the wrong pair shows)."""
    w_gate_up, w_down = banks(torch.float32)
    b_gate_up = torch.randn(12, 144, generator=torch.Generator().manual_seed(5)) * 4
    return (w_gate_up * 8).to(dtype), w_down.to(dtype), b_gate_up.to(dtype)


# fp32: summation order only; bf16: as test_bf16_rounds_like_torch (a last bf16 bit or two)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2 * 2**-8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biased_experts_with_the_clamped_swiglu(dtype):
    """gpt-oss: the gate/up bias of each route's expert (by flat id) before the clamped
    SwiGLU, against plain torch in the banks' dtype."""
    w_gate_up, w_down, b_gate_up = biased_banks(dtype)
    x, rows, pairs, weights = job(dtype=dtype)
    h = torch.einsum("th,pnh->tpn", x.float(), w_gate_up.float()) + b_gate_up.float()
    assert h.max() > 14 and h.min() < -14  # both sides of the clamp are exercised
    kernel = NativeCPUExperts.create(w_gate_up, w_down, "swiglu_oai", 2, b_gate_up=b_gate_up)
    got = kernel(x, rows, pairs, weights)
    want = plain_experts(x, rows, pairs, weights, w_gate_up, w_down, b_gate_up)
    scale = want.abs().max().item()
    tol = TOLERANCE[dtype] * scale
    assert (got - want).abs().max().item() <= tol
    # the bias matters, read at the route's own pair: ignored or shifted by one, far off
    for wrong in (None, b_gate_up.roll(1, 0)):
        off = plain_experts(x, rows, pairs, weights, w_gate_up, w_down, wrong)
        assert (off - want).abs().max().item() > 0.1 * scale  # (tol: under 1% of it)
    # and so does the unit: silu's product of the same projections is far off too
    silu = plain_experts(x, rows, pairs, weights, w_gate_up, w_down, b_gate_up, act="silu")
    assert (silu - want).abs().max().item() > 0.1 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v4s_clamped_swiglu(dtype):
    """DeepSeek-V4's unit, silu(min(gate, 10)) * clamp(up, -10, 10), against plain torch in the
    banks' dtype, with weights large enough that gate and up pass the clamp both ways."""
    w_gate_up, w_down = banks(torch.float32)
    w_gate_up, w_down = (w_gate_up * 16).to(dtype), w_down.to(dtype)
    x, rows, pairs, weights = job(dtype=dtype)
    h = torch.einsum("th,pnh->tpn", x.float(), w_gate_up.float())
    assert h.max() > 12 and h.min() < -12
    kernel = NativeCPUExperts.create(w_gate_up, w_down, "swiglu_clamp", 2)
    got = kernel(x, rows, pairs, weights)
    want = plain_experts(x, rows, pairs, weights, w_gate_up, w_down, act="swiglu_clamp")
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= TOLERANCE[dtype] * scale
    silu = plain_experts(x, rows, pairs, weights, w_gate_up, w_down, act="silu")
    assert (silu - want).abs().max().item() > 0.1 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_fallback_takes_the_bias_bank_too(dtype):
    w_gate_up, w_down, b_gate_up = biased_banks(dtype)
    x, rows, pairs, weights = job(dtype=dtype)
    got = torch_cpu_experts(x, rows, pairs, weights, w_gate_up, w_down, "swiglu_oai", b_gate_up)
    want = plain_experts(x, rows, pairs, weights, w_gate_up, w_down, b_gate_up)
    assert (got - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_zero_bias_is_no_bias(dtype):
    """The bias path adds and rounds only: zeros give the unbiased kernel's result exactly."""
    w_gate_up, w_down = banks(dtype)
    x, rows, pairs, weights = job(dtype=dtype)
    plain = NativeCPUExperts.create(w_gate_up, w_down, "silu", 2)(x, rows, pairs, weights)
    zero = torch.zeros(w_gate_up.shape[:2], dtype=dtype)
    biased = NativeCPUExperts.create(w_gate_up, w_down, "silu", 2, b_gate_up=zero)
    assert torch.equal(biased(x, rows, pairs, weights), plain)


def test_bf16_rounds_like_torch():
    """bf16 banks: every intermediate is rounded where torch rounds it, so results differ only
    where a dot product's summation order flips a last bf16 bit."""
    w_gate_up, w_down = banks(torch.bfloat16)
    kernel = NativeCPUExperts.create(w_gate_up, w_down, "silu", threads=2)
    x, rows, pairs, weights = job(dtype=torch.bfloat16)
    got = kernel(x, rows, pairs, weights)
    want = torch_cpu_experts(x, rows, pairs, weights, w_gate_up, w_down, "silu")
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2 * 2**-8 * scale
    # Without the roundings the fp32 result of the same bf16 weights is measurably different.
    exact = torch_cpu_experts(
        x.float(), rows, pairs, weights, w_gate_up.float(), w_down.float(), "silu"
    )
    assert (got - want).abs().mean() < (exact - want).abs().mean()


def test_one_route_and_thread_counts_agree():
    w_gate_up, w_down = banks(torch.float32)
    x, rows, pairs, weights = job()
    results = [
        NativeCPUExperts.create(w_gate_up, w_down, "silu", threads=t)(x, rows, pairs, weights)
        for t in (1, 2, 3)
    ]
    # The handoff may spin before sleeping (a library-wide setting; put back after).
    spinning = NativeCPUExperts.create(w_gate_up, w_down, "silu", threads=2, spin_seconds=1e-3)
    results += [spinning(x, rows, pairs, weights) for _ in range(3)]
    NativeCPUExperts.create(w_gate_up, w_down, "silu", threads=2, spin_seconds=0.0)
    assert all(torch.equal(results[0], r) for r in results[1:])  # deterministic
    one = NativeCPUExperts.create(w_gate_up, w_down, "silu", threads=1)(
        x, rows[:1], pairs[:1], weights[:1]
    )
    assert torch.count_nonzero(one[1:]) == 0 and torch.count_nonzero(one[0]) > 0


@pytest.mark.parametrize("spin", [0.0, 2e-4])
def test_team_is_exact_under_concurrent_callers(spin):
    """Many back-to-back jobs from several threads, on a team larger than the machine (so
    threads wake late, or find the job they woke for already done): every result equals the
    job's own single-threaded result, bit for bit, and nothing hangs."""
    import threading

    w_gate_up, w_down = banks(torch.float32)
    kernels = [
        NativeCPUExperts.create(w_gate_up, w_down, "silu", threads=t, spin_seconds=spin)
        for t in (1, 3, 6)
    ]
    jobs = [job(seed=s) for s in range(6)]
    want = [kernels[0](*j) for j in jobs]
    failures = []

    def caller(k):
        for n in range(40):
            i = (n + k) % len(jobs)
            if n % 3 == k:  # some jobs come after an early wake-up, some windows run out
                kernels[n % 3].prepare((1e-5, 2e-3, 0.0)[n % 3])
            pending = kernels[(n + k) % 3].submit(*jobs[i])
            if not torch.equal(pending.result(), want[i]):
                failures.append((k, n))

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    NativeCPUExperts.create(w_gate_up, w_down, "silu", threads=2, spin_seconds=0.0)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    assert failures == []


def test_a_team_woken_early_sleeps_again_when_no_job_comes():
    """`prepare` keeps the team awake for its window only: past it, the threads sleep (no CPU
    time spent), and jobs still run exactly, with or without another early wake-up."""
    import time

    w_gate_up, w_down = banks(torch.float32)
    kernel = NativeCPUExperts.create(w_gate_up, w_down, "silu", threads=2)
    x, rows, pairs, weights = job()
    want = kernel(x, rows, pairs, weights)
    kernel.prepare(0.02)
    time.sleep(0.1)  # the window passes with no job
    before = time.process_time()
    time.sleep(0.2)
    assert time.process_time() - before < 0.05, "the team kept spinning"
    assert torch.equal(kernel(x, rows, pairs, weights), want)
    kernel.prepare(1.0)  # a job within the window: the team ends its wait and sleeps after it
    assert torch.equal(kernel(x, rows, pairs, weights), want)
    before = time.process_time()
    time.sleep(0.2)
    assert time.process_time() - before < 0.05, "the team kept spinning after the job"


def test_executor_uses_the_native_kernel_and_reports_bytes():
    class Store:  # what the executor reads of a HostExpertStore
        w_gate_up, w_down = banks(torch.float32)
        b_gate_up = None
        weights = ExpertWeights(w_gate_up, w_down)

        class shape:
            nbytes = 3 * 200 * 72 * 4
            dtype = torch.float32

    executor = CPUExpertExecutor(Store, "silu", native=True)
    assert executor.native is not None
    x, rows, pairs, weights = job()
    result = executor.submit(CPUJob(x, rows, pairs, weights)).result()
    want = torch_cpu_experts(x, rows, pairs, weights, Store.w_gate_up, Store.w_down, "silu")
    assert (result.out - want).abs().max().item() < 1e-5
    assert result.weight_bytes == 6 * Store.shape.nbytes  # six distinct experts
    executor.shutdown()


@pytest.mark.parametrize("use_native", [True, False])
def test_executor_passes_the_bias_bank_to_either_path(use_native):
    w_gate_up, w_down, b_gate_up = biased_banks(torch.float32)

    class Store:
        class shape:
            nbytes = 1
            dtype = torch.float32

    Store.w_gate_up, Store.w_down, Store.b_gate_up = w_gate_up, w_down, b_gate_up
    Store.weights = ExpertWeights(w_gate_up, w_down, b_gate_up)
    executor = CPUExpertExecutor(Store, "swiglu_oai", native=use_native)
    assert (executor.native is not None) == use_native
    x, rows, pairs, weights = job()
    result = executor.submit(CPUJob(x, rows, pairs, weights)).result()
    want = plain_experts(x, rows, pairs, weights, w_gate_up, w_down, b_gate_up)
    assert (result.out - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    executor.shutdown()


def test_unsupported_dtype_has_no_native_kernel():
    w_gate_up, w_down = banks(torch.float16)
    assert NativeCPUExperts.create(w_gate_up, w_down, "silu", threads=1) is None


def test_build_is_cached_and_failure_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load("cpu_native") is not None
    built = list((tmp_path / "native").glob("cpu_native-*.so"))
    assert len(built) == 1
    # A compiler that fails (a different CC also changes the cache key): torch, with a warning.
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING):
        assert native.load("cpu_native") is None
    assert "could not compile cpu_native" in caplog.text
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.delenv("CC")
    monkeypatch.setenv(settings.NATIVE.name, "0")
    assert native.load("cpu_native") is None


def test_unwritable_cache_falls_back(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(blocked / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    with caplog.at_level(logging.WARNING):
        assert native.load("cpu_native") is None
    assert "cannot build or load cpu_native" in caplog.text


def test_a_change_to_any_part_of_the_library_rebuilds_it(tmp_path):
    """The library is one translation unit of several files (cpu_native.c includes its parts):
    its cache key hashes each of them, so a change to the header or to any part builds it anew
    (and every cpu_*.c beside it is a part)."""
    kernels = Path(native.__file__).parent
    parts = native.sources(kernels / "cpu_native.c")
    assert {p.name for p in parts} == {p.name for p in kernels.glob("cpu_*.c")} | {"cpu_native.h"}
    for part in parts:
        (tmp_path / part.name).write_text(part.read_text())
    main = tmp_path / "cpu_native.c"
    key = native.cache_key(main, "cc", ["-O3"])
    assert native.cache_key(main, "cc", ["-O3"]) == key
    for name in ("cpu_native.h", "cpu_team.c", "cpu_listener.c"):
        (tmp_path / name).write_text((tmp_path / name).read_text() + "/* changed */\n")
        changed = native.cache_key(main, "cc", ["-O3"])
        assert changed != key
        key = changed


def test_each_exported_function_is_declared_as_the_header_prototypes_it():
    """Every function cpu_native.h exports is declared by the module that calls it (at its
    import), with as many arguments as its prototype; one that no module declared is not on the
    library (rather than called by ctypes with guessed argument types)."""
    import re

    import freetoken.kernels.cpu_linear
    import freetoken.kernels.norm_rope
    import freetoken.kernels.paged_attention
    import freetoken.moe.doorbell  # noqa: F401
    from freetoken.kernels import cpu_team

    header = (Path(native.__file__).parent / "cpu_native.h").read_text()
    prototypes = {
        name: 0 if params.strip() == "void" else params.count(",") + 1
        for name, params in re.findall(r"\b(ft_\w+)\(([^)]*)\);", header)
    }
    assert len(prototypes) == 17
    declared = {name: len(args) for name, (args, _) in cpu_team._declared.items()}
    assert declared == prototypes
    lib = library()
    assert all(hasattr(lib, name) for name in prototypes)
    assert hasattr(lib.cdll, "ft_cpu_experts_submit") and not hasattr(lib, "ft_not_declared")


# ---------------------------------------------------------------------------------------------
# Quantized experts: decoded in the kernel into exactly the dequantized banks' values
# ---------------------------------------------------------------------------------------------

FORMATS = {
    "fp8-16x24": fp8_format((16, 24)),  # partial blocks; steps across blocks (the buffer's way)
    "fp8-128x128": fp8_format((128, 128)),  # decoded in registers (single routes)
    "mxfp4": MXFP4,
    "nvfp4": NVFP4,
    "q8_0": Q8_0,
    **K_QUANTS,
    "k_mixed": K_MIXED,  # (each expert of one K type, as fill_random_ draws them)
    **LEGACY,
}
# (hidden, intermediate): rows past the last whole 128- (bf16) or 64-value (fp32) step of the
# in-register decoders, a last partial fp8 block, an odd count of nvfp4 blocks in a tail; work
# items of 48 and 64 gate rows and of 64 down columns (quantized items grow with the job), the
# last ones partial; 64 values past the last whole 128-value step (the fp8 tables' 64-value
# tail)
SHAPES = [(416, 160), (256, 176), (1056, 96), (448, 96), (512, 256)]
# The legacy types share their decoders but for which of d's offset, m and the fifth bits each
# has: two shapes of tails (a 32-value step, a partial 64-value one) each


def shapes_of(name: str) -> list[tuple[int, int]]:
    return [(416, 160), (448, 96)] if name in LEGACY else SHAPES


def quantized_bank(fmt, pairs: int, rows: int, cols: int, gen) -> QuantizedBank:
    """Random parts: any codes (but fp8's NaNs), scales of a usual range (products ~0.1)."""
    parts = {}
    for name, (shape, _) in fmt.parts(rows, cols, torch.float32).items():
        shape = (pairs, *shape)
        if fmt.name in K_FAMILY or fmt.name in LEGACY:  # any codes (and sub-block scales,
            # fifth bits); fp16 scales of ~5e-4
            parts[name] = fill_random_(fmt, name, torch.empty(shape, dtype=torch.uint8), gen)
            continue
        if name == "w":
            part = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            if fmt.name == "fp8":
                part[(part & 0x7F) == 0x7F] = 0x3C
        elif name == "g":
            part = torch.rand(shape, generator=gen) * 0.5 + 0.5
        elif fmt.name == "fp8":
            part = torch.rand(shape, generator=gen) * 2e-3 + 1e-4
        elif fmt.name == "mxfp4":  # e8m0: 2^-8 .. 2^-3
            part = torch.randint(119, 125, shape, generator=gen, dtype=torch.uint8)
        elif fmt.name == "q8_0":  # fp16: codes up to 127 to ~0.1
            part = (torch.rand(shape, generator=gen) * 6e-4 + 2e-4).half()
        else:  # nvfp4: e4m3 0.0625 .. 0.23
            part = torch.randint(0x18, 0x26, shape, generator=gen, dtype=torch.uint8)
        parts[name] = part
    return QuantizedBank(fmt, parts["w"], parts["s"], parts.get("g"))


def quantized_experts(fmt, hidden: int, inter: int, seed: int = 0, pairs: int = 12, down=None):
    """Gate/up and down banks of `fmt` (the down projection's `down` where given)."""
    gen = torch.Generator().manual_seed(seed)
    return (
        quantized_bank(fmt, pairs, 2 * inter, hidden, gen),
        quantized_bank(down or fmt, pairs, hidden, inter, gen),
    )


def fits(fmt, hidden: int, inter: int) -> bool:
    return fmt.name == "fp8" or (hidden % fmt.col_block == 0 and inter % fmt.col_block == 0)


def check_quantized_job(
    fmt, dtype, hidden: int, inter: int, act: str, seed: int = 0, down=None
) -> None:
    """The native job on quantized banks equals (bit for bit) the native job on their
    dequantized copies (nvfp4 in bf16: its single-route groups' block route sums in another
    order, so within a bf16 rounding of the intermediates), and is close to the torch reference
    on the quantized banks. `down`: the down projection's format where it differs."""
    w_gate_up, w_down = quantized_experts(fmt, hidden, inter, seed, down=down)
    bias = None
    if act == "swiglu_oai":
        bias = torch.randn(12, 2 * inter, generator=torch.Generator().manual_seed(seed)).to(dtype)
    # groups of two routes (decoded once into the buffer) and of one (in registers)
    x, rows, pairs, weights = job(hidden=hidden, dtype=dtype, seed=seed + 1)
    quantized = NativeCPUExperts.create(w_gate_up, w_down, act, 1, b_gate_up=bias, dtype=dtype)
    assert quantized is not None and quantized.dtype == dtype
    assert (quantized.hidden, quantized.intermediate) == (hidden, inter)
    dense = NativeCPUExperts.create(
        w_gate_up.dequantize(slice(None), dtype),
        w_down.dequantize(slice(None), dtype),
        act,
        1,
        b_gate_up=bias,
    )
    got, same = quantized(x, rows, pairs, weights), dense(x, rows, pairs, weights)
    want = torch_cpu_experts(x, rows, pairs, weights, w_gate_up, w_down, act, bias, dtype=dtype)
    scale = want.abs().max().item()
    # (bf16: nvfp4's block route sums in another order; GGUF's blocks compute with the file's
    # values, where the dequantized banks hold their bf16 roundings)
    other_values = (
        fmt is NVFP4 or bf16_scaled_codes(fmt) or (down is not None and bf16_scaled_codes(down))
    )
    if other_values and dtype == torch.bfloat16:
        # (two bf16 roundings of an intermediate apart: the gate/up outputs' and the down's)
        assert (got - same).abs().max().item() <= 2 * TOLERANCE[dtype] * scale
    else:
        assert torch.equal(got, same)
    # (swiglu_oai: the kernel rounds it once where torch rounds op by op, a bf16 rounding apart
    # before the down projection, which q8_0's full-mantissa weights carry further than fp4's)
    slack = 1.5 if act == "swiglu_oai" and dtype == torch.bfloat16 else 1.0
    if other_values and dtype == torch.bfloat16:
        slack *= 2  # (the reference's weights are bf16 roundings)
    assert scale > 0 and (got - want).abs().max().item() <= slack * TOLERANCE[dtype] * scale


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "fp8-128x128"])
def test_down_rows_wait_for_their_own_groups_activations(name):
    """A group's down rows start once its own gate/up items are done (its activations split
    once, by the last of them, for the routes that read a split x), while other groups' may
    still run: on a team of 6 threads (more than this machine's cores, so items interleave
    every way), every job equals the 1-thread job's result bit for bit."""
    fmt, hidden, inter = FORMATS[name], 256, 1024  # 2 gate/up items a group (64 rows each)
    w_gate_up, w_down = quantized_experts(fmt, hidden, inter)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, hidden, generator=gen).to(torch.bfloat16) for _ in range(2)]
    rows = torch.tensor([0, 1, 0, 1, 0, 1, 0])
    pairs = torch.tensor([4, 4, 1, 7, 2, 9, 11])  # expert 4 twice, five of one route
    weights = torch.rand(7, generator=gen)
    one = NativeCPUExperts.create(w_gate_up, w_down, "silu", 1, dtype=torch.bfloat16)
    want = [one(x, rows, pairs, weights) for x in xs]
    team = NativeCPUExperts.create(w_gate_up, w_down, "silu", 6, dtype=torch.bfloat16)
    for n in range(60):  # two inputs in turn: an early read would find the other's activations
        assert torch.equal(team(xs[n % 2], rows, pairs, weights), want[n % 2]), n


@pytest.mark.parametrize(("name", "shape"), [(n, s) for n in FORMATS for s in shapes_of(n)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
def test_quantized_experts_equal_their_dequantized_banks(name, dtype, shape, act):
    fmt = FORMATS[name]
    if not fits(fmt, *shape):
        pytest.skip(f"{name} needs widths in multiples of {fmt.col_block}")
    check_quantized_job(fmt, dtype, *shape, act)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_q4_k_m_files_formats_q4_k_and_k_mixed_make_one_job(dtype):
    """Gate/up in one K-quant or Q5_0 and down in mixed K-quants (a Q4_K_M file as the pool
    holds it) are one job, equal to the job on their dequantized banks; a pair the kernel cannot
    take together (fp4 beside a K-quant) is refused."""
    check_quantized_job(K_QUANTS["q4_k"], dtype, 512, 256, "silu", down=K_MIXED)
    # (Qwen2.5's Q4_K_M files: gate and up Q5_0)
    check_quantized_job(LEGACY["q5_0"], dtype, 512, 256, "silu", down=K_MIXED)
    w_gate_up, w_down = quantized_experts(MXFP4, 512, 256, down=K_MIXED)
    assert NativeCPUExperts.create(w_gate_up, w_down, "silu", 1, dtype=dtype) is None


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaNs aside (where both hold one)."""
    a, b = a.float(), b.float()
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    a, b = a[~nan], b[~nan]
    return torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


def extreme_banks() -> list[QuantizedBank]:
    """Every code and every scale byte, and fp32 scales from subnormal to infinite: the values
    come out subnormal, overflow, or NaN, and the decoders still hold the definition."""
    gen = torch.Generator().manual_seed(3)
    out = []
    w = torch.randint(0, 256, (2, 256, 32), generator=gen, dtype=torch.uint8)
    every = torch.arange(256, dtype=torch.uint8)
    out.append(QuantizedBank(MXFP4, w, every.repeat_interleave(2).view(1, 256, 2).repeat(2, 1, 1)))
    g = torch.tensor([1.0, 2.0**-120, 2.0**100, 3e-3]).repeat(128).view(2, 256)
    g[1, :4] = torch.tensor([float("inf"), float("nan"), 1e-45, -2.0])
    nv_scales = every.view(1, 256, 1).repeat(2, 1, 3)  # (every byte, e4m3's NaNs included)
    out.append(QuantizedBank(NVFP4, w[..., :24].contiguous(), nv_scales, g))
    for block in ((16, 24), (128, 128), (1, 32)):
        # (columns enough for every extreme scale in each block shape: 9 x 128 and a part)
        codes = every.repeat(2 * 64 * 1100 // 256 + 1)[: 2 * 64 * 1100]
        codes = codes[torch.randperm(codes.numel(), generator=gen)].view(2, 64, 1100)
        shape = (2, -(-64 // block[0]), -(-1100 // block[1]))
        scales = torch.rand(shape, generator=gen) * 1e-2
        extremes = [1e-40, 2.0**-117, 3e38, 2.0**121, float("inf"), float("nan"), 0.0, -0.5]
        scales.view(-1)[: len(extremes)] = torch.tensor(extremes)[: scales.numel()]
        out.append(QuantizedBank(fp8_format(block), codes.contiguous(), scales))
    # q8_0: every code, fp16 scales from the least subnormal to infinite and NaN
    codes = every.repeat(2 * 64 * 256 // 256).view(2, 64, 256)
    codes = codes.view(-1)[torch.randperm(codes.numel(), generator=gen)].view(2, 64, 256)
    bits = torch.randint(0, 0x7C00, (2, 64, 8), generator=gen, dtype=torch.int32)
    extremes = [0x0001, 0x03FF, 0x0400, 0x7BFF, 0x7C00, 0x7E00, 0x8000, 0xFC00, 0x8001, 0x3C00]
    bits.view(-1)[: len(extremes)] = torch.tensor(extremes, dtype=torch.int32)
    bits[1] |= 0x8000  # (negative scales)
    scales = bits.to(torch.int16).view(torch.float16)
    out.append(QuantizedBank(Q8_0, codes.contiguous(), scales.contiguous()))
    # the K-quants: every byte in every place (their fp16 scales from subnormal to NaN)
    for fmt in (*K_QUANTS.values(), K_MIXED):
        w = torch.randint(0, 256, (2, 64, 256), generator=gen, dtype=torch.uint8)
        s = torch.randint(0, 256, (2, 64, 2 * fmt.scale_width), generator=gen, dtype=torch.uint8)
        if fmt is K_MIXED:  # every type, a row's blocks of one (a row is one tensor's)
            tags = s.view(2, 64, 2, MIXED_K_WIDTH)[..., MIXED_K_TAG]
            codes = torch.tensor([f.code for f in K_QUANTS.values()], dtype=torch.uint8)
            tags.copy_(codes.repeat(43)[: 2 * 64].view(2, 64, 1).expand(2, 64, 2))
        out.append(QuantizedBank(fmt, w, s))
    # the legacy types: every code byte, every byte of d, m and qh (d and m subnormal to NaN)
    for fmt in LEGACY.values():
        w = torch.randint(0, 256, (2, 64, 128), generator=gen, dtype=torch.uint8)
        s = torch.randint(0, 256, (2, 64, 8 * fmt.scale_width), generator=gen, dtype=torch.uint8)
        out.append(QuantizedBank(fmt, w, s))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decoders_hold_the_definition_at_the_extremes(dtype):
    for bank in extreme_banks():
        for pair in range(bank.w.shape[0]):
            got, want = decode_expert(bank, pair, dtype), bank.dequantize(pair, dtype)
            assert same_values(got, want), (bank.format, pair)


def test_a_rows_dot_products_are_the_same_by_every_route():
    """In fp32, before the job rounds them to bf16 (which hides most differences in the last
    bits): a quantized row dotted with x in registers, by mxfp4's pairs route (odd products then
    even ones, by FMAs) and decoded into a buffer as a dense row, bit for bit; nvfp4's block
    route (each block's values in its own lane order) within fp32 rounding of them: a K-term
    sum's error bound, K * 2^-24 * sum |x w|, which a value in a wrong lane exceeds by orders;
    two rows at a time (nvfp4's gate and up rows, its down rows) each as alone. K: whole
    128-value steps, then a 32-value step and a partial one (fp4: whole blocks)."""
    gen = torch.Generator().manual_seed(5)
    for name, fmt in FORMATS.items():
        K = 416 if fmt.name == "fp8" else 3 * 128 + 32 + fmt.col_block
        if fmt.name in K_FAMILY:  # (decoded into the buffer whole, 256 values a block)
            K = 3 * 256
        bank = quantized_bank(fmt, 2, 24, K, gen)
        for row in range(24):
            # activations of mixed signs and sizes, so that the order of the additions shows
            x = torch.randn(K, generator=gen) * torch.exp(2 * torch.randn(K, generator=gen))
            other = (row + 7) % 24
            dots = row_dots(bank, row % 2, row, x, other)
            # two rows at a time: each as alone, bit for bit
            assert dots[3] == dots[1] and dots[4] == row_dots(bank, row % 2, other, x)[1]
            if fmt is not NVFP4:
                assert dots[0] == dots[1] == dots[2], (name, row, dots)
                continue
            assert dots[0] == dots[2], (name, row, dots)
            w = bank.dequantize(row % 2, torch.bfloat16)[row].double()
            x64 = x.to(torch.bfloat16).double()
            exact = (w * x64).sum().item()
            bound = K * 2.0**-24 * (w * x64).abs().sum().item()
            assert abs(dots[1] - exact) <= bound and abs(dots[2] - exact) <= bound, (row, dots)


@pytest.mark.parametrize(
    "name", ["q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "k_mixed"]
)
def test_bf16_jobs_compute_gguf_blocks_with_the_files_values(name):
    """A bf16 layer kept in GGUF's blocks multiplies x by the file's values (codes times scales,
    never rounded to bf16): each output is the exact product rounded once to bf16 (but where the
    fp32 sums' order moves a tie), nearer it on average than the bf16-dequantized layer's, and
    a decode row (in registers) equals a batch's (decoded once into the buffer) bit for bit.
    A build without AVX512-BF16 (an AVX2 CPU's) decodes the blocks to their bf16 roundings as
    it does every other format: there each output is the bf16-dequantized layer's, bit for bit."""
    from freetoken.kernels import cpu_linear
    from freetoken.weights.expert_format import QuantizedWeight

    gen = torch.Generator().manual_seed(11)
    bank = quantized_bank(FORMATS[name], 1, 256, 1024, gen)
    weight = QuantizedWeight(FORMATS[name], bank.w[0].contiguous(), bank.s[0].contiguous(), None)
    x = torch.randn(4, 1024, generator=gen).to(torch.bfloat16)
    got = cpu_linear.native_qlinear(x, weight, None)
    if not bf16_scaled_codes(FORMATS[name]):
        dense = bank.dequantize(0, torch.bfloat16).contiguous()
        assert torch.equal(got, cpu_linear.native_linear(x, dense, None))
        return
    exact = x.double() @ bank.dequantize(0, torch.float32).double().T
    rounded = x.double() @ bank.dequantize(0, torch.bfloat16).double().T
    assert (got.double() == exact.to(torch.bfloat16).double()).float().mean() >= 0.99
    error = (got.double() - exact).abs().mean()
    assert error < (rounded.to(torch.bfloat16).double() - exact).abs().mean()
    for t in range(4):  # one row of x: in registers
        assert torch.equal(cpu_linear.native_qlinear(x[t : t + 1], weight, None)[0], got[t])


def check_every_format() -> None:
    """The checks above over every format, model dtype and shape (run by the builds that
    -march=native does not pick here, in a subprocess)."""
    for name, fmt in FORMATS.items():
        for dtype in (torch.float32, torch.bfloat16):
            for shape in shapes_of(name):
                if fits(fmt, *shape):
                    check_quantized_job(fmt, dtype, *shape, "swiglu_oai")
            test_the_decoders_hold_the_definition_at_the_extremes(dtype)
    test_a_rows_dot_products_are_the_same_by_every_route()


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split()}


@pytest.mark.parametrize("flags", ["-mno-avx512vbmi", "-mno-avx512f", "-mno-avx"])
def test_the_avx2_and_scalar_decoders_too(flags, tmp_path):
    """AVX-512 without VBMI (fp8 by the f16 route, not tables: -mno-avx512vbmi), the AVX2
    decoders (-mno-avx512f) and the scalar ones (-mno-avx), built by FREETOKEN_NATIVE_FLAGS, hold
    the same equalities."""
    flag_set = cpu_flags()
    bits = library().ft_cpu_experts_decoder_bits()
    if flags == "-mno-avx512vbmi":
        if bits != 512 or "avx512vbmi" not in flag_set:
            pytest.skip("the default build has no VBMI tables to leave out")
        want = 512
    else:
        want = 0 if flags == "-mno-avx" else 256
        if want == 256 and not {"avx2", "f16c"} <= flag_set:
            want = 0
        if bits == want:
            pytest.skip("the default build is that one already (tested above)")
    out = with_native_flags(
        flags,
        "from freetoken.kernels.cpu_team import library; "
        "print(library().ft_cpu_experts_decoder_bits()); t.check_every_format()",
    )
    assert out.split()[0] == str(want)


def with_native_flags(flags: str, code: str) -> str:
    """Runs `code` (with this module as t) in a new process whose native library is built with
    `flags` (FREETOKEN_NATIVE_FLAGS); returns its output, having checked that it succeeded."""
    env = dict(os.environ, **{settings.NATIVE_FLAGS.name: flags})
    prelude = "import sys; sys.path.insert(0, sys.argv[1]); import test_cpu_experts as t; "
    result = subprocess.run(
        [sys.executable, "-c", prelude + code, str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def job_team_seconds() -> tuple[int, list[float], float]:
    """A job on 3 team threads: (whether the build times its items, the team's seconds in
    phase 1 items, phase 2 items and between them, the job's seconds)."""
    import ctypes

    w_gate_up, w_down = banks(torch.float32)
    kernel = NativeCPUExperts.create(w_gate_up, w_down, "silu", threads=3)
    x, rows, pairs, weights = job()
    out = (ctypes.c_double * 3)()
    library().ft_cpu_experts_item_seconds(out)  # from zero
    pending = kernel.submit(x, rows, pairs, weights)
    pending.result()
    timed = library().ft_cpu_experts_item_seconds(out)
    return timed, list(out), pending.seconds


def test_a_profiling_build_times_the_items_of_each_phase():
    """-DITEM_TIMES (the benchmark's view of where a job's time goes) sums the team's seconds
    in each phase's items, within the team's time in the job; other builds say they do not."""
    timed, split, _ = job_team_seconds()
    assert timed == 0 and split == [0.0, 0.0, 0.0]
    out = with_native_flags("-DITEM_TIMES", "import json; print(json.dumps(t.job_team_seconds()))")
    timed, split, seconds = json.loads(out)
    assert timed == 1 and split[0] > 0 and split[1] > 0 and split[2] >= 0
    assert sum(split) <= 4 * seconds * 1.01  # 3 team threads and the waiting caller


def test_quantized_banks_need_the_model_dtype_and_one_format():
    w_gate_up, w_down = quantized_experts(MXFP4, 64, 32)
    with pytest.raises(ValueError, match="dtype"):
        NativeCPUExperts.create(w_gate_up, w_down, "silu", 1)
    fp8_up, fp8_down = quantized_experts(fp8_format((16, 16)), 64, 32)
    assert NativeCPUExperts.create(w_gate_up, fp8_down, "silu", 1, dtype=torch.float32) is None
    assert NativeCPUExperts.create(w_gate_up, w_down, "silu", 1, dtype=torch.float16) is None
    native = NativeCPUExperts.create(fp8_up, fp8_down, "silu", 1, dtype=torch.bfloat16)
    assert native is not None and native.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Dense layers on the same team (kernels/cpu_linear.py)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_linear_matches_torch(dtype, rows, with_bias):
    from freetoken.kernels.cpu_linear import native_linear

    gen = torch.Generator().manual_seed(rows)
    n, h = 1000 + 7, 300  # rows of w not a multiple of the kernel's block
    w = torch.randn(n, h, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, h, generator=gen).to(dtype)
    ours = native_linear(x, w, bias)
    exact = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
    assert ours.dtype == dtype and ours.shape == (rows, n)
    if dtype == torch.float32:
        assert (ours.double() - exact).abs().max().item() < 1e-4
    else:
        # One rounding of the fp32 sum to bf16, as torch's: within one bf16 step of exact.
        step = exact.abs().clamp_min(1e-3) * 2**-7
        assert ((ours.double() - exact).abs() <= step).all()
        torch_result = torch.nn.functional.linear(x, w, bias)
        assert (ours.float() - torch_result.float()).abs().max().item() <= step.max().item()


def test_linear_takes_only_decode_sized_cpu_batches():
    from freetoken.kernels.cpu_linear import MIN_WEIGHT_BYTES, takes

    big = torch.zeros(MIN_WEIGHT_BYTES // 4, 1)
    with torch.no_grad():
        assert takes(torch.zeros(4, 1), big)
        assert not takes(torch.zeros(64, 1), big)  # a prefill chunk: torch's GEMM
        assert not takes(torch.zeros(4, 1), torch.zeros(8, 1))  # too small to gain
        assert not takes(torch.zeros(4, 1, dtype=torch.float16), big.half())
    assert not takes(torch.zeros(4, 1), big.requires_grad_())  # grad enabled: autograd's own
