"""Decode steps replayed from CUDA graphs (engine/cuda_graphs.py) give the eager logits, for
every MoE strategy (graphs cut at host-driven experts), and one capture per batch size serves
every context length (attention reads lengths and page tables on the device)."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import MoEOptions
from freetoken.engine.runner import ModelRunner
from freetoken.layers import concurrent
from freetoken.models.loading import load_model
from tiny_models import build

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def decode_logits(loaded, prompts, steps, **runner_args):
    runner = ModelRunner(loaded, kv_cache_tokens=2048, page_size=8, **runner_args)
    seqs = [runner.new_sequence() for _ in prompts]
    last = runner.forward(seqs, prompts)
    out = []
    for _ in range(steps):
        last = runner.forward(seqs, [[int(t)] for t in last.argmax(-1)])
        out.append(last)
    return torch.stack(out), runner


def prompts_of(loaded, lengths):
    gen = torch.Generator().manual_seed(3)
    vocab = loaded.config.vocab_size
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@needs_cuda
@pytest.mark.parametrize(
    "options",
    [
        MoEOptions("fused"),
        MoEOptions("offload", "6"),
        MoEOptions("hybrid", "6"),
        MoEOptions("hybrid", "100000"),  # the whole pool: no layer rings the CPU
        MoEOptions("cpu"),
        MoEOptions("static", "6"),
        # fills a layer ahead on a side stream, forked and joined inside the graph
        MoEOptions("offload", "6", prefetch_experts=2),
        MoEOptions("hybrid", "6", prefetch_experts=2),
    ],
    ids=lambda o: f"{o.strategy}-{o.cache_size}" + "-prefetch" * bool(o.prefetch_experts),
)
def test_graph_replay_equals_eager(tmp_path, options):
    path, _ = build("qwen3_moe", tmp_path / "m")
    loaded = load_model(path, dtype="float32", device="cuda")
    prompts = prompts_of(loaded, [5, 17, 11])
    eager, _ = decode_logits(loaded, prompts, 10, moe=options, cuda_graphs=False)
    graphed, runner = decode_logits(loaded, prompts, 10, moe=options, cuda_graphs=True)
    assert runner.graphs.replays >= 8  # captured on the second step, replayed after
    assert (eager - graphed).abs().max().item() < 1e-5
    segments = len(next(iter(runner.graphs.captures.values())).graphs)
    moe_layers = loaded.config.num_moe_layers
    # fused, and offload deciding on the device, are one graph; the others cut at every layer
    whole = options.strategy == "fused" or runner.moe.control is not None
    assert segments == (1 if whole else moe_layers + 1)
    if options.prefetch_experts:
        assert runner.moe.telemetry.total().prefetches > 0


def verify_logits(loaded, prompts, drafts, steps, **runner_args):
    """Each step feeds every sequence its last token and `drafts[b]` more (a verify step of
    speculative decoding: every token's logits), then keeps the first of them, as a rejected
    draft does (its KV cut back)."""
    runner = ModelRunner(loaded, kv_cache_tokens=2048, page_size=8, **runner_args)
    seqs = [runner.new_sequence() for _ in prompts]
    last = runner.forward(seqs, prompts).argmax(-1).tolist()
    out = []
    for step in range(steps):
        chunks = [
            [t] + [(t + step + i) % 50 for i in range(n)] for t, n in zip(last, drafts, strict=True)
        ]
        starts = [seq.length for seq in seqs]
        logits = runner.forward(seqs, chunks, all_logits=True)
        for seq, start in zip(seqs, starts, strict=True):
            seq.length = start + 1  # only the fed token kept
        firsts = [sum(map(len, chunks[:b])) for b in range(len(chunks))]
        last = [int(logits[i].argmax()) for i in firsts]
        out.append(logits)
    return torch.stack(out), runner


@needs_cuda
@pytest.mark.parametrize(
    "options",
    [None, MoEOptions("fused"), MoEOptions("hybrid", "6")],
    ids=lambda o: str(o and o.strategy),
)
def test_verify_steps_replay_from_graphs(tmp_path, options):
    """Verify steps (a few tokens per sequence, every token's logits) are captured per
    (tokens, sequences): attention takes each token as a sequence of its own, its row and
    length read on the device, so the replays give the eager logits as the contexts grow and
    the drafts are cut back."""
    path, _ = build("qwen3" if options is None else "qwen3_moe", tmp_path / "m")
    loaded = load_model(path, dtype="float32", device="cuda")
    prompts = prompts_of(loaded, [5, 17])
    for drafts in ([3], [2, 4]):
        args = dict(moe=options) if options else {}
        eager, _ = verify_logits(
            loaded, prompts[: len(drafts)], drafts, 12, cuda_graphs=False, **args
        )
        graphed, runner = verify_logits(loaded, prompts[: len(drafts)], drafts, 12, **args)
        tokens = len(drafts) + sum(drafts)
        assert (tokens, len(drafts), True) in runner.graphs.captures
        assert runner.graphs.replays >= 10 and runner.untimed == 2  # (first seen, captured)
        assert (eager - graphed).abs().max().item() < 1e-4


@needs_cuda
def test_one_capture_serves_every_length_and_dense_models(tmp_path):
    path, _ = build("qwen3", tmp_path / "m")
    loaded = load_model(path, dtype="float32", device="cuda")
    prompts = prompts_of(loaded, [250, 3])  # decode crosses many pages of both sequences
    eager, _ = decode_logits(loaded, prompts, 40, cuda_graphs=False)
    graphed, runner = decode_logits(loaded, prompts, 40, cuda_graphs=True)
    assert (eager - graphed).abs().max().item() < 1e-4
    assert list(runner.graphs.captures) == [(2, 2, False)] and runner.graphs.replays == 39


def test_a_capture_without_memory_falls_back_to_eager(monkeypatch):
    """Out of device memory while capturing: that shape runs eagerly from then on (no retry,
    no failed request)."""
    from freetoken.engine.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs(model=None, kv=None)
    tries = []

    def no_memory(batch, all_logits):
        tries.append(batch)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(graphs, "_capture", no_memory)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    batch = type("Batch", (), {})()
    monkeypatch.setattr(DecodeGraphs, "key", staticmethod(lambda b, all_logits=False: (1,)))
    assert [graphs.run(batch) for _ in range(4)] == [None] * 4  # warm-up, then eager
    assert len(tries) == 1 and graphs.eager == {(1,)}


def test_state_slots_travel_in_the_packed_buffer(tmp_path):
    """Linear-attention layers read each sequence's state slot from the batch's packed buffer:
    a decode graph's static copy of it takes the next step's slots (another set of sequences)
    with the rest of the step's values."""
    from freetoken.kv.batch import ForwardBatch

    path, _ = build("qwen3_next", tmp_path / "m")
    runner = ModelRunner(load_model(path, dtype="float32"), kv_cache_tokens=256, page_size=8)
    first = [runner.new_sequence() for _ in range(3)]
    batch = ForwardBatch.build(runner.kv, first, [[1], [2], [3]], runner.device)
    assert batch.state_slots.tolist() == [s.state_slot for s in first]
    assert batch.state_slots.data_ptr() >= batch.packed.data_ptr()  # a view of it
    static = batch.views_of(batch.packed.clone())
    spare = runner.new_sequence()  # (so that the next sequences take other slots)
    others = [runner.new_sequence() for _ in range(3)]
    step = ForwardBatch.build(runner.kv, others, [[4], [5], [6]], runner.device)
    static.packed.copy_(step.packed)  # what a replay does
    assert static.state_slots.tolist() == [s.state_slot for s in others]
    assert static.state_slots.tolist() != batch.state_slots.tolist()
    assert spare.state_slot not in static.state_slots.tolist()


@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "kimi_linear"])
@pytest.mark.parametrize(
    "options", [MoEOptions("fused"), MoEOptions("hybrid", "6")], ids=lambda o: o.strategy
)
def test_linear_attention_models_decode_in_graphs(tmp_path, family, options):
    """Gated DeltaNet (and KDA) layers gather and scatter their sequences' states inside the
    graph: the replayed steps give the eager logits, for new sequences (other state slots) too."""
    # (Kimi-Linear's latent layers cache a RoPE part though they turn nothing: of 16, which
    # the kernel takes, as the release's 64)
    overrides = {"qk_rope_head_dim": 16} if family == "kimi_linear" else {}
    path, _ = build(family, tmp_path / "m", **overrides)
    loaded = load_model(path, dtype="float32", device="cuda")
    prompts = prompts_of(loaded, [5, 17, 11])
    eager, _ = decode_logits(loaded, prompts, 10, moe=options, cuda_graphs=False)
    graphed, runner = decode_logits(loaded, prompts, 10, moe=options, cuda_graphs=True)
    assert runner.graphs.replays >= 8
    assert (eager - graphed).abs().max().item() < 1e-5
    # a second set of sequences on the same runner (and captures): other slots
    held = runner.new_sequence()
    seqs = [runner.new_sequence() for _ in prompts]
    assert {s.state_slot for s in seqs} != {0, 1, 2}
    last = runner.forward(seqs, prompts)
    again = []
    for _ in range(10):
        last = runner.forward(seqs, [[int(t)] for t in last.argmax(-1)])
        again.append(last)
    assert (torch.stack(again) - eager).abs().max().item() < 1e-5
    runner.release(held)


