"""`--model FILE.gguf`: a GGUF file converted once into a checkpoint directory in the cache. An
F32 file gives the source model's logits; a Q8_0 file gives the logits of the model holding its
dequantized weights; the tokenizer and chat template come from the file's metadata."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken import paths
from freetoken.engine.runner import ModelRunner
from freetoken.errors import CheckpointError
from freetoken.models import gguf
from freetoken.models.loading import load_model
from freetoken.tokenizer import Tokenizer
from tiny_gguf import write_qwen3_gguf
from tiny_models import build_chat_model

IDS = list(range(3, 40))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(paths.CACHE_DIR_ENV, str(cache))
        path, hf = build_chat_model("qwen3", tmp_path_factory.mktemp("qwen3") / "src")
    return path, hf, cache


def logits(path) -> torch.Tensor:
    runner = ModelRunner(load_model(path, dtype="float32"), kv_cache_tokens=128, page_size=8)
    return runner.forward([runner.new_sequence()], [IDS], all_logits=True)


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_a_gguf_file_serves_its_weights(source, tmp_path, monkeypatch, kind):
    path, hf, _ = source
    monkeypatch.setenv(paths.CACHE_DIR_ENV, str(tmp_path / "cache"))
    file = write_qwen3_gguf(path, tmp_path / f"tiny-{kind}.gguf", kind)
    converted = gguf.checkpoint_of(file)
    assert converted.parent == tmp_path / "cache" / "gguf" and (converted / gguf.DONE).is_file()
    ours = logits(converted)
    if kind == "F32":  # the very weights: the source model's logits
        with torch.no_grad():
            ref = hf(torch.tensor([IDS])).logits[0].float()
        assert (ours - ref).abs().max().item() < 1e-4
    else:  # each matrix dequantized from Q8_0: the source's weights within the blocks' steps
        from safetensors.torch import load_file

        weights = load_file(str(converted / "model.safetensors"))
        state = hf.state_dict()
        q = weights["model.layers.0.self_attn.q_proj.weight"].float()
        assert 0 < (q - state["model.layers.0.self_attn.q_proj.weight"]).abs().max() < 2e-3
        assert json.loads((converted / "config.json").read_text())["dtype"] == "bfloat16"
        hf_q = type(hf)(hf.config).eval()  # the same model holding the dequantized weights
        result = hf_q.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
        assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
        hf_q.tie_weights()
        with torch.no_grad():
            ref = hf_q(torch.tensor([IDS])).logits[0].float()
        ours_bf16 = ModelRunner(load_model(converted, dtype="float32"), kv_cache_tokens=128,
                                page_size=8)  # fmt: skip
        got = ours_bf16.forward([ours_bf16.new_sequence()], [IDS], all_logits=True)
        assert (got - ref).abs().max().item() < 1e-4
    assert gguf.checkpoint_of(file) == converted  # a second start converts nothing


def test_its_tokenizer_and_template_are_the_source_checkpoints(source, tmp_path, monkeypatch):
    path, _, _ = source
    monkeypatch.setenv(paths.CACHE_DIR_ENV, str(tmp_path / "cache"))
    converted = gguf.checkpoint_of(write_qwen3_gguf(path, tmp_path / "t.gguf"))
    ours, theirs = Tokenizer(converted), Tokenizer(path)
    assert not ours.uses_transformers  # (transformers saved it as a tokenizer.json to take)
    for text in ("Hello, world! <|im_end|> 你好 def f(x):\n\treturn x", "  spaces  "):
        assert ours.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "Hi"}]
    assert ours.render_chat(chat) == theirs.render_chat(chat)
    assert ours.token_id("<|im_end|>") in ours.eos_token_ids


def test_an_engine_starts_from_a_gguf_file(source, tmp_path, monkeypatch):
    from freetoken.config import EngineConfig, MoEOptions
    from freetoken.engine.generate import LLMEngine
    from freetoken.engine.sampling import SamplingParams

    path, _, _ = source
    monkeypatch.setenv(paths.CACHE_DIR_ENV, str(tmp_path / "cache"))
    file = write_qwen3_gguf(path, tmp_path / "e.gguf")
    outputs = []
    for model in (file, path):
        engine = LLMEngine.from_config(EngineConfig(model=model, device="cpu", dtype="float32",
                                                    kv_cache_tokens=256, moe=MoEOptions("fused")))
        req = engine.add_request(engine.tokenizer.encode("Hi there"),
                                 SamplingParams(max_new_tokens=6, temperature=0.0))
        while not req.finished:
            engine.step()
        outputs.append(req.output_ids)
    assert outputs[0] == outputs[1]


def test_a_file_that_is_not_gguf_is_refused_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.CACHE_DIR_ENV, str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match=r"bad\.gguf"):
        gguf.checkpoint_of(bad)
    assert not any((tmp_path / "cache" / "gguf").glob("*"))  # nothing half-written left


def test_a_conversion_host_memory_cannot_hold_is_refused_first(source, tmp_path, monkeypatch):
    from freetoken.weights import memory

    path, _, _ = source
    monkeypatch.setenv(paths.CACHE_DIR_ENV, str(tmp_path / "cache"))
    file = write_qwen3_gguf(path, tmp_path / "big.gguf")
    monkeypatch.setattr(memory, "available_host_bytes", lambda: 1024)
    with pytest.raises(CheckpointError, match=r"dequantizes to .* free in host memory"):
        gguf.checkpoint_of(file)
    assert not any((tmp_path / "cache" / "gguf").glob("*"))


def test_a_gguf_file_converts_to_a_weight_directory(source, tmp_path, monkeypatch):
    from freetoken.models.loading import convert_checkpoint

    path, _, _ = source
    monkeypatch.setenv(paths.CACHE_DIR_ENV, str(tmp_path / "cache"))
    file = write_qwen3_gguf(path, tmp_path / "w.gguf")
    dst = convert_checkpoint(file, tmp_path / "weights", progress=False)
    assert torch.equal(logits(dst), logits(gguf.checkpoint_of(file)))
    assert Tokenizer(dst).render_chat([{"role": "user", "content": "x"}])
