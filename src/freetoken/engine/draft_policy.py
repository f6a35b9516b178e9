"""How many drafted tokens a decode step verifies: a cost model, each step, down to none.

A verify step feeds each drafting request its last token and up to k drafted ones; it yields
the kept drafts plus one token. Whether that beats decoding one token depends on the machine
and the moment: with every expert on the GPU a step at batch 1 is bound by latency, and a few
more rows cost almost nothing; under offload each extra token routes to experts the others did
not (the union of top-k choices over t tokens grows as E * (1 - (1 - k/E)^t)), and the ones
the cache misses cost PCIe or CPU time; on a small CPU an extra row costs nearly a token.

So the engine measures what a step costs, by (sequences, tokens), every step whose time is its
steady cost (not one that captured a CUDA graph, ran beside a prefill chunk or right after
one), and each request's acceptance: drafted tokens
kept until the first rejection, counted with decay so old evidence fades. Each step it picks
the draft cap k that maximises expected tokens per second over the decoding requests:

    tokens(k) = sum over requests of 1 + a + ... + a^d   (a: its acceptance, d: min(k, its draft))
    seconds(k) = cost(sequences, sequences + sum of d)

A shape not measured yet is estimated from the largest measured one below it, grown by the
expert bytes the extra tokens add where they miss the cache (`miss_rate` x the union's growth):
optimistic with the experts on the GPU (one verify step then measures it), pessimistic when
most experts miss: trained routers send consecutive tokens to overlapping experts (on
gpt-oss-20b's traces five tokens route to 10.5 distinct experts a layer where uniform routing
gives 15.6), which the formula can't know. So a shape the estimate rejects is still measured
now and then: every `PROBE_EVERY` steps that have drafts, the shortest draft cap above the
chosen one whose shape is unmeasured, or was last measured `STALE_STEPS` drafting steps ago, is
verified once (at batch 1 the four shapes cost a few slow steps in the first hundred, then one
every few hundred), and so is a stale plain step while every step drafts. Without a measured
plain step nothing is drafted. A request whose drafts
fail is drafted for less and less; its evidence fades each step it does not draft, back to
the prior, so it is tried again later (a few percent of steps at most, where drafts are found
at all). The prior is every request's drafts pooled: a workload whose drafts are kept (an
agent's edits) starts each new request drafting, one whose drafts fail starts it cautious.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from freetoken.engine.runner import ModelRunner

DECAY = 0.8  # weight of a request's earlier drafts against its latest
COST_WEIGHT = 0.2  # weight of the newest measured step in a shape's running mean
PROBE_EVERY = 16  # drafting steps between two probes of a shape the cost model would not pick
STALE_STEPS = 512  # drafting steps after which a measured shape is probed again


@dataclass
class Acceptance:
    """A request's drafting record: tokens kept, and drafts cut short by a rejection."""

    kept: float = 0.0
    rejected: float = 0.0
    prior: float = 0.5  # the rate with no evidence (worth two drafted tokens)

    def rate(self) -> float:
        """The chance the next drafted token is kept, given the ones before it were."""
        return (self.kept + 2.0 * self.prior) / (self.kept + self.rejected + 2.0)

    def record(self, drafted: int, accepted: int) -> None:
        self.kept = DECAY * self.kept + accepted
        self.rejected = DECAY * self.rejected + (accepted < drafted)

    def fade(self) -> None:
        """A step without a draft: earlier evidence weighs less."""
        self.kept *= DECAY
        self.rejected *= DECAY

    def expected(self, drafted: int) -> float:
        """Tokens a step yields with `drafted` tokens to verify: 1 + a + ... + a^drafted."""
        a = self.rate()
        return sum(a**i for i in range(drafted + 1))


