"""Routing traces and an expert-cache simulator to replay them.

A trace is the (layer, expert) routing of decode tokens, requests back to back. Decode visits
the MoE layers in a fixed cycle (layer 0..L-1 for token t, then layer 0.. for token t+1), so one
*step* is one (token, layer): its routed experts (unique) are looked up in a cache of S slots
shared by all layers; hits count; every miss is filled, evicting the policy's lowest keep-score
slots, never a slot that holds an expert of the step itself.

`replay` drives an `EvictionPolicy` (moe/policy.py) through exactly the calls the real cache
makes; `belady` is the offline optimum under the same fill-every-miss rule; `static_oracle` is
the best fixed set chosen with whole-trace frequencies (an oracle too: it sees the future).

File format (`np.load`): `meta_json` (uint8 bytes of a JSON object with num_layers,
num_experts, top_k and `requests`: [{index, tokens, ...}]), `experts_NNNN` (int [tokens, layers,
top_k]) per request, optionally `probs_NNNN` (router probabilities, unused here).
"""

from __future__ import annotations

import heapq
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from freetoken.moe.policy import EvictionPolicy


@dataclass(frozen=True)
class Trace:
    """Decode routing: `requests[r]` is an int64 array [tokens, num_layers, top_k]."""

    num_layers: int
    num_experts: int
    top_k: int
    requests: tuple[np.ndarray, ...]
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for r in self.requests:
            if r.ndim != 3 or r.shape[1] != self.num_layers:
                raise ValueError(f"request routing must be [tokens, {self.num_layers}, k]")
            if r.size and (r.min() < 0 or r.max() >= self.num_experts):
                raise ValueError(f"expert ids must lie in [0, {self.num_experts})")

    @classmethod
    def from_routes(cls, requests: Sequence[Sequence], num_layers: int, num_experts: int) -> Trace:
        """Build from nested lists [request][token][layer] -> expert ids (tests, tools)."""
        arrays = tuple(
            np.asarray(r, dtype=np.int64).reshape(len(r), num_layers, -1) for r in requests
        )
        top_k = arrays[0].shape[2] if arrays else 0
        return cls(num_layers, num_experts, top_k, arrays)

    @property
    def num_pairs(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.requests)

    @property
    def num_steps(self) -> int:
        return self.num_tokens * self.num_layers

    def truncated(self, max_tokens: int | None) -> Trace:
        """The first `max_tokens` decode tokens (whole requests, the last one cut)."""
        if max_tokens is None or max_tokens >= self.num_tokens:
            return self
        out, left = [], max_tokens
        for r in self.requests:
            if left <= 0:
                break
            out.append(r[:left])
            left -= len(out[-1])
        return Trace(self.num_layers, self.num_experts, self.top_k, tuple(out), self.meta)

    def routes(self) -> np.ndarray:
        """All tokens back to back: int64 [tokens, num_layers, top_k]."""
        if not self.requests:
            return np.zeros((0, self.num_layers, self.top_k), dtype=np.int64)
        return np.concatenate(self.requests)

    def step_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat pair ids (`layer * E + expert`) of every step, unique within the step, in
        decode order, as (pairs, offsets): step i uses pairs[offsets[i]:offsets[i + 1]]."""
        routes = self.routes()
        n = routes.shape[0] * self.num_layers
        rows = np.sort(routes.reshape(n, -1), axis=1)
        keep = np.ones(rows.shape, dtype=bool)
        keep[:, 1:] = rows[:, 1:] != rows[:, :-1]
        layer = np.tile(np.arange(self.num_layers, dtype=np.int64), routes.shape[0])
        flat = (rows + layer[:, None] * self.num_experts)[keep]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(keep.sum(axis=1), out=offsets[1:])
        return flat, offsets

    def steps(self) -> Iterator[tuple[int, int, int, np.ndarray]]:
        """(request, token within request, layer, unique expert ids) in decode order."""
        for ri, r in enumerate(self.requests):
            for t in range(len(r)):
                for layer in range(self.num_layers):
                    yield ri, t, layer, np.unique(r[t, layer])


def load_trace(path: str | Path) -> Trace:
    """Read a trace `.npz` (format in the module docstring)."""
    with np.load(path) as z:
        meta = json.loads(bytes(z["meta_json"]).decode())
        reqs = tuple(z[f"experts_{int(r['index']):04d}"].astype(np.int64) for r in meta["requests"])
    return Trace(int(meta["num_layers"]), int(meta["num_experts"]), int(meta["top_k"]), reqs, meta)


def capacity_slots(trace: Trace, fraction: float) -> int:
    """Slots for a capacity given as a fraction of the L*E pairs (rounded, at least top_k)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"capacity fraction must be in (0, 1], got {fraction}")
    return max(trace.top_k, round(fraction * trace.num_pairs))


def _check_capacity(trace: Trace, num_slots: int) -> None:
    if num_slots < trace.top_k:
        raise ValueError(f"{num_slots} slots is below top_k={trace.top_k}: a step would not fit")


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    capacity_slots: int
    hits: int
    accesses: int
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def misses(self) -> int:
        return self.accesses - self.hits


