"""Attention over the paged KV cache (kernels/paged_attention.py).

- The torch path (the CPU path and the reference) against a dense fp64 oracle that walks each
  sequence's pages in Python, on random page layouts, lengths, GQA ratios, windows and sinks,
  for decode batches and prefill chunks.
- The Triton decode kernel against the torch path under Triton's CPU interpreter (in one
  subprocess: TRITON_INTERPRET must be set before triton is imported; skipped without
  triton), and on CUDA when there is one.
- The host's work per batch does not grow with the context.
"""

from __future__ import annotations

import importlib.util
import random
import time

import pytest
import torch

from freetoken.kernels.paged_attention import paged_attention_torch
from freetoken.kv.batch import ForwardBatch
from freetoken.kv.paged import KVSequence, PagedKVCache
from interpreted import run_interpreted

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (dev extras, Linux)"
)


def make_case(
    lengths,
    counts,
    heads,
    kv_heads,
    head_dim=16,
    page_size=4,
    seed=0,
    dtype=torch.float32,
    device="cpu",
):
    """A batch of sequences with `lengths[b]` keys, the last `counts[b]` of them new, their
    pages scattered over the pool; random K/V everywhere and random queries."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in lengths) + 7
    cache = PagedKVCache(1, num_pages, page_size, kv_heads, head_dim, dtype, device)
    every = cache.allocator.alloc(num_pages)
    rng.shuffle(every)
    cache.allocator.free(every)  # the free list in random order
    seqs = []
    for length, count in zip(lengths, counts, strict=True):
        seq = KVSequence()
        cache.reserve(seq, length)
        seq.length = length - count
        seqs.append(seq)
    batch = ForwardBatch.build(cache, seqs, [[1] * n for n in counts], torch.device(device))
    cache.k[0].copy_(torch.randn_like(cache.k[0]))
    cache.v[0].copy_(torch.randn_like(cache.v[0]))
    q = torch.randn(sum(counts), heads, head_dim, dtype=dtype, device=device)
    return q, cache, seqs, batch


def oracle(q, cache, seqs, batch, scale, window=None, sinks=None):
    """Dense attention in fp64, each sequence's keys found by walking its page list."""
    out = torch.empty(q.shape, dtype=torch.float64)
    heads, kv_heads = q.shape[1], cache.k[0].shape[1]
    for b, seq in enumerate(seqs):
        length, count, start = batch.seq_lens[b], batch.counts[b], batch.starts[b]
        slots = [cache.slot(seq, j) for j in range(length)]
        keys = cache.k[0][slots].double().cpu()  # [L, kvh, d]
        values = cache.v[0][slots].double().cpu()
        for i in range(count):
            p = length - count + i
            for h in range(heads):
                kh = h // (heads // kv_heads)
                s = (keys[:, kh] @ q[start + i, h].double().cpu()) * scale
                allowed = torch.arange(length) <= p
                if window is not None:
                    allowed &= torch.arange(length) > p - window
                s = s.masked_fill(~allowed, float("-inf"))
                if sinks is not None:
                    s = torch.cat([s, sinks[h].double().cpu().view(1)])
                w = torch.softmax(s, 0)[:length]
                out[start + i, h] = w @ values[:, kh]
    return out


CASES = [
    # lengths, counts, heads, kv_heads, window, sinks
    ([1, 7, 33], [1, 1, 1], 4, 4, None, False),
    ([5, 64, 130], [1, 1, 1], 8, 2, None, False),  # GQA 4
    ([17, 200], [1, 1], 8, 1, None, False),  # MQA
    ([40, 9], [1, 1], 6, 2, 8, False),  # a window shorter than the context
    ([31, 100], [1, 1], 4, 2, None, True),  # attention sinks
    ([12, 50], [12, 6], 4, 2, None, False),  # a whole prompt and a chunk on a cached prefix
    ([70, 23], [9, 23], 8, 2, 16, True),  # prefill with a window and sinks
]


