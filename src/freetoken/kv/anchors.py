"""Semantic anchor checkpoints: recurrent states saved where agents edit conversations.

A hybrid model (Qwen3-Next) can reuse cached KV pages only together with the recurrent state
of its linear-attention layers at exactly the reuse position, and that state covers the whole
prefix: it cannot be cut back to an earlier position, and one costs as much memory as
hundreds of tokens of KV. So only a few are kept, at the positions agents edit at: coding
agents resend the conversation each turn, editing whole blocks delimited by special tokens
(OpenClaw strips older thinking blocks, OpenCode replaces older tool outputs with a
placeholder, SWE-agent keeps the last n observations), and keep the prefix before the edit.

- Where: after a thinking block, before and after a tool call, after a tool output, after a
  turn. The token ids come from the tokenizer and its chat template (`boundary_tokens`), in
  this one place.
- Saving: during a forward, the linear-attention layers copy a sequence's state at each
  requested offset among its new tokens into an anchor slot (`ForwardBatch.captures`), so
  saving costs one state copy per layer and no extra forward.
- Keeping: anchor slots are slots of the recurrent state pool reserved for anchors, a budget
  of their own. A request's anchors wait on the request until it ends and donates its KV
  pages to the radix tree; then each attaches to the radix node whose page holds its
  position's last token, valid only at that exact position on that path. When the budget is
  spent, the least recently used attached anchor goes; when the tree evicts a node, its
  anchors go with it.
- Reuse: a new request restores the deepest anchor on its matched prefix (even partway into
  a page: that page's K/V prefix is copied into a private page, since the request will write
  the rest of it), reuses the KV pages up to it, and prefills only from there.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from freetoken.kv.paged import KVSequence, PagedKVCache
from freetoken.kv.radix import RadixCache, RadixNode
from freetoken.kv.recurrent import RecurrentStatePool

BEFORE, AFTER = 0, 1  # save the state before a boundary token, or after it

# Markers chat templates write around the blocks agents edit: the state is saved after a
# closing marker and before an opening one, so an edited block is recomputed from its first
# token and nothing before it is.
EDIT_MARKERS: tuple[tuple[str, int], ...] = (
    ("</think>", AFTER),  # end of a thinking block
    ("<tool_call>", BEFORE),  # start of a tool call
    ("</tool_call>", AFTER),  # end of a tool call
    ("</tool_response>", AFTER),  # end of a tool output
)


def boundary_tokens(tokenizer: Any) -> dict[int, int]:
    """Token id -> BEFORE or AFTER, for the edit markers that are single tokens of this
    tokenizer and that its chat template writes, and for the end of a turn: the tokenizer's
    end-of-sequence tokens its template writes (Qwen's `<|im_end|>`)."""
    template = tokenizer.chat_template
    found: dict[int, int] = {}
    for marker, side in EDIT_MARKERS:
        tid = tokenizer.token_id(marker)
        if marker in template and tid is not None:
            found[tid] = side
    for tid in tokenizer.eos_token_ids:
        if (token := tokenizer.token(tid)) and token in template:
            found[tid] = AFTER
    return found


def anchor_positions(boundaries: dict[int, int], chunk: Sequence[int], start: int = 0) -> list[int]:
    """Anchor positions a forward feeding `chunk` at positions start, start + 1, ... can save
    (`boundaries`: as `boundary_tokens` gives them): from `start` (the state before it) to
    `start + len(chunk)`, ascending. Over a whole sequence's tokens (start 0): every position
    its anchors were taken at, whichever forwards fed them."""
    found = set()
    for i, token in enumerate(chunk):
        side = boundaries.get(token)
        if side is not None and start + i + side > 0:
            found.add(start + i + side)
    return sorted(found)


@dataclass(eq=False)
class Anchor:
    position: int  # the state after tokens [0, position)
    slot: int  # the state pool slot holding it
    # Where it is attached; None while its request runs.
    node: RadixNode | None = field(default=None, repr=False)
    last_used: int = 0


class AnchorStore:
    def __init__(self, pool: RecurrentStatePool, slots: list[int], boundaries: dict[int, int]):
        self.pool = pool
        self.capacity = len(slots)
        self.boundaries = boundaries
        self._free = list(slots)
        self._attached: dict[Anchor, None] = {}  # an ordered set
        self._clock = itertools.count(1)
        self.saved = self.restored = self.evicted = 0

    @property
    def num_attached(self) -> int:
        return len(self._attached)

    @property
    def num_free(self) -> int:
        return len(self._free)

    # -- saving ---------------------------------------------------------------------------

    def positions(self, chunk: list[int], start: int) -> list[int]:
        return anchor_positions(self.boundaries, chunk, start)

    def reserve(self, positions: list[int], pending: list[Anchor]) -> list[Anchor]:
        """New pending anchors for these positions of a request whose earlier anchors are
        `pending`, each with a slot: a free one, else that of the least recently used attached
        anchor, else that of the request's own shallowest pending anchor when it is shallower
        (removed from `pending`): the deepest states of a long prompt are the ones its next
        turn resumes from. Positions left without a slot are skipped: anchors only save time."""
        anchors: list[Anchor] = []
        for position in sorted(positions, reverse=True):
            if not self._free and self._attached:
                self.release(min(self._attached, key=lambda a: a.last_used))
                self.evicted += 1
            if self._free:
                slot = self._free.pop()
            elif pending and (oldest := min(pending, key=lambda a: a.position)).position < position:
                pending.remove(oldest)
                slot = oldest.slot
            else:
                break
            anchors.append(Anchor(position, slot, last_used=next(self._clock)))
        return anchors[::-1]

    def attach(self, anchors: list[Anchor], path: list[RadixNode], page_size: int) -> None:
        """Attach a finished request's anchors to the tree nodes holding their positions
        (`path`: the nodes of its donated tokens); free those whose page the tree did not
        take, or whose position already has an anchor."""
        for anchor in anchors:
            index = (anchor.position - 1) // page_size
            node = path[index] if index < len(path) else None
            if node is None or anchor.position in node.anchors:
                self._free.append(anchor.slot)
                continue
            node.anchors[anchor.position] = anchor
            anchor.node = node
            self._attached[anchor] = None
            self.saved += 1

    def discard(self, anchors: list[Anchor]) -> None:
        """Free pending anchors whose state was never (or not fully) written."""
        self._free.extend(a.slot for a in anchors)

    def release(self, anchor: Anchor) -> None:
        if anchor.node is not None:
            del anchor.node.anchors[anchor.position]
            anchor.node = None
        self._attached.pop(anchor, None)
        self._free.append(anchor.slot)

    def drop_node(self, node: RadixNode) -> None:
        """The tree evicted `node`: its anchors lose their path (RadixCache.on_evict)."""
        for anchor in list(node.anchors.values()):
            self.release(anchor)

    # -- reuse ----------------------------------------------------------------------------

    def resume(
        self, cache: RadixCache, kv: PagedKVCache, seq: KVSequence, tokens: list[int]
    ) -> tuple[list[RadixNode], Anchor | None]:
        """Start `seq` (empty, with a state slot) from the deepest anchor on the cached prefix
        of `tokens`, leaving at least one token to compute. Returns the radix nodes the
        sequence now shares (locked; unlock them when it ends) and the anchor, or ([], None)
        when no anchor fits."""
        ps = cache.page_size
        path = cache.match(tokens)
        limit = len(tokens) - 1
        # (position, node index) of every anchor the prompt matches up to its position: on
        # the matched pages, and on any child page the match continues partway into.
        found = [(p, i) for i, node in enumerate(path) for p in node.anchors if p <= limit]
        parent, start = (path[-1] if path else cache.root), len(path) * ps
        rest = tokens[start : start + ps]
        beyond = None
        for key, child in parent.children.items():
            n = _common_prefix(key, rest)
            fits = [p for p in child.anchors if p <= min(start + n, limit)]
            if fits and (beyond is None or max(fits) > beyond[0]):
                beyond = (max(fits), child)
        if beyond is not None:
            found.append((beyond[0], len(path)))
            path = [*path, beyond[1]]
        if not found:
            return [], None
        position, index = max(found)
        anchor = path[index].anchors[position]
        held = path[: index + 1]  # through the page holding the anchor's last token
        full, partial = divmod(position, ps)
        cache.lock(held)  # nothing we read from may be evicted while we copy it
        seq.pages = [n.page for n in held[:full]]
        seq.length = full * ps
        if partial:
            try:
                kv.reserve(seq, partial)  # a private page: the sequence writes the rest of it
            except BaseException:
                cache.unlock(held)
                seq.pages, seq.length = [], 0
                raise
            kv.copy_prefix(held[full].page, seq.pages[-1], partial)
            cache.unlock(held[full:])
            held = held[:full]
        seq.length = position
        self.pool.copy(anchor.slot, seq.state_slot)
        anchor.last_used = next(self._clock)
        self.restored += 1
        return held, anchor

    def snapshot(self) -> dict[str, int]:
        return {
            "capacity": self.capacity,
            "attached": self.num_attached,
            "pending": self.capacity - self.num_attached - self.num_free,
            "bytes_each": self.pool.slot_bytes,
            "saved": self.saved,
            "restored": self.restored,
            "evicted": self.evicted,
        }


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
