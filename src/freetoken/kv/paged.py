"""Paged KV cache: fixed-size pages in one pool per layer, a page table per sequence.

Pages let sequences of very different lengths share one preallocated pool without
fragmentation, and let the radix prefix cache share pages between sequences.

The page tables live twice: as each sequence's Python list (what the host decides with) and as
rows of one device tensor, `page_table [rows, pages]`, that attention kernels read in place.
A sequence takes a row when it first gets pages; the device row follows its list
incrementally (`pending_rows`): a decode step sends only the pages added since the last, so
the host's work per step does not grow with the context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from freetoken.errors import FreetokenError


class OutOfPagesError(FreetokenError):
    """The KV pool has no free page left for a sequence."""


class PageAllocator:
    def __init__(self, num_pages: int):
        # Hand out low page ids first: keeps a small working set dense in memory.
        self._free = list(range(num_pages - 1, -1, -1))
        self.num_pages = num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(
                f"KV cache is full: need {n} more pages, {len(self._free)} free of "
                f"{self.num_pages}; raise --kv-cache-tokens or shorten the context"
            )
        pages = self._free[-n:][::-1] if n else []
        del self._free[len(self._free) - n :]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def used_from(self, first: int) -> int:
        """Pages numbered `first` or higher that are handed out."""
        return (self.num_pages - first) - sum(p >= first for p in self._free)

    def resize(self, num_pages: int) -> None:
        """Own pages 0..num_pages-1: new ones free, handed out after the old free ones; those
        given up must be free (`used_from(num_pages) == 0`)."""
        if num_pages > self.num_pages:
            self._free[:0] = range(num_pages - 1, self.num_pages - 1, -1)
        else:
            self._free = [p for p in self._free if p < num_pages]
        self.num_pages = num_pages


@dataclass
class KVSequence:
    """The page table of one sequence and how many of its positions hold K/V.

    `pages` only grows (or is set while the sequence is empty): the first `synced` entries
    are in its row of the device page table. Models with linear-attention layers also give
    the sequence a slot of the recurrent state pool (`kv/recurrent.py`), whose state
    summarises the same `length` positions."""

    pages: list[int] = field(default_factory=list)
    length: int = 0
    state_slot: int | None = None
    row: int | None = None  # its row of PagedKVCache.page_table, while it holds pages
    synced: int = 0


# Rows of the device page table: sequences that may hold KV pages at once (running and
# being set up). Each row costs 8 bytes per page a sequence may have.
PAGE_TABLE_ROWS = 256


class OutOfRowsError(FreetokenError):
    """More sequences hold KV pages at once than the device page table has rows for."""


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_layers: tuple[bool, ...] | None = None,
        max_seq_tokens: int | None = None,
        values_are_keys: bool = False,
        layer_dims: tuple[int, ...] | None = None,
        layer_heads: tuple[int, ...] | None = None,
    ):
        """`kv_layers[i]` False: layer i keeps no K/V (linear attention); default: all do.
        `max_seq_tokens`: the longest sequence (default: the whole pool), which sizes the
        device page table's rows. `values_are_keys`: each layer keeps one pool, read as both
        keys and values (multi-head latent attention caches its latent only: `v` is `k`).
        `layer_dims`: per layer, the width of its pool's rows where layers differ (DeepSeek-V4:
        a token's row holds its K=V and its compressors' state, by layer kind; Gemma-4: each
        layer's head width), instead of `head_dim`; `layer_heads` likewise for `num_kv_heads`."""
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        # the longest sequence's pages (unbounded without max_seq_tokens: the pool's)
        self._max_seq_pages = -(-max_seq_tokens // page_size) if max_seq_tokens else 2**62
        max_pages = min(num_pages, self._max_seq_pages)
        # int64: kernels and torch index with its entries directly.
        self.page_table = torch.zeros(PAGE_TABLE_ROWS, max_pages, dtype=torch.long, device=device)
        self._free_rows = list(range(PAGE_TABLE_ROWS - 1, -1, -1))
        # Called with a number of pages when the pool runs short; returns pages it freed.
        self.reclaim: Callable[[int], list[int]] | None = None
        # Flat [slots, heads, dim] per layer: a token's K/V lives at slot page * page_size + offset.
        if kv_layers is None:
            kv_layers = (True,) * num_layers
        shapes = list(
            zip(
                kv_layers,
                layer_heads or (num_kv_heads,) * num_layers,
                layer_dims or (head_dim,) * num_layers,
                strict=True,
            )
        )

        def pool(held: bool, heads: int, dim: int) -> torch.Tensor:
            size = (num_pages * page_size, heads, dim) if held else (0,)
            return torch.zeros(size, dtype=dtype, device=device)

        self.values_are_keys = values_are_keys
        self.k = [pool(*shape) for shape in shapes]
        self.v = self.k if values_are_keys else [pool(*shape) for shape in shapes]

    def _pools(self) -> list[torch.Tensor]:
        """Every pool once (one per layer when values are keys)."""
        return [t for t in (*self.k, *([] if self.values_are_keys else self.v)) if t.numel()]

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: its K and V in every layer that keeps them."""
        return sum(t[0].numel() * t.element_size() for t in self._pools()) * self.page_size

    def reserve(self, seq: KVSequence, new_tokens: int) -> None:
        """Make room for `new_tokens` more positions after `seq.length`."""
        needed = -(-(seq.length + new_tokens) // self.page_size) - len(seq.pages)
        if needed > 0:
            if len(seq.pages) + needed > self.page_table.shape[1]:
                raise OutOfPagesError(
                    f"a sequence of {seq.length + new_tokens} tokens is longer than the "
                    f"{self.page_table.shape[1] * self.page_size} its page table holds"
                )
            short = needed - self.allocator.num_free
            if short > 0 and self.reclaim is not None:
                self.allocator.free(self.reclaim(short))  # e.g. evict cached prefixes
            seq.pages.extend(self.allocator.alloc(needed))
        if seq.row is None and seq.pages:
            if not self._free_rows:
                raise OutOfRowsError(
                    f"{PAGE_TABLE_ROWS} sequences already hold KV pages: finish some first"
                )
            seq.row, seq.synced = self._free_rows.pop(), 0

    def release(self, seq: KVSequence) -> None:
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.length = 0
        if seq.row is not None:
            self._free_rows.append(seq.row)
            seq.row, seq.synced = None, 0

    def resize(self, num_pages: int) -> None:
        """Hold `num_pages` pages, between steps. Growing adds free pages; shrinking gives up
        the highest page ids, which must all be free (the caller evicts what it caches first):
        pages in use keep their ids and contents, so no page table changes. While the pools
        are replaced both sets are in memory."""
        old = self.num_pages
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        if num_pages < old and self.allocator.used_from(num_pages):
            used = old - self.allocator.num_free
            raise ValueError(
                f"cannot shrink the KV cache to {num_pages} pages while pages above that are "
                f"in use ({used} of {old} in use): retry when fewer requests run"
            )
        slots = min(num_pages, old) * self.page_size
        for pools in (self.k,) if self.values_are_keys else (self.k, self.v):
            for i, pool in enumerate(pools):
                if pool.numel():
                    new = pool.new_zeros((num_pages * self.page_size, *pool.shape[1:]))
                    new[:slots] = pool[:slots]
                    pools[i] = new
        self.allocator.resize(num_pages)
        width = min(num_pages, self._max_seq_pages)
        if width > self.page_table.shape[1]:  # the rows may now hold longer sequences
            table = self.page_table.new_zeros((self.page_table.shape[0], width))
            table[:, : self.page_table.shape[1]] = self.page_table
            self.page_table = table

    def pending_rows(self, seqs: list[KVSequence]) -> tuple[list[int], list[int]]:
        """The page-table entries the device lacks for these sequences, as (flat index into
        `page_table`, page), and mark them sent: the caller copies them over before any
        kernel reads the rows."""
        width = self.page_table.shape[1]
        index, pages = [], []
        for seq in seqs:
            if seq.synced < len(seq.pages):
                base = seq.row * width
                index.extend(range(base + seq.synced, base + len(seq.pages)))
                pages.extend(seq.pages[seq.synced :])
                seq.synced = len(seq.pages)
        return index, pages

    def slot(self, seq: KVSequence, position: int) -> int:
        """Flat slot index of one position of `seq`."""
        return seq.pages[position // self.page_size] * self.page_size + position % self.page_size

    def copy_prefix(self, src_page: int, dst_page: int, n: int) -> None:
        """Copy the K/V of a page's first `n` positions into another page, in every layer:
        copy-on-write for a shared page a sequence continues partway through."""
        ps = self.page_size
        src, dst = slice(src_page * ps, src_page * ps + n), slice(dst_page * ps, dst_page * ps + n)
        for pool in self._pools():
            pool[dst] = pool[src]

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None
    ) -> None:
        """K and V of new tokens into their slots (`v` None where values are keys)."""
        self.k[layer].index_copy_(0, slots, k)
        if not self.values_are_keys:
            self.v[layer].index_copy_(0, slots, v)
