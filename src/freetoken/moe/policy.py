"""Expert-cache eviction policies (pure array math, no engine imports).

The VRAM cache is one pool of S slots shared by every MoE layer. Decode visits the layers in
a fixed cycle, so a slot holding (layer l, expert e) is next *looked at* a known number of
layer-steps from now; whether it is *used* then is the uncertain part. Policies keep per-pair
state in flat tensors indexed by `layer * E + expert` plus one sink entry at the end (index
-1), so that the -1 of an empty slot gathers a -inf score without a mask.

Every method is a handful of array ops over the L*E pairs or the S slots: no per-expert
Python, no host sync, the same code on CUDA and CPU. The per-visit methods are written with
operators and indexing only, so they run on numpy views of the state where it lives on the host
(the engine's case: a numpy op on a few hundred floats costs about 1 us, a torch op 5-10, and
the runtime makes about 15 of them per layer per token) and on the tensors themselves on a GPU;
the once-per-token learning over [L, E, E] stays torch (one pass per in-place op). Arguments
are int arrays or tensors; scores come back as the state's kind (numpy on the host). The
runtime calls `observe` once per
layer per decode step, right after that layer's victims are chosen (so the update runs while
the fills and the CPU share are in flight, off their path; on the gpt-oss-20b trace this
costs 0.0-0.5 points of hit rate against observing first), and `slot_scores` when it must
evict.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------
# Eviction policies
# ---------------------------------------------------------------------------------------------


class EvictionPolicy(Protocol):
    name: str

    def reset(self, num_layers: int, num_experts: int, num_slots: int, device) -> None: ...

    def observe(self, layer: int, experts) -> None:
        """The unique expert ids routed at `layer` this step, hits and misses; called once per
        layer per step, in decode order, after that layer's victim choice."""
        ...

    def slot_scores(self, layer: int, cached_pairs):
        """cached_pairs: [S] flat pair ids (layer*E + expert) held by each slot, -1 for empty.
        Return float [S] keep-scores at this moment: lower = evict first; empty slots must get
        -inf."""
        ...

    def pair_scores(self, layer: int, pairs):
        """Keep-score of not-yet-cached pairs on the same scale (used to rank which misses to
        fill first when only some are filled)."""
        ...


class _ArrayState:
    """Where a policy's state lives, and how its per-visit math reaches it (see above)."""

    def _place(self, device) -> None:
        self.device = torch.device(device)
        self.on_host = self.device.type == "cpu"

    def _view(self, t: torch.Tensor):
        return t.numpy() if self.on_host else t

    def _ids(self, ids):
        """Expert or pair ids as the state's kind of index."""
        return np.asarray(ids) if self.on_host else torch.as_tensor(ids, device=self.device)

    def slot_scores(self, layer: int, cached_pairs):
        # The pairs' own scores: the state's sink entry, which index -1 reads, scores -inf.
        return self.pair_scores(layer, cached_pairs)


class LRUPolicy(_ArrayState):
    """Least recently used: the keep-score is the step of the last use."""

    name = "lru"

    def reset(self, num_layers: int, num_experts: int, num_slots: int, device) -> None:
        self._place(device)
        self.E = num_experts
        # float64: step counts stay exact for 2**53 steps
        last = torch.zeros(num_layers * num_experts + 1, dtype=torch.float64, device=device)
        last[-1] = float("-inf")
        self.last = self._view(last)
        self.clock = 0

    def observe(self, layer: int, experts) -> None:
        self.clock += 1
        self.last[self._ids(experts) + layer * self.E] = float(self.clock)

    def pair_scores(self, layer: int, pairs):
        return self.last[self._ids(pairs)]


def _layer_distance(num_layers: int, num_experts: int, device) -> torch.Tensor:
    """[L, L*E + 1]: layer-steps from the moment layer `cur` is served until a pair's layer is
    visited next (1..L; a pair of layer `cur` itself waits for the next token, L). The sink
    column is +inf."""
    L, E = num_layers, num_experts
    cur = torch.arange(L, device=device)[:, None]
    pair_layer = torch.arange(L, device=device).repeat_interleave(E)[None, :]
    d = (pair_layer - cur - 1) % L + 1
    inf = torch.full((L, 1), float("inf"), device=device)
    return torch.cat([d.float(), inf], dim=1)


