"""Grouped expert compute by slot id (`freetoken.kernels.grouped_experts`).

- The torch reference against a naive per-route loop (CPU, fp32).
- The Triton kernels against the reference under Triton's CPU interpreter: TRITON_INTERPRET must
  be set before triton is imported, so those cases run in one subprocess; they skip when triton
  is not installed (the dev extras bring it on Linux).
- Quantized banks (fp8 block scales, mxfp4, nvfp4): the reference against the same experts
  dequantized; under the interpreter the Triton kernels against the dense Triton kernels on the
  dequantized banks (bit for bit) and `dequantize_slots`' kernel against the formats' definition.
- The Triton kernels on CUDA at Qwen3-30B-A3B and gpt-oss-20b shapes (skip without a GPU).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from compiled import run_compiled
from freetoken.activations import glu
from freetoken.kernels.grouped_experts import grouped_expert_forward, reference_grouped_experts
from freetoken.kernels.grouped_gemm import dequantize_slots, grouped_gemm_experts
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
    QuantizedBank,
    fp8_format,
    k_mixed_rest,
)
from interpreted import run_interpreted

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (dev extras, Linux)"
)


def make_case(
    t: int,
    k: int,
    h: int,
    i: int,
    s: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    skip_frac: float = 0.25,
    slot_dtype: torch.dtype = torch.int64,
    weight_dtype: torch.dtype = torch.float32,
    device: str = "cpu",
):
    """Random inputs with O(1) outputs. Slots may repeat (within and across tokens) and some are
    -1; skipped routes get a nan weight, which must not leak into the output."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    slots = torch.randint(0, s, (t, k), generator=g)
    slots[torch.rand(t, k, generator=g) < skip_frac] = -1
    weights = torch.rand(t, k, generator=g)
    weights[slots < 0] = float("nan")
    w_gate_up = torch.randn(s, 2 * i, h, generator=g) / h**0.5
    w_down = torch.randn(s, h, i, generator=g) / i**0.5
    return (
        x.to(device, dtype),
        slots.to(device, slot_dtype),
        weights.to(device, weight_dtype),
        w_gate_up.to(device, dtype),
        w_down.to(device, dtype),
    )


def biased(case, seed=0, scale=6.0):
    """`case` with gpt-oss's gate/up biases and weights large enough that gate and up reach
    past swiglu_oai's clamp at 7 (|h| up to ~20)."""
    x, slots, weights, w_gate_up, w_down = case
    g = torch.Generator().manual_seed(seed)
    bias = torch.randn(w_gate_up.shape[:2], generator=g).to(w_gate_up.device) * scale / 2
    return x, slots, weights, w_gate_up * scale, w_down, bias.to(w_gate_up.dtype)


