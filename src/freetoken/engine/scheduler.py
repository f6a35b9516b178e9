"""The engine thread: continuous batching for concurrent clients.

One thread owns the LLMEngine (and so the GPU). Clients submit requests from any thread or
event loop; the engine thread admits them between steps up to `max_running` while the KV
pool holds what they need now (their output grows into the pool, and the engine preempts the
newest request when it runs dry), runs steps, and delivers each request's outputs to its
callback. Cancelled requests leave at the next step boundary and free their KV pages. A
bounded waiting queue refuses work beyond `max_queued`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from freetoken.engine.generate import LLMEngine, Request, StepOutput
from freetoken.engine.sampling import SamplingParams
from freetoken.errors import FreetokenError

log = logging.getLogger(__name__)


# Seconds without work after which the engine thread counts as idle (and checks for work again)
IDLE_S = 0.5


class QueueFullError(FreetokenError):
    """The waiting queue is full; the client should retry later (HTTP 429)."""


class ShutdownError(FreetokenError):
    """The server shut down before the request finished."""


@dataclass
class Ticket:
    """A client's handle on one submitted request."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[StepOutput | None, BaseException | None], None]
    on_admit: Callable[[Request], None] | None = None  # once it has KV (cached_tokens known)
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    request: Request | None = None
    cancelled: bool = False


@dataclass
class SchedulerStats:
    running: int  # admitted, not finished (including those preempted)
    queued: int
    preempted: int  # waiting to resume after their KV was taken for older requests
    preemptions: int  # in total
    prefill_tokens: int
    decode_tokens: int
    prefill_seconds: float
    decode_seconds: float
    ttft: list[float]  # recent times to first token, seconds


# Engines a live scheduler's thread steps. A second scheduler on one of them would step it
# from a second thread, and each would drop the outputs of the other's requests.
_DRIVEN: weakref.WeakSet[LLMEngine] = weakref.WeakSet()


