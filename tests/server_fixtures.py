"""A real server on an ephemeral loopback port, around a chosen engine, for API tests."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from freetoken.config import EngineConfig, MoEOptions, ServerConfig
from freetoken.demo import demo_checkpoint
from freetoken.engine.generate import LLMEngine
from freetoken.engine.scheduler import Scheduler
from freetoken.server.app import create_app
from freetoken.server.core import GenerationCore


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(
    engine, name="test-model", api_key=None, max_running=4, max_queued=64, sandbox=None, **config
):
    """`config`: ServerConfig fields beside the key; `sandbox`: a TemplateSandbox."""
    scheduler = Scheduler(engine, max_running, max_queued)
    core = GenerationCore(scheduler, engine.tokenizer, name, template_sandbox=sandbox)
    app = create_app(core, ServerConfig(api_key=api_key, **config))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            httpx.get(base + "/health", timeout=1)  # (any answer: a failed engine's is a 503)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    try:
        yield base, core
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        scheduler.shutdown()


def demo_engine(**changes) -> LLMEngine:
    """The demo model on the CPU in fp32, with the hybrid strategy and a small CPU-tier expert
    cache so the MoE telemetry sees misses; `changes`: other EngineConfig fields."""
    fields = dict(
        model=demo_checkpoint(),
        device="cpu",
        dtype="float32",
        kv_cache_tokens=2048,
        max_batch_size=8,
        moe=MoEOptions("hybrid", "40"),
    )
    config = EngineConfig(**{**fields, **changes})
    return LLMEngine.from_config(config)


def scripted(engine, script: list[int]):
    """Replace sampling with a fixed token script (the n-th generated token is script[n]):
    drives the tool-call parser and the SDK round trips with a model whose outputs are noise.
    Drafting goes off for the engine (a verify step takes the model's tokens, not the
    script's: a script's repeated markup would be drafted)."""
    engine.drafter = None

    def sample(group, logits):
        return [engine._accept(r, script[min(len(r.output_ids), len(script) - 1)]) for r in group]

    return sample


MODEL = "test-model"


def streamed_tool_calls(stream) -> tuple[list[str], str, str | None]:
    """An OpenAI chat stream's tool call names, its arguments' pieces joined, and its finish
    reason; no text may come beside the calls (no markup leaks into it)."""
    names, pieces, finish = [], [], None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                names += [d.function.name] if d.function.name else []
                pieces.append(d.function.arguments or "")
            assert not c.delta.content
            finish = c.finish_reason or finish
    return names, "".join(pieces), finish


def demo_with_template(dst, template: str, special: tuple[str, ...] = ()):
    """The demo model at `dst` (its weights linked, not copied) with another chat template
    and, where given, extra special tokens (in its vocabulary's unused rows); returns
    (dst, the tokenizer). generation_config.json is copied: the caller may rewrite it."""
    from transformers import AutoTokenizer

    src = demo_checkpoint()
    for name in ("config.json", "README.md", "generation_config.json"):
        (dst / name).write_text((src / name).read_text())
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    tok = AutoTokenizer.from_pretrained(src)
    if special:
        tok.add_special_tokens({"additional_special_tokens": list(special)})
    tok.chat_template = template
    tok.save_pretrained(dst)
    return dst, tok


def cpu_engine(model) -> LLMEngine:
    """An fp32 engine on the CPU with every expert resident, for scripted API tests."""
    config = EngineConfig(
        model=model, device="cpu", dtype="float32", kv_cache_tokens=2048, moe=MoEOptions("fused")
    )
    return LLMEngine.from_config(config)


def record_prompts(engine, monkeypatch) -> list[str]:
    """Every prompt the engine is given from now on, decoded with its special tokens."""
    prompts: list[str] = []
    add_request = engine.add_request

    def recording(prompt_ids, params):
        prompts.append(engine.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        return add_request(prompt_ids, params)

    monkeypatch.setattr(engine, "add_request", recording)
    return prompts


# A reasoning model's tool use, as a format-specific test scripts it (`tool_use_round_trip`)
# a tool whose arguments are typed (a string, an integer): the parsers type values by it
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
WEATHER_ASK = "Weather in Paris?"
WEATHER_THOUGHT = "The user wants the weather."
WEATHER_ANSWER = "It is sunny in Paris."


def tool_use_round_trip(
    engine,
    base: str,
    monkeypatch,
    tool: dict,
    call: str,
    args: dict,
    answer: str,
    thought: str | None = WEATHER_THOUGHT,
    **first,
) -> list[str]:
    """A chat format's whole tool-use path through the official `openai` SDK: the scripted
    `call` text (reasoning `thought`, or none, then a call of `tool` with `args`) comes back as
    reasoning and a tool call, whole (`first`: that request's extra arguments) and streamed (no
    markup in the text); the tool's result goes back through the template and the scripted
    `answer` comes back as the reply WEATHER_ANSWER. Returns the prompts the engine was given
    (the three requests'), for the format's own checks."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    tok, name = engine.tokenizer, tool["function"]["name"]
    prompts = record_prompts(engine, monkeypatch)
    monkeypatch.setattr(engine, "_sample", scripted(engine, tok.encode(call)))
    messages = [{"role": "user", "content": WEATHER_ASK}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[tool], max_tokens=100, **first
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    assert choice.message.model_extra.get("reasoning_content") == thought
    [tool_call] = choice.message.tool_calls
    assert tool_call.function.name == name
    assert json.loads(tool_call.function.arguments) == args

    # streamed: the reasoning, then the call's name and arguments in pieces
    names, pieces, reasoning = [], [], []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, tools=[tool], max_tokens=100, stream=True
    ):
        for c in chunk.choices:
            reasoning.append((c.delta.model_extra or {}).get("reasoning_content") or "")
            for d in c.delta.tool_calls or []:
                names += [d.function.name] if d.function.name else []
                pieces.append(d.function.arguments or "")
            assert not c.delta.content  # no markup leaks into the text
    assert "".join(reasoning) == (thought or "")
    assert names == [name] and json.loads("".join(pieces)) == args

    monkeypatch.setattr(engine, "_sample", scripted(engine, tok.encode(answer)))
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tool_call.id, "content": '{"sky": "sunny"}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[tool], max_tokens=100
    )
    assert '{"sky": "sunny"}' in prompts[-1]
    assert second.choices[0].message.content == WEATHER_ANSWER
    assert second.choices[0].finish_reason == "stop"
    return prompts


def forced_tool_call(engine, base: str, monkeypatch, tool: dict, rest: str, question: str):
    """The tool call a request that forces `tool` (tool_choice) gets, the model scripted to
    write `rest`: what the format writes after the call's opening, which the server writes."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    monkeypatch.setattr(engine, "_sample", scripted(engine, engine.tokenizer.encode(rest)))
    forced = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": tool["function"]["name"]}},
        max_tokens=50,
    )
    [tool_call] = forced.choices[0].message.tool_calls
    assert tool_call.function.name == tool["function"]["name"]
    return tool_call
