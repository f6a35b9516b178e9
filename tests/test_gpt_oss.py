"""gpt-oss as its releases store it: MXFP4 experts in [E, out, in] blocks with interleaved gate
and up rows, and its config's limits on the clamped SwiGLU."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from freetoken.errors import UnsupportedModelError
from freetoken.models.families import gpt_oss
from freetoken.models.loading import load_model
from freetoken.moe.runtime import MoEOptions
from test_quantized import logits, mxfp4, write_variants
from tiny_models import build


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build("gpt_oss", tmp_path_factory.mktemp("src") / "gpt_oss")


def release_layout(src, tmp_path):
    """The checkpoint at `src` (transformers' layout: gate_up_proj [E, H, 2I], down_proj
    [E, I, H]) written as the MXFP4 release stores its experts (`*_blocks` / `*_scales` of
    [E, out, in]), and beside it in transformers' layout with the weights those blocks hold."""
    tensors = load_file(src / "model.safetensors")
    stored, plain = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = t.transpose(1, 2).contiguous()  # [E, out, in]
            parts = [mxfp4(expert) for expert in rows]
            stored[name + "_blocks"] = torch.stack([p[".weight_blocks"] for p, _ in parts])
            stored[name + "_scales"] = torch.stack([p[".weight_scales"] for p, _ in parts])
            plain[name] = torch.stack([ref for _, ref in parts]).transpose(1, 2).contiguous()
        else:
            stored[name] = plain[name] = t
    return write_variants(
        src,
        tmp_path,
        {
            "release": (stored, {"quantization_config": {"quant_method": "mxfp4"}}),
            "plain": (plain, {}),
        },
    )


def test_the_mxfp4_release_layout_is_the_model_of_its_dequantized_weights(source, tmp_path):
    release, plain = release_layout(source[0], tmp_path)
    store = load_model(release, dtype="float32").experts
    assert store.format.name == "mxfp4"  # kept as released: codes, scales, and the biases
    assert set(store.named_banks) == {"w_gate_up", "w_down", "b_gate_up", "s_gate_up", "s_down"}
    want = logits(plain)
    for moe in (None, MoEOptions("hybrid", "6"), MoEOptions("cpu"), MoEOptions("offload", "4")):
        assert (logits(release, moe) - want).abs().max().item() < 1e-5, moe
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([list(range(3, 30))])).logits[0]
    assert (want[:27] - ref).abs().max().item() < 1e-4


def test_gate_and_up_are_de_interleaved_into_the_bank_halves():
    # gpt-oss: gate at even positions, up at odd; our banks: the gate half, then the up half
    t = torch.arange(2 * 6 * 3).view(2, 6, 3)
    out = gpt_oss.to_layout("layers.0.moe.experts.gate_up_proj", t, dequantized=True)
    assert torch.equal(out[:, :3], t[:, 0::2]) and torch.equal(out[:, 3:], t[:, 1::2])
    bias = torch.arange(12).view(2, 6)
    out = gpt_oss.to_layout("layers.0.moe.gate_up_proj_bias", bias, dequantized=False)
    assert out.tolist() == [[0, 2, 4, 1, 3, 5], [6, 8, 10, 7, 9, 11]]
    # transformers' layout [E, in, out] is transposed first; the release's is ours already
    down = torch.randn(2, 4, 5)
    assert torch.equal(
        gpt_oss.to_layout("layers.0.moe.experts.down_proj", down, False), down.transpose(1, 2)
    )
    assert torch.equal(gpt_oss.to_layout("layers.0.moe.experts.down_proj", down, True), down)


def test_other_swiglu_constants_are_refused(source, tmp_path):
    config = json.loads((source[0] / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="swiglu_limit=10"):
        gpt_oss.parse_config({**config, "swiglu_limit": 10.0})


def test_the_host_pool_holds_the_gate_up_biases_in_bank_order(source):
    loaded = load_model(source[0], dtype="float32")
    bias = load_file(source[0] / "model.safetensors")[
        "model.layers.1.mlp.experts.gate_up_proj_bias"
    ]
    store = loaded.experts
    rows = store.b_gate_up[store.layer_rows(1)]
    assert torch.equal(rows, torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1))
    assert set(store.named_banks) == {"w_gate_up", "w_down", "b_gate_up"}
    # what a slot holds and a fill moves, the bias row included (cache sizing divides by it)
    assert store.nbytes == sum(bank.numel() * bank.element_size() for bank in store.banks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_mxfp4_release_on_cuda_matches_its_dequantized_weights(source, tmp_path):
    from test_quantized import cuda_logits

    release, plain = release_layout(source[0], tmp_path)
    want = cuda_logits(plain, MoEOptions("fused"))
    for moe in (
        MoEOptions("fused"),
        MoEOptions("offload", "6"),
        MoEOptions("hybrid", "5"),
        MoEOptions("static", "9"),
    ):
        assert (cuda_logits(release, moe) - want).abs().max().item() < 1e-4, moe
