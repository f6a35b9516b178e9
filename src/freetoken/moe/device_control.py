"""The expert cache's decisions on the device: lookup, split, victims, table updates, the fill
list and the CPU's routes of one layer step, as fixed-shape tensor ops with no host sync, so a
decode graph holds them (and the fills, the expert kernel and the CPU's share after them) and
the host is out of the loop.

For one layer step with R = T x k routes (pairs [T, k], flat `layer * E + expert` ids):

    sorted = sort(pairs)              the routed pairs in order; `first` marks distinct ones
    slot   = slot_of[sorted]          hits have a slot, misses -1 (m of them)
    q = clamp(floor(m * f + 0.5), min(lo, m), min(hi, m))    the split (moe/split.py), from
                                      `split` = (f, lo, hi), which the host rewrites between
                                      steps; offload's is (1, R, R): every miss filled
    filled = the q misses the policy scores highest (ties: the lower pair)
    protected = slots of the hits     this step's kernel reads them: never victims
    victims = the q lowest keep-scores among the other slots (the policy's, on the device)
    tables: the victims' old pairs leave, the filled misses move in; the fill list is
            (pair, slot) per route, the sink slot S where nothing is copied
    slots  = slot_of[pairs]           every GPU route has a slot; the CPU's routes -1
    cpu_pairs[r] = pair where slots[r] < 0, else -1; cpu_weights[r] = its gate weight
    cpu_flag = any(slots < 0)         whether the CPU has a share (on the device)
    cpu_x = x                         the layer's activations, for the CPU (CUDA)
    the doorbell rung if cpu_flag     with `shape` (one-program plan only: moe/doorbell.py)

Every table has a sink entry at its end (`slot_of[P]`, `pair_of[S]`): a masked-off entry
reads or writes the sink instead of branching, and index -1 (an empty slot's pair, a missing
pair's slot) lands on it. The same code runs on the CPU (the cache tier in the tests) and on
CUDA; `kernels/expert_fill.py` does the copies on CUDA, reading the pinned host pool where it
lies, and `moe/doorbell.py` hands the CPU's routes to the CPU team from inside the graph. It
needs a slot for every route of a call (S >= R), which any real cache has for decode. On
CUDA, with the `expected-next-use` policy and up to 64 routes, the whole plan is one Triton
program (kernels/cache_control.py); these torch ops are its CPU twin and reference.

The policy must have a fixed-shape update (`observe_masked`); `expected-next-use` has one,
and is what device control uses when the configured policy has none.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from freetoken.kernels import cache_control
from freetoken.kernels.expert_fill import HostRows
from freetoken.moe.cache import ExpertCache
from freetoken.moe.policy import ExpectedNextUsePolicy

# counters per MoE layer, kept on the device and folded into the telemetry when it is read
CALLS, ACCESSES, HITS, FILLS, CPU_PAIRS, CPU_ROUTES, PREFETCHES = range(7)


class DeviceControl:
    def __init__(
        self,
        cache: ExpertCache,
        policy,
        split: torch.Tensor | None = None,
        cpu_inputs: tuple | None = None,
        bell: tuple | None = None,
    ):
        """`split`: float32 (f, lo, hi), read at every plan, which the host rewrites between
        steps (on CUDA pinned: the plan reads it where it lies); None fills every miss
        (offload). `cpu_inputs`: where
        plans write the CPU's share, (pairs int64 [>= R], weights fp32 [>= R], x [>= T, H] or
        None), mapped pinned memory on CUDA (moe/doorbell.py); None: a scratch of the
        control's own for the routes (the CPU tier reads x where it is). `bell`: the
        doorbell's (words, numbers) the one-program plan rings when the CPU has routes
        (moe/doorbell.py `signal`), or None."""
        if not hasattr(policy, "observe_masked"):
            raise ValueError(f"policy {policy.name!r} has no fixed-shape update for the device")
        store, device = cache.store, cache.device
        self.cache, self.policy, self.device = cache, policy, device
        self.num_experts = store.num_experts
        self.num_pairs, self.num_slots = store.num_pairs, cache.num_slots
        self.slot_of = torch.full((self.num_pairs + 1,), -1, dtype=torch.long, device=device)
        self.pair_of = torch.full((self.num_slots + 1,), -1, dtype=torch.long, device=device)
        self.counters = torch.zeros(store.num_layers, 7, dtype=torch.long, device=device)
        self.split = split
        # the prefetch's split (1, 0, p): up to p of a predicted call's misses filled
        # (`plan_ahead`), p written by the host between steps (`set_prefetch`, StepModes'
        # ways); on CUDA pinned, read by the plan where it lies, as the split is
        cuda = device.type == "cuda"
        self.ahead = torch.tensor([1.0, 0.0, 0.0], pin_memory=cuda)
        self.ahead_arg = HostRows(self.ahead) if cuda else self.ahead
        # what the one-program plan reads: the split where it lies, or offload's (every miss)
        if split is None:
            self.split_arg = torch.tensor([1.0, 2.0**30, 2.0**30], device=device)
        else:
            self.split_arg = HostRows(split) if device.type == "cuda" else split
        if cpu_inputs is None:
            pairs = torch.empty(self.num_slots, dtype=torch.long, device=device)
            weights = torch.empty(self.num_slots, dtype=torch.float32, device=device)
            cpu_inputs = (pairs, weights, None)
        self.cpu_pairs, self.cpu_weights, self.cpu_x = cpu_inputs
        self.bell = bell
        # whether the last plan left routes to the CPU (and rang the doorbell): the merge reads it
        self.cpu_flag = torch.zeros((), dtype=torch.bool, device=device)
        # scratch of the one-program plan: slot scores, victims, and per call size its outputs
        self.scores = torch.empty(self.num_slots + 1, dtype=torch.float32, device=device)
        self.victims = torch.empty(cache_control.MAX_ROUTES, dtype=torch.long, device=device)
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.fused = (
            device.type == "cuda"
            and cache_control.triton is not None
            and isinstance(policy, ExpectedNextUsePolicy)
        )
        self.pull_host_tables()

    def fits(self, routes: int) -> bool:
        """Whether a call of this many routes can be decided here: a slot for each, and room
        in the CPU's route buffers; with a split on CUDA, within the one-program plan (the
        torch form reads the split on the host, which a graph would freeze)."""
        if routes > min(self.num_slots, self.cpu_pairs.numel()):
            return False
        return (
            self.split is None
            or self.device.type != "cuda"
            or (self.fused and routes <= cache_control.MAX_ROUTES)
        )

    # -- keeping the host tables and these in step -----------------------------------------
    # A call the host decides (a prefill chunk, a streamed layer) works on the cache's host
    # tables: they are brought up to date before it and read back after it. Always copied,
    # never flagged: a graph replay changes these tables without any Python running.

    def pull_host_tables(self) -> None:
        """Take the cache's host tables (after host-side placements)."""
        self.slot_of[:-1].copy_(self.cache.slot_of)
        self.pair_of[:-1].copy_(self.cache.pair_of)

    def push_host_tables(self) -> None:
        """Give the cache's host tables the current placement (before a host-side step)."""
        self.cache.slot_of.copy_(self.slot_of[:-1])
        self.cache.pair_of.copy_(self.pair_of[:-1])

    @contextmanager
    def host_tables(self):
        """A call the host decides, in between: the host tables pushed before it, pulled after."""
        self.push_host_tables()
        try:
            yield
        finally:
            self.pull_host_tables()

    # -- one layer step -----------------------------------------------------------------------

    def outputs(self, routes: int, ahead: bool = False) -> tuple[torch.Tensor, ...]:
        """The one-program plan's outputs for calls of this many routes (made once, outside
        any capture: a shape runs eagerly before it is captured); a prefetch's are its own,
        since its fills may still read them while the next call's plan writes its own."""
        key = (routes, ahead)
        if key not in self._outputs:
            self._outputs[key] = tuple(
                torch.empty(routes, dtype=torch.long, device=self.device) for _ in range(3)
            )
        return self._outputs[key]

    def set_prefetch(self, experts: int) -> None:
        """Prefetch up to `experts` of each predicted call's misses (0: none), between steps."""
        self.ahead.numpy()[2] = experts

    def plan(
        self,
        moe_layer: int,
        pairs: torch.Tensor,
        weights: torch.Tensor,
        x=None,
        shape: int = 0,
        stamp=None,
    ):
        """Decide a layer step. Returns (slots [T, k], fill_pairs [R], fill_slots [R]): the slot
        of every GPU route once the fills are done (-1: the CPU's), and the copies to make
        (fill_slots == S, the sink, where there is none). The CPU's routes go to
        `cpu_pairs[:R]` / `cpu_weights[:R]`, and x [T, H] to `cpu_x` where there is one;
        `shape`: what the doorbell's shape word says of this step, where there is a bell;
        `stamp`: where the one-program plan writes the device's clock as it starts (moe/split.py
        `StepClock`), None for no stamp."""
        if self.fused and pairs.numel() <= cache_control.MAX_ROUTES:
            return cache_control.plan_layer(self, moe_layer, pairs, weights, x, shape, stamp)
        # (x and the stamp are only for a doorbell, whose calls `fits` keeps on the
        # one-program plan)
        return self.plan_torch(moe_layer, pairs, weights)

    def fused_for(self, routes: int) -> bool:
        """Whether a call of this many routes is planned by the one-program plan."""
        return self.fused and routes <= cache_control.MAX_ROUTES

    def plan_ahead(self, moe_layer: int, pairs: torch.Tensor):
        """A prefetch: up to p of the misses of the predicted routes `pairs` [R] filled, the
        first in route order (put the likeliest first), into the lowest-scored slots but the
        predicted hits'. -> (fill_pairs [R], fill_slots [R]), the copies to make. No route
        runs, the CPU is given nothing and the policy sees no use: only the tables and the
        prefetch counter change."""
        if self.fused_for(pairs.numel()):
            weights = torch.empty(0, device=self.device)  # (read by no route: none is run)
            _, fill_pairs, fill_slots = cache_control.plan_layer(
                self, moe_layer, pairs, weights, ahead=True
            )
            return fill_pairs, fill_slots
        return self.plan_torch(moe_layer, pairs, None, ahead=True)[1:]

    def plan_torch(
        self, moe_layer: int, pairs: torch.Tensor, weights: torch.Tensor | None, ahead=False
    ):
        """`plan` (or with `ahead`, `plan_ahead`) as torch ops: the CPU twin and the
        reference of the one-program plan."""
        S, P = self.num_slots, self.num_pairs
        flat = pairs.reshape(-1)
        R = flat.numel()
        ordered, position = flat.sort(stable=True)
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[1:] = ordered[1:] != ordered[:-1]
        slot = self.slot_of[ordered]
        hit = first & (slot >= 0)
        miss = first & (slot < 0)
        if ahead:  # the earliest routes first
            miss = miss & self._filled(self.ahead, -position.float(), miss)
        elif self.split is not None:
            scores = torch.as_tensor(self.policy.pair_scores(moe_layer, ordered)).float()
            miss = miss & self._filled(self.split, scores, miss)
        # (`miss` from here on: the misses filled; the others stay out of the cache)
        # Keep-scores of every slot (empty: -inf); the hits' slots are protected.
        scores = self.scores
        scores[:S] = torch.as_tensor(self.policy.slot_scores(moe_layer, self.pair_of[:S]))
        # (index_fill_, not an indexed assignment of a Python number: that copies the number
        # from the host, which a graph capture refuses)
        scores.index_fill_(0, torch.where(hit, slot, S), float("inf"))
        victims = torch.topk(scores[:S], min(R, S), largest=False, sorted=True).indices
        rank = torch.cumsum(miss, 0) - 1
        fill_slots = torch.where(miss, victims[rank.clamp(min=0)], S)
        fill_pairs = torch.where(miss, ordered, P)
        # The victims' old pairs leave (an empty victim's -1 and the sink's land on the sink),
        # then the misses move in; the sinks are reset after.
        evicted = self.pair_of[fill_slots]
        self.slot_of.index_fill_(0, torch.where(miss, evicted, P), -1)
        self.slot_of[fill_pairs] = fill_slots
        self.pair_of[fill_slots] = fill_pairs
        self.slot_of[P:].fill_(-1)
        self.pair_of[S:].fill_(-1)
        if ahead:
            self.counters[moe_layer, PREFETCHES].add_(miss.sum())
            return None, fill_pairs, fill_slots
        experts = ordered - moe_layer * self.num_experts
        self.policy.observe_masked(moe_layer, experts, first)
        routed = self.slot_of[pairs]
        on_cpu = routed.reshape(-1) < 0
        self.cpu_flag.copy_(on_cpu.any())
        self.cpu_pairs[:R] = torch.where(on_cpu, flat, -1)
        self.cpu_weights[:R] = weights.reshape(-1).float()
        # the CPU's pairs: distinct routed ones neither hit nor filled
        cpu = first.sum() - hit.sum() - miss.sum()
        counts = torch.stack([first.sum(), hit.sum(), miss.sum(), cpu, on_cpu.sum()])
        self.counters[moe_layer, ACCESSES:PREFETCHES].add_(counts)
        self.counters[moe_layer, CALLS].add_(1)
        return routed, fill_pairs, fill_slots

    @staticmethod
    def _filled(split, scores, miss) -> torch.Tensor:
        """Which of the misses (`miss` over the sorted pairs) `split` = (f, lo, hi) fills:
        the q of the highest `scores`, ties to the lower pair (the sort is stable)."""
        f, lo, hi = split[0], split[1], split[2]
        m = miss.sum()
        q = torch.floor(m.to(torch.float32) * f + 0.5).long()
        lo, hi = torch.minimum(lo.long(), m), torch.minimum(hi.long(), m)
        q = torch.minimum(torch.maximum(q, lo), hi)
        key = torch.where(miss, scores, float("-inf"))
        order = torch.sort(key, descending=True, stable=True).indices
        rank = torch.empty_like(order)
        rank[order] = torch.cumsum(miss[order], 0) - 1
        return rank < q

    def take_counters(self) -> torch.Tensor:
        """[L, 7] counts since the last call (calls, accesses, hits, fills, CPU pairs, CPU
        routes, prefetches), on the host."""
        out = self.counters.to("cpu", copy=True)  # a copy on the CPU tier too
        self.counters.zero_()
        return out
