"""Checkpoint layouts we must load, and the errors a user sees when one is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from freetoken.engine.runner import ModelRunner
from freetoken.errors import CheckpointError, InsufficientMemoryError, UnsupportedModelError
from freetoken.models import loading as loader
from freetoken.models.loading import load_model
from tiny_models import build


def max_logit_error(path, hf, dtype="float32") -> float:
    runner = ModelRunner(load_model(path, dtype=dtype), kv_cache_tokens=128, page_size=8)
    ids = list(range(3, 40))
    ours = runner.forward([runner.new_sequence()], [ids], all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    return (ours - ref).abs().max().item()


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return build("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "qwen3_moe")


def test_sharded_checkpoint(tmp_path):
    path, hf = build("mixtral", tmp_path / "m", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 3
    assert max_logit_error(path, hf) < 1e-4


def test_bf16_checkpoint_loads_in_bf16(tmp_path):
    path, _ = build("qwen2_moe", tmp_path / "m", dtype=torch.bfloat16)
    loaded = load_model(path)  # auto follows the checkpoint
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.model.rotary.inv_freq.dtype == torch.float32
    # Same weights upcast: our fp32 run of the bf16 checkpoint vs transformers loading it in
    # fp32 (not `hf.float()`: its RoPE table was rounded to bf16 by the cast).
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert max_logit_error(path, reference) < 1e-4


def test_tied_embeddings(tmp_path):
    path, hf = build("qwen3", tmp_path / "m", tie_word_embeddings=True)
    names = json.loads((path / "config.json").read_text())
    assert names["tie_word_embeddings"] is True
    loaded = load_model(path)
    assert not hasattr(loaded.model, "lm_head")
    assert max_logit_error(path, hf) < 1e-4


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        load_model(tmp_path)


def test_unreadable_config(qwen3_moe, tmp_path):
    shutil.copytree(qwen3_moe[0], tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"cannot read .*config\.json"):
        load_model(tmp_path / "m")


def test_missing_weights(qwen3_moe, tmp_path):
    shutil.copytree(qwen3_moe[0], tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights"):
        load_model(tmp_path / "m")


def test_missing_shard(tmp_path):
    path, _ = build("mixtral", tmp_path / "m", max_shard_size="40KB")
    next(path.glob("model-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="lists shards that are missing"):
        load_model(path)


def test_corrupt_weights(qwen3_moe, tmp_path):
    shutil.copytree(qwen3_moe[0], tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="cannot read safetensors file"):
        load_model(tmp_path / "m")


def test_missing_tensor_is_named(qwen3_moe, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(qwen3_moe[0], tmp_path / "m")
    file = tmp_path / "m" / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensors: layers\.2\.moe\.experts\.5\.up"):
        load_model(tmp_path / "m")


def test_unsupported_architecture_lists_supported(qwen3_moe, tmp_path):
    shutil.copytree(qwen3_moe[0], tmp_path / "m")
    cfg_file = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as err:
        load_model(tmp_path / "m")
    message = str(err.value)
    assert "GPT2LMHeadModel" in message
    for arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM"):
        assert arch in message


def test_model_larger_than_free_memory(qwen3_moe, monkeypatch):
    monkeypatch.setattr(loader.memory, "available_host_bytes", lambda: 100 * 2**20)
    with pytest.raises(InsufficientMemoryError, match=r"needs about 0\.5 GiB .* only 0\.1 GiB"):
        load_model(qwen3_moe[0])


def test_memory_check_reads_only_headers(qwen3_moe, monkeypatch):
    """The size estimate comes from headers: no tensor may be read before the check."""
    monkeypatch.setattr(loader.memory, "available_host_bytes", lambda: 0)

    def forbidden(*a, **k):
        raise AssertionError("weights were read before the memory check")

    monkeypatch.setattr(loader.CheckpointDir, "iter_tensors", forbidden)
    with pytest.raises(InsufficientMemoryError):
        load_model(qwen3_moe[0])


def test_yarn_rope_matches_transformers(tmp_path):
    path, hf = build(
        "qwen3_moe",
        tmp_path / "m",
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
    )
    assert json.loads((path / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    assert max_logit_error(path, hf) < 1e-4


def test_unsupported_rope_type(qwen3_moe, tmp_path):
    shutil.copytree(qwen3_moe[0], tmp_path / "m")
    cfg_file = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="longrope"):
        load_model(tmp_path / "m")


def test_a_multimodal_qwen3_5_checkpoint_loads_its_text_model(tmp_path):
    """Qwen3.5-MoE releases are image-text models: the text model's config in `text_config`,
    its weights under `model.language_model.`, a vision tower beside it (not read)."""
    from safetensors.torch import load_file, save_file

    path, hf = build("qwen3_5_moe", tmp_path / "text")
    text = json.loads((path / "config.json").read_text())
    weights = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in load_file(path / "model.safetensors").items()
    }
    weights["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)
    full = tmp_path / "full"
    full.mkdir()
    save_file(weights, full / "model.safetensors")
    outer = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": {k: v for k, v in text.items() if k != "architectures"},
        "vision_config": {"depth": 2},
        "tie_word_embeddings": text["tie_word_embeddings"],
    }
    (full / "config.json").write_text(json.dumps(outer))
    loaded = load_model(full, dtype="float32")
    assert loaded.config.family == "qwen3_5_moe" and loaded.config.linear_attention is not None
    assert max_logit_error(full, hf) < 1e-4


START = """
import sys
from freetoken.config import EngineConfig, MoEOptions
from freetoken.engine.generate import LLMEngine
from freetoken.engine.sampling import SamplingParams
engine = LLMEngine.from_config(EngineConfig(model=sys.argv[1], device="cpu", dtype="float32",
                                            kv_cache_tokens=256, moe=MoEOptions("fused")))
prompt = engine.tokenizer.encode("Hi there, " * 40)
first = engine.add_request(prompt, SamplingParams(max_new_tokens=3))
assert engine.step()  # the first token (the request still runs: the engine is not idle)
print(sorted(m for m in ("torch._dynamo", "transformers") if m in sys.modules))
while not first.finished:
    engine.step()
# a prompt after a cached prefix: fewer queries than keys, causal from the bottom right
second = engine.add_request(prompt + first.output_ids + prompt[:9],
                            SamplingParams(max_new_tokens=2))
while not second.finished:
    engine.step()
assert second.cached_tokens > 0, second.cached_tokens
print(sorted(m for m in ("torch._dynamo", "transformers") if m in sys.modules))
"""


@pytest.mark.parametrize("weight_dir", [False, True], ids=["safetensors", "weight directory"])
def test_a_start_to_the_first_token_imports_neither_dynamo_nor_transformers(tmp_path, weight_dir):
    """Each is seconds of a start (torch._dynamo came in through the meta device's reference
    ops: nn.Embedding's random init, the RoPE table; transformers through the tokenizer), nor
    does a prompt after a cached prefix (torch._dynamo came in with SDPA's lower-right causal
    mask, torch.nn.attention.bias)."""
    import subprocess
    import sys

    from tiny_models import build_chat_model

    path = build_chat_model("qwen3_moe", tmp_path / "src")[0]
    if weight_dir:
        loader.convert_checkpoint(path, tmp_path / "dst", progress=False)
        path = tmp_path / "dst"
    out = subprocess.run(
        [sys.executable, "-c", START, str(path)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-2:] == ["[]", "[]"]
