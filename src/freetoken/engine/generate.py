"""Generation: requests in, token and text deltas out.

`LLMEngine.step()` advances every running request by one token: requests waiting for their
first token are prefilled (one forward each), then all others are decoded together in one
batched forward. Requests join and leave between steps; the HTTP scheduler builds on this.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from freetoken.config import EngineConfig
from freetoken.engine.runner import ModelRunner
from freetoken.engine.sampling import Sampler, SamplingParams, make_generator
from freetoken.engine.stopping import TextStream
from freetoken.errors import FreetokenError
from freetoken.kv.anchors import AnchorStore, boundary_tokens
from freetoken.kv.paged import KVSequence
from freetoken.kv.radix import RadixCache
from freetoken.telemetry import PrefixReuseTelemetry
from freetoken.tokenizer import Tokenizer
from freetoken.weights.loader import load_model


class ContextLengthError(FreetokenError, ValueError):
    """A prompt (plus the tokens asked for) does not fit the model's context."""


@dataclass
class Request:
    id: int
    prompt_ids: list[int]
    params: SamplingParams
    seq: KVSequence
    text: TextStream
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens whose KV (and recurrent state) came from the cache
    anchor: int | None = None  # hybrid models: position of the anchor the request resumed at
    prefix: list = field(default_factory=list)  # radix nodes locked for this request
    anchors: list = field(default_factory=list)  # anchor checkpoints saved, not yet attached
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: str | int | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def recomputed_tokens(self) -> int:
        return len(self.prompt_ids) - self.cached_tokens


@dataclass(frozen=True)
class StepOutput:
    request: Request
    token_id: int
    text: str  # text that became final with this token (may be empty)


