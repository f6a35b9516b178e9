"""Generation: requests in, token and text deltas out.

`LLMEngine.step()` advances every running request: requests still prefilling get their next
chunk, all others decode one token together in one batched forward. Requests join and leave
between steps; the HTTP scheduler builds on this.

KV pages are taken as a request needs them, never reserved for its whole `max_new_tokens`:
when the pool runs dry, the newest running request is preempted (its full pages go to the
prefix cache, the rest is freed) and resumes, oldest first, once there is room again, by
recomputing what the prefix cache no longer holds (vLLM's recompute preemption). The oldest
request is never preempted for a newer one, so every request finishes.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from freetoken.config import EngineConfig
from freetoken.devices import resolve_device
from freetoken.engine.draft_policy import Acceptance, DraftPolicy, auto_policy
from freetoken.engine.memory_watch import DeviceMemoryWatch
from freetoken.engine.mtp import Followed, drafter_for, mtp_reading
from freetoken.engine.runner import ModelRunner
from freetoken.engine.sampling import Sampler, SamplingParams, make_generator
from freetoken.engine.speculative import DraftState, PromptLookup
from freetoken.engine.stopping import TextStream
from freetoken.errors import FreetokenError
from freetoken.kv.anchors import AnchorStore, boundary_tokens
from freetoken.kv.paged import KVSequence, OutOfPagesError
from freetoken.kv.radix import RadixCache
from freetoken.models import gguf
from freetoken.models.loading import load_model
from freetoken.telemetry import PrefixReuseTelemetry
from freetoken.tokenizer import Tokenizer
from freetoken.tokenizer import load as load_tokenizer

log = logging.getLogger(__name__)


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
    resumed_at: int = 0  # the position its KV started from when it (last) got its pages
    preemptions: int = 0  # times its KV was taken back for an older request
    prefix: list = field(default_factory=list)  # radix nodes locked for this request
    anchors: list = field(default_factory=list)  # anchor checkpoints saved, not yet attached
    drafting: DraftState | None = None  # prompt lookup's index of its tokens (speculative)
    draft: list[int] = field(default_factory=list)  # this step's drafted tokens
    acceptance: Acceptance = field(default_factory=Acceptance)  # how its drafts fared
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: str | int | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def recomputed_tokens(self) -> int:
        return len(self.prompt_ids) - self.cached_tokens

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens so far: what its KV holds once it has caught up (a
        decoding request's KV holds all but the last output token, which the next step feeds)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the prompt followed by the output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - n) : end - n]


@dataclass(frozen=True)
class StepOutput:
    request: Request
    token_id: int
    text: str  # text that became final with this token (may be empty)
    # Whether this token ends the request. A verified draft gives a request several outputs in
    # one step, so by the time a consumer reads the first, `request.finished` may already tell
    # of the last: consumers ask this, not the request.
    finished: bool = False


@dataclass(frozen=True)
class StepTokens:
    """What one engine step computed: prompt (and recomputed) tokens, and decoded tokens (a
    request's verified draft gives several)."""

    prefill: int = 0
    decode: int = 0


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
        drafter: PromptLookup | None = None,
        draft_policy: DraftPolicy | None = None,
    ):
        """`drafter`: speculative decoding's source of drafts (engine/speculative.py, or
        the MTP layer's: engine/mtp.py), or None for one token a step; `draft_policy`
        chooses how much of each draft a step verifies (engine/draft_policy.py), or None to
        verify every draft whole."""
        self.runner = runner
        self.drafter = drafter
        self.draft_policy = draft_policy
        # (an MTP drafter follows every step's kept positions with their hidden states)
        self._fed: list[tuple[Request, int, torch.Tensor]] = []
        self.drafted = self.accepted = 0  # draft tokens verified and kept, in total
        self.verified = 0  # requests' steps that verified a draft, in total
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_prefill_chunk = max_prefill_chunk
        self.sampler = Sampler()
        self.eos_ids = frozenset(tokenizer.eos_token_ids + runner.config.eos_token_ids)
        if tokenizer.vocab_size > runner.config.vocab_size:
            log.warning(
                "the tokenizer has %d tokens, the model's vocabulary %d: prompts with "
                "the ids beyond it are refused",
                tokenizer.vocab_size,
                runner.config.vocab_size,
            )
        self.running: list[Request] = []  # requests holding KV, oldest first
        # Requests whose KV was taken for older ones, oldest first; they resume before any new
        # request is admitted.
        self.preempted: collections.deque[Request] = collections.deque()
        self.preemptions = 0  # in total, since start
        self.last_step = StepTokens()
        self._prefilled = False  # (the last step ran a prefill chunk: the next is not timed)
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
        # gives expert-cache slots back when another process takes device memory
        self.memory_watch = DeviceMemoryWatch.for_engine(self)

    @property
    def max_context(self) -> int:
        """The longest sequence: the model's, or what the KV pool holds (it can be re-sized)."""
        return min(self.runner.max_model_len, self.runner.kv.capacity_tokens)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        if config.model is None:
            raise FreetokenError(
                "EngineConfig.model names no checkpoint (freetoken.demo.demo_checkpoint() "
                "builds the demo model's)"
            )
        device = resolve_device(config.device)
        model = gguf.resolve(config.model, config.progress)  # (GGUF: converted once, cached)
        # The tokenizer loads on a thread while the weights do (the reads release the GIL);
        # through transformers, where it must, its import alone is seconds.
        with ThreadPoolExecutor(1, thread_name_prefix="ft-tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, model)
            loaded = load_model(
                model,
                config.dtype,
                device,
                progress=config.progress,
                verify=config.verify_weights,
                dequantize_experts=config.dequantize_experts,
                mtp=mtp_reading(config.speculative, device.type),
            )
            drafter = drafter_for(config.speculative, loaded.config.mtp)
            runner = ModelRunner(
                loaded,
                config.kv_cache_tokens,
                config.page_size,
                config.moe,
                config.cuda_graphs,
                max_sequences=config.max_batch_size,
                max_model_len=config.max_model_len,
                state_anchors=config.state_anchors if config.prefix_cache else 0,
                # (hybrid models: each drafting request's state from before its verify step,
                # one sequence's state memory a slot)
                state_scratch=config.max_batch_size if drafter is not None else 0,
            )
            engine = cls(
                runner,
                tokenizer.result(),
                config.max_batch_size,
                config.max_prefill_chunk,
                config.prefix_cache,
                drafter,
            )
            if config.speculative == "auto":
                engine.draft_policy = auto_policy(runner, drafter.max_draft)
                if engine.draft_policy is None:
                    engine.drafter = None
        if device.type == "cpu":  # (after the load, whose conversions use every core)
            from freetoken.kernels.cpu_team import size_torch_threads

            log.debug("torch intra-op threads: %d", size_torch_threads())
        return engine

    # -- requests -------------------------------------------------------------------------

    def check_weights(self) -> None:
        """Refuse to compute once a background check found the weights corrupt (a weight
        directory whose checksums differ): every later step and request fails with its error."""
        integrity = self.runner.integrity
        if integrity is not None and integrity.error is not None:
            raise integrity.error

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> Request:
        self.check_weights()
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        # (an id past the embedding fails the step; on CUDA as a device-side assert, which
        # leaves the context unusable for every later request)
        vocab = self.runner.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            bad = next(t for t in prompt_ids if not 0 <= t < vocab)
            raise ValueError(
                f"token id {bad} is outside the model's vocabulary (0 to {vocab - 1})"
                "; a tokenizer with more tokens than the model's embedding has rows "
                "gives such ids"
            )
        if len(prompt_ids) >= self.max_context:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_context}"
            )
        if len(self.running) + len(self.preempted) >= self.max_batch_size:
            raise RuntimeError(f"already running {self.max_batch_size} requests")
        req = Request(
            id=next(self._ids),
            prompt_ids=prompt_ids,
            params=params,
            seq=self.runner.new_sequence(),
            text=TextStream(self._decoder(params.keep_special_tokens), params.stop),
            generator=make_generator(params.seed, self.runner.device),
        )
        if self.draft_policy is not None:
            req.acceptance = self.draft_policy.acceptance()
        self._take_prefix(req)
        req.cached_tokens = req.resumed_at
        self.reuse.record(len(prompt_ids), req.cached_tokens, req.anchor)
        self.running.append(req)
        return req

    def can_admit(self, prompt_ids: Sequence[int]) -> bool:
        """Whether a new request with this prompt should start now: no preempted request is
        waiting to resume, and the KV pool holds the pages its prompt needs beyond the cached
        prefix, plus one page for each running request's next tokens. Nothing is reserved
        for its output: pages are taken as it grows, and a pool that runs dry preempts the
        newest request (see the module docstring). A request is always admitted when nothing
        runs (alone it fits: add_request checks the context)."""
        if self.preempted:
            return False
        return not self.running or self._room_for(prompt_ids)

    def _room_for(self, tokens: Sequence[int]) -> bool:
        states = self.runner.states
        if states is not None and states.num_free == 0:
            return False
        kv, cache = self.runner.kv, self.prefix_cache
        ps = kv.page_size
        needed = -(-len(tokens) // ps) + len(self.running)
        available = kv.allocator.num_free
        if cache is not None:
            matched = cache.match(tokens) if not self.runner.config.has_recurrent_state else []
            unlocked = sum(node.refs == 0 for node in matched)
            # Matched pages are shared, not taken; unlocked ones stop being evictable.
            needed -= len(matched)
            available += cache.num_evictable - unlocked
        return needed <= available

    def _take_prefix(self, req: Request) -> None:
        """Give the request the longest cached prefix of its tokens (it starts computing from
        there), or nothing without a prefix cache."""
        if self.prefix_cache is not None:
            try:
                self._reuse_prefix(req)
            except BaseException:
                self.runner.release(req.seq)  # its state slot (it shares no pages yet)
                raise
        req.resumed_at = req.seq.length

    def _reuse_prefix(self, req: Request) -> None:
        """Start the request from the longest cached prefix of its tokens (at least one token
        is left to compute: its logits give the next new token)."""
        cache = self.prefix_cache
        tokens = req.tokens(0, req.num_tokens)
        if self.runner.config.has_recurrent_state:
            # Cached pages hold K/V, but linear-attention layers need their recurrent state at
            # exactly the reuse position: only an anchor has it (without one, recompute all).
            if self.anchors is not None:
                req.prefix, anchor = self.anchors.resume(cache, self.runner.kv, req.seq, tokens)
                if anchor is not None:
                    req.anchor = anchor.position
            return
        path = cache.match(tokens)
        while path and len(path) * cache.page_size >= len(tokens):
            path.pop()
        cache.lock(path)
        req.prefix = path
        req.seq.pages = [node.page for node in path]
        req.seq.length = len(path) * cache.page_size

    def abort(self, req: Request) -> None:
        """Remove a request (finished or not) and free its KV, donating its full pages to the
        prefix cache."""
        if req in self.running:
            self.running.remove(req)
            self._release(req)
        elif req in self.preempted:
            self.preempted.remove(req)  # its KV went when it was preempted

    def _release(self, req: Request) -> None:
        """Free the request's KV and state slot; its full pages go to the prefix cache."""
        cache, seq = self.prefix_cache, req.seq
        if cache is None:
            self.runner.release(seq)
            return
        full = seq.length // cache.page_size
        tokens = req.tokens(0, full * cache.page_size)
        spare = cache.insert(tokens, seq.pages[:full])
        cache.unlock(req.prefix)
        req.prefix = []
        if self.anchors is not None:
            self.anchors.attach(req.anchors, cache.match(tokens), cache.page_size)
            req.anchors = []
        self.runner.kv.allocator.free(spare)
        seq.pages = seq.pages[full:]  # the tree holds the first `full` pages now
        self.runner.release(seq)  # the rest, and the recurrent state slot

    def _preempt(self, req: Request) -> None:
        """Take a running request's KV back; it waits in `preempted` and recomputes what the
        prefix cache no longer holds when it resumes."""
        self.running.remove(req)
        self._release(req)
        req.seq = KVSequence()
        req.preemptions += 1
        self.preemptions += 1
        bisect.insort(self.preempted, req, key=lambda r: r.id)
        log.info(
            "KV pool full: request %d preempted at %d tokens (%d waiting to resume)",
            req.id,
            req.num_tokens,
            len(self.preempted),
        )

    def _resume_preempted(self) -> None:
        """Give preempted requests their KV back, oldest first, while the pool has room."""
        while self.preempted and len(self.running) < self.max_batch_size:
            req = self.preempted[0]
            if self.running and not self._room_for(req.tokens(0, req.num_tokens)):
                return
            self.preempted.popleft()
            req.seq = self.runner.new_sequence()
            self._take_prefix(req)
            bisect.insort(self.running, req, key=lambda r: r.id)

    # -- stepping -------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Advance every running request: requests still catching up on their tokens (a new
        prompt, or a resumed request's context) get their next chunk (up to
        `max_prefill_chunk` tokens in all, oldest first, in one forward), and every request
        already generating gets one token (one batched forward). Long prompts are thus split
        across steps so running decodes keep moving. Finished requests leave and free their
        KV pages."""
        self.check_weights()
        if self.memory_watch is not None:
            self.memory_watch.check()
        self._resume_preempted()
        self.last_step = StepTokens()
        if not self.running:
            return []
        prefill, chunks, decoding = self._schedule()
        outputs = []
        self._fed = []
        if prefill:
            logits = self._forward(prefill, chunks, hidden=True)
            done = [i for i, r in enumerate(prefill) if r.seq.length == r.num_tokens]
            if done:
                outputs += self._sample([prefill[i] for i in done], logits[done])
        decoded: list[StepOutput] = []
        fed, untimed, start = len(decoding) + sum(len(r.draft) for r in decoding), 0, 0.0
        if self.draft_policy is not None:
            untimed, start = self.runner.untimed, time.perf_counter()
        if decoding and any(r.draft for r in decoding):
            decoded = self._verify(decoding)
        elif decoding:
            logits = self._forward(decoding, [r.output_ids[-1:] for r in decoding], hidden=True)
            decoded = self._sample(decoding, logits)
        # Timed for the cost model where its time is its steady cost: not beside a prefill chunk
        # (it waits for the chunk's queued work) nor right after one (the CPU team and the
        # cache as the prefill left them). The first plain steps of a run are those; on an
        # H200 under hybrid they stood in the cost model at 29 ms (batch 1) and 50 ms (batch
        # 4) against 9 and 27 steady and, every later step drafting, were never measured again
        # (benchmarks/results/2026-12-07-speculative-hybrid-h100-h200.md).
        steady = not prefill and not self._prefilled and self.runner.untimed == untimed
        if decoding and self.draft_policy is not None and steady:
            # (the step's tokens are on the host: its work is done)
            self.draft_policy.observe(len(decoding), fed, time.perf_counter() - start)
        self._prefilled = bool(prefill)
        outputs += decoded
        self._follow()
        self.last_step = StepTokens(sum(map(len, chunks)), len(decoded))
        for r in [r for r in self.running if r.finished]:
            self.abort(r)
        return outputs

    def _schedule(self) -> tuple[list[Request], list[list[int]], list[Request]]:
        """This step's work, with the KV pages for it taken: (requests catching up, their
        token chunks, requests decoding one token). Requests are taken oldest first; when the
        pool runs dry the newest running request is preempted, which may be the one being
        scheduled."""
        prefill, chunks, decoding = [], [], []
        budget = self.max_prefill_chunk
        for req in list(self.running):
            if req not in self.running:
                continue  # preempted for an older request
            pending = req.num_tokens - req.seq.length
            decode = bool(req.output_ids) and pending == 1
            n = 1 if decode else min(pending, budget)
            if n <= 0 or not self._reserve(req, n):
                continue
            if decode:
                decoding.append(req)
            else:
                prefill.append(req)
                chunks.append(req.tokens(req.seq.length, req.seq.length + n))
                budget -= n
        self._drafts(decoding)
        return prefill, chunks, decoding

    def _drafts(self, decoding: list[Request]) -> None:
        """Each decoding request's draft this step: the drafter's, cut to the policy's cap,
        with pages for it if they are free (never by preempting: drafts come after every
        request's own token has its page)."""
        for req in decoding:
            req.draft = self._draft(req)
        if self.draft_policy is not None and any(r.draft for r in decoding):
            cap = self.draft_policy.choose([(r.acceptance, len(r.draft)) for r in decoding])
            for req in decoding:
                req.draft = req.draft[:cap]
        drafting = 0
        for req in decoding:
            if req.draft and not self._reserve_draft(req, drafting):
                req.draft = []  # no room for it: the step decodes one token
            drafting += bool(req.draft)
            if not req.draft:
                req.acceptance.fade()

    def _reserve_draft(self, req: Request, drafting: int) -> bool:
        """Take pages for the request's token and its draft if they are free: a draft is never
        worth preempting another request (nor, alone, failing for want of pages). Models with
        recurrent state also need a scratch slot for the request's state (`_verify`), of which
        `drafting` are taken this step already."""
        if self.runner.states is not None and drafting >= len(self.runner.scratch_slots):
            return False
        try:
            self.runner.kv.reserve(req.seq, 1 + len(req.draft))
            return True
        except OutOfPagesError:
            return False

    def _reserve(self, req: Request, n: int) -> bool:
        """Take pages for `n` more tokens of `req`, preempting the newest running requests
        while the pool is short. False when `req` itself had to go."""
        while True:
            try:
                self.runner.kv.reserve(req.seq, n)
                return True
            except OutOfPagesError:
                victim = self.running[-1]
                if victim is req and len(self.running) == 1:
                    raise  # alone it cannot fit: add_request's context check was bypassed
                self._preempt(victim)
                if victim is req:
                    return False

    def _forward(
        self,
        group: list[Request],
        chunks: list[list[int]],
        all_logits: bool = False,
        saves: list[list[tuple[int, int]]] | None = None,
        hidden: bool = False,
    ) -> torch.Tensor:
        """One forward over the group; with anchors, it also saves the recurrent state at the
        boundaries among the tokens it feeds (kept by each request until it ends). `saves[i]`:
        more (k, slot) state copies of request i (`ForwardBatch.captures`). `hidden`: where
        the drafter follows the model (MTP), each request's fed positions and their final
        hidden states are noted for it (`_follow`)."""
        hidden = hidden and getattr(self.drafter, "follows", False)
        starts = [r.seq.length for r in group] if hidden else []
        logits = self._run(group, chunks, all_logits, saves, hidden)
        if hidden:
            logits, states = logits
            rows = states.split([len(c) for c in chunks])
            self._fed += zip(group, starts, rows, strict=True)
        return logits

    def _run(self, group, chunks, all_logits, saves, hidden):
        """The runner's forward for `_forward`, with the anchors it saves planned."""
        seqs = [r.seq for r in group]
        if self.anchors is None:
            return self.runner.forward(
                seqs, chunks, all_logits=all_logits, captures=saves, hidden=hidden
            )
        planned, captures = [], []
        for i, (r, chunk) in enumerate(zip(group, chunks, strict=True)):
            start, saved = r.seq.length, {a.position for a in r.anchors}
            positions = [
                p
                for p in self.anchors.positions(chunk, start)
                if p > r.resumed_at and p not in saved
            ]
            planned.append(self.anchors.reserve(positions, r.anchors))
            extra = saves[i] if saves else []
            captures.append(sorted([(a.position - start, a.slot) for a in planned[-1]] + extra))
        try:
            logits = self.runner.forward(seqs, chunks, all_logits, captures=captures, hidden=hidden)
        except BaseException:
            for anchors in planned:
                self.anchors.discard(anchors)
            raise
        for r, anchors in zip(group, planned, strict=True):
            r.anchors += anchors
        return logits

    def _draft(self, req: Request) -> list[int]:
        """Tokens to verify after the request's last one this step (speculative decoding):
        never past its output limit or the context."""
        if self.drafter is None or not req.params.speculative:
            return []
        if req.drafting is None:  # (indexed at its first decode step, not at admission)
            req.drafting = self.drafter.start(req.tokens(0, req.num_tokens))
        room = (
            min(req.params.max_new_tokens - len(req.output_ids), self.max_context - req.num_tokens)
            - 1
        )
        return self.drafter.draft(req.drafting, room) if room > 0 else []

    def _verify(self, group: list[Request]) -> list[StepOutput]:
        """One forward over each request's last token and its draft; each request keeps the
        model's tokens while its draft matches them, and its KV up to the last one kept.

        Models with recurrent state (linear attention), whose state cannot be cut back like
        the KV: the same forward copies each drafting request's state from before its tokens
        into a scratch slot (as anchors are saved: `ForwardBatch.captures`). A request that
        kept every token it fed needs nothing more; one that kept fewer gets the copy back and
        feeds the kept tokens again (`_rewind`), so its state is the one decoding token by
        token gives. The cost: one state copy per linear layer and drafting request each
        verify step, and a rejection costs one more forward of the kept tokens (its logits
        unused, its K/V rewritten as they were)."""
        chunks = [r.output_ids[-1:] + r.draft for r in group]
        starts = [r.seq.length for r in group]
        scratch = iter(self.runner.scratch_slots)
        recurrent = self.runner.states is not None
        kept_in = [next(scratch) if recurrent and r.draft else None for r in group]
        saves = [[] if slot is None else [(0, slot)] for slot in kept_in]
        logits = self._forward(group, chunks, all_logits=True, saves=saves, hidden=True)
        outputs, row, rewind = [], 0, []
        for req, chunk, start, slot in zip(group, chunks, starts, kept_in, strict=True):
            outputs += self._keep_verified(req, logits[row : row + len(chunk)], start)
            row += len(chunk)
            if slot is not None and req.seq.length < start + len(chunk):
                rewind.append((req, chunk[: req.seq.length - start], slot))
        if rewind:
            self._rewind(rewind)
        return outputs

    def _follow(self) -> None:
        """Hand the drafter that follows the model (MTP) the positions this step kept, each
        with its final hidden state and the token after it, before finished requests leave
        (their pages join the prefix cache: the MTP layer's K/V in them must be there); each
        request that decodes next step gets its next draft."""
        fed, self._fed = self._fed, []
        if not fed:
            return
        follow = []
        for req, start, rows in fed:
            n = req.seq.length - start  # (a verify step's kept positions only)
            if n <= 0:
                continue
            state = None
            drafts = req.params.speculative and not req.finished
            if drafts and req.seq.length == req.num_tokens - 1:  # (decoding next step)
                if req.drafting is None:
                    req.drafting = self.drafter.start(req.tokens(0, req.num_tokens))
                state = req.drafting
            follow.append(
                Followed(req.seq, start, req.tokens(start + 1, start + n + 1), rows[:n], state)
            )
        self.drafter.follow(self.runner, follow)

    def _rewind(self, rewind: list[tuple[Request, list[int], int]]) -> None:
        """Bring each (request, its kept tokens, the scratch slot holding its state from
        before them) to the state after exactly those tokens: the copy restored and the tokens
        fed again, in one forward. Anchors saved past them are dropped (their states saw
        rejected tokens); a finished request only drops its anchors (it leaves now)."""
        group, chunks = [], []
        for req, kept, slot in rewind:
            end = req.seq.length
            if self.anchors is not None:
                stale = [a for a in req.anchors if a.position > end]
                self.anchors.discard(stale)
                req.anchors = [a for a in req.anchors if a.position <= end]
            if req.finished:
                continue
            self.runner.states.copy(slot, req.seq.state_slot)
            req.seq.length = end - len(kept)
            group.append(req)
            chunks.append(kept)
        if group:
            self._forward(group, chunks)

    def _keep_verified(self, req: Request, logits: torch.Tensor, start: int) -> list[StepOutput]:
        """The tokens the sampler's verify rule emits from the fed positions (penalties
        counting the draft before each): greedy, the model's tokens while the draft agrees;
        sampled, the speculative sampling rule, which keeps the distribution. The KV holds
        the fed tokens that were kept (the last emitted token is fed by the next step)."""
        draft, n, p = req.draft, len(req.draft) + 1, req.params
        # Each position's output so far, copied only where a penalty reads it (a copy of the
        # whole output per position would be host work growing with the reply, every step)
        penalized = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        outs = [req.output_ids + draft[:i] for i in range(n)] if penalized else None
        history = None
        if p.repetition_penalty != 1.0:
            history = [req.prompt_ids + out for out in outs]
        tokens = self.sampler.verify(logits, p, req.generator, draft, history, outs)
        emitted: list[StepOutput] = []
        for token in tokens:
            emitted.append(self._accept(req, token))
            if req.finished:
                break
        accepted = sum(d == t for d, t in zip(draft, tokens[: len(emitted)], strict=False))
        req.seq.length = start + len(emitted)
        if req.drafting is not None:
            self.drafter.record(req.drafting, len(draft), accepted)
        if draft and self.draft_policy is not None:
            self.draft_policy.record(req.acceptance, len(draft), accepted)
        self.drafted += len(draft)
        self.accepted += accepted
        self.verified += bool(draft)  # (a request without a draft rides in the same step)
        req.draft = []
        return emitted

    def _sample(self, group: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        # The whole history only where a repetition penalty reads it: copying it every step
        # would cost the host time that grows with the context.
        history = None
        if any(r.params.repetition_penalty != 1.0 for r in group):
            history = [r.prompt_ids + r.output_ids for r in group]
        tokens = self.sampler.sample(
            logits,
            [r.params for r in group],
            [r.generator for r in group],
            history,
            [r.output_ids for r in group],
        ).tolist()
        return [self._accept(r, t) for r, t in zip(group, tokens, strict=True)]

    def resize(self, experts: str | int | None = None, kv: str | None = None) -> None:
        """Re-split memory between the expert cache (`experts`: slots, or bytes such as
        "8GiB") and the KV pool (`kv`: tokens, or bytes), between steps: whichever shrinks
        goes first, so the other can grow into what it gave back. Running requests go on,
        their outputs unchanged. Shrinking the KV pool evicts cached prefixes when pages above
        the new size are held by them, and is refused while running requests hold such pages."""
        runner = self.runner
        pages = runner.kv_pages_for(kv) if kv is not None else None
        kv_first = pages is not None and pages < runner.kv.num_pages
        if kv_first:
            self.resize_kv_pages(pages)
        if experts is not None:
            runner.resize_expert_cache(experts)
        if pages is not None and not kv_first:
            self.resize_kv_pages(pages)
        if self.memory_watch is not None:
            self.memory_watch.rebase()  # the operator's split is the one to keep

    def resize_kv_pages(self, pages: int) -> None:
        """The KV pool to `pages` pages, between steps (`resize` says how)."""
        allocator = self.runner.kv.allocator
        if self.prefix_cache is not None and pages > 0 and allocator.used_from(pages):
            # cached prefixes may hold the pages to give up: evicted (what requests hold stays)
            allocator.free(self.prefix_cache.evict(self.prefix_cache.num_evictable))
        self.runner.resize_kv(pages)

    def _decoder(self, keep_special_tokens: bool):
        """The tokenizer's decode for a request's text: special tokens dropped (they are
        markup of the template, or the end of the reply) unless its output format is written
        in them."""
        if not keep_special_tokens:
            return self.tokenizer.decode
        return lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)

    def _accept(self, req: Request, token: int) -> StepOutput:
        params = req.params
        req.output_ids.append(token)
        if req.drafting is not None:
            self.drafter.observe(req.drafting, token)
        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            req.finish_reason, req.stop_reason = "stop", token
            return StepOutput(req, token, req.text.flush(), finished=True)
        text = req.text.push(token)
        if req.text.stopped:
            req.finish_reason, req.stop_reason = "stop", req.text.stop_reason
        elif (
            len(req.output_ids) >= params.max_new_tokens
            or len(req.prompt_ids) + len(req.output_ids) >= self.max_context
        ):
            req.finish_reason = "length"
            text += req.text.flush()
        return StepOutput(req, token, text, finished=req.finished)

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
        while pending or self.running or self.preempted:
            while (
                pending
                and len(self.running) + len(self.preempted) < self.max_batch_size
                and self.can_admit(pending[0][1])
            ):
                i, prompt = pending.pop(0)
                index_of[self.add_request(prompt, params).id] = i
            for out in self.step():
                r = out.request
                texts.setdefault(r.id, []).append(out.text)
                if out.finished:
                    results[index_of[r.id]] = Completion(
                        r.prompt_ids, r.output_ids, "".join(texts[r.id]), r.finish_reason
                    )
        return [results[i] for i in range(len(prompts))]