class ExpectedNextUsePolicy(_ArrayState):
    """Evict the pair with the largest expected distance (in layer-steps) to its next use.

    A pair of layer l is looked at again in d layer-steps (known from the fixed layer cycle)
    and is used there with probability p, an EMA of its use over the visits of layer l; if
    each visit were an independent coin the expected distance is d + L*(1-p)/p. The keep-score
    is its negative. (Rate 0.05 measured best of 0.005..0.1 on gpt-oss-20b decode: a fast
    EMA doubles as recency.)
    """

    name = "expected-next-use"

    def __init__(self, rate: float = 0.05, floor: float = 1e-3) -> None:
        self.rate, self.floor = rate, floor

    def reset(self, num_layers: int, num_experts: int, num_slots: int, device) -> None:
        self._place(device)
        L, E = num_layers, num_experts
        self.L, self.E = L, E
        self.neg_dist = self._view(-_layer_distance(L, E, device))  # sink column -inf: empty
        self.p = self._view(torch.full((L, E), 1.0 / E, device=device))
        # -L*(1-p)/p per pair, refreshed for the visited layer; [-1] is the sink
        neg_wait = torch.full((L * E + 1,), -L * (E - 1.0), device=device)
        neg_wait[-1] = 0.0
        self.neg_wait = self._view(neg_wait)
        self._rows = [self.neg_wait[layer * E : (layer + 1) * E] for layer in range(L)]

    def observe(self, layer: int, experts) -> None:
        p = self.p[layer]
        p *= 1.0 - self.rate
        p[self._ids(experts)] += self.rate  # a visit's ids are distinct
        # -L * (1 - p) / p = L - L / p
        self._rows[layer][:] = self.L - self.L / p.clip(min=self.floor)

    def observe_masked(self, layer: int, experts, mask) -> None:
        """`observe` in fixed shapes, for a decode graph (moe/device_control.py): `experts`
        [R] may repeat, `mask` marks one of each; the same result to the bit (adding a zero
        changes no float)."""
        p = self.p[layer]
        p *= 1.0 - self.rate
        if self.on_host:
            p[np.asarray(experts)[np.asarray(mask)]] += self.rate
        else:
            p.index_add_(0, experts, mask.to(p.dtype) * self.rate)
        self._rows[layer][:] = self.L - self.L / p.clip(min=self.floor)

    def pair_scores(self, layer: int, pairs):
        pairs = self._ids(pairs)
        return self.neg_dist[layer][pairs] + self.neg_wait[pairs]


