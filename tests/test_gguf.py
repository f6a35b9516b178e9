"""`--model FILE.gguf`: a GGUF file converted once into a checkpoint directory in the cache. An
F32 file gives the source model's logits; a Q8_0 file gives the logits of the model holding its
dequantized weights; the tokenizer and chat template come from the file's metadata."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken import settings
from freetoken.engine.runner import ModelRunner
from freetoken.errors import CheckpointError
from freetoken.models import gguf
from freetoken.models.loading import load_model
from freetoken.tokenizer import Tokenizer
from tiny_gguf import build_byte_qwen3, write_qwen3_gguf
from tiny_models import build_chat_model

IDS = list(range(3, 40))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Qwen3 of the byte vocabulary (its files carry the byte tokenizer), and its
    transformers model: the files' source but `qwen_file`'s (a 151k-token vocabulary would
    cost every write and conversion seconds)."""
    return build_byte_qwen3("qwen3", tmp_path_factory.mktemp("qwen3") / "src")


@pytest.fixture(scope="module")
def f32_file(source, tmp_path_factory):
    """The source as one F32 GGUF file, and a cache directory it is converted into once for
    the tests that read the conversion."""
    out = tmp_path_factory.mktemp("f32")
    return write_qwen3_gguf(source[0], out / "tiny.gguf"), out / "cache"


