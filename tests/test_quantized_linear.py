"""Dense layers kept quantized (a GGUF file's blocks): the native quantized linear against the
dense layer on the dequantized weight, for every format the kernel reads, and the Linear that
holds such a weight (test_gguf.py loads a GGUF file's so). About 3 s."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken.config import EXPERT_FORMATS
from freetoken.kernels import native
from freetoken.kernels.cpu_banks import bf16_scaled_codes
from freetoken.kernels.cpu_linear import (
    MAX_ROWS,
    dequantized,
    native_linear,
    native_qlinear,
    takes_quantized,
)
from freetoken.layers.linear import Linear, linear, stacked
from freetoken.layers.mlp import GatedMLP
from freetoken.weights.expert_format import QuantizedWeight, expert_format, fill_random_

needs_native = pytest.mark.skipif(native.load("cpu_native") is None, reason="no C compiler")
# every format a dense layer's weight may be kept in (k_mixed: a bank's, whose rows differ)
FORMATS = [f for f in EXPERT_FORMATS if f not in ("dense", "k_mixed")]


def random_weight(name: str, rows: int, seed: int = 0) -> QuantizedWeight:
    """A weight [rows, K] of random blocks, K a few blocks and a part of a 128-value step (so
    the decoders' tails run) where the format's blocks allow it."""
    fmt = expert_format(name)
    cols = 3 * 256 + (fmt.col_block if fmt.col_block < 256 else 0)
    gen = torch.Generator().manual_seed(seed)
    parts = {}
    for part, (shape, dtype) in fmt.parts(rows, cols, torch.float32).items():
        bank = torch.empty(1, *shape, dtype=dtype)
        if part == "g":  # (nvfp4's per-row scale: one per tensor)
            bank.fill_(2.0**-7)
        else:
            fill_random_(fmt, part, bank, gen)
        parts[part] = bank[0]
    return QuantizedWeight(fmt, parts["w"], parts["s"], parts.get("g"))


@needs_native
@pytest.mark.parametrize("name", FORMATS)
def test_the_quantized_linear_is_the_dense_layer_on_the_dequantized_weight(name):
    """Bit for bit the native dense layer's on the dequantized weight (the same dot products,
    the weight decoded into them; but nvfp4's block route in bf16, one row of x: the same
    products summed in another order; and GGUF's blocks in bf16: the exact sum over the file's
    values rounded once, but where fp32's order moves a tie), and torch's F.linear within the
    order of the sums."""
    for rows in (37, 333):  # (odd; one work item, several)
        weight = random_weight(name, rows)
        for dtype in (torch.float32, torch.bfloat16):
            dense = weight.dequantize(dtype)
            assert torch.equal(dequantized(weight, dtype), dense)  # (the native decoders')
            for tokens in (1, 3, 16):
                gen = torch.Generator().manual_seed(tokens)
                x = torch.randn(tokens, weight.shape[1], generator=gen).to(dtype)
                for bias in (None, torch.randn(rows, generator=gen).to(dtype)):
                    with torch.no_grad():
                        assert takes_quantized(x, weight)
                        got = native_qlinear(x, weight, bias)
                        same = native_linear(x, dense, bias)
                        ref = F.linear(
                            x.float(), dense.float(), None if bias is None else bias.float()
                        )
                    assert got.dtype == dtype and got.shape == (tokens, rows)
                    what = (name, rows, dtype, tokens, bias is not None)
                    if name == "nvfp4" and dtype == torch.bfloat16 and tokens == 1:
                        assert torch.allclose(got.float(), same.float(), rtol=2**-7, atol=1e-6)
                    elif bf16_scaled_codes(weight.format) and dtype == torch.bfloat16:
                        # the file's values (the fp32 dequantization), the sum rounded once
                        exact = F.linear(
                            x.double(),
                            weight.dequantize(torch.float32).double(),
                            None if bias is None else bias.double(),
                        )
                        hits = got.double() == exact.to(dtype).double()
                        assert hits.float().mean() >= 0.97, what
                    else:
                        assert torch.equal(got, same), what
                    step = 1e-5 if dtype == torch.float32 else 2**-7  # (of the largest)
                    err = (got.float() - ref).abs().max().item()
                    assert err <= step * ref.abs().max().item(), what


@needs_native
def test_a_linear_keeps_a_quantized_weight_and_dequantizes_it_for_prompts():
    """A Linear given a quantized weight drops its dense one; decode-sized batches go to the
    native kernel, longer ones (and 3-D inputs) through the dequantized weight, equal within the
    order of the sums; a cast or a move leaves the parts' dtypes as the format's."""
    weight = random_weight("q8_0", 40)
    layer = Linear(weight.shape[1], 40, bias=True, device="meta").to(torch.float32)
    layer.bias = torch.nn.Parameter(torch.randn(40))
    layer.keep_quantized(weight)
    assert layer.weight is None and dict(layer.named_parameters()).keys() == {"bias"}
    layer.to(torch.bfloat16).to(torch.float32)
    assert layer.quantized.s.dtype == torch.float16 and layer.quantized.w.dtype == torch.uint8
    dense = weight.dequantize(torch.float32)
    with torch.no_grad():
        for shape in ((1, 800), (40, 800), (2, 3, 800)):
            x = torch.randn(*shape)
            ref = F.linear(x, dense, layer.bias)
            assert torch.allclose(layer(x), ref, atol=1e-5, rtol=1e-5), shape
            assert torch.allclose(linear(x, weight, layer.bias), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shape"):
        Linear(800, 41, device="meta").keep_quantized(weight)


@needs_native
@pytest.mark.parametrize("name", ["q5_0", "q4_k", "q8_0", "fp8"])
def test_stacked_projections_compute_what_each_computes_alone(name):
    """q, k and v (with biases) stacked into one weight give each projection's output (bit for
    bit at decode, in the native job; a prompt's rows are torch's GEMMs, whose sums BLAS may
    block by the matrix's width: within rounding), and each layer's weight becomes a view of
    the stacked rows (no second copy)."""
    gen = torch.Generator().manual_seed(1)
    rows = [256, 128, 128]  # (fp8's row blocks of 128 split between them)
    layers = []
    for i, n in enumerate(rows):
        weight = random_weight(name, n, seed=i)
        layer = Linear(weight.shape[1], n, bias=True, device="meta")
        layer.keep_quantized(weight)
        layer.bias = torch.nn.Parameter(torch.randn(n, generator=gen), requires_grad=False)
        layers.append(layer)
    alone = [layer.quantized for layer in layers]
    qkv = stacked(*layers)
    assert qkv is not None and qkv.out_features == sum(rows)
    for layer, weight in zip(layers, alone, strict=True):
        assert torch.equal(layer.quantized.w, weight.w) and torch.equal(layer.quantized.s, weight.s)
        assert layer.quantized.w.untyped_storage().data_ptr() == qkv.quantized.w.data_ptr() or (
            layer.quantized.w.data_ptr() > qkv.quantized.w.data_ptr()
        )
    for dtype in (torch.float32, torch.bfloat16):
        for tokens in (1, 5, 40):  # (the native job; a prompt's rows, dequantized)
            x = torch.randn(tokens, layers[0].in_features, generator=gen).to(dtype)
            with torch.no_grad():
                parts = qkv.to(dtype)(x).split(rows, dim=-1)
                for part, layer in zip(parts, layers, strict=True):
                    if tokens <= MAX_ROWS:
                        assert torch.equal(part, layer.to(dtype)(x)), (dtype, tokens)
                    else:
                        tol = 1e-5 if dtype == torch.float32 else 1e-2
                        torch.testing.assert_close(part, layer.to(dtype)(x), rtol=tol, atol=tol)


def test_weights_of_other_formats_are_not_stacked():
    a, b = Linear(800, 64, bias=False, device="meta"), Linear(800, 64, bias=False, device="meta")
    a.keep_quantized(random_weight("q8_0", 64))
    b.keep_quantized(random_weight("q4_0", 64))
    assert stacked(a, b) is None
    dense = Linear(800, 64, bias=False)
    assert stacked(a, dense) is None


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stacked_mlp_is_one_native_job_giving_the_mlp_s_output(dtype):
    """A dense MLP kept quantized (Q5_0 gate/up, Q4_K down, as the 0.5B Qwen's) computes a
    decode step as one job of the experts' kernel: the three layers' output, bit for bit in
    bf16 (every value rounded where torch rounds it), in fp32 within the order of the sums."""
    gate, up = random_weight("q5_0", 768, seed=10), random_weight("q5_0", 768, seed=11)
    down = random_weight("q4_k", 800, seed=12)  # [800, 768]: gate/up are [768, 800]
    mlp = GatedMLP(800, 768, "silu").to(device="meta")
    for layer, weight in ((mlp.gate_proj, gate), (mlp.up_proj, up), (mlp.down_proj, down)):
        layer.keep_quantized(weight)
    x = torch.randn(3, 800, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        want = mlp(x)
        mlp.stack_projections(dtype, dense=False)
        assert mlp.native is not None and mlp.gate_up_proj is not None
        for got, ref in ((mlp(x), want), (mlp(x[:1]), want[:1])):
            if dtype == torch.bfloat16:
                assert torch.equal(got, ref)
            else:
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        mlp.native = None  # the stacked gate/up alone (a prompt's path, or no native MLP)
        torch.testing.assert_close(mlp(x), want, rtol=0, atol=0)
