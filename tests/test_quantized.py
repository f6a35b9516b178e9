"""Quantized checkpoints (weights/quantized.py): each reader against its format's definition on
hand-made blocks, and tiny checkpoints written in each format give the logits of the same model
written with the dequantized weights, on every strategy."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.config import MoEOptions
from freetoken.engine.runner import ModelRunner
from freetoken.errors import CheckpointError
from freetoken.models.loading import load_model
from freetoken.weights import quantized as q
from tiny_models import build


def e2m1(code: int) -> float:
    """The e2m1 code's value from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    if exponent == 0:
        return sign * mantissa * 0.5  # subnormal: 0 or 0.5
    return sign * 2.0 ** (exponent - 1) * (1 + mantissa / 2)


def test_fp4_codes_unpack_low_nibble_first():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = codes | (codes.flip(0) << 4)  # byte i: low nibble i, high nibble 15 - i
    values = q.unpack_fp4(packed)
    for i in range(16):
        assert values[2 * i].item() == e2m1(i)
        assert values[2 * i + 1].item() == e2m1(15 - i)
    assert math.copysign(1.0, values[2 * 8].item()) == -1.0  # code 8 is -0.0


def test_mxfp4_blocks_scale_by_a_power_of_two():
    blocks = torch.zeros(2, 3, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x21  # values 0 and 1 of block 0: 0.5 and 1.0
    blocks[1, 2, 15] = 0xF7  # values 30 and 31 of the last block: 6.0 and -6.0
    scales = torch.tensor([[127, 128, 129], [125, 126, 130]], dtype=torch.uint8)
    out = q.dequantize_mxfp4(blocks, scales)
    assert out.shape == (2, 96)
    assert out[0, :2].tolist() == [0.5, 1.0]  # 2^0
    assert out[1, 64 + 30 :].tolist() == [6.0 * 8, -6.0 * 8]  # 2^(130 - 127)
    assert out.count_nonzero() == 4
    with pytest.raises(CheckpointError, match="do not match"):
        q.dequantize_mxfp4(blocks, scales[:, :2])


def test_fp8_block_scales_cover_partial_blocks():
    weight = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    fp8 = weight.to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[1.0, 10.0], [100.0, 1000.0]])  # blocks of 2 x 2, the last partial
    out = q.dequantize_fp8_blocks(fp8, scale_inv, (2, 2))
    want = [[1.0, 2.0, 30.0], [4.0, 5.0, 60.0], [700.0, 800.0, 9000.0]]
    assert out.tolist() == want
    with pytest.raises(CheckpointError, match="needs scales of shape"):
        q.dequantize_fp8_blocks(fp8, scale_inv[:1], (2, 2))


def test_q8_0_scales_each_32_int8_codes_by_an_fp16():
    codes = torch.tensor([[-128, -1, 0, 1, 127] + [2] * 27 + [3] * 32], dtype=torch.int8)
    scales = torch.tensor([[0.5, -(2.0**-24)]], dtype=torch.float16)  # (a subnormal fp16)
    out = q.dequantize_q8_0(codes, scales)
    assert out[0, :5].tolist() == [-64.0, -0.5, 0.0, 0.5, 63.5]
    assert out[0, 32:].unique().tolist() == [-3 * 2.0**-24]
    assert torch.equal(q.dequantize_q8_0(codes.view(torch.uint8), scales), out)  # (bank bytes)
    with pytest.raises(CheckpointError, match="need scales of shape"):
        q.dequantize_q8_0(codes, scales[:, :1])