@pytest.fixture(scope="module")
def qwen_file(tmp_path_factory):
    """A tiny Qwen3 with the Qwen tokenizer and chat template (build_chat_model's), its F32
    GGUF file holding them, and the cache directory that converts into once: for the tests
    that need the real tokenizer (each conversion parses 151k tokens' metadata)."""
    cache = tmp_path_factory.mktemp("qwen-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(settings.CACHE_DIR.name, str(cache))
        path, _ = build_chat_model("qwen3", tmp_path_factory.mktemp("qwen3-vocab") / "src")
    out = tmp_path_factory.mktemp("qwen-f32")
    return path, write_qwen3_gguf(path, out / "tiny.gguf", tokenizer="qwen"), out / "cache"


@pytest.fixture(scope="module")
def q8_0_file(source, tmp_path_factory):
    """The source as one Q8_0 GGUF file, and the cache directory it converts into once."""
    out = tmp_path_factory.mktemp("q8_0")
    return write_qwen3_gguf(source[0], out / "tiny-Q8_0.gguf", "Q8_0"), out


def logits(path) -> torch.Tensor:
    runner = ModelRunner(load_model(path, dtype="float32"), kv_cache_tokens=128, page_size=8)
    return runner.forward([runner.new_sequence()], [IDS], all_logits=True)


# every type the gguf package writes (llama.cpp's K-quants it cannot: NotImplementedError)
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"]


@pytest.mark.parametrize("kind", TYPES)
def test_every_type_converts_to_its_dequantized_values(source, tmp_path, kind):
    """The conversion's tensors are the gguf package's dequantization of the file's, under
    transformers' names, in the checkpoint's dtype (a file without tokenizer metadata: the
    tensors alone; the files below go the whole way, tokenizer and engine included)."""
    import gguf as gguf_package
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, hf = source
    file = write_qwen3_gguf(path, tmp_path / f"{kind}.gguf", kind, tokenizer=None)
    parsed = load_gguf_checkpoint(str(file), return_tensors=False)
    fields = {k: v for k, v in parsed["config"].items() if k != "model_type"}
    config = AutoConfig.for_model(parsed["config"]["model_type"], **fields, head_dim=16)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    reader = gguf_package.GGUFReader(str(file))
    tensors = gguf._tensors(reader, "qwen3", parsed["config"], skeleton, set())
    assert set(tensors) == set(hf.state_dict()) - {"lm_head.weight"}  # (tied)
    stored = {t.name: t for t in reader.tensors}
    for ours, theirs in (
        ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
        ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"),
        ("model.embed_tokens.weight", "token_embd.weight"),
    ):
        t = stored[theirs]
        want = gguf_package.quants.dequantize(t.data, t.tensor_type)
        assert torch.equal(tensors[ours], torch.tensor(want)), (kind, ours)
        source_w = hf.state_dict()[ours]
        step = {"F32": 0.0, "Q8_0": 0.01, "F16": 0.01, "BF16": 0.01, "MXFP4": 0.35}.get(kind, 0.2)
        assert (tensors[ours] - source_w).abs().max() <= step * source_w.abs().max(), kind


@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_0"])
def test_a_gguf_file_serves_its_weights(source, q8_0_file, tmp_path, monkeypatch, kind):
    path, hf = source
    if kind == "Q8_0":
        file, cache = q8_0_file
    else:
        file, cache = write_qwen3_gguf(path, tmp_path / f"tiny-{kind}.gguf", kind), tmp_path
    monkeypatch.setenv(settings.CACHE_DIR.name, str(cache / "cache"))
    converted = gguf.checkpoint_of(file)
    assert converted.parent == cache / "cache" / "gguf" and (converted / gguf.DONE).is_file()
    ours = logits(converted)
    if kind == "F32":  # the very weights: the source model's logits
        with torch.no_grad():
            ref = hf(torch.tensor([IDS])).logits[0].float()
        assert (ours - ref).abs().max().item() < 1e-4
    else:  # each matrix dequantized: the source's weights within the type's steps
        import gguf as gguf_package
        from safetensors.torch import load_file

        from freetoken.weights.safetensors_dir import CheckpointDir

        # a dense layer's weight is kept as its blocks where the kernels read its type, else
        # stored dequantized, exactly (fp32: bf16 would round most of a block's values)
        stored = load_file(str(converted / "model.safetensors"))
        name = "model.layers.0.self_attn.q_proj.weight"
        assert (name not in stored) == (kind in gguf.KEPT_TYPES)
        assert name in stored or name + "_" + kind.lower() + "_scales" in stored
        assert name not in stored or stored[name].dtype == torch.float32
        # either way the values the file defines
        weights = {n: t.float() for n, t, _ in CheckpointDir(converted).iter_weights()}
        q, source_q = weights[name], hf.state_dict()[name]
        step = {"Q8_0": 0.01}.get(kind, 0.2)  # (of the largest)
        assert 0 < (q - source_q).abs().max() < step * source_q.abs().max()
        t = next(
            t for t in gguf_package.GGUFReader(str(file)).tensors if t.name == "blk.0.attn_q.weight"
        )
        want = torch.from_numpy(gguf_package.quants.dequantize(t.data, t.tensor_type))
        assert torch.equal(q, want)
        assert json.loads((converted / "config.json").read_text())["dtype"] == "bfloat16"
        hf_q = type(hf)(hf.config).eval()  # the same model holding the dequantized weights
        result = hf_q.load_state_dict(weights, strict=False)
        assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
        hf_q.tie_weights()
        with torch.no_grad():
            ref = hf_q(torch.tensor([IDS])).logits[0].float()
        assert (ours - ref).abs().max().item() < 1e-4
    assert gguf.checkpoint_of(file) == converted  # a second start converts nothing


def test_a_gguf_files_dense_layers_load_quantized_and_match_its_dequantized_model(
    q8_0_file, monkeypatch
):
    """A Q8_0 file: its attention and MLP weights, and the tied output head (from the
    embedding's blocks; the table dequantized for lookups), load as quantized weights on the
    CPU, and the model's fp32 logits over a prompt (its rows: the weights dequantized per call)
    and paged decode steps (one row: the native kernel on the blocks) are those of the same
    file's model loaded dequantized, within 1e-4."""
    from freetoken.layers.linear import Linear
    from freetoken.weights.expert_format import QuantizedWeight

    file, cache = q8_0_file
    monkeypatch.setenv(settings.CACHE_DIR.name, str(cache / "cache"))
    converted = gguf.checkpoint_of(file)
    quantized = load_model(converted, dtype="float32")
    model = quantized.model
    for layer in model.layers:
        for proj in (
            layer.attn.q_proj,
            layer.attn.k_proj,
            layer.attn.v_proj,
            layer.attn.o_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
        ):
            assert proj.weight is None and proj.quantized.format.name == "q8_0"
        # (stacked on the CPU: q, k and v one weight, the MLP one job of the experts' kernel)
        assert layer.attn.qkv_proj is not None and layer.mlp.native is not None
    head = model.lm_head_weight()
    assert isinstance(head, QuantizedWeight) and model.config.tie_word_embeddings
    assert torch.equal(model.embed.weight, head.dequantize(torch.float32))
    dense = load_model(converted, dtype="float32", dequantize_dense=True)
    assert not any(isinstance(m, Linear) and m.quantized is not None for m in dense.model.modules())

    def run(loaded) -> torch.Tensor:
        runner = ModelRunner(loaded, kv_cache_tokens=128, page_size=8)
        seq = runner.new_sequence()
        out = [runner.forward([seq], [IDS], all_logits=True)]
        for token in (5, 17, 3, 11):
            out.append(runner.forward([seq], [[token]]))
        return torch.cat(out)

    got, ref = run(quantized), run(dense)
    assert got.shape == (len(IDS) + 4, model.config.vocab_size)
    assert (got - ref).abs().max().item() < 1e-4


def test_exact_storage_takes_the_narrowest_type_holding_every_value():
    halves = torch.tensor([0.5, -1.25, 3.0])  # exact in bf16 and fp16
    assert gguf._exact(halves).dtype == torch.bfloat16
    fine = torch.tensor([1 + 2**-10, 3.0])  # 11 significant bits: fp16's, not bf16's
    assert gguf._exact(fine).dtype == torch.float16
    block = torch.tensor([0.0123, 7.0]).half().float() * 13  # a scale times a code
    assert gguf._exact(block).dtype == torch.float32
    for t in (halves, fine, block):
        assert torch.equal(gguf._exact(t).float(), t)


def test_dequantized_routed_experts_are_stored_in_bf16_the_rest_exactly(tmp_path, monkeypatch):
    """Experts of a type the kernels do not keep (F16 here: every quantized type the gguf
    package writes is kept since Q4_0-Q5_1 were added) are the bulk of a file: bf16, as the
    engine holds them; the attention's Q4_0 matrices as the file's blocks."""
    import gguf as gguf_package
    from safetensors.torch import load_file

    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "cache"))
    path, _ = build_byte_qwen3("qwen3_moe", tmp_path / "src", mlp_only_layers=[])
    file = write_qwen3_gguf(path, tmp_path / "q4_0.gguf", "Q4_0", experts="F16")
    stored = load_file(str(gguf.checkpoint_of(file) / "model.safetensors"))
    tensors = {t.name: t for t in gguf_package.GGUFReader(str(file)).tensors}

    def values(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(gguf_package.quants.dequantize(t.data, t.tensor_type))

    down = stored["model.layers.1.mlp.experts.down_proj"]
    assert down.dtype == torch.bfloat16
    assert torch.equal(down, values("blk.1.ffn_down_exps.weight").to(torch.bfloat16))
    gate_up = stored["model.layers.1.mlp.experts.gate_up_proj"]  # (gate, then up: merged)
    gate, up = values("blk.1.ffn_gate_exps.weight"), values("blk.1.ffn_up_exps.weight")
    assert gate_up.dtype == torch.bfloat16
    assert torch.equal(gate_up, torch.cat([gate, up], dim=1).to(torch.bfloat16))
    # (the attention's Q4_0 matrices: kept as their blocks, which read as the file's values)
    from freetoken.weights.safetensors_dir import CheckpointDir

    name = "model.layers.1.self_attn.q_proj.weight"
    assert name not in stored and name + "_q4_0" in stored
    q = next(t for n, t, _ in CheckpointDir(gguf.checkpoint_of(file)).iter_weights() if n == name)
    assert torch.equal(q, values("blk.1.attn_q.weight"))


def test_an_earlier_releases_conversion_is_made_again(f32_file, monkeypatch):
    file, cache = f32_file
    monkeypatch.setenv(settings.CACHE_DIR.name, str(cache))
    converted = gguf.checkpoint_of(file)
    done = json.loads((converted / gguf.DONE).read_text())
    assert done["format"] == gguf.FORMAT
    (converted / gguf.DONE).write_text(json.dumps({**done, "format": gguf.FORMAT - 1}))
    (converted / "model.safetensors").write_bytes(b"stale")  # an earlier layout's weights
    assert gguf.checkpoint_of(file) == converted
    assert json.loads((converted / gguf.DONE).read_text())["format"] == gguf.FORMAT
    assert (converted / "model.safetensors").stat().st_size > 1000


def test_its_tokenizer_and_template_are_the_source_checkpoints(qwen_file, monkeypatch):
    path, file, cache = qwen_file
    monkeypatch.setenv(settings.CACHE_DIR.name, str(cache))
    converted = gguf.checkpoint_of(file)
    ours, theirs = Tokenizer(converted), Tokenizer(path)
    assert not ours.uses_transformers  # (transformers saved it as a tokenizer.json to take)
    for text in ("Hello, world! <|im_end|> 你好 def f(x):\n\treturn x", "  spaces  "):
        assert ours.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.render_chat(chat) == theirs.render_chat(chat)
    assert ours.token_id("<|im_end|>") in ours.eos_token_ids


def test_a_conversion_parses_the_files_metadata_once(f32_file, tmp_path, monkeypatch, capsys):
    """transformers' config and tokenizer readers each parse the file again unless handed the
    conversion's reader (each parse of a 151k-token vocabulary is 5-6 s); the gguf package is
    left as it was. The conversion shows its progress over the file's tensors when asked."""
    import gguf as gguf_package

    parses, escaped = [], []
    ours = gguf.reader_class()

    class Counting(ours):
        def __init__(self, *args, **kwargs):
            parses.append(args[0])
            super().__init__(*args, **kwargs)

    class Escaped(gguf_package.GGUFReader):  # a parse of transformers' own, not handed ours
        def __init__(self, *args, **kwargs):
            escaped.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "reader_class", lambda: Counting)
    monkeypatch.setattr(gguf_package, "GGUFReader", Escaped)
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "cache"))
    converted = gguf.checkpoint_of(f32_file[0], progress=True)
    assert (converted / "tokenizer.json").is_file() and (converted / "config.json").is_file()
    assert parses == [str(f32_file[0].resolve())] and escaped == []
    bar = capsys.readouterr().err
    assert "Converting" in bar and "100%" in bar
    assert gguf_package.GGUFReader is Escaped


