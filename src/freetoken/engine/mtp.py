"""Speculative drafts from the model's own next-token-prediction (MTP) layer: DeepSeek-V3,
V3.2, GLM-4.5, GLM-5 and Qwen3-Next ship one (`num_nextn_predict_layers`,
`mtp_num_hidden_layers`), trained to predict the token after next.

At position i the layer reads the model's final hidden state there (normed: what the output
head reads) and the embedding of token i+1, each through its own norm, projects their
concatenation back to the hidden width (`eh_proj`; Qwen3-Next's `fc`), runs its decoder block
(attention over its own K/V of the positions before, in layer `num_layers` of the paged cache,
under the sequence's page table; its MoE or MLP) and the shared output head: the logits of
token i+2 (models/decoder.py, `DecoderModel.mtp_forward`).

The layer follows the model: after each step, the positions the step kept (a prompt chunk, a
decoded token, a verified draft's kept tokens) go through it in one batched forward, with
the hidden states the step's forward gave beside its logits and the tokens that came after
them (`MTPDrafter.follow`). So its K/V covers every position the model's does, prefix-cached
pages included; rejected positions are written again when they are kept. Its logits at a
request's last position give the first draft token; more are drafted by feeding each drafted
token back with the layer's own hidden state at the position before (one one-token forward a
token, written past the request's length and overwritten once kept). Drafts are the layer's
argmax; the verify step (engine/generate.py) keeps the model's tokens whatever they are, and
how long a draft the layer makes follows its acceptance (`MTPDrafter.record`), and how much
of it a step verifies is the engine's policy's (engine/draft_policy.py).

The cost: one decoder layer and the output head over each kept position, and one more of
each per extra draft token; on a GPU the decode step runs eagerly (its CUDA graph gives the
logits only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from freetoken.engine import speculative
from freetoken.engine.speculative import DraftState, PromptLookup

if TYPE_CHECKING:
    from freetoken.engine.runner import ModelRunner
    from freetoken.kv.paged import KVSequence


@dataclass
class MTPState(DraftState):
    """One request's MTP drafting: the next draft, and how its drafts fared."""

    index: None = None  # (prompt lookup's n-gram index: none here)
    proposal: list[int] = field(default_factory=list)  # drafted at the end of the last step
    # Each draft costs the layer a forward a token before the engine's policy sees it: the
    # layer drafts `length` tokens, doubled while drafts are kept whole, halved when most of
    # one is rejected, and none for `PAUSE` steps after `MAX_MISSES` fruitless ones.
    length: int = 1
    misses: int = 0
    paused: int = 0


MAX_MISSES, PAUSE = 3, 8


@dataclass
class Followed:
    """Positions a step kept for one request, for the MTP layer to follow: `tokens[j]`
    came after position start + j, whose final hidden state is `hidden[j]`. `state`: the
    request's drafting, None where it drafts nothing next step."""

    seq: KVSequence
    start: int
    tokens: list[int]
    hidden: torch.Tensor
    state: MTPState | None


@dataclass
class MTPDrafter(PromptLookup):
    """The engine's drafter where the model's MTP layer was read: up to `max_draft` tokens a
    step (the first from the layer's pass over the kept positions, each further one a
    one-token forward of it); its drafts lengthen, shorten and pause with their acceptance."""

    max_draft: int = 3
    follows = True  # (the engine hands it each step's hidden states: `follow`)

    def start(self, tokens: list[int]) -> MTPState:
        return MTPState()

    def draft(self, state: MTPState, room: int) -> list[int]:
        proposal, state.proposal = state.proposal, []  # (never offered twice)
        if state.paused > 0:
            state.paused -= 1
            return []
        return proposal[: min(self.max_draft, state.length, room)]

    def observe(self, state: MTPState, token: int) -> None:
        pass

    def record(self, state: MTPState, drafted: int, accepted: int) -> None:
        super().record(state, drafted, accepted)
        if drafted == 0:
            return
        if accepted == drafted:
            state.length = min(self.max_draft, 2 * state.length)
        elif accepted < drafted // 2:
            state.length = max(1, state.length // 2)
        state.misses = 0 if accepted else state.misses + 1
        if state.misses >= MAX_MISSES:
            state.misses, state.paused = 0, PAUSE

    def follow(self, runner: ModelRunner, fed: list[Followed]) -> None:
        """The MTP layer over each request's kept positions, in one forward; then each
        drafting request's next draft, the longer ones one batched token at a time."""
        if not fed:
            return
        logits, hidden = runner.mtp_forward(
            [f.seq for f in fed],
            [f.tokens for f in fed],
            [f.start for f in fed],
            torch.cat([f.hidden for f in fed]),
        )
        firsts = logits.argmax(dim=-1).tolist()
        lengths: dict[int, int] = {}  # fed index -> its draft's length
        for i, f in enumerate(fed):
            if f.state is None:
                continue
            f.state.proposal = [firsts[i]]
            want = 1 if f.state.paused else min(self.max_draft, f.state.length)
            if want > 1 and _room(runner, f.seq, want - 1):
                lengths[i] = want
        for j in range(1, max(lengths.values(), default=1)):
            group = [i for i, n in lengths.items() if n > j]
            logits, step_hidden = runner.mtp_forward(
                [fed[i].seq for i in group],
                [[fed[i].state.proposal[-1]] for i in group],
                [fed[i].seq.length + j - 1 for i in group],
                hidden[group],
            )
            hidden = hidden.index_copy(0, torch.tensor(group, device=hidden.device), step_hidden)
            for i, token in zip(group, logits.argmax(dim=-1).tolist(), strict=True):
                fed[i].state.proposal.append(token)


def _room(runner: ModelRunner, seq: KVSequence, positions: int) -> bool:
    """Take pages for `positions` past the sequence's length where they are free (drafting
    never evicts or preempts for them)."""
    kv = runner.kv
    needed = -(-(seq.length + positions) // kv.page_size) - len(seq.pages)
    if needed > kv.allocator.num_free:
        return False
    kv.reserve(seq, positions)
    return True


def drafter_for(mode: str, mtp: bool) -> PromptLookup | None:
    """The drafter of a `--speculative` mode for a loaded model: the MTP layer's where it was
    read (`mtp`: `mtp_reading` had it read), for `mtp` and for `auto` where that drafts;
    else prompt lookup's as `speculative.drafter_for` gives it."""
    lookup = speculative.drafter_for(mode)
    if mode == "mtp" and not mtp:
        raise ValueError("MTP drafts need the model's MTP layer read (load_model's mtp)")
    if mtp and mode in ("mtp", "auto"):  # (auto reads it on the CPU only: `mtp_reading`)
        return MTPDrafter()
    return lookup


def mtp_reading(mode: str, device_type: str) -> str:
    """Whether a mode has the loader read the model's MTP layer (models/loading.py `mtp`):
    `mtp` must, `auto` where it drafts and the checkpoint has one; `ngram` and `off` spend
    no memory on it."""
    if mode == "mtp":
        return "on"
    return "auto" if mode == "auto" and device_type == "cpu" else "off"
