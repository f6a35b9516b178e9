"""What one forward pass needs to know about the sequences it advances.

A batch is a list of sequences, each with some positions already in the KV cache and some new
tokens (a whole prompt, a prefill chunk, or one decode token). Tokens are flattened sequence
by sequence; attention works on a padded [batch, queries, keys] view built from the tables
here, once per forward, shared by all layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from freetoken.kv.paged import KVSequence, PagedKVCache


@dataclass
class StateGroup:
    """Sequences a linear-attention layer advances together (see ForwardBatch.state_groups)."""

    rows: slice  # their new tokens, flat
    slots: torch.Tensor  # [n] their recurrent state slots
    n: int  # sequences (each with rows / n new tokens)
    captures: list[tuple[int, int]] = field(default_factory=list)  # only when n == 1


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] new tokens, flattened sequence by sequence
    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] KV slot of each new token
    key_slots: torch.Tensor  # [B, K] KV slots of every key each sequence attends to (padded)
    query_index: torch.Tensor  # [B, Q] flat index of each sequence's queries (padded with 0)
    query_rows: torch.Tensor  # [T] row of each new token in the padded [B * Q] queries
    causal_mask: torch.Tensor  # [B, 1, Q, K] bool
    # One sequence whose keys end with its new tokens (no padding): the causal mask is the
    # lower-right triangle, which SDPA's fused kernels take without a materialised mask.
    causal_lower_right: bool
    sliding_mask: torch.Tensor | None  # [B, 1, Q, K] bool, when some layer slides
    last_index: torch.Tensor  # [B] flat index of each sequence's last new token
    seq_lens: list[int]  # total length of each sequence after this forward
    counts: list[int]  # new tokens of each sequence
    state_slots: torch.Tensor | None = None  # [B] recurrent state slot of each sequence
    # Per sequence: (k, slot) = copy the recurrent state after its first k new tokens into
    # pool slot `slot` (an anchor checkpoint, kv/anchors.py); k ascending, 0 <= k <= count.
    captures: list[list[tuple[int, int]]] | None = None

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

    @staticmethod
    def build(
        cache: PagedKVCache,
        seqs: Sequence[KVSequence],
        new_tokens: Sequence[Sequence[int]],
        device: torch.device,
        sliding_window: int | None = None,
        key_bucket: int | None = None,
        captures: list[list[tuple[int, int]]] | None = None,
    ) -> ForwardBatch:
        """Reserve pages for the new tokens and build the tables. Does not advance
        `seq.length`; call :func:`commit` after the forward succeeds. With `key_bucket`, the
        key tables are padded (masked) to a multiple of it, so their shape changes rarely: what
        a captured CUDA graph needs."""
        ids: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        starts, counts, totals = [], [], []
        for seq, toks in zip(seqs, new_tokens, strict=True):
            if not toks:
                raise ValueError("every sequence in a batch needs at least one new token")
            cache.reserve(seq, len(toks))
            starts.append(seq.length)
            counts.append(len(toks))
            totals.append(seq.length + len(toks))
            ids.extend(toks)
            positions.extend(range(seq.length, seq.length + len(toks)))
            write_slots.extend(cache.slots(seq, seq.length, seq.length + len(toks)))

        b, q_max, k_max = len(seqs), max(counts), max(totals)
        if key_bucket:
            k_max = -(-k_max // key_bucket) * key_bucket
        key_slots = torch.zeros(b, k_max, dtype=torch.long)
        query_index = torch.zeros(b, q_max, dtype=torch.long)
        q_pos = torch.full((b, q_max), -1, dtype=torch.long)
        k_len = torch.tensor(totals)
        offset = 0
        for i, seq in enumerate(seqs):
            key_slots[i, : totals[i]] = torch.tensor(cache.slots(seq, 0, totals[i]))
            query_index[i, : counts[i]] = torch.arange(offset, offset + counts[i])
            q_pos[i, : counts[i]] = torch.arange(starts[i], totals[i])
            offset += counts[i]
        k_pos = torch.arange(k_max)
        # A query at position p sees keys at positions <= p of its own sequence.
        causal = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
            k_pos[None, None, :] < k_len[:, None, None]
        )
        sliding = None
        if sliding_window:
            sliding = causal & (k_pos[None, None, :] > q_pos[:, :, None] - sliding_window)
            sliding = sliding[:, None].to(device)
        last = torch.tensor(counts).cumsum(0) - 1

        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return ForwardBatch(
            input_ids=dev(torch.tensor(ids, dtype=torch.long)),
            positions=dev(torch.tensor(positions, dtype=torch.long)),
            write_slots=dev(torch.tensor(write_slots, dtype=torch.long)),
            key_slots=dev(key_slots),
            query_index=dev(query_index),
            # An index, not a mask: boolean indexing would make the host wait for the device.
            query_rows=dev(torch.nonzero((q_pos >= 0).flatten()).squeeze(1)),
            causal_mask=dev(causal[:, None]),
            # (never with bucketed keys: a graph captured this way would replay it padded)
            causal_lower_right=b == 1 and not key_bucket and k_max == totals[0],
            sliding_mask=sliding,
            last_index=dev(last),
            seq_lens=totals,
            counts=counts,
            state_slots=None
            if any(seq.state_slot is None for seq in seqs)
            else dev(torch.tensor([seq.state_slot for seq in seqs], dtype=torch.long)),
            captures=captures,
        )


def commit(seqs: Sequence[KVSequence], batch: ForwardBatch) -> None:
    """Mark the batch's new tokens as held in the KV cache."""
    for seq, total in zip(seqs, batch.seq_lens, strict=True):
        seq.length = total
