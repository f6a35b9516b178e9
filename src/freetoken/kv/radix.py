"""A radix tree over token ids whose nodes own KV pages: prefix reuse across requests.

Each node below the root holds exactly one full page: its key is the page's `page_size`
token ids, its value the KV page that holds them (at the positions the path implies). A new
request walks the tree page by page and reuses the longest cached prefix, prefilling only the
rest. Finished requests donate their full pages; pages a request shares are locked (reference
counts) and never evicted; unlocked leaves are evicted least recently used when the page pool
runs short. Page granularity keeps sharing free of copies: a prefix is reused up to its last
full page (with `page_size` 1 the reuse is exact to the token).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...] = ()
    page: int = -1
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    refs: int = 0
    last_used: int = 0
    # Recurrent-state checkpoints saved on this node's page, by position (kv/anchors.py): an
    # anchor at position p holds the state after tokens [0, p) of this node's path.
    anchors: dict[int, Any] = field(default_factory=dict)


class RadixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = RadixNode()
        self._clock = itertools.count(1)
        self.num_pages = 0  # pages owned by the tree
        self.num_locked = 0  # of them, pages some running request shares (never evicted)
        # Called with each node the tree evicts (its anchors go with it).
        self.on_evict: Callable[[RadixNode], None] | None = None

    def _pages_of(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i : i + ps]) for i in range(0, len(tokens) - ps + 1, ps)]

    def match(self, tokens: Sequence[int]) -> list[RadixNode]:
        """The nodes of the longest cached prefix of `tokens` (whole pages), root excluded."""
        node, path, now = self.root, [], next(self._clock)
        for key in self._pages_of(tokens):
            child = node.children.get(key)
            if child is None:
                break
            child.last_used = now
            path.append(child)
            node = child
        return path

    def lock(self, path: list[RadixNode]) -> None:
        for node in path:
            self.num_locked += node.refs == 0
            node.refs += 1

    def unlock(self, path: list[RadixNode]) -> None:
        for node in path:
            node.refs -= 1
            assert node.refs >= 0, "radix node unlocked more often than locked"
            self.num_locked -= node.refs == 0

    @property
    def num_evictable(self) -> int:
        """Pages the tree would give up if the pool ran short: every unlocked node (a request
        locks whole paths from the root, so an unlocked node has no locked descendant)."""
        return self.num_pages - self.num_locked

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Donate the full pages holding `tokens` (pages[i] holds page i). Returns the pages the
        tree did not take, because it already held the same tokens (the caller frees them)."""
        node, now, spare = self.root, next(self._clock), []
        for key, page in zip(self._pages_of(tokens), pages, strict=False):
            child = node.children.get(key)
            if child is None:
                child = RadixNode(key=key, page=page, parent=node, last_used=now)
                node.children[key] = child
                self.num_pages += 1
            elif child.page != page:
                spare.append(page)
            child.last_used = now
            node = child
        return spare

    def evict(self, needed: int) -> list[int]:
        """Remove up to `needed` unlocked leaves, least recently used first; their pages."""
        freed: list[int] = []
        while len(freed) < needed:
            leaves = [n for n in self._nodes() if not n.children and n.refs == 0]
            if not leaves:
                break
            leaves.sort(key=lambda n: n.last_used)
            for leaf in leaves[: needed - len(freed)]:
                del leaf.parent.children[leaf.key]
                freed.append(leaf.page)
                self.num_pages -= 1
                if self.on_evict is not None:
                    self.on_evict(leaf)
        return freed

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def pages(self) -> list[int]:
        return [n.page for n in self._nodes()]
