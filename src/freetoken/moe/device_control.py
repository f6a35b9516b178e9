"""The expert cache's decisions on the device: lookup, victims, table updates and the fill
list of one layer step, as fixed-shape tensor ops with no host sync, so a decode graph holds
them (and the fills and the expert kernel after them) and the host is out of the loop.

For one layer step with R = T x k routes (pairs [T, k], flat `layer * E + expert` ids):

    sorted = sort(pairs)              the routed pairs in order; `first` marks distinct ones
    slot   = slot_of[sorted]          hits have a slot, misses -1
    protected = slots of the hits     this step's kernel reads them: never victims
    victims = the R lowest keep-scores among the other slots (the policy's, on the device):
              one top-k over the S slots, the same cost for any number of misses
    miss j  -> victims[rank of j among the misses]
    tables: the victims' old pairs leave, the misses move in; the fill list is
            (pair, slot) per route, the sink slot S where nothing is copied
    slots  = slot_of[pairs]           every route now has a slot

Every table has a sink entry at its end (`slot_of[P]`, `pair_of[S]`): a masked-off entry
reads or writes the sink instead of branching, and index -1 (an empty slot's pair, a missing
pair's slot) lands on it. The same code runs on the CPU (the cache tier in the tests) and on
CUDA; `kernels/expert_fill.py` does the copies on CUDA, reading the pinned host pool where it
lies. It needs a slot for every route of a call (S >= R), which any real cache has for decode.
On CUDA, with the `expected-next-use` policy and up to 64 routes, the whole plan is one Triton
program (kernels/cache_control.py); these torch ops are its CPU twin and reference.

The policy must have a fixed-shape update (`observe_masked`); `expected-next-use` has one,
and is what device control uses when the configured policy has none.
"""

from __future__ import annotations

import torch

from freetoken.kernels import cache_control
from freetoken.moe.cache import ExpertCache
from freetoken.moe.policy import ExpectedNextUsePolicy

# counters per MoE layer, kept on the device and folded into the telemetry when it is read
CALLS, ACCESSES, HITS, FILLS = range(4)


class DeviceControl:
    def __init__(self, cache: ExpertCache, policy):
        if not hasattr(policy, "observe_masked"):
            raise ValueError(f"policy {policy.name!r} has no fixed-shape update for the device")
        store, device = cache.store, cache.device
        self.cache, self.policy, self.device = cache, policy, device
        self.num_experts = store.num_experts
        self.num_pairs, self.num_slots = store.num_pairs, cache.num_slots
        self.slot_of = torch.full((self.num_pairs + 1,), -1, dtype=torch.long, device=device)
        self.pair_of = torch.full((self.num_slots + 1,), -1, dtype=torch.long, device=device)
        self.counters = torch.zeros(store.num_layers, 4, dtype=torch.long, device=device)
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
        """Whether a call of this many routes can be decided here (a slot for each)."""
        return routes <= self.num_slots

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

    # -- one layer step -----------------------------------------------------------------------

    def outputs(self, routes: int) -> tuple[torch.Tensor, ...]:
        """The one-program plan's outputs for calls of this many routes (made once, outside
        any capture: a shape runs eagerly before it is captured)."""
        if routes not in self._outputs:
            self._outputs[routes] = tuple(
                torch.empty(routes, dtype=torch.long, device=self.device) for _ in range(3)
            )
        return self._outputs[routes]

    def plan(self, moe_layer: int, pairs: torch.Tensor):
        """Decide a layer step. Returns (slots [T, k], fill_pairs [R], fill_slots [R]): the slot
        of every route once the fills are done, and the copies to make (fill_slots == S,
        the sink, where there is none)."""
        if self.fused and pairs.numel() <= cache_control.MAX_ROUTES:
            return cache_control.plan_layer(self, moe_layer, pairs)
        return self.plan_torch(moe_layer, pairs)

    def plan_torch(self, moe_layer: int, pairs: torch.Tensor):
        """`plan` as torch ops: the CPU twin and the reference of the one-program plan."""
        S, P = self.num_slots, self.num_pairs
        flat = pairs.reshape(-1)
        R = flat.numel()
        ordered = flat.sort().values
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[1:] = ordered[1:] != ordered[:-1]
        slot = self.slot_of[ordered]
        hit = first & (slot >= 0)
        miss = first & (slot < 0)
        # Keep-scores of every slot (empty: -inf); the hits' slots are protected.
        scores = self.scores
        scores[:S] = torch.as_tensor(self.policy.slot_scores(moe_layer, self.pair_of[:S]))
        # (index_fill_, not an indexed assignment of a Python number: that copies the number
        # from the host, which a graph capture refuses)
        scores.index_fill_(0, torch.where(hit, slot, S), float("inf"))
        victims = torch.topk(scores[:S], R, largest=False, sorted=True).indices
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
        experts = ordered - moe_layer * self.num_experts
        self.policy.observe_masked(moe_layer, experts, first)
        counts = torch.stack([first.sum(), hit.sum(), miss.sum()])
        self.counters[moe_layer, ACCESSES:].add_(counts)
        self.counters[moe_layer, CALLS].add_(1)
        return self.slot_of[pairs], fill_pairs, fill_slots

    def take_counters(self) -> torch.Tensor:
        """[L, 4] counts since the last call (calls, accesses, hits, fills), on the host."""
        out = self.counters.to("cpu", copy=True)  # a copy on the CPU tier too
        self.counters.zero_()
        return out
