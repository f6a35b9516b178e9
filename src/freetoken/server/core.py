"""The protocol-neutral generation core: a request in, a stream of events out.

Adapters parse their API's JSON into a `GenerationRequest` (messages rendered with the
checkpoint's chat template, sampling settings, tools) and turn the events back into their wire
format. The core owns nothing protocol-specific: tokens come from the scheduler's engine
thread, text goes through the model's output parser (reasoning, tool calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from freetoken.engine.generate import StepOutput
from freetoken.engine.sampling import SamplingParams
from freetoken.engine.scheduler import Scheduler, ShutdownError
from freetoken.server import access_log
from freetoken.server import events as ev
from freetoken.server.errors import ApiError, bad_request, shown
from freetoken.server.sandbox import TemplateTimeout
from freetoken.tokenizer import Tokenizer

REQUIRED = "required"  # a tool choice: the reply must call some tool


@dataclass(frozen=True)
class ForcedOutput:
    """The start of the reply, written into the prompt for the model (a forced tool call's
    opening): the parser reads it before the generated text."""

    text: str = ""
    tokens: int = 0  # how many prompt tokens it took, at the prompt's end


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    parse_output: bool = True  # run the model's reasoning / tool-call parser
    tools: list[dict[str, Any]] = field(default_factory=list)
    forced: ForcedOutput = ForcedOutput()


# chat_template_kwargs that the renderer itself sets: a client's would collide with them.
RENDER_ARGUMENTS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "tokenize",
        "continue_final_message",
        "return_dict",
        "return_tensors",
        "chat_template",
    }
)


def shutdown_reserve(timeout: float) -> float:
    """How much of a shutdown timeout to keep for after the requests are ended: the engine
    ends them at its next step boundary (a prefill chunk can take a second on a CPU), then the
    last events go out and the process exits."""
    return min(2.0, timeout / 3)


# What the APIs sample with where neither the request nor the checkpoint says
API_SAMPLING_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


class GenerationCore:
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        model_name: str,
        template_sandbox=None,
    ):
        """`template_sandbox`: a TemplateSandbox (server/sandbox.py) where client chat
        templates render; None refuses them."""
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.template_sandbox = template_sandbox
        self.metrics = None  # the app's Metrics (server/stats.py), observed per token
        self.draining = False  # shutting down: no new requests
        self.shutdown_deadline: float | None = None  # time.monotonic() to be gone by
        # ids a request may name (logit_bias): the model's logits', which a tokenizer's
        # vocabulary may exceed (an id past them would fail the step)
        self.vocab_size = min(tokenizer.vocab_size, scheduler.engine.runner.config.vocab_size)
        # A request that sets no output limit gets the checkpoint's own (generation_config's
        # max_new_tokens), else whatever the context leaves.
        self.default_max_tokens = tokenizer.default_max_new_tokens
        # ... and the checkpoint's recommended sampling for what it leaves unset
        self.sampling_defaults = tokenizer.sampling_defaults()
        self.parser_name = None
        self.template_source = ""
        # the parser reads special tokens (Harmony's): requests it parses decode with them kept
        self.parser_keeps_special = False
        if tokenizer.has_chat_template:
            from freetoken.server.parsers import keeps_special_tokens, parser_for_template

            self.template_source = tokenizer.chat_template
            self.parser_name = parser_for_template(self.template_source)
            if self.parser_name is not None:
                self.parser_keeps_special = keeps_special_tokens(self.parser_name)

    # -- building requests ----------------------------------------------------------------

    @property
    def max_context(self) -> int:
        """The longest sequence served (it follows the KV pool when that is re-sized)."""
        return self.scheduler.engine.max_context

    @property
    def weights_error(self) -> str | None:
        """Why the engine refuses to compute (its weights failed their checksums), or None."""
        integrity = self.scheduler.engine.runner.integrity
        return str(integrity.error) if integrity is not None and integrity.error else None

    def check_model(self, model: str) -> str:
        if model != self.model_name:
            raise ApiError(
                404,
                "invalid_request_error",
                f"model '{shown(model)}' does not exist; this server serves '{self.model_name}'",
                code="model_not_found",
                param="model",
            )
        return model

    def template_kwargs(self, kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """A client's `chat_template_kwargs`, checked: none that the renderer sets itself,
        and a template of the client's own only where the operator allows it."""
        kwargs = dict(kwargs or {})
        taken = sorted(RENDER_ARGUMENTS.intersection(kwargs) - {"chat_template"})
        if taken:
            raise bad_request(
                f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do",
                param="chat_template_kwargs",
            )
        if "chat_template" in kwargs:
            if self.template_sandbox is None:
                raise bad_request(
                    "chat templates in requests are refused: this server renders its "
                    "checkpoint's own (start it with --allow-request-chat-template to allow "
                    "them)",
                    param="chat_template_kwargs.chat_template",
                )
            if not isinstance(kwargs["chat_template"], str):
                raise bad_request("chat_template must be a string", param="chat_template")
        return kwargs

    def encode(self, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except Exception as e:  # text the tokenizer cannot take is the request's fault
            raise bad_request(f"cannot tokenize the text: {shown(str(e), 200)}") from e

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        if not messages:
            raise ApiError(400, "invalid_request_error", "messages must not be empty")
        if not self.tokenizer.has_chat_template:
            raise ApiError(400, "invalid_request_error", "this model has no chat template")
        if tools and self.parser_name is None:
            # Whatever the tool_choice: the template would leave the tools out of the prompt
            # and no parser would read a call from the reply (docs/api.md).
            raise ApiError(
                400,
                "invalid_request_error",
                "tools were offered, but this model's chat template has no tool-call format: "
                "the model can neither see them nor call them. Send no tools (or tool_choice "
                "none), or serve a model whose template has tool calls (e.g. "
                "qwen2.5-coder-0.5b-instruct)",
                param="tools",
            )
        try:
            text = self._render(messages, tools, template_kwargs)
        except TemplateTimeout as e:
            raise bad_request(str(e), param="chat_template_kwargs.chat_template") from e
        except Exception as e:  # template errors are the request's fault (bad roles, shapes)
            raise bad_request(f"cannot render the chat: {shown(str(e), 300)}") from e
        return self.encode(text)

    def _render_once(self, messages, tools, template_kwargs) -> str:
        if "chat_template" in template_kwargs:
            return self.template_sandbox.render(messages, tools, template_kwargs)
        return self.tokenizer.render_chat(messages, tools=tools, **template_kwargs)

    def _render(self, messages, tools, template_kwargs) -> str:
        try:
            return self._render_once(messages, tools or None, template_kwargs)
        except Exception:
            # Agents put system messages mid-conversation (Claude Code's reminders). Templates
            # that take a system message only first get those as user turns, in place.
            later = [m for m in messages[1:] if m.get("role") == "system"]
            if not later:
                raise
            moved = [messages[0]] + [
                {**m, "role": "user"} if m.get("role") == "system" else m for m in messages[1:]
            ]
            return self._render_once(moved, tools or None, template_kwargs)

    def reasoning_options(
        self, effort: str | None = None, thinking: bool | None = None
    ) -> dict[str, Any]:
        """Chat template arguments for a client's reasoning settings (an effort such as
        "low" / "high", or thinking on / off), for the arguments this template reads: Qwen3's
        `enable_thinking`, gpt-oss's `reasoning_effort`. An effort of "none" turns thinking
        off."""
        if effort == "none":
            effort, thinking = None, False
        options: dict[str, Any] = {}
        if effort is not None and "reasoning_effort" in self.template_source:
            options["reasoning_effort"] = effort
        if thinking is not None and "enable_thinking" in self.template_source:
            options["enable_thinking"] = thinking
        return options

    def force_tool_call(
        self, prompt_ids: list[int], tools: list[dict[str, Any]], tool: str
    ) -> tuple[list[int], ForcedOutput]:
        """Make the reply a call of `tool` (a name, or REQUIRED for any of `tools`): the call's
        opening, as the model would write it, goes at the end of the prompt, so the model can
        only continue it. Returns the prompt and what it forced."""
        names = [t["function"]["name"] for t in tools]
        if not names:
            raise ApiError(400, "invalid_request_error", "tool_choice forces a call, but no tools")
        if tool != REQUIRED and tool not in names:
            raise ApiError(
                400, "invalid_request_error", f"tool_choice names {tool!r}, not one of the tools"
            )
        from freetoken.server.parsers import forced_tool_call, prompt_opens_reasoning

        tail = self.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
        text = None
        if self.parser_name:
            name = None if tool == REQUIRED else tool
            text = forced_tool_call(self.parser_name, name, prompt_opens_reasoning(tail))
        if text is None:
            raise ApiError(
                400, "invalid_request_error", "this model's output format has no tool calls"
            )
        forced_ids = self.tokenizer.encode(text)
        return prompt_ids + forced_ids, ForcedOutput(text, len(forced_ids))

    def sampling_params(self, **settings) -> SamplingParams:
        """A request's SamplingParams from its settings (SamplingParams' fields): each sampling
        setting it leaves unset (None) is the checkpoint's recommendation (generation_config.json,
        as `ft generate` and vLLM take it: a model published for greedy decoding gets it), else
        the APIs' own default (temperature 1, no top-p/top-k/min-p cut, no penalty). A value
        SamplingParams refuses is the API's 400."""
        given = {k: v for k, v in settings.items() if v is not None}
        for name in API_SAMPLING_DEFAULTS:
            if name not in given:
                given[name] = self.sampling_defaults.get(name, API_SAMPLING_DEFAULTS[name])
        try:
            return SamplingParams(**given)
        except ValueError as e:
            raise bad_request(str(e)) from e

    def output_budget(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """How many tokens the reply may have: what the client asked for (or the checkpoint's
        default), cut to the room the context leaves; a reply cut there finishes with the
        length reason, as llama-server does and as clients' own retry logic expects. Only a
        prompt that leaves no room at all is an error, worded as each API words it (clients
        compact the conversation on it)."""
        room = self.max_context - len(prompt_ids)
        if room <= 0:
            raise ApiError(
                400,
                "invalid_request_error",
                f"This model's maximum context length is {self.max_context} tokens. However, "
                f"your messages resulted in {len(prompt_ids)} tokens. Please reduce the length "
                "of the messages.",
                code="context_length_exceeded",
                anthropic_message=(
                    f"prompt is too long: {len(prompt_ids)} tokens > {self.max_context} maximum"
                ),
            )
        wanted = max_tokens if max_tokens is not None else self.default_max_tokens
        return min(wanted or room, room)

    # -- running --------------------------------------------------------------------------

    def start(self, req: GenerationRequest) -> Generation:
        """Submit now (so a full queue fails before any response starts) and return the
        generation: its events, and when it was admitted; closing it early cancels the
        request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[StepOutput | None, BaseException | None]] = asyncio.Queue()
        admitted: asyncio.Future[int] = loop.create_future()

        def on_output(out, error):
            # The client's loop may be gone (server shut down mid-request): nothing to deliver.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, (out, error))

        def on_admit(request):
            def resolve():
                if not admitted.done():
                    admitted.set_result(request.cached_tokens)

            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(resolve)

        params = req.params
        if req.parse_output and self.parser_keeps_special:
            params = dataclasses.replace(params, keep_special_tokens=True)
        ticket = self.scheduler.submit(req.prompt_ids, params, on_output, on_admit)
        return Generation(self._events(req, queue, ticket), admitted)

    async def _events(self, req, queue, ticket) -> AsyncIterator[ev.Event]:
        parser = None
        if req.parse_output and self.parser_name:
            from freetoken.server.parsers import make_parser, prompt_opens_reasoning

            # Thinking templates may open <think> in the generation prompt itself. Every
            # parser `parser_for_template` picks takes this option.
            prompt = req.prompt_ids[: len(req.prompt_ids) - req.forced.tokens]
            tail = self.tokenizer.decode(prompt[-8:], skip_special_tokens=False)
            parser = make_parser(
                self.parser_name, req.tools, starts_in_reasoning=prompt_opens_reasoning(tail)
            )
        completion_tokens = 0
        started = last = time.perf_counter()
        try:
            if parser is not None and req.forced.text:
                for event in parser.feed(req.forced.text):
                    yield event
            while True:
                out, error = await queue.get()
                if error is not None:
                    yield failure(error)
                    return
                now = time.perf_counter()
                if self.metrics is not None:
                    latency = self.metrics.inter_token if completion_tokens else self.metrics.ttft
                    latency.observe(now - (last if completion_tokens else started))
                last = now
                completion_tokens += 1
                if out.text:
                    for event in parser.feed(out.text) if parser else [ev.TextDelta(out.text)]:
                        yield event
                if out.finished:
                    if parser:
                        for event in parser.finish():
                            yield event
                    yield ev.Usage(
                        len(req.prompt_ids), completion_tokens, out.request.cached_tokens
                    )
                    yield self._finish(out, parser)
                    if self.metrics is not None:
                        self.metrics.duration.observe(now - started)
                    return
        finally:
            access_log.note(len(req.prompt_ids), completion_tokens)
            if not (ticket.request is not None and ticket.request.finished):
                self.scheduler.cancel(ticket)

    # -- shutting down --------------------------------------------------------------------

    def check_serving(self) -> None:
        """Refuse new work (503) once the server is shutting down."""
        if self.draining:
            raise ApiError(
                503,
                "overloaded_error",
                "the server is shutting down",
                headers={"Retry-After": "10"},
            )

    def begin_shutdown(self, timeout: float) -> float:
        """Stop taking requests; those in flight may finish until `timeout` seconds from now
        less a reserve for the engine's last step and the exit, after which the scheduler ends
        them (each gets a Failure: streams end with their API's error event). Returns the
        deadline (time.monotonic()) by which the process should be gone. From any thread (the
        server calls it from its SIGTERM handler)."""
        if self.shutdown_deadline is not None:
            return self.shutdown_deadline
        self.shutdown_deadline = time.monotonic() + timeout
        self.draining = True
        self.scheduler.stop_admitting()
        # A daemon timer: a process whose requests all finished sooner need not wait for it.
        timer = threading.Timer(timeout - shutdown_reserve(timeout), self.scheduler.end_all)
        timer.daemon = True
        timer.start()
        return self.shutdown_deadline

    def _finish(self, out: StepOutput, parser) -> ev.Finish:
        request = out.request
        if request.finish_reason == "length":
            return ev.Finish("length")
        if parser is not None and parser.saw_tool_call:
            return ev.Finish("tool_calls")
        if isinstance(request.stop_reason, str):
            return ev.Finish("stop_sequence", stop_sequence=request.stop_reason)
        return ev.Finish("stop")


class Generation:
    """A submitted request: an async iterator of its events (closing it cancels the request)
    that also says how much of the prompt the prefix cache held, once the engine admits it."""

    def __init__(self, events: AsyncIterator[ev.Event], admitted: asyncio.Future[int]):
        self._events = events
        self._admitted = admitted

    def __aiter__(self):
        return self

    async def __anext__(self) -> ev.Event:
        return await anext(self._events)

    async def aclose(self) -> None:
        await self._events.aclose()

    async def cached_tokens(self, timeout: float) -> int | None:
        """Prompt tokens reused from the prefix cache, known when the engine admits the
        request (usually within one engine step); None if that takes longer than `timeout`
        (the queue is long), so a stream need not wait to start."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._admitted), timeout)
        except asyncio.TimeoutError:
            return None


def failure(error: BaseException) -> ev.Failure:
    """The event for a request the engine could not finish."""
    if isinstance(error, ShutdownError):
        return ev.Failure(503, "overloaded_error", str(error))
    if isinstance(error, ValueError):  # refused at admission (the context, an empty prompt)
        return ev.Failure(400, "invalid_request_error", str(error))
    return ev.Failure(500, "server_error", f"the engine failed: {shown(str(error), 200)}")


def failed(event: ev.Failure) -> ApiError:
    """A whole answer's error for a Failure event."""
    return ApiError(event.status, event.kind, event.message)


async def with_keepalive(events: AsyncIterator[ev.Event], interval: float):
    """The events, with None yielded whenever `interval` seconds pass without one (a long
    prefill), so a stream can send keep-alives that stop clients and proxies timing out."""
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield event
    finally:
        if pending is not None and not pending.done():
            # The events' generator is still running inside `pending`: closing it now would
            # raise "aclose(): asynchronous generator is already running". Cancel that step
            # (which cancels the request) and let it finish first.
            pending.cancel()
            await asyncio.wait({pending})
        if pending is not None and not pending.cancelled():
            pending.exception()  # retrieved, so asyncio does not log it as lost
        await events.aclose()