def test_the_plain_view_reader_reads_what_the_package_reads(f32_file):
    """The conversion's reader (a plain ndarray view of the map: no memmap slice per value)
    gives every field and tensor the package's own reader gives."""
    import gguf as gguf_package
    import numpy as np

    theirs = gguf_package.GGUFReader(str(f32_file[0]))
    ours = gguf.reader_class()(str(f32_file[0]))
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert mine.data == field.data and mine.types == field.types
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True))
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert np.array_equal(a.data, b.data)


def test_an_engine_starts_from_a_gguf_file(qwen_file, monkeypatch):
    from freetoken.config import EngineConfig, MoEOptions
    from freetoken.engine.generate import LLMEngine
    from freetoken.engine.sampling import SamplingParams

    path, file, cache = qwen_file  # (a source with tokenizer files: the engine starts from it)
    monkeypatch.setenv(settings.CACHE_DIR.name, str(cache))
    outputs = []
    for model in (file, path):
        engine = LLMEngine.from_config(
            EngineConfig(
                model=model,
                device="cpu",
                dtype="float32",
                kv_cache_tokens=256,
                moe=MoEOptions("fused"),
            )
        )
        req = engine.add_request(
            engine.tokenizer.encode("Hi there"), SamplingParams(max_new_tokens=6, temperature=0.0)
        )
        while not req.finished:
            engine.step()
        outputs.append(req.output_ids)
    assert outputs[0] == outputs[1]