def swiglu_oai(gate, up, limit=7.0):
    """gpt-oss's unit written out here (not activations.py's), so the oracle is independent."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(1.702 * gate)


def naive_loop(x, slots, weights, w_gate_up, w_down, act="silu", b_gate_up=None, limit=7.0):
    """The definition, one route at a time."""
    unit = (lambda g, u: swiglu_oai(g, u, limit)) if act == "swiglu_oai" else glu(act)
    i = w_down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(slots.shape[1]):
            s = int(slots[t, j])
            if s < 0:
                continue
            h = w_gate_up[s] @ x[t]
            if b_gate_up is not None:
                h = h + b_gate_up[s]
            y = w_down[s] @ unit(h[:i], h[i:])
            out[t] += (y * weights[t, j]).to(x.dtype)
    return out


QUANTIZED = {
    "fp8": fp8_format((16, 24)),
    "fp8_128": fp8_format((128, 128)),
    "fp8_32x64": fp8_format((32, 64)),
    "mxfp4": MXFP4,
    "nvfp4": NVFP4,
    "q8_0": Q8_0,
    **K_QUANTS,
    "k_mixed": K_MIXED,
    **LEGACY,
}


def quantized_bank(fmt, slots: int, n: int, k: int, gen, scale: float = 1.0) -> QuantizedBank:
    """A random bank of `fmt` whose values are ~ scale * N(0, 1 / k) in size (every e2m1 code,
    e4m3 codes but the NaNs, scales spread over a few binades)."""
    parts = fmt.parts(n, k, torch.float32)
    w_shape, s_shape = (slots, *parts["w"][0]), (slots, *parts["s"][0])
    w = torch.randint(0, 256, w_shape, dtype=torch.uint8, generator=gen)
    size = scale / k**0.5
    if fmt.name == "fp8":
        w[(w & 0x7F) == 0x7F] = 0x3A  # (the two NaN codes)
        s = (torch.rand(s_shape, generator=gen) + 0.5) * size / 60  # |e4m3| ~ 60 on average
        return QuantizedBank(fmt, w, s)
    if fmt.name == "q8_0":  # |int8| ~ 64 on average
        s = ((torch.rand(s_shape, generator=gen) + 0.5) * size / 64).half()
        return QuantizedBank(fmt, w, s)
    if fmt.name == "k_mixed":  # each slot of one of the K-quants (as a file's layers are)
        kinds = [
            quantized_bank(K_QUANTS[name], 1, n, k, gen, scale)
            for name in (list(K_QUANTS) * slots)[:slots]
        ]
        w = torch.cat([b.w for b in kinds])
        s = torch.cat([k_mixed_rest(b.format.name, b.s) for b in kinds])
        return QuantizedBank(fmt, w, s)
    if fmt.name in K_QUANTS:  # any codes and sub-block scales; fp16 scales to values ~ size
        s = torch.randint(0, 256, s_shape, dtype=torch.uint8, generator=gen)
        blocks = s.view(*s_shape[:-1], -1, fmt.scale_width)
        d = torch.tensor([size / (40 if fmt.name == "q6_k" else 300)], dtype=torch.float16)
        for at in (80,) if fmt.name == "q6_k" else (0, 2):
            blocks[..., at : at + 2] = d.view(torch.uint8)
        return QuantizedBank(fmt, w, s)
    if fmt.name in LEGACY:  # any codes and fifth bits; d to values ~ size (|q - 8| ~ 4)
        s = torch.randint(0, 256, s_shape, dtype=torch.uint8, generator=gen)
        blocks = s.view(*s_shape[:-1], -1, fmt.scale_width)
        d = ((torch.rand(blocks.shape[:-1], generator=gen) + 0.5) * size / 4).half()
        blocks[..., 0:2] = d.unsqueeze(-1).view(torch.uint8)
        if fmt.name in ("q4_1", "q5_1"):
            blocks[..., 2:4] = (-8 * d).unsqueeze(-1).view(torch.uint8)
        if fmt.name in ("q5_0", "q5_1"):  # (centred: q - 16)
            blocks[..., 0:2] = (d.float() / 2).half().unsqueeze(-1).view(torch.uint8)
        return QuantizedBank(fmt, w, s)
    if fmt.name == "mxfp4":  # |e2m1| ~ 2.6 on average
        e = round(torch.tensor(size / 2.6).log2().item()) + 127
        return QuantizedBank(
            fmt, w, torch.randint(e - 2, e + 2, s_shape, dtype=torch.uint8, generator=gen)
        )
    s = (torch.rand(s_shape, generator=gen) * 3 + 0.25).to(torch.float8_e4m3fn).view(torch.uint8)
    g = (torch.rand(slots, n, generator=gen) + 0.5) * size / 4
    return QuantizedBank(fmt, w, s, g)


def quantized_case(
    name: str,
    t: int,
    k: int,
    h: int,
    i: int,
    s: int,
    *,
    seed: int = 0,
    dtype=torch.float32,
    scale: float = 1.0,
    device: str = "cpu",
):
    """make_case's routing with random quantized banks of format `name` ("a+b": the gate/up
    projections' and the down projection's), and the dense banks they dequantize to, in
    `dtype`."""
    x, slots, weights, _, _ = make_case(t, k, h, i, s, seed=seed, dtype=dtype, device=device)
    if t * k > 1:  # (at least one route skipped, its gate weight nan)
        slots[0, -1], weights[0, -1] = -1, float("nan")
    gen = torch.Generator().manual_seed(1000 + seed)
    gate_up, _, down = name.partition("+")
    fmt, down = QUANTIZED[gate_up], QUANTIZED[down or gate_up]
    banks = [quantized_bank(fmt, s, 2 * i, h, gen, scale), quantized_bank(down, s, h, i, gen)]
    banks = [QuantizedBank(b.format, *(p.to(device) for p in b.tensors)) for b in banks]
    dense = [b.dequantize(slice(None), dtype) for b in banks]
    return (x, slots, weights, *banks), (x, slots, weights, *dense)


# ---------------------------------------------------------------------------------------------
# Reference (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_reference_matches_naive_loop(seed):
    g = torch.Generator().manual_seed(100 + seed)
    t, k, h, i, s = (
        int(torch.randint(lo, hi, (), generator=g))
        for lo, hi in [(1, 7), (1, 5), (8, 97), (4, 49), (1, 9)]
    )
    case = make_case(t, k, h, i, s, seed=seed)
    torch.testing.assert_close(
        reference_grouped_experts(*case), naive_loop(*case), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("act", ["swiglu_oai", "silu"])
def test_reference_with_biases_matches_naive_loop(act):
    x, slots, weights, w_gate_up, w_down, bias = biased(make_case(4, 3, 48, 24, 6, seed=8))
    want = naive_loop(x, slots, weights, w_gate_up, w_down, act, bias)
    got = reference_grouped_experts(x, slots, weights, w_gate_up, w_down, act, bias)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # each route's own slot's bias, and the clamp, both count
    assert (
        reference_grouped_experts(x, slots, weights, w_gate_up, w_down, act, bias.roll(1, 0)) - want
    ).abs().max() > 1e-2
    h = torch.einsum("th,snh->tsn", x, w_gate_up) + bias
    assert h.abs().max() > 14
    if act == "swiglu_oai":
        unclamped = naive_loop(x, slots, weights, w_gate_up, w_down, act, bias, float("inf"))
        assert (unclamped - want).abs().max() > 1


def test_grouped_gemm_with_biases_matches_reference():
    case = biased(make_case(40, 4, 48, 24, 6, seed=9))
    x, slots, weights, w_gate_up, w_down, bias = case
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm missing")
    try:
        got = grouped_gemm_experts(x, slots, weights, w_gate_up, w_down, "swiglu_oai", bias)
    except RuntimeError as e:  # (CPU builds of torch without the grouped GEMM)
        pytest.skip(f"torch._grouped_mm unavailable here: {e}")
    want = reference_grouped_experts(x, slots, weights, w_gate_up, w_down, "swiglu_oai", bias)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_bias_bank_of_the_wrong_shape_is_refused():
    x, slots, weights, w_gate_up, w_down, bias = biased(make_case(2, 2, 16, 8, 3))
    with pytest.raises(ValueError, match="b_gate_up must be"):
        reference_grouped_experts(x, slots, weights, w_gate_up, w_down, "swiglu_oai", bias[:, 1:])


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "relu"])
def test_reference_activations(act):
    case = make_case(4, 3, 32, 16, 3, seed=7)
    torch.testing.assert_close(
        reference_grouped_experts(*case, act=act), naive_loop(*case, act=act), rtol=0, atol=1e-5
    )


def test_reference_int32_slots_and_dispatch_on_cpu():
    case = make_case(5, 4, 48, 24, 6, seed=3)
    x, slots, *rest = case
    expected = reference_grouped_experts(*case)
    assert torch.equal(reference_grouped_experts(x, slots.int(), *rest), expected)
    assert torch.equal(grouped_expert_forward(x, slots.int(), *rest), expected)


def test_reference_edge_cases():
    x, slots, weights, w_gate_up, w_down = make_case(3, 2, 16, 8, 2, seed=1)
    skipped = torch.full_like(slots, -1)
    assert torch.equal(
        reference_grouped_experts(x, skipped, weights, w_gate_up, w_down), torch.zeros_like(x)
    )
    empty = reference_grouped_experts(x[:0], slots[:0], weights[:0], w_gate_up, w_down)
    assert empty.shape == (0, 16)
    no_routes = reference_grouped_experts(x, slots[:, :0], weights[:, :0], w_gate_up, w_down)
    assert torch.equal(no_routes, torch.zeros_like(x))


def test_reference_bf16_rounds_like_torch_per_route():
    """In bf16 each route's steps round where torch rounds them (compared with the naive loop,
    whose matrix-vector products accumulate in a different order: a few bf16 ulps)."""
    case = make_case(4, 4, 64, 32, 5, seed=2, dtype=torch.bfloat16, weight_dtype=torch.bfloat16)
    ours, naive = reference_grouped_experts(*case), naive_loop(*case)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), naive.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("seed", range(4))
def test_grouped_gemm_matches_reference(seed):
    """Long chunks' path: one grouped GEMM per projection over slot-sorted routes, skipped
    routes (nan weights, rows past the last offset) contributing nothing."""
    case = make_case(9 + seed, 4, 48, 24, 5, seed=seed, skip_frac=0.3)
    torch.testing.assert_close(
        grouped_gemm_experts(*case), reference_grouped_experts(*case), rtol=0, atol=1e-5
    )
    x, slots, weights, w_gate_up, w_down = case
    none = grouped_gemm_experts(x, torch.full_like(slots, -1), weights, w_gate_up, w_down)
    assert torch.equal(none, torch.zeros_like(x))


def test_grouped_gemm_in_windows_of_slots(monkeypatch):
    """More slots than one grouped GEMM takes (torch's limit is 1024): windows of slots."""
    import freetoken.kernels.grouped_gemm as gg

    monkeypatch.setattr(gg, "GROUPED_MM_MAX_GROUPS", 2)
    case = make_case(12, 4, 48, 24, 5, seed=9, skip_frac=0.3)
    torch.testing.assert_close(
        grouped_gemm_experts(*case), reference_grouped_experts(*case), rtol=0, atol=1e-5
    )


def test_argument_checks():
    x, slots, weights, w_gate_up, w_down = make_case(2, 2, 16, 8, 2)
    with pytest.raises(ValueError, match="slots must be int32 or int64"):
        reference_grouped_experts(x, slots.float(), weights, w_gate_up, w_down)
    with pytest.raises(ValueError, match="w_down must be"):
        reference_grouped_experts(x, slots, weights, w_gate_up, w_down[:, :, :4])
    with pytest.raises(ValueError, match="must have x's dtype"):
        reference_grouped_experts(x, slots, weights, w_gate_up.double(), w_down)
    with pytest.raises(ValueError, match="expected x"):
        reference_grouped_experts(x, slots, weights[:, :1], w_gate_up, w_down)


@pytest.mark.parametrize("name", ["fp8", "mxfp4", "nvfp4", "q8_0", "q4_1", "q5_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_on_quantized_banks_is_the_dequantized_experts(name, dtype):
    """A quantized expert gives its dequantized copy's result: the same function, bit for bit
    (and so do dispatch on the CPU and dequantize_slots, the definition there)."""
    quantized, dense = quantized_case(
        name, 4, 3, 96, 48 if name == "nvfp4" else 64, 5, seed=3, dtype=dtype
    )
    want = reference_grouped_experts(*dense)
    assert want.abs().max() > 0.1
    assert torch.equal(reference_grouped_experts(*quantized), want)
    assert torch.equal(grouped_expert_forward(*quantized), want)
    index = torch.tensor([4, 1, 1])
    assert torch.equal(dequantize_slots(quantized[3], index, dtype), dense[3][index])


@needs_triton
def test_quantized_banks_with_scales_of_the_wrong_shape_are_refused():
    from freetoken.kernels.grouped_launch import triton_grouped_expert_forward

    (x, slots, weights, gu, dn), _ = quantized_case("nvfp4", 2, 2, 64, 32, 3)
    with pytest.raises(ValueError, match="the s part of a nvfp4 bank"):
        bad = QuantizedBank(dn.format, dn.w, dn.s[:, :, 1:], dn.g)
        triton_grouped_expert_forward(x, slots, weights, gu, bad)
    with pytest.raises(ValueError, match=r"the g part of a nvfp4 bank .* not none"):
        triton_grouped_expert_forward(x, slots, weights, QuantizedBank(gu.format, gu.w, gu.s), dn)


def test_quantized_and_dense_banks_do_not_mix():
    quantized, dense = quantized_case("mxfp4", 2, 2, 64, 32, 3)
    with pytest.raises(ValueError, match="both be dense or both quantized"):
        reference_grouped_experts(*quantized[:4], dense[4])


@needs_triton
@pytest.mark.parametrize("name", ["q5_0", "k_mixed"])
def test_word_tiles_below_their_minimum_rows_are_refused(name, monkeypatch):
    """The word-read formats' tiles of fewer rows than WORD_MIN_BLOCK_N (which computed wrong
    sums on the GPU) are refused before any launch, naming the parameter; each projection's
    kernel takes its own format's parameters."""
    import freetoken.kernels.grouped_launch as gl

    quantized, _ = quantized_case(f"q5_0+{name}", 1, 2, 256, 256, 3)
    monkeypatch.setitem(gl.QUANTIZED_LAUNCH, name, dict(gl.QUANTIZED_LAUNCH[name], DOWN_BLOCK_N=8))
    with pytest.raises(ValueError, match="DOWN_BLOCK_N >= 16"):
        gl.triton_grouped_expert_forward(*quantized)


# ---------------------------------------------------------------------------------------------
# Triton kernels under the CPU interpreter
# ---------------------------------------------------------------------------------------------


def _interpreter_cases(part: str = "all") -> dict[str, float]:
    """Runs in a subprocess with TRITON_INTERPRET=1; returns case -> max abs error vs the
    reference (fp32 unless named; -1.0 when the case checks exact equality and it holds).
    `part`: "dense" (the dense kernels and dequantize_slots'), "quantized" (the quantized
    decode kernels) or "all" (the fixture runs the two parts at once, of about equal time)."""
    if part == "quantized":
        return _quantized_interpreter_cases()
    from freetoken.kernels.grouped_launch import triton_grouped_expert_forward as tri

    def err(case, act="silu"):
        ours, ref = tri(*case, act=act), reference_grouped_experts(*case, act=act)
        assert ours.dtype == ref.dtype and ours.shape == ref.shape
        return (ours.float() - ref.float()).abs().max().item() if ref.numel() else 0.0

    res: dict[str, float] = {}
    base = make_case(3, 2, 64, 32, 5)
    base[1][1] = torch.tensor([2, 2])  # the same slot twice for one token
    base[1][2, 0] = -1
    base[2][2, 0] = float("nan")
    res["basic"] = err(base)
    x, slots, *rest = base
    res["int32_slots"] = err((x, slots.int(), *rest))
    # Partial blocks on every dimension and several loop steps (H, I > BLOCK_K).
    res["odd_shapes"] = err(make_case(2, 3, 72, 40, 4, seed=1))
    res["long_rows"] = err(make_case(1, 2, 600, 300, 3, seed=2, skip_frac=0.0))
    for act in ("gelu", "gelu_pytorch_tanh", "relu"):
        res[act] = err(make_case(3, 2, 64, 32, 5, seed=3), act=act)
    # Banks as strided views of a larger pool: [S, 2 layers, ...][:, 1].
    x, slots, weights, w_gate_up, w_down = make_case(3, 2, 64, 32, 5, seed=4)
    pool_gu = torch.stack([torch.zeros_like(w_gate_up), w_gate_up], dim=1)
    pool_d = torch.stack([torch.zeros_like(w_down), w_down], dim=1)
    res["strided_banks"] = err((x, slots, weights, pool_gu[:, 1], pool_d[:, 1]))
    # Every route skipped (nan weights) -> exact zeros; no tokens; no routes.
    x, slots, weights, w_gate_up, w_down = make_case(3, 2, 64, 32, 5, seed=5, skip_frac=1.0)
    assert torch.equal(tri(x, slots, weights, w_gate_up, w_down), torch.zeros_like(x))
    res["all_skipped"] = -1.0
    assert tri(x[:0], slots[:0], weights[:0], w_gate_up, w_down).shape == (0, 64)
    no_routes = tri(x, slots[:, :0], weights[:, :0], w_gate_up, w_down)
    assert torch.equal(no_routes, torch.zeros_like(x))
    res["empty"] = -1.0
    # bf16 exercises the dtype plumbing only: the interpreter truncates fp32 -> bf16 casts
    # instead of rounding to nearest as the GPU does, so compare loosely.
    res["bf16"] = err(
        make_case(3, 2, 64, 32, 5, seed=6, dtype=torch.bfloat16, weight_dtype=torch.bfloat16)
    )

    # gpt-oss: per-slot gate/up biases and the clamped SwiGLU, with weights scaled so gate and up
    # reach past the clamp at 7; errors relative to the output's largest value (~40-70).
    def rel(case, act, with_bias=True):
        x, slots, weights, w_gate_up, w_down, bias = case
        bias = bias if with_bias else None
        ours = tri(x, slots, weights, w_gate_up, w_down, act, bias)
        ref = reference_grouped_experts(x, slots, weights, w_gate_up, w_down, act, bias)
        return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

    bf16 = dict(dtype=torch.bfloat16, weight_dtype=torch.bfloat16)
    for act in ("swiglu_oai", "silu"):
        res[f"bias_{act}"] = rel(biased(make_case(4, 3, 72, 40, 6, seed=7)), act)
    res["swiglu_oai"] = err(make_case(3, 2, 64, 32, 5, seed=8), act="swiglu_oai")
    res["swiglu_oai_clamped"] = rel(biased(make_case(4, 3, 72, 40, 6, seed=9)), "swiglu_oai", False)
    res["bf16_swiglu_oai"] = rel(
        biased(make_case(4, 3, 72, 40, 6, seed=10, **bf16)), "swiglu_oai", False
    )
    res["bf16_bias_swiglu_oai"] = rel(
        biased(make_case(4, 3, 72, 40, 6, seed=11, **bf16)), "swiglu_oai"
    )
    # DeepSeek-V4: silu's unit over gate and up clamped at 10 (the weights reach past it)
    res["swiglu_clamp_clamped"] = rel(
        biased(make_case(4, 3, 72, 40, 6, seed=12), scale=8.0), "swiglu_clamp", False
    )
    res.update(_dequantize_interpreter_cases())
    if part == "all":
        res.update(_quantized_interpreter_cases())
    return res


# Tiles for the interpreter (its time grows with the number of programs and K steps, hardly
# with tile sizes): several K steps and partial tiles on every dimension at the shapes below;
# the down kernel's split-K at 2 steps (those shapes' 2 steps or fewer: unsplit).
SMALL_LAUNCH = {
    "GATE_UP_BLOCK_N": 64,
    "GATE_UP_BLOCK_K": 64,
    "GATE_UP_WARPS": 4,
    "GATE_UP_STAGES": 1,
    "DOWN_BLOCK_N": 64,
    "DOWN_BLOCK_K": 32,
    "DOWN_WARPS": 4,
    "DOWN_STAGES": 1,
    "DOWN_SPLIT_STEPS": 2,
}
# The K-quants' 256-wide cases (whole super-blocks: no tile of theirs can be partial) in fewer
# programs: one row block a projection, 2 K steps in gate/up, and the down's 8 steps in 3 splits
# (3, 3, 2: the last split's dead step). (With SMALL_LAUNCH's 16 to 32 programs a route they held
# a CI worker 4x as long; the defaults' cases below walk the K-quants' row blocks.)
SUPER_BLOCK_LAUNCH = {
    **SMALL_LAUNCH,
    "GATE_UP_BLOCK_N": 256,
    "GATE_UP_BLOCK_K": 128,
    "DOWN_BLOCK_N": 256,
    "DOWN_SPLIT_STEPS": 3,
}
QUANTIZED_SHAPES = {
    "fp8": (72, 40),
    "fp8_32x64": (72, 40),
    "mxfp4": (96, 64),
    "nvfp4": (96, 48),
    "q8_0": (96, 64),
    **{name: (256, 256) for name in K_QUANTS},
    "k_mixed": (256, 256),
    "q4_k+k_mixed": (256, 256),
    **{name: (96, 64) for name in LEGACY},
}
# (q6_k and k_mixed in bf16 only: fp32's path is q4_k's here and k_mixed's in the defaults'
# case below, and each such case held a CI worker ~30 s under the interpreter)
QUANTIZED_DTYPES = [
    ("fp8", "fp32"),
    ("fp8", "bf16"),
    ("fp8_32x64", "fp32"),
    ("mxfp4", "fp32"),
    ("mxfp4", "bf16"),
    ("nvfp4", "fp32"),
    ("nvfp4", "bf16"),
    ("q8_0", "fp32"),
    ("q8_0", "bf16"),
    ("q4_k", "fp32"),
    ("q5_k", "bf16"),
    ("q6_k", "bf16"),
    ("k_mixed", "bf16"),
    ("q4_k+k_mixed", "bf16"),
    ("q4_0", "fp32"),
    ("q4_1", "bf16"),
    ("q5_0", "bf16"),
    ("q5_1", "fp32"),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# dequantize_slots' extreme bytes on two of the legacy types: together d's offset, m and the
# fifth bits (the other two's tiles are checked against the dense kernels above)
DQ_LEGACY = ("q4_0", "q5_1")


def _quantized_interpreter_cases() -> dict[str, float]:
    """Quantized banks under the interpreter: the kernels' output against the dense kernels' on
    the dequantized banks with the same launch parameters (-1.0: equal bit for bit, else the
    largest difference) and the error relative to the reference's largest value."""
    import freetoken.kernels.grouped_launch as gl

    def with_launch(params, fn):
        """fn() with `params` for the dense kernels and for every quantized format."""
        saved = {n: getattr(gl, n) for n in gl.LAUNCH_NAMES}, dict(gl.QUANTIZED_LAUNCH)
        try:
            for n in gl.LAUNCH_NAMES:
                setattr(gl, n, params[n])
            for f in gl.QUANTIZED_LAUNCH:
                gl.QUANTIZED_LAUNCH[f] = params
            return fn()
        finally:
            for n, v in saved[0].items():
                setattr(gl, n, v)
            gl.QUANTIZED_LAUNCH.update(saved[1])

    def compare(cases, key, act="silu", bias=None, params=SMALL_LAUNCH):
        quantized, dense = cases
        q = with_launch(params, lambda: gl.triton_grouped_expert_forward(*quantized, act, bias))
        d = with_launch(params, lambda: gl.triton_grouped_expert_forward(*dense, act, bias))
        ref = reference_grouped_experts(*dense, act, bias)
        assert q.dtype == ref.dtype and q.shape == ref.shape and ref.abs().max() > 0.1
        res[key] = -1.0 if torch.equal(q, d) else (q.float() - d.float()).abs().max().item()
        res[key + "_ref"] = ((q.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

    res: dict[str, float] = {}
    for name, dt in QUANTIZED_DTYPES:
        h, i = QUANTIZED_SHAPES[name]
        mixed = "k_mixed" in name
        cases = quantized_case(name, 2, 2, h, i, 5, seed=19 if mixed else 20, dtype=DTYPES[dt])
        if mixed:  # (its 3 routes to a slot of each K type: slot % 3)
            assert sorted(int(s) % 3 for s in cases[0][1].flatten() if s >= 0) == [0, 1, 2]
        super_blocks = QUANTIZED[name.partition("+")[0]].name in K_FAMILY
        compare(
            cases, f"q_{name}_{dt}", params=SUPER_BLOCK_LAUNCH if super_blocks else SMALL_LAUNCH
        )
    # int32 slots; the launch defaults (larger tiles than the dims: one partial K step for fp4,
    # fp8's one-scale-per-row path with 128 x 128 blocks)
    quantized, dense = quantized_case("fp8", 2, 3, 72, 40, 4, seed=21)
    slots32 = quantized[1].int()
    compare(
        ((*quantized[:1], slots32, *quantized[2:]), (*dense[:1], slots32, *dense[2:])),
        "q_int32_slots",
    )
    # (q4_k: 2 super-blocks in gate/up's K steps; k_mixed: 5 steps of its 256-column tiles,
    # split 3 + 2. These two on one route, to a slot of q4_k's and one of k_mixed's q6_k: their
    # tiles' many programs on 4 routes held a CI worker ~2 min; routing is the cases' above)
    for name, (h, i, tokens, k, seed) in {
        "fp8_128": (192, 64, 2, 2, 22),
        "mxfp4": (160, 64, 2, 2, 22),
        "nvfp4": (160, 48, 2, 2, 22),
        "q8_0": (160, 64, 2, 2, 22),
        "q4_k": (512, 256, 1, 1, 25),
        "k_mixed": (256, 1280, 1, 1, 29),
    }.items():
        fmt = QUANTIZED[name].name
        compare(
            quantized_case(name, tokens, k, h, i, 4, seed=seed),
            f"q_{name}_defaults",
            params=gl.launch_params(fmt),
        )
    # gpt-oss's unit with biases, gate and up past its clamp
    for name, dt in (("mxfp4", "bf16"), ("fp8", "fp32")):
        h, i = QUANTIZED_SHAPES[name]
        quantized, dense = quantized_case(name, 3, 2, h, i, 6, seed=23, dtype=DTYPES[dt], scale=6)
        g = torch.Generator().manual_seed(23)
        bias = (torch.randn(6, 2 * i, generator=g) * 3).to(DTYPES[dt])
        compare((quantized, dense), f"q_{name}_{dt}_bias_swiglu_oai", "swiglu_oai", bias)
    # every route skipped: exact zeros (nan gate weights)
    quantized, _ = quantized_case("mxfp4", 2, 2, 96, 64, 5, seed=24)
    x, slots, weights, gu, dn = quantized
    skipped = torch.full_like(slots, -1)
    out = gl.triton_grouped_expert_forward(x, skipped, weights.fill_(float("nan")), gu, dn)
    res["q_all_skipped"] = -1.0 if torch.equal(out, torch.zeros_like(x)) else 1.0
    return res


def _dequantize_interpreter_cases() -> dict[str, float]:
    """dequantize_slots' kernel under the interpreter against the definition, on every code,
    extreme and NaN scales, in each dtype, with the default tiles and small ones (-1.0: equal,
    NaNs where it has them)."""
    import freetoken.kernels.grouped_launch as gl

    res: dict[str, float] = {}
    gen = torch.Generator().manual_seed(25)
    formats = ("fp8", "fp8_128", "mxfp4", "nvfp4", "q8_0", *K_QUANTS, "k_mixed", *DQ_LEGACY)
    for j, name in enumerate(formats):
        fmt = QUANTIZED[name]
        # (K tails: nvfp4 2.5 chunks, q8_0 and the legacy types 1.25 of the default tiles)
        k = {"fp8": 100, "mxfp4": 96, "nvfp4": 80, "q8_0": 160, **dict.fromkeys(LEGACY, 160)}.get(
            fmt.name, 512
        )
        bank = quantized_bank(fmt, 4, 40, k, gen)
        bank.w.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # (NaNs in fp8)
        if fmt.name in K_FAMILY or fmt.name in LEGACY:  # every byte of the blocks' rest: fp16
            # scales to NaN
            bank.s.view(-1)[: bank.s.shape[-1]] = torch.arange(bank.s.shape[-1]) % 256
            if fmt.name == "k_mixed":  # (a row's type as it was: a row is of one type)
                tags = bank.s.view(*bank.s.shape[:-1], -1, MIXED_K_WIDTH)[..., MIXED_K_TAG]
                tags[0, 0] = tags[0, 1]
        elif fmt.name == "fp8":
            bank.s.view(-1)[:3] = torch.tensor([1e30, 2.0**-140, 0.0])
        elif fmt.name == "q8_0":  # fp16: subnormal, largest, infinite, NaN
            extremes = torch.tensor([1, 0x7BFF, 0x7C00, 0x7E00, -0x7FFF], dtype=torch.int16)
            bank.s.view(torch.int16).view(-1)[:5] = extremes
        else:  # e8m0 0 (subnormal) .. 254; nvfp4: every e4m3 scale, its NaNs too
            bank.s.view(-1)[:255] = torch.arange(255, dtype=torch.uint8)
        index = torch.tensor([3, 0, 3, 2])
        ok = True
        for d, dtype in enumerate(DTYPES.values()):
            want = bank.dequantize(index, dtype)
            # the small tiles in one dtype a format, in turn (a dtype's rounding is apart from
            # the tiles' columns; every pair held a CI worker ~40 s)
            block_k = 32 if d == j % len(DTYPES) else gl.DEQUANTIZE_BLOCK_K
            saved = gl.DEQUANTIZE_BLOCK_K
            gl.DEQUANTIZE_BLOCK_K = block_k
            try:
                got = gl.triton_dequantize_slots(bank, index, dtype)
            finally:
                gl.DEQUANTIZE_BLOCK_K = saved
            checked = torch.ones_like(want, dtype=torch.bool)
            if dtype == torch.bfloat16:
                # the interpreter's fp32 -> bf16 conversion (the store) mangles subnormal
                # results; the kernel's values are right (fp32, fp16 here; CUDA checks bf16)
                checked = (want.abs() >= 2.0**-126) | (want == 0) | want.isnan()
            try:
                torch.testing.assert_close(
                    got[checked], want[checked], rtol=0, atol=0, equal_nan=True
                )
            except AssertionError:
                ok = False
        res[f"dq_{name}"] = -1.0 if ok else 1.0
    return res


# bf16 swiglu_oai: the interpreter's truncating casts, and the kernel rounds the unit once where
# torch rounds op by op (~2% of the largest output measured; a wrong or missing bias or clamp
# is off by 40% or more).
INTERPRETER_TOLERANCE = {
    "bf16": 5e-2,
    "bias_swiglu_oai": 1e-5,
    "bias_silu": 1e-5,
    "swiglu_oai_clamped": 1e-5,
    "swiglu_clamp_clamped": 1e-5,
    "bf16_swiglu_oai": 5e-2,
    "bf16_bias_swiglu_oai": 5e-2,
}
# Quantized cases: equal to the dense kernels bit for bit (-1.0), and within the dense kernels'
# own tolerance of the reference (relative to the largest output; bf16: the interpreter's
# truncating casts, a few % as for the dense bf16 cases above).
QUANTIZED_INTERPRETER_CASES = [
    *(f"q_{name}_{dt}" for name, dt in QUANTIZED_DTYPES),
    "q_int32_slots",
    "q_fp8_128_defaults",
    "q_mxfp4_defaults",
    "q_nvfp4_defaults",
    "q_q8_0_defaults",
    "q_q4_k_defaults",
    "q_k_mixed_defaults",
    "q_mxfp4_bf16_bias_swiglu_oai",
    "q_fp8_fp32_bias_swiglu_oai",
]
for _case in QUANTIZED_INTERPRETER_CASES:
    INTERPRETER_TOLERANCE[_case] = -1.0
    INTERPRETER_TOLERANCE[_case + "_ref"] = 5e-2 if "bf16" in _case else 1e-5
QUANTIZED_INTERPRETER_CASES += [
    *(case + "_ref" for case in QUANTIZED_INTERPRETER_CASES),
    "q_all_skipped",
    "dq_fp8",
    "dq_fp8_128",
    "dq_mxfp4",
    "dq_nvfp4",
    "dq_q8_0",
    *(f"dq_{name}" for name in (*K_QUANTS, "k_mixed", *DQ_LEGACY)),
]
for _case in (
    "q_all_skipped",
    "dq_fp8",
    "dq_fp8_128",
    "dq_mxfp4",
    "dq_nvfp4",
    "dq_q8_0",
    *(f"dq_{name}" for name in (*K_QUANTS, "k_mixed", *DQ_LEGACY)),
):
    INTERPRETER_TOLERANCE[_case] = -1.0


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, float]:
    # the two parts in two processes at once: the interpreter keeps one core busy for a
    # minute, and the test machine has two
    from concurrent.futures import ThreadPoolExecutor

    def run(part: str) -> dict[str, float]:
        return run_interpreted("test_grouped_experts", "_interpreter_cases", part, timeout=900)

    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(run, ("dense", "quantized")))
    return {case: err for part in parts for case, err in part.items()}


INTERPRETER_CASES = [
    "basic",
    "int32_slots",
    "odd_shapes",
    "long_rows",
    "gelu",
    "gelu_pytorch_tanh",
    "relu",
    "strided_banks",
    "all_skipped",
    "empty",
    "bf16",
    "bias_swiglu_oai",
    "bias_silu",
    "swiglu_oai",
    "swiglu_oai_clamped",
    "bf16_swiglu_oai",
    "bf16_bias_swiglu_oai",
    "swiglu_clamp_clamped",
    *QUANTIZED_INTERPRETER_CASES,
]


@needs_triton
@pytest.mark.parametrize("case", INTERPRETER_CASES)
def test_triton_interpreter_matches_reference(interpreter_results, case):
    assert interpreter_results[case] <= INTERPRETER_TOLERANCE.get(case, 1e-4)


# ---------------------------------------------------------------------------------------------
# Triton kernels on CUDA
# ---------------------------------------------------------------------------------------------


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


@needs_cuda
@needs_triton
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 4, 32])
def test_cuda_qwen3_30b_shapes_bf16(tokens, weight_dtype):
    from freetoken.kernels.grouped_launch import triton_grouped_expert_forward

    case = make_case(
        tokens,
        8,
        2048,
        768,
        24,
        seed=tokens,
        dtype=torch.bfloat16,
        skip_frac=0.2,
        weight_dtype=weight_dtype,
        device="cuda",
    )
    ours = grouped_expert_forward(*case)
    assert ours.dtype == torch.bfloat16
    assert _rel_err(ours, reference_grouped_experts(*case)) < 1e-2
    assert torch.equal(triton_grouped_expert_forward(*case), ours)  # deterministic
    x, slots, *rest = case
    assert torch.equal(grouped_expert_forward(x, slots.int(), *rest), ours)


@needs_cuda
@needs_triton
@pytest.mark.parametrize("tokens", [1, 4, 160])  # (160 x 8 routes: the grouped GEMM path)
def test_cuda_biased_swiglu_oai(tokens):
    x, slots, weights, w_gate_up, w_down, bias = biased(
        make_case(tokens, 8, 256, 128, 24, seed=11, device="cuda")
    )
    args = (x, slots, weights, w_gate_up, w_down, "swiglu_oai", bias)
    ref = reference_grouped_experts(*args)
    assert _rel_err(grouped_expert_forward(*args), ref) < 1e-5
    bf16 = [a.bfloat16() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    bf16[2] = weights
    assert _rel_err(grouped_expert_forward(*bf16), reference_grouped_experts(*bf16)) < 2e-2


@needs_cuda
@pytest.mark.parametrize("act", ["silu", "relu"])
def test_cuda_long_chunks_use_grouped_gemm(act):
    case = make_case(
        160, 8, 2048, 768, 24, seed=5, dtype=torch.bfloat16, skip_frac=0.2, device="cuda"
    )  # 1280 routes: the grouped GEMM path
    ours = grouped_expert_forward(*case, act=act)
    assert torch.equal(ours, grouped_gemm_experts(*case, act=act))
    assert _rel_err(ours, reference_grouped_experts(*case, act=act)) < 1e-2


@needs_cuda
@needs_triton
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "relu"])
@pytest.mark.parametrize("shape", [(3, 2, 64, 32, 5), (2, 3, 72, 40, 4), (5, 4, 600, 300, 7)])
def test_cuda_fp32_small_shapes(shape, act):
    case = make_case(*shape, seed=sum(shape), device="cuda")
    torch.testing.assert_close(
        grouped_expert_forward(*case, act=act),
        reference_grouped_experts(*case, act=act),
        rtol=0,
        atol=1e-4,
    )


@needs_cuda
@needs_triton
def test_cuda_edge_cases():
    x, slots, weights, w_gate_up, w_down = make_case(
        3, 2, 64, 32, 5, skip_frac=1.0, dtype=torch.bfloat16, device="cuda"
    )
    assert torch.equal(grouped_expert_forward(x, slots, weights, w_gate_up, w_down), 0 * x)
    assert grouped_expert_forward(x[:0], slots[:0], weights[:0], w_gate_up, w_down).shape == (
        0,
        64,
    )


# Quantized banks on CUDA, at the shapes of the models that ship them: gpt-oss-20b (H = I = 2880,
# top-4; 2880 is no multiple of 128, so fp8's last scale blocks and the tiles' K steps are
# partial) and Qwen3-30B-A3B (H 2048, I 768, top-8).
# (Qwen2.5-0.5B made into an MoE: its down kernel split, 4864 columns in 4-step splits)
MODEL_SHAPES = {
    "gpt-oss": (2880, 2880, 32, 4),
    "qwen3": (2048, 768, 32, 8),
    "qwen2.5-0.5b": (896, 4864, 8, 2),
}
CUDA_FORMATS = ["fp8_128", "mxfp4", "nvfp4", "q8_0", "q4_k", "q6_k", "k_mixed", "q4_1", "q5_0"]


def skip_unless_it_fits(name: str, h: int, i: int) -> None:
    """The K-quants take widths of whole 256-value super-blocks (gpt-oss's 2880 is not)."""
    fmt = QUANTIZED[name]
    if fmt.name in K_FAMILY and (h % fmt.col_block or i % fmt.col_block):
        pytest.skip(f"{name} needs widths in multiples of {fmt.col_block}")


COMPILED_FORMATS = [
    "dense",
    *CUDA_FORMATS,
    "q5_k",
    "q4_k+k_mixed",
    "q4_0",
    "q5_1",
    "q5_0+k_mixed",
    "q5_0+k_mixed@qwen2.5-0.5b",
]


def _compile_cases() -> dict[str, list[str] | str]:
    """Every format's decode kernels (and dequantize_slots) launched at Qwen3-30B-A3B's shape
    with their launch parameters, under compiled.py's compile-only driver: each case's kernels
    compiled, or its error."""
    import compiled
    import freetoken.kernels.grouped_launch as gl

    res: dict[str, list[str] | str] = {}
    for case in COMPILED_FORMATS:
        name, _, model = case.partition("@")
        h, i, _, k = MODEL_SHAPES[model or "qwen3"]
        before = len(compiled.COMPILED)
        try:
            if name == "dense":
                x, slots, weights, w_gate_up, w_down = make_case(
                    4, k, h, i, 8, dtype=torch.bfloat16
                )
                gl.triton_grouped_expert_forward(x, slots, weights, w_gate_up, w_down)
            else:
                quantized, _ = quantized_case(name, 4, k, h, i, 8, dtype=torch.bfloat16)
                gl.triton_grouped_expert_forward(*quantized)
                gl.triton_dequantize_slots(quantized[3], quantized[1][0], torch.bfloat16)
        except Exception as e:  # (the test names it)
            res[case] = f"{type(e).__name__}: {str(e)[-600:]}"
            continue
        res[case] = [c["name"] for c in compiled.COMPILED[before:]]
    return res


@pytest.fixture(scope="module")
def compiled_results() -> dict[str, list[str] | str]:
    return run_compiled("test_grouped_experts", "_compile_cases")


@needs_triton
@pytest.mark.parametrize("case", COMPILED_FORMATS)
def test_the_decode_kernels_compile_for_the_gpu(compiled_results, case):
    """Triton's code generator and ptxas take every format's kernels as launched on an H200
    (which the interpreter's tests do not check): the gate/up, down and sum kernels (and a
    quantized format's dequantize kernel) each compiled once (at Qwen2.5-0.5B's shape, the down
    kernel's columns split)."""
    kernels = compiled_results[case]
    assert isinstance(kernels, list), kernels
    expected = ["_gate_up_act_kernel", "_down_kernel", "_sum_routes_kernel"]
    if case != "dense":
        expected.append("_dequantize_kernel")
    assert kernels == expected


@needs_cuda
@needs_triton
@pytest.mark.parametrize("name", CUDA_FORMATS)
@pytest.mark.parametrize("model", sorted(MODEL_SHAPES))
def test_cuda_quantized_decode_kernels(model, name, monkeypatch):
    """The quantized kernels against the dense kernels on the dequantized banks, with the same
    launch parameters: equal, or within a bf16 rounding where the fp4 tiles' in-tile sums are
    ordered differently; and against the reference like the dense kernels."""
    import freetoken.kernels.grouped_launch as gl

    h, i, s, k = MODEL_SHAPES[model]
    skip_unless_it_fits(name, h, i)
    for tokens in (1, 4):
        quantized, dense = quantized_case(
            name, tokens, k, h, i, s, seed=tokens, dtype=torch.bfloat16, device="cuda"
        )
        ours = grouped_expert_forward(*quantized)
        assert ours.dtype == torch.bfloat16
        assert torch.equal(gl.triton_grouped_expert_forward(*quantized), ours)  # deterministic
        for param, value in gl.launch_params(QUANTIZED[name].name).items():
            monkeypatch.setattr(gl, param, value)
        dense_kernels = gl.triton_grouped_expert_forward(*dense)
        diff = (ours.float() - dense_kernels.float()).abs().max().item()
        scale = dense_kernels.float().abs().max().item()
        # (the same fp32 products and sums per tile element; only the in-tile reduction may be
        # ordered differently: an fp32 rounding, now and then a bf16 one, before the output's)
        assert diff <= 2**-6 * scale, (diff, scale, torch.equal(ours, dense_kernels))
        assert _rel_err(ours, dense_kernels) < 5e-3
        assert _rel_err(ours, reference_grouped_experts(*dense)) < 1e-2
        monkeypatch.undo()


@needs_cuda
@needs_triton
@pytest.mark.parametrize("name", CUDA_FORMATS)
def test_cuda_quantized_biased_swiglu_oai(name):
    h, i, s, k = MODEL_SHAPES["gpt-oss"]
    skip_unless_it_fits(name, h, i)
    quantized, dense = quantized_case(
        name, 4, k, h, i, s, seed=5, dtype=torch.bfloat16, scale=6, device="cuda"
    )
    bias = (torch.randn(s, 2 * i, device="cuda") * 3).bfloat16()
    ours = grouped_expert_forward(*quantized, "swiglu_oai", bias)
    want = reference_grouped_experts(*dense, "swiglu_oai", bias)
    assert _rel_err(ours, want) < 2e-2


@needs_cuda
@pytest.mark.parametrize("name", CUDA_FORMATS)
@pytest.mark.parametrize("model", sorted(MODEL_SHAPES))
def test_cuda_quantized_long_chunks_use_grouped_gemm(model, name):
    """Prefill-sized calls: the used slots dequantized (one Triton launch per window) and run as
    grouped GEMMs: the dense path's result on the dequantized banks."""
    h, i, s, k = MODEL_SHAPES[model]
    skip_unless_it_fits(name, h, i)
    tokens = 160  # (640 or 1280 routes: the grouped GEMM path)
    quantized, dense = quantized_case(
        name, tokens, k, h, i, s, seed=7, dtype=torch.bfloat16, device="cuda"
    )
    ours = grouped_expert_forward(*quantized)
    assert _rel_err(ours, grouped_gemm_experts(*dense)) < 5e-3
    assert _rel_err(ours, reference_grouped_experts(*dense)) < 1e-2


@needs_cuda
@needs_triton
@pytest.mark.parametrize("name", ["fp8", "fp8_128", "mxfp4", "nvfp4", "q8_0", *LEGACY])
def test_cuda_dequantize_slots_is_the_definition(name):
    """Every code and extreme scales (subnormal results, overflow, NaN codes), each dtype: the
    kernel's values are torch's definition's, bit for bit."""
    from freetoken.kernels.grouped_launch import triton_dequantize_slots

    fmt = QUANTIZED[name]
    gen = torch.Generator().manual_seed(3)
    for n, k in ((40, 96), (2 * 2880, 2880), (2048, 768)):
        bank = quantized_bank(fmt, 5, n, k, gen)
        bank.w.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
        if fmt.name == "fp8":
            bank.s.view(-1)[:3] = torch.tensor([1e30, 2.0**-140, 0.0])
        elif fmt.name == "q8_0":
            extremes = torch.tensor([1, 0x7BFF, 0x7C00, 0x7E00, -0x7FFF], dtype=torch.int16)
            bank.s.view(torch.int16).view(-1)[:5] = extremes
        else:
            bank.s.view(-1)[:255] = torch.arange(255, dtype=torch.uint8)
        on_device = QuantizedBank(fmt, *(p.cuda() for p in bank.tensors))
        index = torch.tensor([4, 0, 4, 2])
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            torch.testing.assert_close(  # (the definition as the loader computes it: on the CPU)
                triton_dequantize_slots(on_device, index.cuda(), dtype).cpu(),
                bank.dequantize(index, dtype),
                rtol=0,
                atol=0,
                equal_nan=True,
            )
