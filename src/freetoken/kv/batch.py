"""What one forward pass needs to know about the sequences it advances.

A batch is a list of sequences, each with some positions already in the KV cache and some new
tokens (a whole prompt, a prefill chunk, or one decode token). Tokens are flattened sequence
by sequence. Attention reads each sequence's keys where they lie, through its row of the
cache's device page table and its length: no key table, no mask, nothing whose size grows
with the context is built here. The per-step values (tokens, positions, write slots, rows,
lengths and, for models with linear-attention layers, each sequence's recurrent state slot)
travel to the device in one packed copy, together with the page-table entries added since the
last step (`PagedKVCache.pending_rows`): a decode graph copies that one buffer in and reads
everything else where it lies.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from freetoken.kv.paged import KVSequence, PagedKVCache

# New tokens per sequence up to which attention runs the decode kernels once per token
# (`ForwardBatch.per_query`): a verify step's last token and its draft (prompt lookup drafts
# at most 4: engine/speculative.py's PromptLookup.max_draft).
SHORT_QUERIES = 8


@dataclass
class StateGroup:
    """Sequences a linear-attention layer advances together (see ForwardBatch.state_groups)."""

    rows: slice  # their new tokens, flat
    slots: torch.Tensor  # [n] their recurrent state slots
    n: int  # sequences (each with rows / n new tokens)
    captures: list[tuple[int, int]] = field(default_factory=list)  # only when n == 1


class PinnedStaging:
    """Page-locked host buffers for the packed per-step copy (a copy from pageable memory is
    synchronous, and pinning a new buffer each step costs more than the copy). Two buffers
    alternate; each is rewritten only after the copy that last read it has run."""

    def __init__(self):
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def upload(self, values: list[int], device: torch.device) -> torch.Tensor:
        i, self._turn = self._turn, 1 - self._turn
        if self._events[i] is not None:
            self._events[i].synchronize()
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < len(values):
            buffer = torch.empty(max(len(values), 1024), dtype=torch.long).pin_memory()
            self._buffers[i] = buffer
        host = buffer[: len(values)]
        host.copy_(torch.tensor(values, dtype=torch.long))
        flat = host.to(device, non_blocking=True)
        event = self._events[i] or torch.cuda.Event()
        event.record()
        self._events[i] = event
        return flat


@dataclass
class ForwardBatch:
    # Device tensors, views of one packed copy (`packed`); int64 throughout.
    input_ids: torch.Tensor  # [T] new tokens, flattened sequence by sequence
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] KV slot of each new token
    token_rows: torch.Tensor  # [T] the page-table row of each new token's sequence
    rows: torch.Tensor  # [B] each sequence's row of the page table
    lengths: torch.Tensor  # [B] keys of each sequence after this forward
    last_index: torch.Tensor  # [B] flat index of each sequence's last new token
    packed: torch.Tensor  # the above, in one buffer (what a decode graph copies in)
    page_table: torch.Tensor  # the cache's [rows, pages] table (persistent, not per batch)
    page_size: int
    # The same on the host, for the code that loops over sequences.
    seq_lens: list[int]  # total length of each sequence after this forward
    counts: list[int]  # new tokens of each sequence
    row_ids: list[int]
    state_slots: torch.Tensor | None = None  # [B] recurrent state slot of each sequence (in
    # `packed`, after the others, where every sequence has one)
    # Per sequence: (k, slot) = copy the recurrent state after its first k new tokens into
    # pool slot `slot` (an anchor checkpoint, kv/anchors.py); k ascending, 0 <= k <= count.
    captures: list[list[tuple[int, int]]] | None = None
    # The sequences a decode kernel splits keys for (`per_query`: the batch's own, so a
    # verify step's queries sum as the decode steps they stand in for do); None: one a query.
    split_as: int | None = None
    # DeepSeek Sparse Attention: the last indexer layer's choice of keys in this forward, for
    # the layers that share it (layers/mla.py sets and reads it)
    index_selection: Any = None

    @property
    def is_decode(self) -> bool:
        """One new token per sequence."""
        return self.num_tokens == len(self.counts)

    @property
    def few_queries(self) -> bool:
        """At most SHORT_QUERIES new tokens per sequence (a decode step, a verify step of
        drafted tokens): few enough that attention reads each sequence's keys once per new
        token (`per_query`, the decode kernels) rather than gathering them for a prefill
        kernel."""
        return max(self.counts) <= SHORT_QUERIES

    @functools.cached_property
    def per_query(self) -> ForwardBatch:
        """The batch as attention sees it with every new token a sequence of its own: its
        sequence's row of the page table, the keys up to its own position. With the new
        tokens' keys written first, that is the causal mask, so the decode kernels (one query
        per sequence, lengths read on the device) serve a verify step, in a CUDA graph too,
        splitting each query's keys as a decode step of the batch's sequences would. Made
        once per batch: every attention layer reads it."""
        lengths, row_ids = [], []
        for total, count, row in zip(self.seq_lens, self.counts, self.row_ids, strict=True):
            lengths.extend(range(total - count + 1, total + 1))
            row_ids.extend([row] * count)
        t = self.num_tokens
        return ForwardBatch(
            input_ids=self.input_ids,
            positions=self.positions,
            write_slots=self.write_slots,
            token_rows=self.token_rows,
            rows=self.token_rows,
            lengths=self.positions + 1,
            last_index=torch.arange(t, device=self.positions.device),
            packed=self.packed,
            page_table=self.page_table,
            page_size=self.page_size,
            seq_lens=lengths,
            counts=[1] * t,
            row_ids=row_ids,
            split_as=len(self.counts),
        )

    @property
    def starts(self) -> list[int]:
        """Flat index of each sequence's first new token."""
        out, start = [], 0
        for n in self.counts:
            out.append(start)
            start += n
        return out

    def state_groups(self) -> list[StateGroup]:
        """How linear-attention layers walk the batch, in flat token order. Sequences with
        equally many new tokens (every decode step) go as one batch; otherwise each goes
        alone, since a recurrence cannot share a padded batch without letting the padding
        into its state. A sequence with captures goes alone too (rare: a decode step that
        feeds a boundary token, or a prefill chunk that holds some)."""
        assert self.state_slots is not None, "a linear-attention layer needs state slots"
        captures = self.captures or [[] for _ in self.counts]
        if len(set(self.counts)) == 1 and not any(captures):
            return [StateGroup(slice(0, self.num_tokens), self.state_slots, len(self.counts))]
        groups, start = [], 0
        for i, n in enumerate(self.counts):
            rows = slice(start, start + n)
            groups.append(StateGroup(rows, self.state_slots[i : i + 1], 1, captures[i]))
            start += n
        return groups

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def table_pages(self) -> int:
        """The page-table columns a captured decode step reads where its shapes follow the
        context (DSA's indexer, DeepSeek-V4's windows): the longest sequence's pages rounded up
        to a power of two, within the table. A decode graph is captured per such width
        (engine/cuda_graphs.py), so a step reads at most twice its context, not the whole
        table, and a sequence re-captures at most log2(table) times as it grows."""
        needed = max(1, -(-max(self.seq_lens) // self.page_size))
        return min(1 << (needed - 1).bit_length(), self.page_table.shape[1])

    def decode_pages(self) -> int:
        """The page-table columns a decode step that gathers its sequences' slots reads: the
        longest sequence's pages, or while a CUDA graph is captured `table_pages` (its replays
        then read any length up to that)."""
        if self.page_table.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.table_pages()
        return min(self.page_table.shape[1], -(-max(self.seq_lens) // self.page_size))

    @staticmethod
    def build(
        cache: PagedKVCache,
        seqs: Sequence[KVSequence],
        new_tokens: Sequence[Sequence[int]],
        device: torch.device,
        captures: list[list[tuple[int, int]]] | None = None,
        staging: PinnedStaging | None = None,
        starts: Sequence[int] | None = None,
    ) -> ForwardBatch:
        """Reserve pages for the new tokens, bring the device page table up to date and
        build the batch (on a GPU, through `staging`'s pinned buffers when given). Does not
        advance `seq.length`; call :func:`commit` after the forward succeeds. The host's work
        is proportional to the new tokens and the pages added, never to the context.
        `starts[i]`: sequence i's new tokens go from that position instead of its length (an
        MTP layer's, which follows the model's positions: not to be committed)."""
        ids: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        token_rows: list[int] = []
        counts, totals, last = [], [], []
        for i, (seq, toks) in enumerate(zip(seqs, new_tokens, strict=True)):
            if not toks:
                raise ValueError("every sequence in a batch needs at least one new token")
            start = seq.length if starts is None else starts[i]
            cache.reserve(seq, start + len(toks) - seq.length)
            counts.append(len(toks))
            totals.append(start + len(toks))
            ids.extend(toks)
            positions.extend(range(start, start + len(toks)))
            write_slots.extend(cache.slot(seq, p) for p in range(start, start + len(toks)))
            token_rows.extend([seq.row] * len(toks))
            last.append(len(ids) - 1)
        row_ids = [seq.row for seq in seqs]
        state_slots = [seq.state_slot for seq in seqs]
        states = [] if any(slot is None for slot in state_slots) else state_slots
        update_index, update_pages = cache.pending_rows(list(seqs))
        t, b, u = len(ids), len(seqs), len(update_index)
        n = 4 * t + 3 * b + len(states)  # the per-step values, then the page-table updates
        values = [
            *ids,
            *positions,
            *write_slots,
            *token_rows,
            *row_ids,
            *totals,
            *last,
            *states,
            *update_index,
            *update_pages,
        ]
        if staging is not None and device.type == "cuda":
            flat = staging.upload(values, device)
        else:
            flat = torch.tensor(values, dtype=torch.long).to(device)
        if u:
            cache.page_table.view(-1).index_copy_(0, flat[n : n + u], flat[n + u :])
        return ForwardBatch._over(
            flat[:n],
            t,
            b,
            bool(states),
            cache.page_table,
            cache.page_size,
            totals,
            counts,
            row_ids,
            captures,
        )

    @staticmethod
    def _over(packed, t, b, states, page_table, page_size, totals, counts, row_ids, captures):
        views = packed.split([t, t, t, t, b, b, b, *([b] if states else [])])
        return ForwardBatch(
            input_ids=views[0],
            positions=views[1],
            write_slots=views[2],
            token_rows=views[3],
            rows=views[4],
            lengths=views[5],
            last_index=views[6],
            packed=packed,
            page_table=page_table,
            page_size=page_size,
            seq_lens=totals,
            counts=counts,
            row_ids=row_ids,
            state_slots=views[7] if states else None,
            captures=captures,
        )

    def views_of(self, packed: torch.Tensor) -> ForwardBatch:
        """This batch over another packed buffer of the same layout (a decode graph's static
        inputs), the rest shared."""
        return ForwardBatch._over(
            packed,
            self.num_tokens,
            len(self.counts),
            self.state_slots is not None,
            self.page_table,
            self.page_size,
            list(self.seq_lens),
            list(self.counts),
            list(self.row_ids),
            self.captures,
        )


def commit(seqs: Sequence[KVSequence], batch: ForwardBatch) -> None:
    """Mark the batch's new tokens as held in the KV cache."""
    for seq, total in zip(seqs, batch.seq_lens, strict=True):
        seq.length = total
