"""Paged KV cache: fixed-size pages in one pool per layer, a page table per sequence.

Pages let sequences of very different lengths share one preallocated pool without
fragmentation, and let later work (the radix prefix cache) share pages between sequences.
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
                f"{self.num_pages}; raise --kv-pages or shorten the context"
            )
        pages = self._free[-n:][::-1] if n else []
        del self._free[len(self._free) - n :]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


@dataclass
class KVSequence:
    """The page table of one sequence and how many of its positions hold K/V.

    Models with linear-attention layers also give the sequence a slot of the recurrent state
    pool (`kv/recurrent.py`), whose state summarises the same `length` positions."""

    pages: list[int] = field(default_factory=list)
    length: int = 0
    state_slot: int | None = None


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
    ):
        """`kv_layers[i]` False: layer i keeps no K/V (linear attention); default: all do."""
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        # Called with a number of pages when the pool runs short; returns pages it freed.
        self.reclaim: Callable[[int], list[int]] | None = None
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        # Flat [slots, heads, dim] per layer: a token's K/V lives at slot page * page_size + offset.
        if kv_layers is None:
            kv_layers = (True,) * num_layers

        def pool(held: bool) -> torch.Tensor:
            return torch.zeros(shape if held else (0,), dtype=dtype, device=device)

        self.k = [pool(held) for held in kv_layers]
        self.v = [pool(held) for held in kv_layers]

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def reserve(self, seq: KVSequence, new_tokens: int) -> None:
        """Make room for `new_tokens` more positions after `seq.length`."""
        needed = -(-(seq.length + new_tokens) // self.page_size) - len(seq.pages)
        if needed > 0:
            short = needed - self.allocator.num_free
            if short > 0 and self.reclaim is not None:
                self.allocator.free(self.reclaim(short))  # e.g. evict cached prefixes
            seq.pages.extend(self.allocator.alloc(needed))

    def release(self, seq: KVSequence) -> None:
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.length = 0

    def slots(self, seq: KVSequence, start: int, end: int) -> list[int]:
        """Flat slot index of each position in [start, end) of `seq`."""
        ps = self.page_size
        return [seq.pages[p // ps] * ps + p % ps for p in range(start, end)]

    def copy_prefix(self, src_page: int, dst_page: int, n: int) -> None:
        """Copy the K/V of a page's first `n` positions into another page, in every layer:
        copy-on-write for a shared page a sequence continues partway through."""
        ps = self.page_size
        src, dst = slice(src_page * ps, src_page * ps + n), slice(dst_page * ps, dst_page * ps + n)
        for k, v in zip(self.k, self.v, strict=True):
            if k.numel():
                k[dst] = k[src]
                v[dst] = v[src]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)
