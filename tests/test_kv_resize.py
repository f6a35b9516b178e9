"""The KV pool re-sized between steps (kv/paged.py `resize`): growing keeps every page in use
with its id and contents and adds free pages (and widens the page table when the pool bounded
it); shrinking gives up only free high pages and is refused while one above the new size is in
use; the free list never names a page the pool does not have."""

from __future__ import annotations

import pytest
import torch

from freetoken.kv.paged import KVSequence, OutOfPagesError, PagedKVCache


def cache(pages=4, page_size=2, max_seq_tokens=None):
    return PagedKVCache(
        num_layers=2,
        num_pages=pages,
        page_size=page_size,
        num_kv_heads=1,
        head_dim=3,
        dtype=torch.float32,
        device="cpu",
        max_seq_tokens=max_seq_tokens,
    )


def fill(kv, seq, tokens):
    kv.reserve(seq, tokens)
    slots = torch.tensor([kv.slot(seq, p) for p in range(seq.length, seq.length + tokens)])
    values = torch.randn(tokens, 1, 3)
    for layer in range(2):
        kv.write(layer, slots, values, -values)
    seq.length += tokens
    return slots, values


def test_growing_keeps_pages_and_contents_and_adds_free_pages():
    kv = cache(pages=4)
    seq = KVSequence()
    slots, values = fill(kv, seq, 5)  # 3 pages
    pages = list(seq.pages)
    assert kv.page_bytes == 2 * 2 * 1 * 3 * 4 * 2  # layers, K and V, heads, dim, fp32, page
    kv.resize(10)
    assert kv.num_pages == 10 and kv.allocator.num_free == 7
    assert seq.pages == pages and torch.equal(kv.k[1][slots], values)
    assert kv.page_table.shape[1] == 10  # the pool bounded it: wider now
    more = KVSequence()
    fill(kv, more, 14)  # 7 pages: all the free ones, new ids among them
    assert sorted(more.pages) == sorted(set(range(10)) - set(pages))
    with pytest.raises(OutOfPagesError):
        kv.reserve(more, 2)


def test_shrinking_gives_up_only_free_high_pages():
    kv = cache(pages=8, max_seq_tokens=6)
    low, high = KVSequence(), KVSequence()
    fill(kv, low, 4)  # pages 0, 1
    fill(kv, high, 6)  # pages 2, 3, 4
    with pytest.raises(ValueError, match="in use"):
        kv.resize(4)
    kv.release(high)
    kv.resize(3)
    assert kv.num_pages == 3 and kv.allocator.num_free == 1
    assert kv.allocator.used_from(0) == 2 and kv.k[0].shape[0] == 6  # pages 0, 1: low's
    assert sorted(kv.allocator.alloc(1)) == [2]  # the one free page, none given up
    assert kv.page_table.shape[1] == 3  # bounded by the sequence length, not widened
    with pytest.raises(ValueError, match="at least one page"):
        kv.resize(0)