def test_a_file_that_is_not_gguf_is_refused_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match=r"bad\.gguf"):
        gguf.checkpoint_of(bad)
    assert not any((tmp_path / "cache" / "gguf").glob("*"))  # nothing half-written left


def test_a_conversion_host_memory_cannot_hold_is_refused_first(source, tmp_path, monkeypatch):
    from freetoken.weights import memory

    path, _ = source
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "cache"))
    file = write_qwen3_gguf(path, tmp_path / "big.gguf")
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 1024)
    with pytest.raises(CheckpointError, match=r"converts to .* free in host memory"):
        gguf.checkpoint_of(file)
    assert not any((tmp_path / "cache" / "gguf").glob("*"))


def test_a_gguf_file_converts_to_a_weight_directory(f32_file, tmp_path, monkeypatch):
    from freetoken.models.loading import convert_checkpoint

    monkeypatch.setenv(settings.CACHE_DIR.name, str(f32_file[1]))
    file = f32_file[0]
    dst = convert_checkpoint(file, tmp_path / "weights", progress=False)
    assert torch.equal(logits(dst), logits(gguf.checkpoint_of(file)))
    assert Tokenizer(dst).render_chat([{"role": "user", "content": "x"}])


# -- Qwen3-MoE with Q8_0 or MXFP4 experts: kept as stored -----------------------------------