class ReuseDensityPolicy(_ArrayState):
    """Keep the pairs with the most expected uses per layer-step of cache space.

    The keep-score of pair j (layer l) while layer `cur` is served is

        (q1 + q2) / (d + L)

    the expected uses at the next two visits of layer l divided by the layer-steps until the
    second of them (d from the fixed layer cycle, then one full cycle). The probabilities come
    from two online models of each layer's visit-to-visit (token-to-token) routing:

    - a two-state Markov chain per pair: p_hot = P(used | used at the previous visit),
      p_cold = P(used | not used at the previous visit), EMAs with rate `markov_rate`.
      On gpt-oss-20b decode P(used | used at the previous token) is 0.43 against a 0.125
      average.
    - a per-layer transition table T[l, i, j] = P(j used | i used at the previous visit),
      EMA rate `transition_rate`, read as a lift mean_i T[l, i, j] / P(j) over the experts i
      of the latest visit (self-transition left to the chain), which multiplies the odds of
      q1 with exponent `lift_weight`.

    q2 carries q1 one more visit through the chain. `observe` refreshes the visited layer's
    scores at once (~15 ops on E-element rows); the learning (EMAs over [L, E] and [L, E, E])
    runs once per token, when the last layer has been observed, a lag that costs nothing
    measurable. Eviction is one multiply and one gather over the S slots.
    """

    name = "reuse-density"

    def __init__(
        self,
        markov_rate: float = 0.03,
        transition_rate: float = 0.05,
        marginal_rate: float = 0.01,
        lift_weight: float = 2.0,
        floor: float = 1e-3,
        name: str | None = None,
    ) -> None:
        if name is not None:
            self.name = name
        self.markov_rate, self.transition_rate = markov_rate, transition_rate
        self.marginal_rate, self.lift_weight, self.floor = marginal_rate, lift_weight, floor

    def reset(self, num_layers: int, num_experts: int, num_slots: int, device) -> None:
        self._place(device)
        L, E = num_layers, num_experts
        n = L * E
        self.L, self.E = L, E
        f = dict(device=device, dtype=torch.float32)
        # 1 / (d + L) per serving layer; the sink column (empty slot) is -inf
        inv_span = 1.0 / (_layer_distance(L, E, device) + L)
        inv_span[:, -1] = float("-inf")
        prior = min(4.0 / E, 0.5)  # a typical top-k share before anything is seen
        self.p = torch.empty(2, L, E, **f)  # [p_hot, p_cold]
        self.p[0], self.p[1] = 0.3, prior
        self.trans = torch.full((L, E, E), prior, **f)
        self.trans.diagonal(dim1=1, dim2=2).zero_()
        self.marg = torch.full((L, E), prior, **f)
        self.inv_marg = 1.0 / self.marg
        # weights of a mean over the other experts of a visit with k experts: 1/k, 1/(k-1)
        self._inv_k = [0.0] + [1.0 / k for k in range(1, E + 1)]
        self._inv_k1 = [0.0, 0.0] + [1.0 / (k - 1) for k in range(2, E + 1)]
        # use at the previous and at the latest visit of each layer
        self.prev = torch.zeros(L, E, **f)
        self.cur = torch.zeros(L, E, **f)
        self.value = torch.full((n + 1,), prior, **f)  # q1 + q2; [-1] is the empty-slot sink
        self._w_base = torch.tensor([0.0, self.markov_rate], **f)[:, None, None]
        self._w_sign = torch.tensor([self.markov_rate, -self.markov_rate], **f)[:, None, None]
        # what `observe` and the scores read and write (see the module docstring)
        self._inv_span, self._p, self._trans, self._inv_marg, self._cur, self._value = map(
            self._view, (inv_span, self.p, self.trans, self.inv_marg, self.cur, self.value)
        )
        self._rows = [self._value[layer * E : (layer + 1) * E] for layer in range(L)]

    def observe(self, layer: int, experts) -> None:
        experts = self._ids(experts)
        k = len(experts)
        used = self._cur[layer]
        used[:] = 0.0
        used[experts] = 1.0
        p_hot, p_cold = self._p[0, layer], self._p[1, layer]
        # lift of each expert given this visit's experts: mean over the others of T[l, i, j],
        # the column sums over the visit's rows (the diagonal is kept at zero: the
        # self-transition is the chain's business) over k - 1 for a used j, k for the others
        mean_w = self._inv_k[k] + used * (self._inv_k1[k] - self._inv_k[k])
        c = self._trans[layer][experts].sum(0) * mean_w
        lift = (c * self._inv_marg[layer]) ** self.lift_weight
        if k == 1:
            lift = lift + used  # a lone expert has no others to learn from: neutral lift 1
        # q1: next-visit probability from the chain state, its odds scaled by the lift
        q = p_cold + used * (p_hot - p_cold)
        qx = q * lift
        q1 = qx / (qx - q + 1.0)  # = qx / (1 - q + qx)
        # q1 + q2, q2 = q1 * p_hot + (1 - q1) * p_cold
        self._rows[layer][:] = q1 + p_cold + q1 * (p_hot - p_cold)
        if layer == self.L - 1:
            self._learn()

    def _learn(self) -> None:
        """One token of learning for every layer: the chain row and the transition rows that
        the previous visit selected move toward this visit's use."""
        prev, cur = self.prev, self.cur
        w = torch.addcmul(self._w_base, self._w_sign, prev)  # [2, L, E]: hot row if used
        self.p.lerp_(cur.expand(2, -1, -1), w).clamp_(self.floor, 1.0 - self.floor)
        # Only the rows of the previous visit's experts move (k of E per layer): a pass over
        # the whole [L, E, E] table cost 0.15-0.45 ms per token beside the CPU expert team.
        layer, expert = prev.nonzero(as_tuple=True)
        rows = self.trans[layer, expert].lerp_(cur[layer], self.transition_rate)
        rows[torch.arange(len(expert), device=rows.device), expert] = 0.0  # the diagonal
        self.trans[layer, expert] = rows
        self.marg.lerp_(cur, self.marginal_rate).clamp_(min=self.floor)
        torch.reciprocal(self.marg, out=self.inv_marg)
        prev.copy_(cur)

    def pair_scores(self, layer: int, pairs):
        pairs = self._ids(pairs)
        return self._value[pairs] * self._inv_span[layer][pairs]


def default_policy() -> EvictionPolicy:
    """The policy the engine uses unless told otherwise."""
    return ReuseDensityPolicy()


# name -> factory of a fresh policy (policies hold state: one instance per cache)
POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "expected-next-use": ExpectedNextUsePolicy,
    # the default without the transition lift: what the two-state chain alone gives
    "markov-density": lambda: ReuseDensityPolicy(lift_weight=0.0, name="markov-density"),
    "reuse-density": ReuseDensityPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}"
        ) from None


# ---------------------------------------------------------------------------------------------
# (end of the eviction policies)
# ---------------------------------------------------------------------------------------------
