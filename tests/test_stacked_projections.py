"""Projections of one input stacked into one weight (layers/linear.py's `stacked`): dense layers
in one dtype as views of the stacked rows, each output the layer's own; every attention kind's
projections of x and every MLP's gate and up stacked, the model's logits unchanged and its
checkpoint names the same. About 20 s."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken.engine.runner import ModelRunner
from freetoken.kernels import native
from freetoken.kernels.cpu_linear import MAX_ROWS
from freetoken.layers.attention import Attention
from freetoken.layers.compressed_attention import CompressedAttention
from freetoken.layers.gated_deltanet import GatedDeltaNet
from freetoken.layers.linear import Linear, stacked
from freetoken.layers.mla import LatentAttention
from freetoken.layers.mlp import GatedMLP
from freetoken.models.loading import load_model
from tiny_models import build

needs_native = pytest.mark.skipif(native.load("cpu_native") is None, reason="no C compiler")


def dense_layers(rows: list[int], hidden: int = 1024, bias: bool = True) -> list[Linear]:
    torch.manual_seed(0)
    layers = [Linear(hidden, n, bias=bias) for n in rows]
    for layer in layers:
        layer.requires_grad_(False)
    return layers


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_layers_stack_into_views_each_computing_as_alone(dtype):
    """Each layer's weight becomes a view of the stacked rows (no second copy, and not a
    parameter of the stacked layer: a checkpoint names the layers' own); the stacked output is
    each layer's, bit for bit at decode (the native kernel's dot products are the same), within
    rounding for a prompt's rows (torch's GEMM may block its sums by the matrix's width)."""
    rows = [256, 128, 128]  # (each large enough alone for the native kernel, in bf16 too)
    layers = [layer.to(dtype) for layer in dense_layers(rows)]
    alone = [(layer.weight.clone(), layer.bias.clone()) for layer in layers]
    qkv = stacked(*layers)
    assert qkv is not None and qkv.out_features == sum(rows) and qkv.stack.dtype == dtype
    assert dict(qkv.named_parameters()).keys() == {"bias"}
    start = qkv.stack.data_ptr()
    for i, (layer, (weight, bias)) in enumerate(zip(layers, alone, strict=True)):
        assert torch.equal(layer.weight, weight) and torch.equal(layer.bias, bias)
        offset = sum(rows[:i]) * layer.in_features * layer.weight.element_size()
        assert layer.weight.data_ptr() == start + offset  # (a view of its rows)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for tokens in (1, 5, MAX_ROWS, 40):
            x = torch.randn(tokens, layers[0].in_features, generator=gen).to(dtype)
            parts = qkv(x).split(rows, dim=-1)
            for part, layer, (weight, bias) in zip(parts, layers, alone, strict=True):
                if tokens <= MAX_ROWS:
                    assert torch.equal(part, layer(x)), (dtype, tokens)
                tol = 1e-5 if dtype == torch.float32 else 1e-2
                ref = F.linear(x.float(), weight.float(), bias.float()).to(dtype)
                torch.testing.assert_close(part, ref, rtol=tol, atol=tol)
    qkv.to(torch.float64)  # (a cast reaches the stacked rows, held outside the parameters)
    assert qkv.stack.dtype == torch.float64


def test_layers_unlike_each_other_are_not_stacked():
    a, b = dense_layers([32, 32])
    assert stacked(a, b.to(torch.bfloat16)) is None  # dtypes
    assert stacked(a, Linear(320, 32, bias=True)) is None  # inputs
    assert stacked(a, Linear(1024, 32, bias=False)) is None  # biases
    assert stacked(a, Linear(1024, 32, bias=True, device="meta")) is None  # not loaded


# (each attention kind: q, k, v; MLA with q's down projection and the DSA indexer's keys; MLA
# without it and KDA (Kimi-Linear's); DeepSeek-V4's compressed attention, sliding, CSA and HCA
# layers; gated DeltaNet's projections as Qwen3-Next and Qwen3.5 lay them out)
LINEAR = {"kimi_linear", "qwen3_next", "qwen3_5_moe"}
FAMILIES = ["qwen3_moe", "glm_moe_dsa", "kimi_linear", "deepseek_v4", "qwen3_next", "qwen3_5_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stacked_model_computes_what_it_computed_alone(family, tmp_path):
    """A model whose dense projections are stacked (every attention's projections of x, every
    MLP's gate and up) gives the fp32 logits over a prompt and decode steps of the same model
    unstacked, and its parameters keep their names and values."""
    path, _ = build(family, tmp_path / family)
    alone = load_model(path, dtype="float32")
    model = load_model(path, dtype="float32")
    model.model.stack_projections(dense=True)  # (on a GPU with decoder.STACK_ON_GPU)
    modules = list(model.model.modules())
    stacks = [
        m.qkv_proj if isinstance(m, Attention) else m.x_proj
        for m in modules
        if isinstance(m, (Attention, LatentAttention, CompressedAttention, GatedDeltaNet))
    ]
    assert stacks and None not in stacks, family
    assert all(m.gate_up_proj is not None for m in modules if isinstance(m, GatedMLP)), family
    assert not any(  # (the CPU stacks dense weights only when asked)
        getattr(m, "x_proj", None) or getattr(m, "qkv_proj", None) for m in alone.model.modules()
    )
    assert any(isinstance(m, GatedDeltaNet) for m in modules) == (family in LINEAR), family
    ours, theirs = dict(model.model.named_parameters()), dict(alone.model.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)

    prompt = torch.randint(0, 100, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = []
    for loaded in (model, alone):
        runner = ModelRunner(loaded, kv_cache_tokens=256)
        seq = runner.new_sequence()
        out = [runner.forward([seq], [prompt], all_logits=True)]
        token = int(out[0][-1].argmax())
        for _ in range(4):
            out.append(runner.forward([seq], [[token]]))
            token = int(out[-1][-1].argmax())
        logits.append(torch.cat(out))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