# (GGUF type of the rest, of the experts; the expert format kept (gate/up's, and the down
# projection's where it differs), its parts' suffixes)
MOE_KINDS = {
    "Q8_0": ("Q8_0", None, "q8_0", ("_q8_0", "_q8_0_scales")),
    "MXFP4_MOE": ("Q8_0", "MXFP4", "mxfp4", ("_blocks", "_scales")),
    **{
        f"{k}_EXPERTS": ("Q8_0", k, k.lower(), (f"_{k.lower()}", f"_{k.lower()}_scales"))
        for k in ("Q4_K", "Q5_K", "Q6_K")
    },
    # Q4_K_M / Q5_K_M-like: the down projections of even layers Q6_K
    **{
        f"{k}_M": (
            "Q8_0",
            f"{k}_M",
            (k.lower(), "k_mixed"),
            (f"_{k.lower()}", f"_{k.lower()}_scales"),
        )
        for k in ("Q4_K", "Q5_K")
    },
    # SmolLM2's Q4_1 file's type; Qwen2.5's Q4_K_M files' (gate and up Q5_0)
    "Q4_1_EXPERTS": ("Q8_0", "Q4_1", "q4_1", ("_q4_1", "_q4_1_scales")),
    "Q5_0_Q4_K_M": ("Q8_0", "Q5_0_Q4_K_M", ("q5_0", "k_mixed"), ("_q5_0", "_q5_0_scales")),
}
# a kept expert tensor's suffixes (codes, scales) -> its format
SUFFIXES = {
    "_q8_0": "q8_0",
    "_blocks": "mxfp4",
    "_q4_k": "q4_k",
    "_q5_k": "q5_k",
    "_q6_k": "q6_k",
    "_q4_0": "q4_0",
    "_q4_1": "q4_1",
    "_q5_0": "q5_0",
    "_q5_1": "q5_1",
}