@needs_cuda
def test_latent_attention_models_decode_in_graphs(tmp_path):
    """DeepSeek-V3's latent heads (the pool read as keys and values) take the Triton decode
    kernel, so its decode steps are captured too and replay the eager logits."""
    # (a RoPE part of 16: the kernel scores a key-only rest of at least 16 values)
    path, _ = build("deepseek_v3", tmp_path / "m", qk_rope_head_dim=16, head_dim=16)
    loaded = load_model(path, dtype="float32", device="cuda")
    prompts = prompts_of(loaded, [5, 17, 11])
    eager, _ = decode_logits(loaded, prompts, 10, cuda_graphs=False)
    graphed, runner = decode_logits(loaded, prompts, 10, cuda_graphs=True)
    assert runner.graphs is not None and runner.graphs.replays >= 8
    assert (eager - graphed).abs().max().item() < 1e-4


@needs_cuda
@pytest.mark.parametrize(
    "options", [MoEOptions("fused"), MoEOptions("hybrid", "6")], ids=lambda o: o.strategy
)
def test_gemma4_decodes_in_graphs_with_its_full_layers_wide_heads(tmp_path, options):
    """Gemma-4's full layers have heads 512 wide (the release's `global_head_dim`), their
    values read from the key projection; the Triton decode kernel takes them, so its decode
    steps are captured, and replay the eager logits as the sequences cross the sliding
    layers' window (8 here)."""
    path, _ = build("gemma4", tmp_path / "m", global_head_dim=512)
    loaded = load_model(path, dtype="float32", device="cuda")
    assert 512 in loaded.config.kv_layer_dims
    prompts = prompts_of(loaded, [5, 17, 11])
    eager, _ = decode_logits(loaded, prompts, 10, moe=options, cuda_graphs=False)
    graphed, runner = decode_logits(loaded, prompts, 10, moe=options, cuda_graphs=True)
    assert runner.graphs is not None and runner.graphs.replays >= 8
    assert (eager - graphed).abs().max().item() < 1e-4