def replay(
    trace: Trace, capacity_slots: int, policy: EvictionPolicy, device: str | torch.device = "cpu"
) -> ReplayResult:
    """Simulate the global expert cache with `policy` choosing victims; count hits.

    The cache model is the real one's tables: `slot_of[L*E + 1]` (slot of a pair, -1 when not
    cached; the extra entry is a sink so that index -1 writes go nowhere) and `pair_of_slot[S]`
    (-1 when empty). Slots fill in order while free; once full every miss evicts.
    """
    L, E, S = trace.num_layers, trace.num_experts, capacity_slots
    _check_capacity(trace, S)
    t0 = time.perf_counter()
    flat, offsets = trace.step_pairs()
    pairs_all = torch.from_numpy(flat).to(device)
    experts_all = pairs_all % E
    offs = offsets.tolist()
    slot_of = torch.full((L * E + 1,), -1, dtype=torch.long, device=device)
    pair_of_slot = torch.full((S,), -1, dtype=torch.long, device=device)
    policy.reset(L, E, S, device)
    hits = used = 0
    inf = float("inf")
    for i in range(len(offs) - 1):
        layer = i % L
        a, b = offs[i], offs[i + 1]
        pairs = pairs_all[a:b]
        slots = slot_of[pairs]
        miss = slots < 0
        n_miss = int(miss.sum())
        hits += (b - a) - n_miss
        if not n_miss:
            policy.observe(layer, experts_all[a:b])
            continue
        new = pairs[miss] if n_miss < b - a else pairs
        if used + n_miss <= S:
            target = torch.arange(used, used + n_miss, device=device)
            used += n_miss
        else:
            scores = torch.as_tensor(policy.slot_scores(layer, pair_of_slot), device=device)
            if n_miss < b - a:  # never evict what this step uses
                scores = scores.index_fill(0, slots[~miss], inf)
            target = torch.topk(scores, n_miss, largest=False, sorted=False).indices
            slot_of[pair_of_slot[target]] = -1
            used = S
        pair_of_slot[target] = new
        slot_of[new] = target
        # As the runtime does: the visit is observed after its victims are chosen.
        policy.observe(layer, experts_all[a:b])
    accesses = len(flat)
    return ReplayResult(policy.name, S, hits, accesses, time.perf_counter() - t0)


def belady(trace: Trace, capacity_slots: int) -> ReplayResult:
    """Offline optimum with every miss filled: evict the cached pair whose next use is farthest
    (never one of the current step's pairs). Next-use positions from one sort by (pair, step); a
    max-heap of (next use, pair) with lazy deletion."""
    L, E, S = trace.num_layers, trace.num_experts, capacity_slots
    _check_capacity(trace, S)
    t0 = time.perf_counter()
    flat, offsets = trace.step_pairs()
    n_steps = len(offsets) - 1
    step_of = np.repeat(np.arange(n_steps, dtype=np.int64), np.diff(offsets))
    # next_use[j]: step of the next access to the pair of access j (n_steps when none)
    next_use = np.full(len(flat), n_steps, dtype=np.int64)
    order = np.lexsort((step_of, flat))  # by pair, then by time
    same = flat[order][1:] == flat[order][:-1]
    next_use[order[:-1][same]] = step_of[order][1:][same]
    nxt = next_use.tolist()
    flat_l = flat.tolist()
    offs = offsets.tolist()
    cur_next = [-1] * (L * E)  # next use of each cached pair; -1 when not cached
    heap: list[tuple[int, int]] = []  # (-next use, pair), entries may be stale
    size = hits = 0
    for i in range(n_steps):
        a, b = offs[i], offs[i + 1]
        step = flat_l[a:b]
        new = [p for p in step if cur_next[p] < 0]
        hits += (b - a) - len(new)
        for j in range(a, b):
            p = flat_l[j]
            if cur_next[p] >= 0:
                cur_next[p] = nxt[j]
                heapq.heappush(heap, (-nxt[j], p))
        evict = size + len(new) - S
        held = []
        while evict > 0:
            neg, p = heapq.heappop(heap)
            if cur_next[p] != -neg:
                continue  # stale entry
            if p in step:
                held.append((neg, p))
                continue
            cur_next[p] = -1
            size -= 1
            evict -= 1
        for h in held:
            heapq.heappush(heap, h)
        for j in range(a, b):
            p = flat_l[j]
            if p in new:
                cur_next[p] = nxt[j]
                heapq.heappush(heap, (-nxt[j], p))
                size += 1
    return ReplayResult("belady", S, hits, len(flat), time.perf_counter() - t0)


def static_oracle(trace: Trace, capacity_slots: int) -> ReplayResult:
    """The `capacity_slots` most used pairs over the whole trace, fixed for its length (misses
    are not cached). An oracle: the set is chosen with knowledge of the future."""
    flat, _ = trace.step_pairs()
    t0 = time.perf_counter()
    counts = np.bincount(flat, minlength=trace.num_pairs)
    top = np.sort(counts)[::-1][:capacity_slots]
    return ReplayResult(
        "static-oracle", capacity_slots, int(top.sum()), len(flat), time.perf_counter() - t0
    )
