"""DeepSeek-V4 beyond the common exactness test: chunked prefill and prefix reuse are exact
(every compressor's state lives in the cache's rows), the Lightning Indexer's choice matters,
the released checkpoint's tensor names map, unsupported configs are refused."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.runner import ModelRunner
from freetoken.errors import UnsupportedModelError
from freetoken.models.families import family_for
from freetoken.models.loading import load_model
from tiny_models import build

PROMPT = 45  # crosses the window (8), 11 CSA windows (4; the indexer keeps 3), 5 HCA ones (8)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    path, hf = build("deepseek_v4", tmp_path_factory.mktemp("v4") / "m")
    return load_model(path, dtype="float32"), hf


def prompt(n=PROMPT, seed=3):
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunked_prefill_matches_one_pass(v4):
    loaded, hf = v4
    ids = prompt()
    whole = ModelRunner(loaded, kv_cache_tokens=256, page_size=8)
    ref = whole.forward([whole.new_sequence()], [ids], all_logits=True)
    with torch.no_grad():
        assert (ref - hf(torch.tensor([ids])).logits[0]).abs().max().item() < 1e-4
    for chunk in (1, 3, 7, 16):
        runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=8)
        seq = runner.new_sequence()
        parts = [
            runner.forward([seq], [ids[i : i + chunk]], all_logits=True)
            for i in range(0, len(ids), chunk)
        ]
        assert (torch.cat(parts) - ref).abs().max().item() < 1e-5, chunk


def test_prefix_reuse_is_exact(v4):
    """A sequence continuing from another's cached pages (as the radix cache hands them over,
    whole pages) decodes as a cold run: the windows straddling the shared boundary pool from
    the shared rows."""
    loaded, _ = v4
    page = 8
    first, second = prompt(), prompt()[:29] + prompt(20, seed=4)
    runner = ModelRunner(loaded, kv_cache_tokens=512, page_size=page)
    a = runner.new_sequence()
    runner.forward([a], [first])
    b = runner.new_sequence()
    shared = 3  # pages: 24 tokens, in the middle of an HCA window and after a CSA one
    b.pages, b.length = list(a.pages[:shared]), shared * page
    resumed = runner.forward([b], [second[shared * page :]], all_logits=True)
    cold_runner = ModelRunner(loaded, kv_cache_tokens=512, page_size=page)
    cold = cold_runner.forward([cold_runner.new_sequence()], [second], all_logits=True)
    assert (resumed - cold[shared * page :]).abs().max().item() < 1e-5


def test_indexer_choice_matters(v4):
    """With more windows closed than the indexer keeps, keeping them all changes the logits:
    the sparse selection is really exercised by the tests' prompts."""
    loaded, _ = v4
    ids = prompt()
    runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=8)
    sparse = runner.forward([runner.new_sequence()], [ids], all_logits=True)
    indexers = [
        layer.attn.indexer for layer in loaded.model.layers if hasattr(layer.attn, "indexer")
    ]
    assert indexers and all(ix.topk < PROMPT // 4 for ix in indexers)
    try:
        for ix in indexers:
            ix.topk = 1000
        dense = runner.forward([runner.new_sequence()], [ids], all_logits=True)
    finally:
        for ix in indexers:
            ix.topk = 3
    assert (dense - sparse).abs().max().item() > 1e-3


def test_released_tensor_names():
    family = family_for({"architectures": ["DeepseekV4ForCausalLM"]})
    names = {
        "embed.weight": "embed.weight",
        "head.weight": "lm_head.weight",
        "norm.weight": "norm.weight",
        "hc_head_fn": "hc_head.fn",
        "layers.0.attn_norm.weight": "layers.0.attn_norm.weight",
        "layers.0.ffn_norm.weight": "layers.0.mlp_norm.weight",
        "layers.0.hc_attn_fn": "layers.0.attn_hc.fn",
        "layers.0.hc_ffn_scale": "layers.0.ffn_hc.scale",
        "layers.0.attn.attn_sink": "layers.0.attn.sinks",
        "layers.0.attn.q_norm.weight": "layers.0.attn.q_a_norm.weight",
        "layers.0.attn.kv_norm.weight": "layers.0.attn.kv_norm.weight",
        "layers.0.attn.norm.weight": "layers.0.attn.kv_norm.weight",  # (transformers' save)
        "layers.0.attn.wo_a.weight": "layers.0.attn.wo_a.weight",
        "layers.2.attn.compressor.ape": "layers.2.attn.compressor.ape",
        "layers.2.attn.compressor.norm.weight": "layers.2.attn.compressor.norm.weight",
        "layers.2.attn.indexer.compressor.wgate.weight": "layers.2.attn.indexer.wgate.weight",
        "layers.2.attn.indexer.wq_b.weight": "layers.2.attn.indexer.wq_b.weight",
        "layers.0.ffn.gate.tid2eid": "layers.0.moe.tid2eid",
        "layers.5.ffn.gate.bias": "layers.5.moe.correction_bias",
        "layers.5.ffn.gate.weight": "layers.5.moe.router.weight",
        "layers.5.ffn.experts.7.w1.weight": "layers.5.moe.experts.7.gate_proj.weight",
        "layers.5.ffn.experts.7.w2.weight": "layers.5.moe.experts.7.down_proj.weight",
        "layers.5.ffn.shared_experts.w3.weight": "layers.5.moe.shared.up_proj.weight",
        # (transformers' save_pretrained keeps a `model.` prefix)
        "model.layers.1.attn.wq_a.weight": "layers.1.attn.wq_a.weight",
        "model.embed_tokens.weight": "embed.weight",
        "model.hc_head.hc_base": "hc_head.base",
    }
    for stored, ours in names.items():
        assert family.canonical_name(stored) == ours, stored
    assert family.canonical_name("mtp.0.attn.wq_a.weight") is None  # (not read)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"swiglu_limit": 7.0}, "swiglu_limit"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    raw = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 1, **change}
    family = family_for(raw)
    with pytest.raises(UnsupportedModelError, match=message):
        family.parse_config(raw)


def test_batched_decode_matches_transformers(v4):
    """Sequences of different lengths decoding together (the fixed-shape decode path) give
    each one's transformers logits."""
    loaded, hf = v4
    runner = ModelRunner(loaded, kv_cache_tokens=512, page_size=8)
    prompts = [prompt(n, seed=n) for n in (5, 33, 45)]
    seqs = [runner.new_sequence() for _ in prompts]
    logits = runner.forward(seqs, prompts)
    ids = [list(p) for p in prompts]
    worst = 0.0
    for _ in range(10):
        for i, row in enumerate(logits):
            ids[i].append(int(row.argmax()))
        logits = runner.forward(seqs, [[s[-1]] for s in ids])
        with torch.no_grad():
            ref = torch.cat([hf(torch.tensor([s])).logits[0, -1:] for s in ids])
        worst = max(worst, (logits - ref).abs().max().item())
    assert worst < 1e-4


def test_engine_reuses_a_prefix_and_chunks_prompts_exactly(tmp_path, monkeypatch):
    """Through the engine: turn 2 of a conversation resumes from turn 1's cached pages (the
    radix cache), in prefill chunks of 24 tokens, and answers as a cold, unchunked run."""
    from freetoken.config import EngineConfig
    from freetoken.engine.generate import LLMEngine
    from freetoken.engine.sampling import SamplingParams
    from tiny_models import build_chat_model

    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = build_chat_model("deepseek_v4", tmp_path / "m")

    def engine(chunk):
        return LLMEngine.from_config(
            EngineConfig(
                model=path,
                device="cpu",
                dtype="float32",
                kv_cache_tokens=2048,
                page_size=4,
                max_prefill_chunk=chunk,
            )
        )

    greedy = SamplingParams(max_new_tokens=8, temperature=0)
    warm = engine(24)
    tok = warm.tokenizer
    first = [{"role": "user", "content": "Tell me a story about a compressor " * 4}]
    [one] = warm.generate([tok.encode(tok.render_chat(first))], greedy)
    history = [
        *first,
        {"role": "assistant", "content": one.text},
        {"role": "user", "content": "And then?"},
    ]
    turn2 = tok.encode(tok.render_chat(history))
    req = warm.add_request(turn2, greedy)
    while not req.finished:
        warm.step()
    assert req.cached_tokens > 20
    [cold] = engine(8192).generate([turn2], greedy)
    assert req.output_ids == cold.output_ids


def test_the_next_token_prediction_layer_is_skipped_with_a_note(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    path, _ = build("deepseek_v4", tmp_path / "m")
    plain = load_model(path, dtype="float32")
    tensors = load_file(path / "model.safetensors")
    tensors["mtp.0.attn.wq_a.weight"] = torch.ones(24, 64)  # (as the release stores it)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        with_mtp = load_model(path, dtype="float32")
    assert "mtp.0.attn.wq_a.weight" in caplog.text
    ids = prompt(12)
    a, b = (ModelRunner(m, kv_cache_tokens=64, page_size=8) for m in (plain, with_mtp))
    assert torch.equal(a.forward([a.new_sequence()], [ids]), b.forward([b.new_sequence()], [ids]))


LEGACY = dict(  # the spellings older V4 configs ship (transformers folds them in)
    num_hidden_layers=6,
    compress_ratios=[0, 0, 4, 128, 4, 128, 4],
    num_hash_layers=2,
    qk_rope_head_dim=64,
    rope_scaling=dict(type="yarn", factor=16.0, original_max_position_embeddings=65536),
    max_position_embeddings=1048576,
)
MODERN = dict(
    num_hidden_layers=5,
    compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 16},
    layer_types=[
        "sliding_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "sliding_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["moe", "hash_moe", "moe", "moe", "hash_moe"],
    partial_rotary_factor=0.25,
    rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=4096, beta_fast=16.0
    ),
    compress_rope_theta=40000.0,
    rope_theta=20000.0,
)


@pytest.mark.parametrize("raw", [LEGACY, MODERN, dict(num_hidden_layers=7)], ids=str)
def test_configs_read_as_transformers_reads_them(raw):
    """Layer kinds, hash layers, ratios, the RoPE head width and both RoPE tables (YaRN's
    included) as transformers' DeepseekV4Config and rotary embedding give them."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from freetoken.layers.rope import RotaryEmbedding

    hf = DeepseekV4Config(**raw)
    cfg = family_for({"architectures": ["DeepseekV4ForCausalLM"]}).parse_config(
        {"architectures": ["DeepseekV4ForCausalLM"], **raw}
    )
    c = cfg.compressed
    assert c.layer_kinds == tuple(hf.layer_types)
    assert c.hash_layers == tuple(t == "hash_moe" for t in hf.mlp_layer_types)
    rates = hf.compress_rates
    assert c.csa_ratio == rates["compressed_sparse_attention"]
    assert c.hca_ratio == rates["heavily_compressed_attention"]
    assert c.rope_dim == hf.qk_rope_head_dim and cfg.head_dim == hf.head_dim
    theirs = DeepseekV4RotaryEmbedding(hf)
    for ours, kind in (
        (RotaryEmbedding(cfg.rope, cfg.head_dim), "main"),
        (RotaryEmbedding(c.compress_rope, cfg.head_dim), "compress"),
    ):
        torch.testing.assert_close(ours.inv_freq, getattr(theirs, f"{kind}_inv_freq"))
        assert ours.scaling == getattr(theirs, f"{kind}_attention_scaling")


def test_bf16_prefill_rounds_as_transformers(tmp_path):
    """In bf16 on the CPU our logits are transformers' bf16 logits (equal here; the bound is a
    thousandth of the two runs' distance from the fp32 truth, ~0.7)."""
    from transformers import DeepseekV4ForCausalLM

    path, _ = build("deepseek_v4", tmp_path / "m", dtype=torch.bfloat16)
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    runner = ModelRunner(load_model(path, dtype="bfloat16"), kv_cache_tokens=256, page_size=8)
    ids = prompt()
    ours = runner.forward([runner.new_sequence()], [ids], all_logits=True).float()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - theirs).abs().max().item() < 1e-3


