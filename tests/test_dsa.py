"""DeepSeek Sparse Attention (layers/mla.py's indexer; DeepSeek-V3.2, GLM-5): with prompts
longer than the indexer's top-k, the logits match transformers in chunked prefill, after a
reused prefix (pages shared as the radix cache shares them) and with sequences side by side in
prefill and decode; the index keys live in the latent's page slots; the selection is real
(reading every earlier token instead gives other logits)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freetoken.engine.runner import ModelRunner, kv_bytes_per_token
from freetoken.models.loading import load_model
from test_exactness import reference_logits
from tiny_models import FAMILIES, build

DSA_FAMILIES = ["deepseek_v32", "glm_moe_dsa"]
TOL = 1e-4


@pytest.fixture(scope="module", params=DSA_FAMILIES)
def model(request, tmp_path_factory):
    path, hf = build(request.param, tmp_path_factory.mktemp(request.param) / "m")
    return load_model(path, dtype="float32"), hf


def prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 160, (n,), generator=gen).tolist()


def decode(runner, seq, ids, logits, hf, steps=6) -> float:
    worst = 0.0
    for _ in range(steps):
        ids.append(int(logits[-1].argmax()))
        logits = runner.forward([seq], [[ids[-1]]])
        worst = max(worst, (logits - reference_logits(hf, ids)[-1:]).abs().max().item())
    return worst


def test_the_index_keys_share_the_latents_page_slots(model):
    loaded, hf = model
    cfg = loaded.config
    mla, extra = cfg.mla, hf.config
    assert mla.indexer.topk == extra.index_topk < 40
    runner = ModelRunner(loaded, kv_cache_tokens=128, page_size=8)
    width = mla.kv_lora_rank + mla.qk_rope_head_dim + extra.index_head_dim
    assert runner.kv.v is runner.kv.k and all(p.shape[1:] == (1, width) for p in runner.kv.k)
    assert kv_bytes_per_token(cfg, torch.float32) == cfg.num_layers * width * 4
    full = getattr(extra, "indexer_types", None) or ["full"] * cfg.num_layers
    assert mla.indexer.full == tuple(t == "full" for t in full)
    kept = [hasattr(layer.attn, "indexer") for layer in loaded.model.layers]
    assert kept == list(mla.indexer.full)


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_and_decode_match_transformers(model, chunk):
    loaded, hf = model
    runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=8)
    ids, seq = prompt(45, 3), runner.new_sequence()
    logits = torch.cat(
        [
            runner.forward([seq], [ids[i : i + chunk]], all_logits=True)
            for i in range(0, len(ids), chunk)
        ]
    )
    assert (logits - reference_logits(hf, ids)).abs().max().item() < TOL
    assert decode(runner, seq, ids, logits, hf) < TOL


def test_a_prompt_scored_a_few_queries_at_a_time_matches_transformers(model, monkeypatch):
    """A long chunk's index scores go a block of queries at a time (`SCORE_ELEMENTS`)."""
    import freetoken.layers.mla as mla

    loaded, hf = model
    monkeypatch.setattr(mla, "SCORE_ELEMENTS", 32 * 45 * 3)  # blocks of 3 queries or fewer
    runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=8)
    ids = prompt(45, 9)
    logits = runner.forward([runner.new_sequence()], [ids], all_logits=True)
    assert (logits - reference_logits(hf, ids)).abs().max().item() < TOL


def test_a_reused_prefix_matches_transformers(model):
    """A second sequence starts on the first one's full pages (as the radix prefix cache
    hands them over) and prefills only its own suffix, whose queries choose among the shared
    index keys too."""
    loaded, hf = model
    runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=8)
    first = prompt(30, 4)
    a = runner.new_sequence()
    runner.forward([a], [first])
    b = runner.new_sequence()
    b.pages, b.length = list(a.pages[:3]), 24  # its first 24 tokens are a's
    ids = first[:24] + prompt(19, 5)
    logits = runner.forward([b], [ids[24:]], all_logits=True)
    assert (logits - reference_logits(hf, ids)[24:]).abs().max().item() < TOL
    assert decode(runner, b, ids, logits, hf) < TOL


def test_sequences_side_by_side_match_transformers(model):
    """Two sequences of different lengths in one prefill, then in one decode batch (each
    reading its own top-k slots from its page-table row)."""
    loaded, hf = model
    runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=8)
    ids = [prompt(41, 6), prompt(13, 7)]
    seqs = [runner.new_sequence(), runner.new_sequence()]
    logits = runner.forward(seqs, ids, all_logits=True)
    want = torch.cat([reference_logits(hf, p) for p in ids])
    assert (logits - want).abs().max().item() < TOL
    last = torch.stack([logits[40], logits[-1]])
    for _ in range(5):
        for p, row in zip(ids, last, strict=True):
            p.append(int(row.argmax()))
        last = runner.forward(seqs, [[p[-1]] for p in ids])
        want = torch.cat([reference_logits(hf, p)[-1:] for p in ids])
        assert (last - want).abs().max().item() < TOL


def test_the_selection_is_exercised(model):
    """Each query reading all its earlier tokens (a top-k past the prompt) departs from
    transformers: the sparse choice, not the dense attention, is what matches."""
    loaded, hf = model
    ids = prompt(40, 8)
    indexers = [
        layer.attn.indexer for layer in loaded.model.layers if hasattr(layer.attn, "indexer")
    ]
    saved = indexers[0].idx
    try:
        for indexer in indexers:
            indexer.idx = dataclasses.replace(saved, topk=10**6)
        runner = ModelRunner(loaded, kv_cache_tokens=128, page_size=8)
        dense = runner.forward([runner.new_sequence()], [ids], all_logits=True)
    finally:
        for indexer in indexers:
            indexer.idx = saved
    assert (dense - reference_logits(hf, ids)).abs().max().item() > 100 * TOL


def test_the_families_are_registered():
    assert set(DSA_FAMILIES) <= set(FAMILIES)


def test_an_fp8_release_layout_equals_its_dequantized_copy(model, tmp_path):
    """FP8 with block scales (V3.2's and GLM-5's FP8 releases), the indexer's projections
    quantized too: the same logits as the dequantized weights, the experts kept fp8. (NVFP4,
    GLM-5's other release, needs inputs in multiples of 16, which q_lora_rank 24 is not.)"""
    fmt = "fp8"
    from test_quantized import logits, quantized_pair

    quantized, plain = quantized_pair(model[0].path, tmp_path, fmt)
    store = load_model(quantized, dtype="float32").experts
    assert store.format.name == fmt  # (the experts kept as stored)
    assert (logits(quantized) - logits(plain)).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "keys",
    [
        {},
        {"index_topk_freq": 3},
        {"index_topk_freq": 4, "index_skip_topk_offset": 5},
        {"index_topk_pattern": "FSSFFS"},
    ],
)
def test_glm_indexer_layers_as_transformers_derives_them(keys):
    """GLM-5's full and shared layers from `index_topk_freq` / `index_skip_topk_offset` or a
    pattern, as GlmMoeDsaConfig derives `indexer_types`."""
    import transformers

    from freetoken.models.families.glm_moe_dsa import indexer_layers

    theirs = transformers.GlmMoeDsaConfig(num_hidden_layers=6, **keys).indexer_types
    assert indexer_layers({"num_hidden_layers": 6, **keys}) == tuple(t == "full" for t in theirs)
    assert indexer_layers({"num_hidden_layers": 6, "indexer_types": theirs}) == tuple(
        t == "full" for t in theirs
    )