def expert_union(tokens: int, experts: int, top_k: int) -> float:
    """Distinct experts `tokens` tokens route to, on average, under uniform routing."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


@dataclass
class DraftPolicy:
    """The draft cap each step (`choose`), from measured step costs (`observe`)."""

    max_draft: int = 4
    experts: int = 0  # routed experts a layer (0: a dense model)
    top_k: int = 0
    # The fraction of routed experts not in the device cache, read when a shape's cost is
    # estimated (rarely): 0 with every expert on the device.
    miss_rate: Callable[[], float] = field(default=lambda: 0.0)
    costs: dict[tuple[int, int], float] = field(default_factory=dict)
    steps: int = 0  # steps `choose` was asked about (steps with drafts)
    measured_at: dict[tuple[int, int], int] = field(default_factory=dict)  # shape -> `steps`
    last_probe: int = 0
    # Every request's drafts together: a new request's prior. An agent's turns are requests
    # of a few hundred tokens each, and with a prior of 1/2 a batch of them may never draft:
    # on an H100 under hybrid at batch 4, a verify step of two tokens a sequence cost 1.65x
    # a plain one, worth it only above an acceptance of 0.65, so drafts kept whole were never
    # tried (benchmarks/results/2026-12-07-speculative-hybrid-h100-h200.md, call A).
    pooled: Acceptance = field(default_factory=Acceptance)

    def acceptance(self) -> Acceptance:
        """A new request's drafting record: no evidence of its own, the pooled rate as its
        prior (where its own evidence fades, it returns there)."""
        return Acceptance(prior=self.pooled.rate())

    def record(self, acceptance: Acceptance, drafted: int, accepted: int) -> None:
        """A verified draft: in the request's record and the pool's."""
        acceptance.record(drafted, accepted)
        self.pooled.record(drafted, accepted)

    def observe(self, sequences: int, tokens: int, seconds: float) -> None:
        key = (sequences, tokens)
        old = self.costs.get(key)
        self.costs[key] = seconds if old is None else old + COST_WEIGHT * (seconds - old)
        self.measured_at[key] = self.steps

    def cost(self, sequences: int, tokens: int) -> float | None:
        """A step's seconds: measured, or grown from the largest measured shape below it."""
        measured = self.costs.get((sequences, tokens))
        if measured is not None:
            return measured
        below = [t for (s, t) in self.costs if s == sequences and t < tokens]
        if not below:
            return None
        base = max(below)
        return self.costs[(sequences, base)] * self._growth(base, tokens)

    def _growth(self, base: int, tokens: int) -> float:
        if not self.experts:
            return 1.0
        union = expert_union(tokens, self.experts, self.top_k)
        return 1.0 + self.miss_rate() * (union / expert_union(base, self.experts, self.top_k) - 1)

    def choose(self, drafts: list[tuple[Acceptance, int]]) -> int:
        """The cap on each request's draft this step, given each decoding request's
        acceptance and the longest draft it has (0 if none): the cap with the most expected
        tokens per second, the shortest among equals, 0 while a plain step is unmeasured."""
        self.steps += 1
        sequences = len(drafts)
        plain = self.cost(sequences, sequences)
        longest = min(self.max_draft, max((n for _, n in drafts), default=0))
        if plain is None or longest == 0:
            return 0
        best, best_rate = 0, sequences / plain
        for k in range(1, longest + 1):
            seconds = self.cost(sequences, self._fed(drafts, k))
            if seconds is None:
                continue
            tokens = sum(a.expected(min(k, n)) for a, n in drafts)
            if tokens / seconds > best_rate * 1.0001:
                best, best_rate = k, tokens / seconds
        probe = self._probe(drafts, best, longest)
        return best if probe is None else probe

    @staticmethod
    def _fed(drafts: list[tuple[Acceptance, int]], k: int) -> int:
        """Tokens a step feeds with each draft cut to `k`."""
        return sum(1 + min(k, n) for _, n in drafts)

    def _probe(self, drafts: list[tuple[Acceptance, int]], best: int, longest: int) -> int | None:
        """A cap to measure this step instead of `best`, or None: the shortest above it whose
        shape is unmeasured or stale, else a stale plain step (while every step drafts, the
        plain cost it is weighed against is measured no more), at most once every
        PROBE_EVERY steps."""
        if self.steps - self.last_probe < PROBE_EVERY:
            return None
        sequences = len(drafts)
        for k in [*range(best + 1, longest + 1), *([0] if best else [])]:
            seen = self.measured_at.get((sequences, self._fed(drafts, k)))
            if seen is None or self.steps - seen >= STALE_STEPS:
                self.last_probe = self.steps
                return k
        return None


def auto_policy(runner: ModelRunner, max_draft: int) -> DraftPolicy | None:
    """`--speculative auto`'s cost model for the runner's model, or None where it does not
    draft: on a GPU whose decode runs in CUDA graphs, a verify step that can't
    (engine/runner.py's `_captures_verify`) costs several decode steps of host time. (Verify
    steps replaying graphs passed their CUDA tests on an H100 and drafted 2.08x the tokens/s
    of none on edit turns, 1.00x on random text:
    benchmarks/results/2026-12-07-speculative-h100.md.)"""
    if runner.graphs is not None and not runner.verify_graphs:
        return None
    cfg, moe = runner.config, runner.moe

    def miss_rate() -> float:
        if moe is None or moe.cache is None:
            return 0.0
        return 1.0 - moe.telemetry.snapshot()["hit_rate"]

    experts = cfg.moe.num_experts if cfg.moe is not None else 0
    top_k = cfg.moe.top_k if cfg.moe is not None else 0
    return DraftPolicy(max_draft, experts, top_k, miss_rate)
