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

Where it pays: a step's weights are read once for all its rows, so on the CPU (and wherever a
step is bound by weight bytes) verifying a few tokens costs about what one costs; a draft whose
tokens are rejected costs the extra rows only, but where a step is bound by arithmetic (a small
CPU's quantized kernels) an extra row costs nearly a token. Drafting follows each request's
acceptance: a draft starts one token long, doubles while drafts are kept whole and halves when
most of one is rejected; after `max_misses` steps in a row without an accepted token it pauses
for `pause` steps. (The 0.5B Qwen on the 2-core Intel machine: a fresh chat answer, where few
drafts hold, decodes at 0.99x of no drafting, a reply that repeats its context at 1.5x;
fixed drafts of four cost the fresh answer 6%.) Sampled
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
    """One request's drafting: its context's index and how its recent drafts fared."""

    index: NgramIndex
    misses: int = 0  # steps in a row whose draft had no token accepted
    paused: int = 0  # steps left without drafting
    length: int = 1  # the next draft's length at most: grows while drafts are kept whole
    drafted: int = 0  # in total
    accepted: int = 0


@dataclass
class PromptLookup:
    """The engine's drafter: `max_draft` tokens a step at most, n-grams of `min_n` to `max_n`
    tokens; drafting pauses `pause` steps after `max_misses` fruitless ones."""

    max_draft: int = 4
    min_n: int = 2
    max_n: int = 4
    max_misses: int = 3
    pause: int = 8

    def start(self, tokens: list[int]) -> DraftState:
        index = NgramIndex(self.min_n, self.max_n)
        index.extend(tokens)
        return DraftState(index)

    def draft(self, state: DraftState, room: int) -> list[int]:
        """This step's draft (at most `room` tokens: what the request may still emit, less
        the one the step yields anyway)."""
        if state.paused > 0:
            state.paused -= 1
            return []
        return state.index.draft(min(self.max_draft, state.length, room))

    def observe(self, state: DraftState, token: int) -> None:
        """The request emitted `token`."""
        state.index.extend([token])

    def record(self, state: DraftState, drafted: int, accepted: int) -> None:
        """A verified step: `accepted` of its `drafted` tokens were the model's."""
        state.drafted += drafted
        state.accepted += accepted
        if drafted == 0:
            return
        # A draft kept whole doubles the next one's length, a rejected one halves it: each
        # drafted row costs a verify step compute (where a step is bound by arithmetic, as on
        # a small CPU, nearly a token's), paid back only by the tokens kept.
        if accepted == drafted:
            state.length = min(self.max_draft, 2 * state.length)
        elif accepted < drafted // 2:
            state.length = max(1, state.length // 2)
        state.misses = 0 if accepted else state.misses + 1
        if state.misses >= self.max_misses:
            state.misses, state.paused = 0, self.pause


SPECULATIVE_MODES = ("auto", "ngram", "mtp", "off")


def drafter_for(mode: str, device_type: str) -> PromptLookup | None:
    """The prompt-lookup drafter a mode gives: `ngram` always, `auto` where verifying costs
    about one step (the CPU; on a GPU the verify step does not run in the decode's CUDA graph
    yet, so it would give that up), `off` never; `mtp` none (its drafts come from the model's
    next-token-prediction layer, as `auto`'s do where it was read: engine/mtp.py)."""
    if mode not in SPECULATIVE_MODES:
        raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, not {mode!r}")
    on = mode == "ngram" or (mode == "auto" and device_type == "cpu")
    return PromptLookup() if on else None