def test_gemma4_releases_heads_are_taken_by_the_decode_kernel():
    """Every layer of the released Gemma-4 26B-A4B (sliding heads of 256, full ones of 512) has
    heads the Triton decode kernel takes: the condition ModelRunner captures decode graphs on."""
    from freetoken.kernels import paged_attention
    from freetoken.models.families import family_for
    from test_more_families import GEMMA4_26B

    if paged_attention.triton is None:
        pytest.skip("needs triton")
    cfg = family_for(GEMMA4_26B).parse_config(GEMMA4_26B)
    assert set(cfg.kv_layer_dims) == {256, 512}
    assert all(paged_attention.triton_decode_width(d) for d in cfg.kv_layer_dims)


@needs_cuda
@pytest.mark.parametrize(
    "options",
    [
        MoEOptions("fused"),
        MoEOptions("hybrid", "6"),
        MoEOptions("hybrid", "6", prefetch_experts=2),
        # decided on the host: each MoE layer cuts the graph, the shared expert's side branch
        # (layers/concurrent.py) joined before the cut
        MoEOptions("static", "6"),
    ],
    ids=lambda o: o.strategy + "-prefetch" * bool(o.prefetch_experts),
)
@pytest.mark.parametrize("side", [False, True], ids=["in-order", "side-branches"])
def test_compressed_attention_models_decode_in_graphs(tmp_path, options, side, monkeypatch):
    """DeepSeek-V4's attention reads every window of the page-table width it is captured for
    (its shapes fixed, masked past each length), its hyper-connections and hash-routed layer
    run inside the graph: the replayed steps give the eager logits as the sequences cross
    sliding windows, compression boundaries (windows of 4 and 8 here) and a width (pages of
    8: the longest grows from 3 pages to 5). With `side`, the shared expert and the row's
    projections run on a side stream (layers/concurrent.py), forked and joined in the graph."""
    monkeypatch.setattr(concurrent, "ON_GPU", side)
    path, _ = build("deepseek_v4", tmp_path / "m")
    loaded = load_model(path, dtype="float32", device="cuda")
    prompts = prompts_of(loaded, [5, 23, 11])
    eager, _ = decode_logits(loaded, prompts, 12, moe=options, cuda_graphs=False)
    graphed, runner = decode_logits(loaded, prompts, 12, moe=options, cuda_graphs=True)
    assert runner.graphs is not None and runner.graphs.replays >= 8
    assert {key[3] for key in runner.graphs.captures} == {4, 8}
    assert (eager - graphed).abs().max().item() < 1e-4


