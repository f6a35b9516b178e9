"""Speculative decoding by prompt lookup: tokens drafted from the request's own context, all
verified in one forward, the model's own choices kept.

A coding agent's turns repeat long spans of their context (a file read, then written back with
an edit), so the tokens that followed the last few tokens' earlier occurrence are often what
comes next. A request's step feeds its last token and up to `max_draft` drafted ones at once;
the logits at each position give the model's token there (chosen as the sampler chooses it,
penalties counting the tokens before that position), and drafts are kept while they equal those
tokens: the output is the one decoding token by token gives (up to the sums' rounding between a
one-token and a several-token forward), and one step yields 1 to max_draft + 1 tokens. A sampled
request keeps each drafted token with the model's probability of it there, else draws from the
rest: the same distribution as sampling token by token, not the same draws.

Where it pays depends on the machine and the moment (the union of experts a verify step
routes to, the cache's misses, a small CPU's arithmetic): `--speculative auto` lets a cost model
choose each step's draft length from measured step costs and each request's acceptance
(engine/draft_policy.py); `ngram` verifies every draft whole. The first verify step of each
shape runs in a CUDA graph from its second sighting on, as decode steps do. Sampled
Sampled
requests keep their distribution by the speculative sampling rule (engine/sampling.py,
`Sampler.verify`). Models with recurrent state (linear attention) draft too: the verify step
keeps a copy of a drafting request's state from before it, and a rejection restores it and feeds
the kept tokens again, one more small forward (engine/generate.py, `LLMEngine._verify`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """Where each n-gram (min_n to max_n tokens) of a token list last ended, for lookups of
    the list's own suffix: O(max_n) work per token appended, none that grows with the context."""

    min_n: int = 1
    max_n: int = 4
    tokens: list[int] = field(default_factory=list)
    # n-gram -> the position of its last token, at its latest occurrence but the suffix's own
    _ends: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            # The n-grams ending at the previous last token join the index only now, so a
            # lookup of the suffix finds an earlier occurrence, not itself.
            end = len(self.tokens) - 1
            for n in range(self.min_n, self.max_n + 1):
                if end - n + 1 >= 0:
                    self._ends[tuple(self.tokens[end - n + 1 : end + 1])] = end
            self.tokens.append(token)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix n-gram's latest earlier occurrence
        (none where the suffix never occurred before)."""
        size = len(self.tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            end = self._ends.get(tuple(self.tokens[size - n :]))
            if end is not None:
                return self.tokens[end + 1 : min(end + 1 + k, size)]
        return []


@dataclass
class DraftState:
    """One request's drafting: its context's index and its drafts' totals."""

    index: NgramIndex
    drafted: int = 0
    accepted: int = 0


@dataclass
class PromptLookup:
    """The engine's n-gram drafter: up to `max_draft` tokens a step, from n-grams of `min_n`
    to `max_n` tokens (how many a step verifies: engine/draft_policy.py)."""

    max_draft: int = 4
    min_n: int = 2
    max_n: int = 4

    def start(self, tokens: list[int]) -> DraftState:
        index = NgramIndex(self.min_n, self.max_n)
        index.extend(tokens)
        return DraftState(index)

    def draft(self, state: DraftState, room: int) -> list[int]:
        """This step's draft (at most `room` tokens: what the request may still emit, less
        the one the step yields anyway)."""
        return state.index.draft(min(self.max_draft, room))

    def observe(self, state: DraftState, token: int) -> None:
        """The request emitted `token`."""
        state.index.extend([token])

    def record(self, state: DraftState, drafted: int, accepted: int) -> None:
        """A verified step: `accepted` of its `drafted` tokens were the model's."""
        state.drafted += drafted
        state.accepted += accepted


SPECULATIVE_MODES = ("auto", "ngram", "mtp", "off")


def drafter_for(mode: str) -> PromptLookup | None:
    """The prompt-lookup drafter a mode gives: for `ngram` (every draft verified whole) and
    `auto` (as much of each as pays: the engine's DraftPolicy), none for `off` and `mtp` (its
    drafts come from the model's next-token-prediction layer, as `auto`'s do where it was
    read: engine/mtp.py)."""
    if mode not in SPECULATIVE_MODES:
        raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, not {mode!r}")
    return None if mode in ("off", "mtp") else PromptLookup()
