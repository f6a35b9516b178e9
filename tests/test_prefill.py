"""Streamed prefill (moe/prefill.py) with the cache tier on the CPU: the same logits as the
unstreamed path for every chunk size, the device-to-device path for cached experts, and a warm
decode cache afterwards."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import MoEOptions
from freetoken.engine.runner import ModelRunner
from freetoken.models.loading import load_model
from tiny_models import build

PROMPT = 40


# (gpt-oss: a bias bank; MiniMax-M2: sigmoid routing; Kimi-K2.6: MLA, leading dense layers;
# GLM-5: sparse attention, chunks of one token taking its decode path; Gemma-4: experts that
# read the residual stream, a dense MLP beside them)
@pytest.fixture(
    scope="module",
    params=["qwen3_moe", "gpt_oss", "minimax_m2", "kimi_k25", "glm_moe_dsa", "gemma4"],
)
def loaded(request, tmp_path_factory):
    path, _ = build(request.param, tmp_path_factory.mktemp("m") / "m")
    return load_model(path, dtype="float32")


def prompt_ids(loaded):
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, loaded.config.vocab_size, (PROMPT,), generator=gen).tolist()


def prefill_then_decode(loaded, options: MoEOptions, chunk: int, steps: int = 4, overlap=True):
    """Prefill in chunks of `chunk` tokens, then greedy decode; all logits, and the runner."""
    runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=8, moe=options)
    if runner.moe.streamer is not None:
        runner.moe.streamer.overlap = overlap
    seq, ids = runner.new_sequence(), prompt_ids(loaded)
    logits = [
        runner.forward([seq], [ids[i : i + chunk]], all_logits=True)
        for i in range(0, len(ids), chunk)
    ]
    for _ in range(steps):
        logits.append(runner.forward([seq], [[int(logits[-1][-1].argmax())]], all_logits=True))
    return torch.cat(logits), runner


@pytest.mark.parametrize("chunk", [1, 7, 64, PROMPT])
@pytest.mark.parametrize("room", [True, False], ids=["two-buffers", "no-room"])
def test_streamed_prefill_equals_unstreamed(loaded, chunk, room):
    reference, _ = prefill_then_decode(loaded, MoEOptions("fused"), chunk)
    threshold = 1 if room else None  # every chunk streams; or streaming is off (fallback)
    options = MoEOptions("hybrid", "5", prefill_stream_threshold=threshold)
    logits, runner = prefill_then_decode(loaded, options, chunk)
    assert (logits - reference).abs().max().item() < 1e-5
    streamer = runner.moe.streamer
    if room:
        chunks = -(-PROMPT // chunk)
        assert streamer.counters.chunks == chunks + 4  # the decode steps stream too (T >= 1)
    else:
        assert streamer is None


def test_cached_experts_come_device_to_device(loaded):
    # (a cold cache: the counts below are those of an empty one)
    options = MoEOptions("hybrid", "12", prefill_stream_threshold=8, warm_cache=False)
    runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=8, moe=options)
    store, streamer = runner.moe.store, runner.moe.streamer
    seq, ids = runner.new_sequence(), prompt_ids(loaded)
    runner.forward([seq], [ids[:16]])
    first = dict(streamer.counters.history[-1])
    layer_bytes = store.num_layers * store.num_experts * store.shape.nbytes
    # The cache starts empty: every expert of every layer crosses "PCIe"; the last token's
    # experts are then copied device to device into the decode cache.
    assert first["bytes_h2d"] == layer_bytes
    assert first["bytes_d2d"] > 0
    warmed = runner.moe.cache.slot_of.ge(0).sum().item()
    assert 0 < warmed <= 12
    runner.forward([seq], [ids[16:32]])
    second = streamer.counters.history[-1]
    # Experts now in the cache are copied on the device, the rest over PCIe.
    assert second["bytes_d2d"] >= warmed * store.shape.nbytes
    assert second["bytes_h2d"] < layer_bytes
    assert streamer.counters.tokens == 32


def test_last_token_experts_stay_in_the_decode_cache(loaded):
    options = MoEOptions("offload", "24", prefill_stream_threshold=4)  # room for all 16 pairs
    runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=8, moe=options)
    routed: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(runner.model.layers):
        if hasattr(layer, "moe"):
            layer.moe.router.register_forward_hook(
                lambda m, inp, out, i=i: routed.__setitem__(i, out[-1].topk(2).indices)
            )
    runner.forward([runner.new_sequence()], [prompt_ids(loaded)])
    cache, e = runner.moe.cache, runner.moe.store.num_experts
    for moe_layer, model_layer in enumerate(loaded.config.moe_layer_ids):
        for expert in routed[model_layer].tolist():
            assert cache.slot_of[moe_layer * e + expert] >= 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("chunk", [7, PROMPT])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
def test_streamed_prefill_on_cuda_matches_fused(tmp_path, chunk, overlap):
    """The copy stream and its events order the buffers correctly on a real device."""
    path, _ = build("qwen3_moe", tmp_path / "m")
    loaded = load_model(path, dtype="float32", device="cuda")
    reference, _ = prefill_then_decode(loaded, MoEOptions("fused"), chunk)
    options = MoEOptions("hybrid", "5", prefill_stream_threshold=4)
    logits, runner = prefill_then_decode(loaded, options, chunk, overlap=overlap)
    assert (logits - reference).abs().max().item() < 1e-5
    assert runner.moe.streamer.counters.chunks >= 1