def test_gguf_legacy_blocks_hold_low_nibbles_then_high_ones_and_their_fifth_bits():
    """Q4_0, Q4_1, Q5_0, Q5_1 (split as the GGUF conversion keeps them: 16 code bytes, the
    other bytes): value j in byte j's low nibble and j + 16 in its high one, bit j of qh its
    fifth bit; d * (q - 8), d * q + m, d * (q - 16), d * q + m."""
    codes = torch.tensor([[0x10 * (15 - j) + j for j in range(16)]], dtype=torch.uint8)
    low, high = list(range(16)), [15 - j for j in range(16)]  # values 0-15, 16-31
    d = torch.tensor([0.5], dtype=torch.float16).view(torch.uint8).tolist()
    m = torch.tensor([-3.0], dtype=torch.float16).view(torch.uint8).tolist()
    qh = [0b101, 0, 0, 0x80]  # fifth bits of values 0, 2 and 31
    fifth = [16 if j in (0, 2, 31) else 0 for j in range(32)]
    nibbles = [*low, *high]
    for fmt, rest, want in (
        ("q4_0", d, [0.5 * (c - 8) for c in nibbles]),
        ("q4_1", d + m, [0.5 * c - 3.0 for c in nibbles]),
        ("q5_0", d + qh, [0.5 * (c + f - 16) for c, f in zip(nibbles, fifth, strict=True)]),
        ("q5_1", d + m + qh, [0.5 * (c + f) - 3.0 for c, f in zip(nibbles, fifth, strict=True)]),
    ):
        out = q.legacy_values(fmt, codes, torch.tensor([rest], dtype=torch.uint8))
        assert out[0].tolist() == want, fmt
    with pytest.raises(CheckpointError, match="need the rest of their blocks"):
        q.legacy_values("q5_0", codes, torch.zeros(1, 4, dtype=torch.uint8))


def test_nvfp4_scales_by_block_and_tensor():
    packed = torch.full((2, 16), 0x22, dtype=torch.uint8)  # every value 1.0, 32 a row
    scale = torch.tensor([[0.5, 2.0], [4.0, 0.25]]).to(torch.float8_e4m3fn)  # per 16 values
    out = q.dequantize_nvfp4(packed, scale, torch.tensor(3.0))
    assert out[0, :16].unique().tolist() == [1.5] and out[0, 16:].unique().tolist() == [6.0]
    assert out[1, :16].unique().tolist() == [12.0] and out[1, 16:].unique().tolist() == [0.75]


# -- the test's own encoders (to write checkpoints in each format) --------------------------

FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def encode_fp4(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 codes of x (already scaled to [-6, 6]), packed two a byte."""
    codes = (x.abs().unsqueeze(-1) - FP4_MAGNITUDES).abs().argmin(-1)
    codes = (codes | ((x < 0).long() << 3)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def decode_fp4(packed: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(*packed.shape[:-1], -1)
    return torch.tensor([e2m1(c) for c in range(16)])[codes.long()]


def fp8_blocks(w, block, power_of_two=False):
    """FP8 e4m3 in blocks, each scaled by its largest value over 448 (rounded up to a power of
    two where asked: e8m0 scales)."""
    bn, bk = block
    n, k = w.shape
    scale_inv = torch.empty(-(-n // bn), -(-k // bk))
    data = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    ref = torch.empty(n, k)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            s = tile.abs().max() / 448.0
            if power_of_two:
                s = torch.exp2(torch.ceil(torch.log2(s)))
            scale_inv[i, j] = s
            codes = (tile / s).to(torch.float8_e4m3fn)
            data[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = codes
            ref[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = codes.float() * s
    return {".weight": data, ".weight_scale_inv": scale_inv}, ref


def mxfp4(w):
    n, k = w.shape
    groups = w.view(n, k // 32, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    blocks = encode_fp4(scaled)  # [n, G, 16]
    ref = decode_fp4(blocks) * torch.exp2(exponent).unsqueeze(-1)
    scales = (exponent + 127).to(torch.uint8)
    return {".weight_blocks": blocks, ".weight_scales": scales}, ref.reshape(n, k)


def nvfp4(w):
    n, k = w.shape
    global_scale = w.abs().max() / (6.0 * 448.0)
    groups = w.view(n, k // 16, 16)
    block = (groups.abs().amax(-1) / 6.0 / global_scale).to(torch.float8_e4m3fn)
    step = block.float() * global_scale
    packed = encode_fp4(groups / step.unsqueeze(-1)).reshape(n, k // 2)
    ref = decode_fp4(packed).view(n, k // 16, 16) * step.unsqueeze(-1)
    parts = {
        ".weight": packed,
        ".weight_scale": block,
        ".weight_scale_2": global_scale.reshape(()),
        ".input_scale": torch.tensor(1.0),
    }
    return parts, ref.reshape(n, k)


def q8_0(w):
    """GGUF's Q8_0 as llama.cpp's quantizer makes it (d = amax / 127 in fp16, codes rounded),
    in the tensor names freetoken's GGUF conversion writes."""
    n, k = w.shape
    groups = w.view(n, k // 32, 32)
    d = (groups.abs().amax(-1) / 127.0).half()
    codes = torch.round(groups / d.float().clamp_min(1e-30).unsqueeze(-1)).clamp(-127, 127)
    codes = codes.to(torch.int8)
    ref = codes.float() * d.float().unsqueeze(-1)
    return {".weight_q8_0": codes.reshape(n, k), ".weight_q8_0_scales": d}, ref.reshape(n, k)


FORMATS = {
    "fp8": (
        dict(
            quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[16, 24]
        ),
        lambda w: fp8_blocks(w, (16, 24)),
    ),
    "mxfp4": (dict(quant_method="mxfp4"), mxfp4),
    "nvfp4": (dict(quant_method="modelopt", quant_algo="NVFP4"), nvfp4),
    "q8_0": (dict(quant_method="gguf"), q8_0),
}


def encoded_copies(tensors: dict, encoder) -> tuple[dict, dict]:
    """(the tensors as stored, each `encoder(name)` names encoded under its parts' names;
    their dequantized values under the plain names)."""
    stored, plain = {}, {}
    for name, t in tensors.items():
        encode = encoder(name)
        if encode is None:
            stored[name] = plain[name] = t
            continue
        parts, plain[name] = encode(t)
        for suffix, part in parts.items():
            stored[name.removesuffix(".weight") + suffix] = part.contiguous()
    return stored, plain


def quantized_pair(src, tmp_path, fmt):
    """The checkpoint at `src` written twice: its projections (attention, experts, dense MLP)
    in `fmt`, and with those weights as the test's own decoder reads them back."""
    quant_config, encode = FORMATS[fmt]
    stored, plain = encoded_copies(
        load_file(src / "model.safetensors"),
        lambda name: encode if name.endswith("_proj.weight") else None,
    )
    return write_variants(
        src,
        tmp_path,
        {
            "quantized": (stored, {"quantization_config": quant_config}),
            "plain": (plain, {}),
        },
    )


def write_variants(src, tmp_path, variants: dict) -> tuple:
    """Checkpoints of `src`'s config, one per variant (label -> (weights, config additions)),
    in the variants' order."""
    config = json.loads((src / "config.json").read_text())
    out = []
    for label, (weights, extra) in variants.items():
        d = tmp_path / label
        d.mkdir()
        save_file(weights, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps({**config, **extra}))
        out.append(d)
    return tuple(out)


def logits(path, moe: MoEOptions | None = None, **load) -> torch.Tensor:
    runner = ModelRunner(
        load_model(path, dtype="float32", **load), kv_cache_tokens=128, page_size=8, moe=moe
    )
    seq = runner.new_sequence()
    ids = list(range(3, 30))
    out = [runner.forward([seq], [ids], all_logits=True)]
    for token in (5, 17, 40, 9):  # paged decode steps
        out.append(runner.forward([seq], [[token]]))
    return torch.cat(out)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build("qwen3_moe", tmp_path_factory.mktemp("src") / "qwen3_moe")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_quantized_checkpoint_is_the_model_of_its_dequantized_weights(fmt, source, tmp_path):
    quantized, plain = quantized_pair(source[0], tmp_path, fmt)
    # (the quantization changed the model: the comparison is not with the source's weights)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    before = load_file(source[0] / "model.safetensors")[q_proj]
    assert not torch.equal(load_file(plain / "model.safetensors")[q_proj], before)
    want = logits(plain)
    # the routed experts stay quantized: the host pool holds the codes and scales as stored
    store = load_model(quantized, dtype="float32").experts
    assert store.format.name == fmt and store.w_gate_up.dtype == torch.uint8
    assert store.nbytes < load_model(plain, dtype="float32").experts.nbytes / 3
    # every strategy and cache size (one slot, a few, all) computes with them as defined
    for moe in (
        None,
        MoEOptions("hybrid", "6"),
        MoEOptions("hybrid", "1"),
        MoEOptions("cpu"),
        MoEOptions("offload", "3"),
        MoEOptions("static", "5"),
    ):
        got = logits(quantized, moe)
        assert (got - want).abs().max().item() < 1e-5, (fmt, moe)
    # the dequantized model itself is what transformers computes from those weights
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([list(range(3, 30))])).logits[0]
    assert (want[:27] - ref).abs().max().item() < 1e-4


def test_the_memory_check_counts_quantized_weights_dequantized(source, tmp_path):
    from freetoken.weights.safetensors_dir import CheckpointDir

    quantized, plain = quantized_pair(source[0], tmp_path, "nvfp4")
    packed, full = CheckpointDir(quantized), CheckpointDir(plain)
    assert packed.nbytes() < full.nbytes()  # stored: four bits a weight, and the scales
    assert packed.nbytes(torch.bfloat16) == full.nbytes(torch.bfloat16)
    assert packed.nbytes(torch.float32) == full.nbytes(torch.float32)


def test_quantized_checkpoints_that_cannot_be_read_are_refused_with_what_to_do(source, tmp_path):
    quantized, _ = quantized_pair(source[0], tmp_path, "fp8")
    config = json.loads((quantized / "config.json").read_text())
    for qc, match in (
        ({"quant_method": "gptq", "bits": 4}, "'gptq', which freetoken cannot read"),
        ({"quant_method": "fp8", "fmt": "e4m3"}, "block scales"),  # per-tensor FP8
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, "only ModelOpt's NVFP4"),
        ({"quant_method": "mxfp4"}, "no tensor has the companion scales"),  # none there
    ):
        (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        if qc["quant_method"] == "mxfp4":
            # (an FP8 checkpoint's scales are there; the check is on the MXFP4 ones)
            weights = load_file(quantized / "model.safetensors")
            kept = {
                k: v
                for k, v in weights.items()
                if "scale" not in k and v.dtype != torch.float8_e4m3fn
            }
            save_file(kept, quantized / "model.safetensors")
        with pytest.raises(CheckpointError, match=match):
            load_model(quantized)


def test_an_fp8_weight_without_its_scales_is_refused(source, tmp_path):
    """A float8 tensor the readers do not recognise would otherwise be read as its raw codes."""
    quantized, _ = quantized_pair(source[0], tmp_path, "fp8")
    weights = load_file(quantized / "model.safetensors")
    del weights["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(weights, quantized / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"q_proj\.weight is stored in torch\.float8_e4m3fn"):
        load_model(quantized)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_quantized_checkpoint_converts_to_a_weight_directory_of_its_quantized_experts(
    fmt, source, tmp_path
):
    from freetoken.models.loading import convert_checkpoint

    quantized, plain = quantized_pair(source[0], tmp_path, fmt)
    converted = convert_checkpoint(quantized, tmp_path / "converted")
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    a, b = load_model(quantized), load_model(converted)
    assert b.experts.format == a.experts.format and b.experts.format.name == fmt
    for name, bank in a.experts.named_banks.items():
        assert torch.equal(bank, b.experts.named_banks[name]), name
    # the quantized experts compute with their defined values: the model dequantized at load
    # exactly (and the test's own decoding of the weights within rounding: it multiplies
    # NVFP4's two scales first)
    # (within rounding, not bit for bit: since the dense quantized layers (ft_cpu_qlinear) the
    # q8_0 rows' fp32 dot products may sum in another order than the dense job's)
    kept, dequantized = logits(converted), logits(quantized, dequantize_experts=True)
    assert (kept - dequantized).abs().max().item() < 1e-5
    assert (logits(converted) - logits(plain)).abs().max().item() < 1e-5


def test_a_weight_directory_of_quantized_experts_serves_them_dequantized_on_request(
    source, tmp_path
):
    from freetoken.models.loading import convert_checkpoint

    quantized, _ = quantized_pair(source[0], tmp_path, "mxfp4")
    converted = convert_checkpoint(quantized, tmp_path / "converted")
    want = load_model(quantized, dtype="float32", dequantize_experts=True).experts
    got = load_model(converted, dequantize_experts=True).experts
    assert not got.format.quantized
    for name, bank in want.named_banks.items():
        assert torch.equal(got.named_banks[name], bank), name
    # or converted so: a dense weight directory
    dense = convert_checkpoint(quantized, tmp_path / "dense", dequantize_experts=True)
    assert not load_model(dense).experts.format.quantized
    assert torch.equal(logits(dense), logits(converted))


def test_loading_says_what_was_kept_quantized_and_what_it_takes(source, tmp_path, caplog):
    quantized, _ = quantized_pair(source[0], tmp_path, "fp8")
    with caplog.at_level("INFO", logger="freetoken.models.loading"):
        load_model(quantized, dtype="bfloat16")
    [line] = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    names = load_file(source[0] / "model.safetensors")
    count = len([n for n in names if n.endswith("_proj.weight")])
    experts = len([n for n in names if ".experts." in n])
    kept = (
        f"{count} tensors stored fp8, {experts} of them routed experts and 0 dense layers kept so"
    )
    assert kept in line
    assert "dequantized to bfloat16" in line


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantize_experts_holds_them_in_the_model_dtype_with_the_same_logits(
    fmt, source, tmp_path
):
    quantized, plain = quantized_pair(source[0], tmp_path, fmt)
    loaded = load_model(quantized, dtype="float32", dequantize_experts=True)
    assert not loaded.experts.format.quantized and loaded.experts.w_gate_up.dtype == torch.float32
    # the weights the kernels compute with when the experts are kept quantized
    kept = load_model(quantized, dtype="float32").experts.weights
    every = slice(None)
    assert torch.equal(loaded.experts.w_gate_up, kept.gate_up.dequantize(every, torch.float32))
    assert torch.equal(loaded.experts.w_down, kept.down.dequantize(every, torch.float32))
    # (and the test's own decoding of them, within rounding: NVFP4's scales multiply first)
    dense = load_model(plain, dtype="float32").experts
    assert torch.allclose(loaded.experts.w_gate_up, dense.w_gate_up, rtol=1e-6, atol=0)
    assert (logits(quantized, dequantize_experts=True) - logits(plain)).abs().max() < 1e-5


def test_the_memory_check_counts_experts_kept_quantized_at_their_stored_size(source, tmp_path):
    from freetoken.models.families import family_for
    from freetoken.models.loading import expert_storage
    from freetoken.weights.safetensors_dir import CheckpointDir

    quantized, _ = quantized_pair(source[0], tmp_path, "mxfp4")
    ckpt = CheckpointDir(quantized)
    family = family_for(ckpt.config)
    fmt, kept, _ = expert_storage(ckpt, family, family.parse_config(ckpt.config))
    assert fmt.name == "mxfp4" and kept and all(".experts." in n for n in kept)
    expert_bytes = sum(
        ckpt.tensors[p].stored_bytes for n in kept for p in ckpt.quantized.tensors[n].parts
    )
    dequantized = sum(ckpt.quantized.tensors[n].numel for n in kept) * 2
    assert ckpt.nbytes(torch.bfloat16, kept) == ckpt.nbytes(torch.bfloat16) - dequantized + (
        expert_bytes
    )
    # what the host pool then holds: those bytes (and nothing dequantized)
    assert load_model(quantized, dtype="bfloat16").experts.nbytes == expert_bytes


def test_experts_whose_blocks_straddle_gate_and_up_are_dequantized_with_a_warning(
    source, tmp_path, caplog
):
    quantized, plain = quantized_pair(source[0], tmp_path, "fp8")
    config = json.loads((quantized / "config.json").read_text())
    # 24-row blocks: the tiny model's 32 gate rows end inside a block shared with the up rows
    tensors = load_file(quantized / "model.safetensors")
    dense = load_file(plain / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_proj.weight_scale_inv")]:
        weight = dense[name.removesuffix("_scale_inv")]
        parts, _ = fp8_blocks(weight, (24, 24))
        tensors[name] = parts[".weight_scale_inv"]
        tensors[name.removesuffix("_scale_inv")] = parts[".weight"]
    save_file(tensors, quantized / "model.safetensors")
    config["quantization_config"]["weight_block_size"] = [24, 24]
    (quantized / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="freetoken.models.loading"):
        loaded = load_model(quantized, dtype="float32")
    assert not loaded.experts.format.quantized
    assert any("straddle the gate and up" in r.getMessage() for r in caplog.records)


def test_e8m0_scales_stored_as_their_own_dtype_are_read_by_their_bits():
    blocks = torch.full((2, 1, 16), 0x22, dtype=torch.uint8)  # two rows of a block of 1.0s
    codes = torch.tensor([[127], [130]], dtype=torch.uint8)
    e8m0 = codes.view(torch.float8_e8m0fnu)  # safetensors' F8_E8M0
    assert q.dequantize_mxfp4(blocks, e8m0).tolist() == q.dequantize_mxfp4(blocks, codes).tolist()
    assert q.dequantize_mxfp4(blocks, codes)[1].unique().tolist() == [8.0]


def test_stacked_banks_dequantize_expert_by_expert_as_one():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 4, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 134, (3, 4, 2), dtype=torch.uint8, generator=gen)
    whole = torch.stack([q.dequantize_mxfp4(blocks[e], scales[e]) for e in range(3)])
    assert torch.equal(q.dequantize_mxfp4(blocks, scales), whole)
    packed = torch.randint(0, 256, (3, 4, 16), dtype=torch.uint8, generator=gen)
    block_scales = torch.rand(3, 4, 2, generator=gen).to(torch.float8_e4m3fn)
    g = torch.tensor(0.5)
    each = torch.stack([q.dequantize_nvfp4(packed[e], block_scales[e], g) for e in range(3)])
    assert torch.equal(q.dequantize_nvfp4(packed, block_scales, g), each)


def test_a_quantized_tensor_the_model_does_not_have_is_passed_over(
    source, tmp_path, caplog, monkeypatch
):
    """A layer the model has no place for (a next-token-prediction layer, say) is reported
    unused, not dequantized."""
    quantized, plain = quantized_pair(source[0], tmp_path, "fp8")
    weights = load_file(quantized / "model.safetensors")
    extra = "model.layers.9.mlp.gate_proj.weight"
    weights[extra] = weights["model.layers.1.mlp.gate_proj.weight"].clone()
    weights[extra + "_scale_inv"] = weights["model.layers.1.mlp.gate_proj.weight_scale_inv"].clone()
    save_file(weights, quantized / "model.safetensors")
    made = []
    dequantize = q.dequantize_fp8_blocks
    monkeypatch.setattr(q, "dequantize_fp8_blocks", lambda *a: made.append(1) or dequantize(*a))
    with caplog.at_level("WARNING", logger="freetoken.models.loading"):
        assert torch.equal(logits(quantized), logits(plain))
    assert any("ignored" in r.getMessage() for r in caplog.records)
    used = [
        n
        for n in load_file(plain / "model.safetensors")
        if n.endswith("_proj.weight") and ".experts." not in n
    ]
    assert len(made) == len(used)  # the extra one was not dequantized (nor the experts, kept)


def cuda_logits(path, moe: MoEOptions | None, dtype: str = "float32") -> torch.Tensor:
    loaded = load_model(path, dtype=dtype, device="cuda")
    runner = ModelRunner(loaded, kv_cache_tokens=128, page_size=8, moe=moe)
    seq = runner.new_sequence()
    out = [runner.forward([seq], [list(range(3, 30))], all_logits=True)]
    for token in (5, 17, 40, 9, 11, 23):  # paged decode steps (graphs from the second)
        out.append(runner.forward([seq], [[token]]))
    return torch.cat(out).float().cpu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quantized_experts_on_cuda_match_the_dequantized_model(fmt, source, tmp_path):
    """The device tier with experts kept quantized: Triton kernels dequantizing in the kernel,
    fills and the CPU share moving the quantized bytes, decode graphs; every strategy gives
    the dequantized model's logits."""
    quantized, plain = quantized_pair(source[0], tmp_path, fmt)
    want = cuda_logits(plain, MoEOptions("fused"))
    for moe in (
        MoEOptions("fused"),
        MoEOptions("offload", "3"),
        MoEOptions("offload", "6"),
        MoEOptions("hybrid", "5"),
        MoEOptions("hybrid", "5", device_control=False),
        MoEOptions("static", "9"),
        MoEOptions("cpu"),
    ):
        got = cuda_logits(quantized, moe)
        assert (got - want).abs().max().item() < 1e-4, (fmt, moe)
    # bf16: the kernels compute with the dequantized weights' bf16 values
    want = cuda_logits(plain, MoEOptions("fused"), "bfloat16")
    for moe in (MoEOptions("fused"), MoEOptions("hybrid", "5")):
        got = cuda_logits(quantized, moe, "bfloat16")
        assert (got - want).abs().max().item() < 0.05 * want.abs().max().item(), (fmt, moe)


def fp8_e8m0_blocks(w, block=(128, 128)):
    """FP8 in blocks with power-of-two scales stored as e8m0, under DeepSeek's own name
    `X.scale` (DeepSeek-V4's releases: `scale_fmt` "ue8m0")."""
    parts, ref = fp8_blocks(w, block, power_of_two=True)
    scale = (torch.log2(parts[".weight_scale_inv"]) + 127).to(torch.uint8)
    return {".weight": parts[".weight"], ".scale": scale.view(torch.float8_e8m0fnu)}, ref


def fp4_rows(w):
    """DeepSeek-V4's FP4 experts: e2m1 pairs as int8 [N, K / 2] (the low nibble first) and an
    e8m0 scale per 32 values of a row [N, K / 32], under `X.weight` and `X.scale`."""
    parts, ref = mxfp4(w)
    n, k = w.shape
    data = parts[".weight_blocks"].reshape(n, k // 2).view(torch.int8)
    return {".weight": data, ".scale": parts[".weight_scales"].view(torch.float8_e8m0fnu)}, ref


# DeepSeek-V4's release config: FP8 e4m3 in 128 x 128 blocks with e8m0 scales, FP4 experts
V4_RELEASE = {
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    },
    "expert_dtype": "fp4",
}


def test_deepseek_v4_release_layout_fp8_attention_and_fp4_experts(source, tmp_path):
    """A checkpoint in DeepSeek-V4's release layout (FP8 e4m3 attention with e8m0 block scales,
    FP4 experts with e8m0 scales per 32 values of a row, each under `X.scale`): its experts
    are kept as MXFP4 (the same values), the rest dequantized, and it computes what its
    dequantized copy computes, on every strategy."""
    tensors = load_file(source[0] / "model.safetensors")

    def encoder(name):
        if name.endswith("_proj.weight"):
            return fp4_rows if ".experts." in name else fp8_e8m0_blocks
        return None

    stored, plain = encoded_copies(tensors, encoder)
    quantized, plain_dir = write_variants(
        source[0], tmp_path, {"quantized": (stored, V4_RELEASE), "plain": (plain, {})}
    )
    loaded = load_model(quantized, dtype="float32")
    assert loaded.experts.format.name == "mxfp4" and loaded.experts.w_gate_up.dtype == torch.uint8
    want = logits(plain_dir)
    for moe in (None, MoEOptions("hybrid", "3"), MoEOptions("cpu"), MoEOptions("offload", "2")):
        got = logits(quantized, moe)
        assert (got - want).abs().max().item() < 1e-5, moe


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    return build("glm_moe_dsa", tmp_path_factory.mktemp("glm5") / "glm_moe_dsa")


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_glm5_fp8_and_nvfp4_releases_compute_as_their_dequantized_copies(fmt, glm5, tmp_path):
    """GLM-5.x's releases come in FP8 (128 x 128 blocks) and NVFP4 (ModelOpt): read as the
    other families' are, its sparse attention's projections among them."""
    quant_config, encode = FORMATS[fmt]
    tensors = load_file(glm5[0] / "model.safetensors")
    # (a tiny model's narrow low-rank projections, 24 wide, stay plain: NVFP4 needs 16s)
    encoded = {
        n for n, t in tensors.items() if n.endswith("_proj.weight") and t.shape[-1] % 32 == 0
    }
    stored, weights = encoded_copies(tensors, lambda name: encode if name in encoded else None)
    variants = {
        "quantized": (stored, {"quantization_config": quant_config}),
        "plain": (weights, {}),
    }
    quantized, plain = write_variants(glm5[0], tmp_path, variants)
    assert any(".experts." in n and n.endswith(FORMATS_SUFFIX[fmt]) for n in stored)
    assert any("indexer" in n and n.endswith(FORMATS_SUFFIX[fmt]) for n in stored)
    loaded = load_model(quantized, dtype="float32")
    assert loaded.experts.format.name == fmt
    want = logits(plain)
    for moe in (None, MoEOptions("cpu"), MoEOptions("hybrid", "4")):
        assert (logits(quantized, moe) - want).abs().max().item() < 1e-5, moe


FORMATS_SUFFIX = {"fp8": ".weight_scale_inv", "nvfp4": ".weight_scale_2"}