@needs_cuda
@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("side", [False, True], ids=["in-order", "side-branches"])
def test_sparse_attention_models_decode_in_graphs_per_table_width(
    tmp_path, family, side, monkeypatch
):
    """DSA's indexer gathers its sequences' slots over the page-table columns its capture
    fixes: the graphs are captured per width (a power of two of pages), so a sequence that
    grows past one is captured again, and the replays give the eager logits throughout (with
    `side`, MLA's cache row and the shared expert on a side stream: layers/concurrent.py)."""
    monkeypatch.setattr(concurrent, "ON_GPU", side)
    path, _ = build(family, tmp_path / "m")
    loaded = load_model(path, dtype="float32", device="cuda")
    prompts = prompts_of(loaded, [5, 23, 11])  # pages of 8: the longest grows from 3 to 5
    eager, _ = decode_logits(loaded, prompts, 14, cuda_graphs=False)
    graphed, runner = decode_logits(loaded, prompts, 14, cuda_graphs=True)
    assert runner.graphs is not None and runner.graphs.replays >= 8
    assert {key[3] for key in runner.graphs.captures} == {4, 8}
    assert (eager - graphed).abs().max().item() < 1e-4


def test_a_captured_width_is_the_longest_sequences_pages_to_a_power_of_two():
    from freetoken.kv.batch import ForwardBatch
    from freetoken.kv.paged import KVSequence, PagedKVCache

    # (layers, pages, page size, KV heads, head dim, dtype, device; sequences of at most 40)
    cache = PagedKVCache(1, 64, 4, 1, 8, torch.float32, "cpu", max_seq_tokens=40)
    assert cache.page_table.shape[1] == 10
    widths = []
    for length in (1, 4, 5, 9, 17, 33, 40):
        seq = KVSequence()
        batch = ForwardBatch.build(cache, [seq], [list(range(length))], torch.device("cpu"))
        widths.append(batch.table_pages())
        cache.release(seq)
    assert widths == [1, 1, 2, 4, 8, 10, 10]  # (pages of 4; the table holds 10)