def test_decode_in_capture_shapes_is_exact(v4, monkeypatch):
    """The decode step as a CUDA graph would capture it (every window the page table can hold,
    128 CSA windows here, whatever the length) gives the eager step's logits (the batch's
    longest sequence's windows, in steps of 64)."""
    from freetoken.layers import compressed_attention

    loaded, _ = v4
    prompts = [prompt(n, seed=n) for n in (6, 45)]

    def decode(capturing):
        monkeypatch.setattr(compressed_attention, "_capturing", lambda x: capturing)
        runner = ModelRunner(loaded, kv_cache_tokens=512, page_size=8)
        seqs = [runner.new_sequence() for _ in prompts]
        logits, steps = runner.forward(seqs, prompts), []
        for _ in range(6):
            logits = runner.forward(seqs, [[int(t)] for t in logits.argmax(-1)])
            steps.append(logits)
        return torch.stack(steps)

    assert (decode(True) - decode(False)).abs().max().item() < 1e-5


def test_the_quantized_release_layout_computes_as_its_dequantized_copy(tmp_path):
    """DeepSeek-V4's release as published: FP8 attention and shared experts in e8m0-scaled
    blocks and FP4 routed experts with an e8m0 scale per 32 values, under DeepSeek's `X.scale`
    names: the routed experts stay quantized (MXFP4's values), and every strategy computes what
    the dequantized copy computes, over a prompt and paged decode."""
    from safetensors.torch import load_file

    from freetoken.config import MoEOptions
    from test_quantized import V4_RELEASE, encoded_copies, fp4_rows, fp8_e8m0_blocks, write_variants

    def encoder(name):
        if ".ffn.experts." in name and name.endswith(".weight"):
            return fp4_rows
        if name.endswith(".weight") and (".attn.w" in name or ".shared_experts." in name):
            return fp8_e8m0_blocks
        return None

    path, _ = build("deepseek_v4", tmp_path / "src")
    stored, plain = encoded_copies(load_file(path / "model.safetensors"), encoder)
    variants = {"quantized": (stored, V4_RELEASE), "plain": (plain, {})}
    dirs = dict(zip(variants, write_variants(path, tmp_path, variants), strict=True))

    def run(label, moe=None):
        loaded = load_model(dirs[label], dtype="float32")
        runner = ModelRunner(loaded, kv_cache_tokens=128, page_size=8, moe=moe)
        seq = runner.new_sequence()
        out = [runner.forward([seq], [prompt(20)], all_logits=True)]
        for token in (5, 17, 40):
            out.append(runner.forward([seq], [[token]]))
        return loaded, torch.cat(out)

    loaded, got = run("quantized")
    assert loaded.experts.format.name == "mxfp4"
    _, want = run("plain")
    assert (got - want).abs().max().item() < 1e-5
    for moe in (MoEOptions("cpu"), MoEOptions("hybrid", "5")):
        assert (run("quantized", moe)[1] - want).abs().max().item() < 1e-5, moe