class Scheduler:
    def __init__(
        self,
        engine: LLMEngine,
        max_running: int | None = None,
        max_queued: int = 64,
        on_idle: Callable[[], None] | None = None,
    ):
        """`max_running`: at most this many requests at once (default and at most: the
        engine's `max_batch_size`, which sized its state pools). `on_idle`: called once, on the
        engine thread, the first time it had nothing to do for IDLE_S (a server's one-time
        chores that would hold the GIL: no request is waiting on them). One scheduler per
        engine at a time: shut one down before giving its engine to another."""
        if engine in _DRIVEN:
            raise RuntimeError(
                "this engine is already driven by a running Scheduler; shut that one down "
                "before starting another on it"
            )
        _DRIVEN.add(engine)
        self.engine = engine
        self.max_running = min(max_running or engine.max_batch_size, engine.max_batch_size)
        self.max_queued = max_queued
        self._admitting = True
        self._end_all = False
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._active: dict[int, Ticket] = {}  # engine request id -> ticket
        self._cancel: set[int] = set()
        self._calls: list[tuple[Callable[[], Any], Future]] = []  # see `call`
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self._on_idle = on_idle
        self._ttft: collections.deque[float] = collections.deque(maxlen=256)
        self._counters = dict(prefill_tokens=0, decode_tokens=0, prefill_s=0.0, decode_s=0.0)
        self._thread = threading.Thread(target=self._loop, name="ft-engine", daemon=True)
        self._thread.start()

    # -- client side (any thread) ---------------------------------------------------------

    def stop_admitting(self) -> None:
        """Refuse new submissions (shutting down); those queued or running go on."""
        with self._lock:
            self._admitting = False

    def end_all(self) -> None:
        """End every request, queued or running: each gets a ShutdownError (from any thread;
        the engine thread does it at its next step boundary)."""
        with self._lock:
            self._end_all = True
        self._wake.set()

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        on_output: Callable[[StepOutput | None, BaseException | None], None],
        on_admit: Callable[[Request], None] | None = None,
    ) -> Ticket:
        """Queue a request. `on_output(step, None)` is called from the engine thread for each
        generated token, and `on_output(None, error)` if the request fails; `on_admit(request)`
        when the engine takes it (its prefix-cache reuse is known then)."""
        ticket = Ticket(next(self._ids), list(prompt_ids), params, on_output, on_admit)
        if ticket.id == 0:
            log.debug("first request submitted")
        with self._lock:
            if not self._admitting:
                raise ShutdownError("the server is shutting down")
            if len(self._waiting) >= self.max_queued:
                raise QueueFullError(
                    f"the server is busy: {len(self._waiting)} requests are waiting; retry later"
                )
            self._waiting.append(ticket)
        self._wake.set()
        return ticket

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` on the engine thread between two steps (nothing of the engine in flight:
        the place to change what steps read, such as the expert cache); its result, or its
        error, in the returned future. Requests running meanwhile go on after it."""
        future: Future = Future()
        with self._lock:
            if self._stop:
                raise ShutdownError("the server is shutting down")
            self._calls.append((fn, future))
        self._wake.set()
        return future

    def cancel(self, ticket: Ticket) -> None:
        """Stop a request (client gone); its KV pages are freed at the next step boundary."""
        with self._lock:
            ticket.cancelled = True
            if ticket in self._waiting:
                self._waiting.remove(ticket)
            elif ticket.request is not None:
                self._cancel.add(ticket.request.id)
        self._wake.set()

    def stats(self) -> SchedulerStats:
        with self._lock:
            c = self._counters
            return SchedulerStats(
                running=len(self._active),
                queued=len(self._waiting),
                preempted=len(self.engine.preempted),
                preemptions=self.engine.preemptions,
                prefill_tokens=c["prefill_tokens"],
                decode_tokens=c["decode_tokens"],
                prefill_seconds=c["prefill_s"],
                decode_seconds=c["decode_s"],
                ttft=list(self._ttft),
            )

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop = True
            calls, self._calls = self._calls, []
        for _, future in calls:
            future.cancel()
        self._wake.set()
        self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            _DRIVEN.discard(self.engine)

    # -- engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop:
            self._run_calls()
            self._admit_and_cancel()
            if not self.engine.running and not self.engine.preempted:
                woken = self._wake.wait(timeout=IDLE_S)
                self._wake.clear()
                if not woken and self._on_idle is not None:
                    self._run_idle_chore()
                continue
            self._step()

    def _run_idle_chore(self) -> None:
        chore, self._on_idle = self._on_idle, None
        try:
            chore()
        except Exception:  # (a chore's failure is its own; the engine goes on)
            log.exception("the engine thread's idle chore failed")

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:  # the caller's to report; the engine goes on
                    future.set_exception(e)

    def _admit_and_cancel(self) -> None:
        engine = self.engine
        with self._lock:
            if self._end_all:
                self._end_everything()
            for req in [r for r in [*engine.running, *engine.preempted] if r.id in self._cancel]:
                engine.abort(req)
                self._active.pop(req.id, None)
            self._cancel.clear()
            while (
                self._waiting
                and len(engine.running) + len(engine.preempted) < self.max_running
                and engine.can_admit(self._waiting[0].prompt_ids)
            ):
                ticket = self._waiting.popleft()
                try:
                    ticket.request = engine.add_request(ticket.prompt_ids, ticket.params)
                except (ValueError, RuntimeError, FreetokenError) as e:
                    self._deliver(ticket, None, e)
                    continue
                self._active[ticket.request.id] = ticket
                if ticket.on_admit is not None:
                    try:
                        ticket.on_admit(ticket.request)
                    except Exception:
                        log.exception("admission callback of request %d failed", ticket.id)

    def _end_everything(self) -> None:
        """(Under the lock, on the engine thread.) Every request ends with a ShutdownError."""
        error = ShutdownError("the server shut down before this request finished")
        for req in [*self.engine.running, *self.engine.preempted]:
            self.engine.abort(req)
            ticket = self._active.pop(req.id, None)
            if ticket is not None:
                self._deliver(ticket, None, error)
        while self._waiting:
            self._deliver(self._waiting.popleft(), None, error)
        self._cancel.clear()

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # a failed step fails its requests, never the server
            log.exception("engine step failed")
            with self._lock:
                for req in [*self.engine.running, *self.engine.preempted]:
                    self.engine.abort(req)
                    ticket = self._active.pop(req.id, None)
                    if ticket is not None:
                        self._deliver(ticket, None, e)
            return
        elapsed = time.perf_counter() - start
        now = time.perf_counter()
        prefill, decode = self.engine.last_step.prefill, self.engine.last_step.decode
        with self._lock:
            c = self._counters
            if not (c["prefill_tokens"] or c["decode_tokens"]):  # the first: a start's costs
                log.debug("first step: %.3f s", elapsed)
            total = max(1, prefill + decode)
            c["prefill_tokens"] += prefill
            c["decode_tokens"] += decode
            c["prefill_s"] += elapsed * prefill / total
            c["decode_s"] += elapsed * decode / total
            for out in outputs:
                ticket = self._active.get(out.request.id)
                if ticket is None or ticket.cancelled:
                    continue
                if ticket.first_token is None:
                    ticket.first_token = now
                    self._ttft.append(now - ticket.submitted)
                if out.finished:
                    self._active.pop(out.request.id, None)
                self._deliver(ticket, out, None)

    def _deliver(self, ticket: Ticket, out: StepOutput | None, error: BaseException | None) -> None:
        """Hand an output to its client; a failing callback must not stop the engine thread."""
        try:
            ticket.on_output(out, error)
        except Exception:
            log.exception("delivering output of request %d failed; cancelling it", ticket.id)
            ticket.cancelled = True
            if ticket.request is not None:
                self._cancel.add(ticket.request.id)
