"""Recurrent state pool: the per-sequence memory of linear-attention layers.

A linear-attention layer (gated DeltaNet) remembers a sequence in a fixed-size state instead of
K/V per token: a conv state (the last `kernel - 1` inputs of its causal conv) and an SSM state
(the delta-rule matrix, [value heads, key dim, value dim], kept in fp32 as the reference
kernels keep it). The pool preallocates both for every linear layer and a fixed number of slots
(`[layers, slots, ...]`, so one slot of all layers is one index); a sequence takes a slot when
it starts and gives it back when it is freed. Batched decode gathers the slots of its
sequences and scatters the new states back (`layers/gated_deltanet.py`).

The slot lives in the sequence's `KVSequence.state_slot`, next to its page table: a
KVSequence is everything the model remembers about a sequence, and `length` counts positions
held in the pages and summarised by the state alike, so the two cannot drift apart.

Unlike KV pages, a state summarises the whole prefix up to `length` and cannot be cut back to
an earlier position: a radix prefix can be resumed only where a state of exactly that
position was saved (`kv/anchors.py`).
"""

from __future__ import annotations

import torch

from freetoken.errors import FreetokenError
from freetoken.model_config import ModelConfig


class OutOfStateSlotsError(FreetokenError, RuntimeError):
    """Every recurrent state slot is held by a running sequence."""


class RecurrentStatePool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        conv_shape: tuple[int, ...],
        ssm_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_slots = num_slots
        self.conv = torch.zeros(num_layers, num_slots, *conv_shape, dtype=dtype, device=device)
        self.ssm = torch.zeros(
            num_layers, num_slots, *ssm_shape, dtype=torch.float32, device=device
        )
        self._free = list(range(num_slots - 1, -1, -1))  # low slots first

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str
    ) -> RecurrentStatePool | None:
        """The pool a model needs, or None when no layer carries a recurrent state."""
        la = cfg.linear_attention
        if la is None or not cfg.has_recurrent_state:
            return None
        return cls(
            num_layers=len(cfg.linear_layer_ids),
            num_slots=num_slots,
            conv_shape=(la.conv_dim, la.conv_kernel - 1),
            ssm_shape=(la.num_value_heads, la.key_head_dim, la.value_head_dim),
            dtype=dtype,
            device=device,
        )

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one sequence's state over all layers (what one anchor copy costs)."""
        return (self.conv[:, 0].numel() * self.conv.element_size()) + (
            self.ssm[:, 0].numel() * self.ssm.element_size()
        )

    def alloc(self) -> int:
        """A zeroed slot: the state of an empty sequence."""
        if not self._free:
            raise OutOfStateSlotsError(
                f"all {self.num_slots} recurrent state slots are in use; run fewer requests "
                f"at once or raise the engine's max batch size"
            )
        slot = self._free.pop()
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()
        return slot

    def copy(self, src: int, dst: int) -> None:
        """Slot `dst`'s state becomes slot `src`'s (every layer's conv and SSM state)."""
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"recurrent state slot {slot} is not allocated")
        self._free.append(slot)
