"""Fills a layer ahead: while a decode step's next layer runs its attention, the PCIe link is
idle, since a layer's misses are known only once its router has run. The model predicts the
next MoE layer's routes from the residual stream as it leaves this layer (that layer's router
over that layer's norm, attention skipped) and up to p of the predicted misses are copied then,
so the ones predicted right are hits when the layer routes (device-decided calls only:
moe/device_layer.py).

On CUDA the prediction, its plan (`DeviceControl.plan_ahead`) and the copies run on a side
stream, forked from the decode stream after the layer and joined in two places of the next
layer's call: before its plan (the tables must hold the prefetch) and before its fills and
expert kernel (no slot may be read or written while a prefetch copy lands in it). Both joins
are stream events, so a decode graph captures the fork and the joins like any other work.
On the CPU tier the same calls run in order, as the twin.

A prediction wrong costs a slot's old expert and link time that had nothing else to carry;
the outputs never change, since every route still runs on the expert it was routed to.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from freetoken.moe.device_control import DeviceControl
from freetoken.moe.fills import Fills


class Prefetch:
    def __init__(self, control: DeviceControl, fills: Fills, experts: int):
        """`experts`: up to this many predicted misses filled a layer (0: none)."""
        self.control, self.fills = control, fills
        self.experts = experts
        device = control.device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._planned: torch.cuda.Event | None = None  # the pending prefetch's plan, done
        self._held: tuple = ()  # what the side stream reads, kept alive until it is joined
        self.pending = False
        control.set_prefetch(experts)

    def rebind(self, control: DeviceControl) -> None:
        """Plan on `control` from now on (after a cache re-size)."""
        self.join()
        self.control = control
        control.set_prefetch(self.experts)

    def switch(self, on: bool) -> None:
        """For the coming steps: prefetch (up to `experts`) or predict and fill nothing, as
        hybrid's way of stepping says (moe/split.py StepModes)."""
        self.control.set_prefetch(self.experts if on else 0)

    @contextmanager
    def ahead(self, held: tuple = ()):
        """Where the model predicts a layer's routes and hands them to `submit(moe_layer, ids)`
        (ids [T, k], each token's likeliest first): on CUDA, the side stream forked from the
        current one after everything queued so far. `held`: tensors of the decode stream the
        prediction reads, kept until the join (their memory must not be reused before)."""
        self.join()
        if self.side is None:
            yield self._submit
            return
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        self._held = held
        with torch.cuda.stream(self.side):
            yield self._submit

    def _submit(self, moe_layer: int, ids: torch.Tensor) -> None:
        """Plan and copy the prefetch of `moe_layer` for the predicted routes `ids`: ranked by
        rank first (each token's first choice, then the seconds, ...), so the p filled are
        the likeliest of all tokens."""
        pairs = ids.t().reshape(-1) + moe_layer * self.control.num_experts
        fill_pairs, fill_slots = self.control.plan_ahead(moe_layer, pairs)
        if self.side is not None:
            self._planned = torch.cuda.Event()
            self._planned.record(self.side)
            self._held = (*self._held, pairs, fill_pairs, fill_slots)
        self.fills.launch(fill_pairs, fill_slots)
        self.pending = True

    def before_plan(self) -> None:
        """The decode stream waits for the pending prefetch's plan (its tables)."""
        if self.pending and self._planned is not None:
            torch.cuda.current_stream(self.side.device).wait_event(self._planned)

    def join(self) -> None:
        """The decode stream waits for the pending prefetch's copies too."""
        if not self.pending:
            return
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
        self.pending, self._planned, self._held = False, None, ()