@pytest.mark.parametrize(("lengths", "counts", "heads", "kv_heads", "window", "sinks"), CASES)
@pytest.mark.parametrize("page_size", [4, 16])
def test_torch_path_matches_the_dense_oracle(
    lengths, counts, heads, kv_heads, window, sinks, page_size
):
    q, cache, seqs, batch = make_case(lengths, counts, heads, kv_heads, page_size=page_size)
    sink = torch.randn(heads) if sinks else None
    scale = 16**-0.5
    ours = paged_attention_torch(q, cache.k[0], cache.v[0], batch, scale, window, sink)
    expected = oracle(q, cache, seqs, batch, scale, window, sink)
    assert (ours.double() - expected).abs().max().item() < 1e-5


needs_native = pytest.mark.skipif(
    __import__("freetoken.kernels.cpu_team", fromlist=["library"]).library() is None,
    reason="no C compiler",
)


@needs_native
@pytest.mark.parametrize(
    ("lengths", "counts", "heads", "kv_heads", "window", "sinks"),
    [c for c in CASES if set(c[1]) == {1}],
)
@pytest.mark.parametrize("page_size", [4, 16])
def test_native_cpu_decode_matches_the_dense_oracle(
    lengths, counts, heads, kv_heads, window, sinks, page_size
):
    from freetoken.kernels.paged_attention import paged_decode_cpu

    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        q, cache, seqs, batch = make_case(
            lengths, counts, heads, kv_heads, page_size=page_size, dtype=dtype
        )
        sink = torch.randn(heads) if sinks else None
        ours = paged_decode_cpu(q, cache.k[0], cache.v[0], batch, 0.25, window, sink)
        assert ours.dtype == dtype
        expected = oracle(q, cache, seqs, batch, 0.25, window, sink)
        # bf16: the result is rounded to bf16 (about 4e-3 of values near 1), as SDPA's is.
        assert (ours.double() - expected).abs().max().item() < tolerance


@needs_native
@pytest.mark.parametrize(("window", "sinks"), [(None, False), (5, True)])
def test_a_few_new_tokens_a_sequence_take_the_decode_kernel_per_token(window, sinks):
    """A verify step (a few new tokens per sequence): each token attends as a sequence of its
    own (`ForwardBatch.per_query`: its sequence's row, its keys up to itself), through the
    decode kernel, and that is causal attention."""
    from freetoken.kernels.paged_attention import paged_attention

    lengths, counts = [9, 30, 4], [3, 5, 1]
    q, cache, seqs, batch = make_case(lengths, counts, 8, 2, page_size=4)
    queries = batch.per_query
    assert queries.is_decode and queries.counts == [1] * 9
    assert queries.seq_lens == [7, 8, 9, 26, 27, 28, 29, 30, 4]
    assert queries.lengths.tolist() == queries.seq_lens
    assert queries.rows.tolist() == [seqs[0].row] * 3 + [seqs[1].row] * 5 + [seqs[2].row]
    sink = torch.randn(8) if sinks else None
    ours = paged_attention(q, cache.k[0], cache.v[0], batch, 0.25, window, sink)
    expected = oracle(q, cache, seqs, batch, 0.25, window, sink)
    assert (ours.double() - expected).abs().max().item() < 1e-5
    assert not make_case([20], [9], 4, 2)[3].few_queries  # (a prefill chunk: gathered)


@needs_native
def test_a_verify_steps_attention_equals_the_decode_steps_it_stands_in_for():
    """bf16: each new token's attention in a verify step is bit for bit what decoding it
    alone gives (its keys split as a decode step of the batch's sequences splits them), so a
    draft changes no sum's order there."""
    from freetoken.kernels.paged_attention import paged_attention

    for seed in range(3):
        q, cache, seqs, batch = make_case(
            [700], [5], 14, 2, 64, page_size=16, seed=seed, dtype=torch.bfloat16
        )
        verify = paged_attention(q, cache.k[0], cache.v[0], batch, 0.125)
        for i, length in enumerate(range(696, 701)):
            seqs[0].length = length - 1  # the state when token i was decoded alone
            one = ForwardBatch.build(cache, seqs[:1], [[1]], torch.device("cpu"))
            alone = paged_attention(q[i : i + 1], cache.k[0], cache.v[0], one, 0.125)
            assert torch.equal(verify[i], alone[0]), (seed, i)