@dataclass(frozen=True)
class Completion:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        max_batch_size: int = 4,
        max_prefill_chunk: int = 8192,
        prefix_cache: bool = True,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_prefill_chunk = max_prefill_chunk
        self.sampler = Sampler()
        self.eos_ids = frozenset(tokenizer.eos_token_ids + runner.config.eos_token_ids)
        self.max_context = min(runner.config.max_position_embeddings, runner.kv.capacity_tokens)
        self.running: list[Request] = []
        self._ids = itertools.count()
        self.prefix_cache = RadixCache(runner.kv.page_size) if prefix_cache else None
        if self.prefix_cache is not None:
            runner.kv.reclaim = self.prefix_cache.evict
        # Hybrid models resume a cached prefix only at an anchor checkpoint (kv/anchors.py).
        self.anchors: AnchorStore | None = None
        if self.prefix_cache is not None and runner.anchor_slots:
            self.anchors = AnchorStore(
                runner.states, runner.anchor_slots, boundary_tokens(tokenizer)
            )
            self.prefix_cache.on_evict = self.anchors.drop_node
        self.reuse = PrefixReuseTelemetry()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        path = config.model
        if path is None:
            from freetoken.demo import demo_checkpoint

            path = demo_checkpoint()
        loaded = load_model(
            Path(path), config.dtype, config.resolved_device(), progress=config.progress
        )
        runner = ModelRunner(
            loaded,
            config.kv_cache_tokens,
            config.page_size,
            config.moe,
            config.cuda_graphs,
            max_sequences=config.max_batch_size,
            state_anchors=config.state_anchors if config.prefix_cache else 0,
        )
        return cls(
            runner,
            Tokenizer(loaded.path),
            config.max_batch_size,
            config.max_prefill_chunk,
            config.prefix_cache,
        )

    # -- requests -------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_context}"
            )
        if len(self.running) >= self.max_batch_size:
            raise RuntimeError(f"already running {self.max_batch_size} requests")
        req = Request(
            id=next(self._ids),
            prompt_ids=prompt_ids,
            params=params,
            seq=self.runner.new_sequence(),
            text=TextStream(self.tokenizer.decode, params.stop),
            generator=make_generator(params.seed, self.runner.device),
        )
        if self.prefix_cache is not None:
            try:
                self._reuse_prefix(req)
            except BaseException:
                self.runner.release(req.seq)  # its state slot (it shares no pages yet)
                raise
        self.reuse.record(len(prompt_ids), req.cached_tokens, req.anchor)
        self.running.append(req)
        return req

    def _reuse_prefix(self, req: Request) -> None:
        """Start the request from the longest cached prefix of its prompt (at least one prompt
        token is left to compute: its logits give the first new token)."""
        cache = self.prefix_cache
        if self.runner.config.has_recurrent_state:
            # Cached pages hold K/V, but linear-attention layers need their recurrent state at
            # exactly the reuse position: only an anchor has it (without one, recompute all).
            if self.anchors is not None:
                req.prefix, anchor = self.anchors.resume(
                    cache, self.runner.kv, req.seq, req.prompt_ids
                )
                if anchor is not None:
                    req.anchor = req.cached_tokens = anchor.position
            return
        path = cache.match(req.prompt_ids)
        while path and len(path) * cache.page_size >= len(req.prompt_ids):
            path.pop()
        cache.lock(path)
        req.prefix = path
        req.seq.pages = [node.page for node in path]
        req.seq.length = req.cached_tokens = len(path) * cache.page_size

    def abort(self, req: Request) -> None:
        """Remove a request (finished or not) and free its KV, donating its full pages to the
        prefix cache."""
        if req in self.running:
            self.running.remove(req)
        cache, seq = self.prefix_cache, req.seq
        if cache is None:
            self.runner.release(seq)
            return
        full = seq.length // cache.page_size
        tokens = (req.prompt_ids + req.output_ids)[: full * cache.page_size]
        spare = cache.insert(tokens, seq.pages[:full])
        cache.unlock(req.prefix)
        req.prefix = []
        if self.anchors is not None:
            self.anchors.attach(req.anchors, cache.match(tokens), cache.page_size)
            req.anchors = []
        self.runner.kv.allocator.free(spare)
        seq.pages = seq.pages[full:]  # the tree holds the first `full` pages now
        self.runner.release(seq)  # the rest, and the recurrent state slot

    # -- stepping -------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Advance every running request: prompts still being prefilled get their next chunk
        (up to `max_prefill_chunk` tokens in all, oldest first, in one forward), and every
        request already generating gets one token (one batched forward). Long prompts are thus
        split across steps so running decodes keep moving. Finished requests leave and free
        their KV pages."""
        if not self.running:
            return []
        prefilling = [r for r in self.running if r.seq.length < len(r.prompt_ids)]
        decoding = [r for r in self.running if r.seq.length >= len(r.prompt_ids)]
        outputs = []
        if prefilling:
            group, chunks, budget = [], [], self.max_prefill_chunk
            for r in prefilling:
                if budget <= 0:
                    break
                chunk = r.prompt_ids[r.seq.length : r.seq.length + budget]
                group.append(r)
                chunks.append(chunk)
                budget -= len(chunk)
            logits = self._forward(group, chunks)
            done = [i for i, r in enumerate(group) if r.seq.length == len(r.prompt_ids)]
            if done:
                outputs += self._sample([group[i] for i in done], logits[done])
        if decoding:
            logits = self._forward(decoding, [r.output_ids[-1:] for r in decoding])
            outputs += self._sample(decoding, logits)
        for r in [r for r in self.running if r.finished]:
            self.abort(r)
        return outputs

    def _forward(self, group: list[Request], chunks: list[list[int]]) -> torch.Tensor:
        """One forward over the group; with anchors, it also saves the recurrent state at the
        boundaries among the tokens it feeds (kept by each request until it ends)."""
        seqs = [r.seq for r in group]
        if self.anchors is None:
            return self.runner.forward(seqs, chunks)
        planned, captures = [], []
        for r, chunk in zip(group, chunks, strict=True):
            start, saved = r.seq.length, {a.position for a in r.anchors}
            positions = [
                p
                for p in self.anchors.positions(chunk, start)
                if p > r.cached_tokens and p not in saved
            ]
            planned.append(self.anchors.reserve(positions, r.anchors))
            captures.append([(a.position - start, a.slot) for a in planned[-1]])
        try:
            logits = self.runner.forward(seqs, chunks, captures=captures)
        except BaseException:
            for anchors in planned:
                self.anchors.discard(anchors)
            raise
        for r, anchors in zip(group, planned, strict=True):
            r.anchors += anchors
        return logits

    def _sample(self, group: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        tokens = self.sampler.sample(
            logits,
            [r.params for r in group],
            [r.generator for r in group],
            [r.prompt_ids + r.output_ids for r in group],
        ).tolist()
        return [self._accept(r, t) for r, t in zip(group, tokens, strict=True)]

    def _accept(self, req: Request, token: int) -> StepOutput:
        params = req.params
        req.output_ids.append(token)
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            req.finish_reason, req.stop_reason = "stop", token
            return StepOutput(req, token, req.text.flush())
        text = req.text.push(token)
        if req.text.stopped:
            req.finish_reason, req.stop_reason = "stop", req.text.stop_reason
        elif (
            len(req.output_ids) >= params.max_new_tokens
            or len(req.prompt_ids) + len(req.output_ids) >= self.max_context
        ):
            req.finish_reason = "length"
            text += req.text.flush()
        return StepOutput(req, token, text)

    # -- conveniences ---------------------------------------------------------------------

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[StepOutput]:
        """Generate for one prompt, yielding each step's output as it comes."""
        req = self.add_request(prompt_ids, params)
        try:
            while not req.finished:
                for out in self.step():
                    if out.request is req:
                        yield out
        finally:
            if not req.finished:
                self.abort(req)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        """Generate for several prompts, decoding up to `max_batch_size` of them together."""
        pending = list(enumerate(prompts))
        results: dict[int, Completion] = {}
        texts: dict[int, list[str]] = {}
        index_of: dict[int, int] = {}
        while pending or self.running:
            while pending and len(self.running) < self.max_batch_size:
                i, prompt = pending.pop(0)
                index_of[self.add_request(prompt, params).id] = i
            for out in self.step():
                r = out.request
                texts.setdefault(r.id, []).append(out.text)
                if r.finished:
                    results[index_of[r.id]] = Completion(
                        r.prompt_ids, r.output_ids, "".join(texts[r.id]), r.finish_reason
                    )
        return [results[i] for i in range(len(prompts))]