@pytest.fixture(scope="module", params=sorted(MOE_KINDS))
def moe_file(request, tmp_path_factory):
    """A tiny Qwen3-MoE GGUF (every layer MoE, as llama.cpp's qwen3moe) in Q8_0, or with MXFP4
    experts (llama.cpp's MXFP4_MOE), its converted checkpoint and what it should keep."""
    rest, experts, fmt, suffixes = MOE_KINDS[request.param]
    cache = tmp_path_factory.mktemp("moe-cache")
    # (K-quants: super-blocks of 256 values a row)
    widths = dict(hidden_size=256, moe_intermediate_size=256) if "k" in str(fmt) else {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(settings.CACHE_DIR.name, str(cache))
        path, _ = build_byte_qwen3(
            "qwen3_moe", tmp_path_factory.mktemp("moe") / "src", mlp_only_layers=[], **widths
        )
        out = tmp_path_factory.mktemp("moe-gguf") / f"{request.param}.gguf"
        file = write_qwen3_gguf(path, out, rest, experts)
        return gguf.checkpoint_of(file), fmt, suffixes


def moe_logits(path, moe=None, **load) -> torch.Tensor:
    """Prefill logits and four paged decode steps'."""
    runner = ModelRunner(
        load_model(path, dtype="float32", **load), kv_cache_tokens=128, page_size=8, moe=moe
    )
    seq = runner.new_sequence()
    out = [runner.forward([seq], [IDS], all_logits=True)]
    for token in (5, 17, 40, 9):
        out.append(runner.forward([seq], [[token]]))
    return torch.cat(out)


def test_gguf_experts_stay_quantized_and_compute_as_their_dequantized_copy(moe_file):
    from safetensors.torch import load_file

    from freetoken.config import MoEOptions
    from freetoken.weights.expert_format import expert_format

    converted, fmt, (codes_suffix, scales_suffix) = moe_file
    fmt, down = fmt if isinstance(fmt, tuple) else (fmt, fmt)
    stored = load_file(str(converted / "model.safetensors"))
    base = "model.layers.0.mlp.experts.gate_up_proj"
    codes, scales = stored[base + codes_suffix], stored[base + scales_suffix]
    inter = json.loads((converted / "config.json").read_text())["moe_intermediate_size"]
    assert codes.shape[:2] == scales.shape[:2] == (8, 2 * inter)  # [E, 2I, ...]
    assert codes.dtype in (torch.int8, torch.uint8) and base not in stored  # not dequantized
    # the host pool holds the codes and scales as the file stores them
    experts = load_model(converted, dtype="float32").experts
    assert experts.format.name == fmt and experts.w_gate_up.dtype == torch.uint8
    assert experts.formats["down"].name == down
    dense = load_model(converted, dtype="float32", dequantize_experts=True)
    assert experts.nbytes < dense.experts.nbytes / 3.5  # (8.5 or 4.25 bits a weight: fp32's 32)
    want = moe_logits(converted, dequantize_experts=True)
    # every strategy and cache size (one slot, a few, all) computes with them as defined
    for moe in (
        None,
        MoEOptions("hybrid", "6"),
        MoEOptions("hybrid", "1"),
        MoEOptions("cpu"),
        MoEOptions("offload", "3"),
        MoEOptions("static", "5"),
    ):
        got = moe_logits(converted, moe)
        assert (got - want).abs().max().item() < 1e-5, moe
    # the dequantized model is transformers' on those weights (the experts exact in fp32)
    from transformers import AutoModelForCausalLM

    from freetoken.weights.quantized import QuantizedParts

    def dequantized(name: str) -> torch.Tensor:  # (by the type the file stores it in)
        from freetoken.weights.expert_format import bank_parts

        codes = next(s for s in SUFFIXES if name + s in stored)
        scales = name + codes.replace("_blocks", "") + "_scales"
        kind = SUFFIXES[codes]
        parts = bank_parts(QuantizedParts(kind, stored[name + codes], stored[scales]))
        return expert_format(kind).dequantize(parts["w"], parts["s"])

    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    kept = (*SUFFIXES, *(s.replace("_blocks", "") + "_scales" for s in SUFFIXES))
    state = {k: v.float() for k, v in stored.items() if not k.endswith(kept)}
    for part in stored:  # (the experts', and the dense layers' kept Q8_0)
        if part.endswith(tuple(SUFFIXES)):
            name = part.removesuffix(next(s for s in SUFFIXES if part.endswith(s)))
            state[name] = dequantized(name)
    result = hf.load_state_dict(state, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
    hf.tie_weights()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    assert (want[: len(IDS)] - ref).abs().max().item() < 1e-4


def test_the_kept_experts_are_the_files_values():
    """MXFP4: GGUF's block (a scale, then values j and j + 16 in byte j) reordered into
    freetoken's (values 2j, 2j + 1 in byte j) holds the values the gguf package's own
    dequantization gives; Q8_0 and the K-quants likewise."""
    import gguf as gguf_package
    import numpy as np

    from freetoken.weights.expert_format import MXFP4, Q8_0

    rng = np.random.default_rng(0)
    weights = rng.standard_normal((3, 5, 64)).astype(np.float32) * 0.1
    for kind, fmt in (("MXFP4", MXFP4), ("Q8_0", Q8_0)):
        qtype = getattr(gguf_package.GGMLQuantizationType, kind)
        data = gguf_package.quants.quantize(weights, qtype)
        want = gguf_package.quants.dequantize(data, qtype)
        codes, scales = (gguf._mxfp4 if kind == "MXFP4" else gguf._q8_0)(data)
        w = torch.from_numpy(codes)
        w = w.flatten(-2) if kind == "MXFP4" else w.view(torch.uint8)
        got = fmt.dequantize(w, torch.from_numpy(scales))
        assert torch.equal(got, torch.from_numpy(want)), kind
    # the K-quants: a block's code bytes and its other bytes apart hold the file's values
    from freetoken.weights.expert_format import K_QUANTS
    from tiny_gguf import random_k_blocks

    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        data = random_k_blocks(kind, (3, 5, 512), rng)
        qtype = getattr(gguf_package.GGMLQuantizationType, kind)
        want = gguf_package.quants.dequantize(data, qtype)
        codes, rest = gguf._PARTS[kind](data)
        got = K_QUANTS[kind.lower()].dequantize(torch.from_numpy(codes), torch.from_numpy(rest))
        assert torch.equal(got, torch.from_numpy(want)), kind
    # the legacy types likewise, on the package's blocks and on any bytes (d and m from
    # subnormal to infinite and NaN, every fifth bit): bit for bit but NaNs' payloads
    from freetoken.weights.expert_format import LEGACY

    for kind in gguf.LEGACY_TYPES:
        qtype = getattr(gguf_package.GGMLQuantizationType, kind)
        size = gguf_package.GGML_QUANT_SIZES[qtype][1]
        quantized = gguf_package.quants.quantize(weights, qtype)
        for data in (quantized, rng.integers(0, 256, (3, 5, 64 * size), dtype=np.uint8)):
            with np.errstate(invalid="ignore", over="ignore"):
                want = torch.from_numpy(gguf_package.quants.dequantize(data, qtype))
            codes, rest = map(torch.from_numpy, gguf._PARTS[kind](data))
            got = LEGACY[kind.lower()].dequantize(codes, rest)
            nan = want.isnan()
            assert torch.equal(got.isnan(), nan), kind
            assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), kind


def test_which_mixes_of_expert_types_are_kept_and_the_log_says_why_not(caplog):
    """K-quants of several types (Q4_K_M: some layers' down projections Q6_K) are kept; a layer
    whose gate and up differ in type (they are stacked in one bank row), or a K-quant beside
    another type, is dequantized, and the warning says why."""
    from types import SimpleNamespace

    def tensor(name: str, kind: str):
        return SimpleNamespace(name=name, tensor_type=SimpleNamespace(name=kind))

    def kept(tensors) -> set[str]:
        return gguf._kept_experts(SimpleNamespace(tensors=tensors))

    one = [tensor("blk.0.ffn_down_exps.weight", "Q6_K"), tensor("blk.0.ffn_up_exps.weight", "Q6_K")]
    assert kept(one) == {t.name for t in one}
    mixed = [*one, tensor("blk.1.ffn_down_exps.weight", "Q4_K")]
    assert kept(mixed) == {t.name for t in mixed}
    with caplog.at_level("WARNING"):
        assert kept([*mixed, tensor("blk.0.ffn_gate_exps.weight", "Q4_K")]) == set()
    assert "gate and up projections differ in type (Q4_K/Q6_K)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert kept([*mixed, tensor("blk.2.ffn_down_exps.weight", "Q8_0")]) == set()
    assert "several types (Q4_K/Q6_K/Q8_0)" in caplog.text
    # gate and up of one type, the down projections of another or K-quants (Qwen2.5's Q4_K_M)
    qwen = [tensor(f"blk.{i}.ffn_{p}_exps.weight", "Q5_0") for i in (0, 1) for p in ("gate", "up")]
    qwen += [
        tensor("blk.0.ffn_down_exps.weight", "Q6_K"),
        tensor("blk.1.ffn_down_exps.weight", "Q4_K"),
    ]
    assert kept(qwen) == {t.name for t in qwen}
    assert kept([*qwen[:4], tensor("blk.0.ffn_down_exps.weight", "Q8_0")])
    caplog.clear()
    with caplog.at_level("WARNING"):  # (the gate/up projections of two types across layers)
        assert kept([*qwen, tensor("blk.2.ffn_gate_exps.weight", "Q8_0")]) == set()
        assert kept([*qwen[:4], tensor("blk.0.ffn_down_exps.weight", "MXFP4")]) == set()
    assert "several types (Q4_K/Q5_0/Q6_K/Q8_0)" in caplog.text
    assert "several types (MXFP4/Q5_0)" in caplog.text


def test_gguf_experts_convert_to_a_weight_directory_kept_quantized(moe_file, tmp_path):
    from freetoken.models.loading import convert_checkpoint
    from freetoken.weights.weight_dir import WeightDir

    converted, fmt, _ = moe_file
    fmt, down = fmt if isinstance(fmt, tuple) else (fmt, fmt)
    dst = convert_checkpoint(converted, tmp_path / "weights", "float32", progress=False)
    assert WeightDir(dst).meta["expert_format"] == fmt
    assert WeightDir(dst).meta.get("expert_format_down", fmt) == down
    experts = load_model(dst, dtype="float32").experts
    assert experts.format.name == fmt and experts.formats["down"].name == down
    # (the directory holds the dense layers as the model's dtype, as a load that dequantizes
    # them: the same values, and the same kernels)
    assert torch.equal(moe_logits(dst), moe_logits(converted, dequantize_dense=True))


def test_a_k_mixed_bank_holds_each_tensors_own_values():
    """k_mixed (a projection whose layers differ in K type): each block's other bytes padded
    and tagged with its type hold the values of the type it came from; a block whose tag is no
    K type is refused rather than read as one."""
    import numpy as np

    from freetoken.weights.expert_format import K_MIXED, K_QUANTS, MIXED_K_TAG, MIXED_K_WIDTH
    from freetoken.weights.expert_format import bank_parts as parts_of
    from freetoken.weights.quantized import QuantizedParts
    from tiny_gguf import random_k_blocks

    rng = np.random.default_rng(1)
    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        codes, rest = map(torch.from_numpy, gguf._PARTS[kind](random_k_blocks(kind, (3, 512), rng)))
        stored = QuantizedParts(kind.lower(), codes, rest)
        mixed = parts_of(stored, K_MIXED)
        assert mixed["s"].shape == (3, 2 * MIXED_K_WIDTH)
        want = K_QUANTS[kind.lower()].dequantize(codes, rest)
        assert torch.equal(K_MIXED.dequantize(mixed["w"], mixed["s"]), want), kind
    mixed["s"].view(3, 2, MIXED_K_WIDTH)[1, 0, MIXED_K_TAG] = 9
    with pytest.raises(ValueError, match="type code 9"):
        K_MIXED.dequantize(mixed["w"], mixed["s"])


def test_the_memory_check_counts_a_k_mixed_pool_as_held(moe_file, monkeypatch):
    """k_mixed pads its blocks, so the host pool is larger than the file's experts: the
    admission check asks for the pool's size beside the other weights."""
    from freetoken.models import loading

    converted, fmt, _ = moe_file
    if not isinstance(fmt, tuple):
        pytest.skip("one format: the pool holds the experts as stored")
    asked = []
    monkeypatch.setattr(loading, "_admit", lambda path, nbytes, dtype: asked.append(nbytes))
    loaded = load_model(converted, dtype="float32")
    dense = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert asked[0] >= dense + loaded.experts.nbytes