def test_host_work_per_decode_batch_does_not_grow_with_the_context():
    """Building a decode batch sends the step's values and the new page-table entries only."""

    def build_time(context: int) -> float:
        cache = PagedKVCache(1, context // 16 + 8, 16, 2, 16, torch.float32, "cpu")
        seqs = [KVSequence() for _ in range(4)]
        for seq in seqs:
            cache.reserve(seq, context // 4)
            seq.length = context // 4 - 1
        ForwardBatch.build(cache, seqs, [[1]] * 4, torch.device("cpu"))  # the rows, once
        best = float("inf")
        for _ in range(30):
            start = time.perf_counter()
            ForwardBatch.build(cache, seqs, [[1]] * 4, torch.device("cpu"))
            best = min(best, time.perf_counter() - start)
        return best

    short, long = build_time(1024), build_time(262144)
    assert long < 3 * short, (short, long)  # was ~linear in the context (a key table per step)


def test_the_device_page_table_follows_the_page_lists():
    cache = PagedKVCache(1, 64, 4, 1, 16, torch.float32, "cpu")
    a, b = KVSequence(), KVSequence()
    cache.reserve(a, 9)
    cache.reserve(b, 3)
    ForwardBatch.build(cache, [a, b], [[1], [1]], torch.device("cpu"))
    assert cache.page_table[a.row, : len(a.pages)].tolist() == a.pages
    assert cache.page_table[b.row, : len(b.pages)].tolist() == b.pages
    a.length = 12  # crosses into a new page: only that entry is sent
    index, pages = cache.pending_rows([a])
    assert index == [] and pages == []
    cache.reserve(a, 1)
    index, pages = cache.pending_rows([a])
    assert pages == a.pages[-1:] and index == [a.row * cache.page_table.shape[1] + 3]
    cache.release(a)
    assert a.row is None and a.synced == 0


# ---------------------------------------------------------------------------------------------
# The Triton decode kernel
# ---------------------------------------------------------------------------------------------


def _decode_cases(device: str) -> dict[str, float]:
    """Max abs error of the Triton decode kernel against the torch path, per case."""
    from freetoken.kernels import paged_attention
    from freetoken.kernels.paged_attention import paged_decode_triton

    if device == "cpu":  # (the interpreter, in a process of its own)
        # The default splits as for a GPU of 32 programs (2 to 10 a case, the later ones
        # empty): 256's were ~250 programs a case, nearly all empty splits, each as slow as a
        # full one under the interpreter (16 of the fixture's 20 s).
        paged_attention.DECODE_TARGET_PROGRAMS = 32
    res = {}
    cases = {
        "mha": ([1, 7, 33], 4, 4, None, False, None),
        "gqa": ([5, 64, 130], 8, 2, None, False, None),
        "mqa_long": ([17, 300], 8, 1, None, False, 3),
        "window": ([40, 9, 100], 6, 2, 8, False, None),
        "sinks": ([31, 100], 4, 2, None, True, None),
        "one_split": ([300], 4, 2, None, False, 1),  # (3 key blocks: the running rescale)
        "many_splits": ([90, 3], 4, 2, 20, True, 16),
    }
    for name, (lengths, heads, kv_heads, window, sinks, splits) in cases.items():
        for page_size in (4, 16):
            q, cache, _, batch = make_case(
                lengths, [1] * len(lengths), heads, kv_heads, 32, page_size, device=device
            )
            sink = torch.randn(heads, device=device) if sinks else None
            args = (q, cache.k[0], cache.v[0], batch, 32**-0.5, window, sink)
            ours = paged_decode_triton(*args, splits=splits)
            ref = paged_attention_torch(*args)
            res[f"{name}/{page_size}"] = (ours - ref).abs().max().item()
    # latent attention's heads: the pool read as keys [latent 64, RoPE part 16] and as values
    # (the latent: the kernel returns its width), 20 query heads on one KV head (two blocks of
    # 16, the second partial); and 512 + 64, DeepSeek-V3's, on one split
    for name, (lengths, heads, latent, rope, splits) in {
        "latent": ([5, 70, 33], 20, 64, 16, None),
        "latent_576": ([40], 16, 512, 64, 2),
    }.items():
        q, cache, _, batch = make_case(
            lengths, [1] * len(lengths), heads, 1, latent + rope, 8, device=device
        )
        pool = cache.k[0]
        ours = paged_decode_triton(q, pool, pool, batch, 0.1, splits=splits)
        ref = paged_attention_torch(q, pool, pool, batch, 0.1)[..., :latent]
        res[f"{name}/8"] = (ours - ref).abs().max().item() if ours.shape == ref.shape else 1.0
    # heads 512 wide (Gemma-4's full layers: 16 query heads over 2 KV heads, the values in their
    # own pool), with the default splits (most of them empty here) and with a window, sinks and
    # a partial group on 3 splits; and a 512-wide pool read as its own values (no key-only part)
    for name, (lengths, heads, kv_heads, window, sinks, splits, shared) in {
        "wide_512": ([40, 7, 90], 16, 2, None, False, None, False),
        "wide_512_window_sinks": ([37, 70], 6, 1, 20, True, 3, False),
        "wide_512_values_are_keys": ([33, 5], 4, 2, None, False, 2, True),
    }.items():
        q, cache, _, batch = make_case(
            lengths, [1] * len(lengths), heads, kv_heads, 512, 16, device=device
        )
        k_pool = cache.k[0]
        v_pool = k_pool if shared else cache.v[0]
        sink = torch.randn(heads, device=device) if sinks else None
        args = (q, k_pool, v_pool, batch, 512**-0.5, window, sink)
        ours = paged_decode_triton(*args, splits=splits)
        ref = paged_attention_torch(*args)
        res[f"{name}/16"] = (ours - ref).abs().max().item() if ours.shape == ref.shape else 1.0
    return res


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, float]:
    return run_interpreted("test_paged_attention", "_decode_cases", "cpu")


@needs_triton
def test_triton_decode_matches_the_torch_path_in_the_interpreter(interpreter_results):
    assert len(interpreter_results) == 19
    assert max(interpreter_results.values()) < 1e-4, interpreter_results


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_decode_matches_the_torch_path_on_cuda():
    results = _decode_cases("cuda")
    assert max(results.values()) < 1e-3, results  # fp32 on the GPU: tf32-free dots


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "value_dim"),
    [(8, 2, 128, 128), (6, 6, 72, 72), (16, 16, 192, 128)],  # GQA; a padded head; MLA's
)
def test_a_chunk_after_a_cached_prefix_attends_from_the_bottom_right_on_cuda(
    heads, kv_heads, head_dim, value_dim
):
    """Fewer queries than keys on CUDA: flash attention's causal mask (its own padding for a
    head size not a multiple of 8) or memory-efficient attention's bottom-right mask give what
    SDPA gives with that mask made (fp32, explicit)."""
    from freetoken.kernels.paged_attention import causal_attention

    torch.manual_seed(0)
    n, length = 37, 300
    q = torch.randn(1, heads, n, head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, kv_heads, length, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(1, kv_heads, length, value_dim, dtype=torch.bfloat16, device="cuda")
    scale = head_dim**-0.5
    ours = causal_attention(q, k, v, scale)
    mask = torch.ones(n, length, dtype=torch.bool, device="cuda").tril(length - n)
    group = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(),
        k.float().repeat_interleave(group, 1),
        v.float().repeat_interleave(group, 1),
        attn_mask=mask,
        scale=scale,
    )
    assert ours.shape == expected.shape
    assert (ours.float() - expected).abs().max().item() < 3e-2
