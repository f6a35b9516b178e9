"""Kimi-K2's, Kimi-Linear's and MiniMax-M2's own chat templates (tests/data/templates/,
unchanged) rendered by chat_template.py: a conversation with a system message, tools, an
assistant's reasoning, text and tool call, the tool's result and the generation prompt, against
the text read off each template by hand."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from freetoken import chat_template
from server_fixtures import WEATHER

TEMPLATES = Path(__file__).parent / "data" / "templates"
# (the call's id is a client's own: the Kimi templates show which of them read it)
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "reasoning_content": "They want the weather.",
        "tool_calls": [
            {
                "type": "function",
                "id": "call_1",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
]

KIMI_TOOLS = f"<|im_system|>tool_declare<|im_middle|>{json.dumps([WEATHER])}<|im_end|>"
KIMI_ID = "functions.get_weather:0"  # the id the Instruct and Thinking templates number
KIMI_CALL = (
    f"<|tool_calls_section_begin|><|tool_call_begin|>{KIMI_ID}"
    '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)
KIMI_START = (
    f"{KIMI_TOOLS}<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
    "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|><|im_assistant|>assistant<|im_middle|>"
)
KIMI_PROMPT = "<|im_assistant|>assistant<|im_middle|>"
# The Instruct and Thinking templates number the calls themselves and write that id again
# before the result; the first Kimi-K2 template writes the request's `tool_call_id` there
# (after a literal backslash-n: the template's text has "\n" outside a string).
KIMI_RESULT = '<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{"sky": "sunny"}'
EXPECTED = {
    "Kimi-K2-Instruct.jinja": (
        f"{KIMI_START}Let me look.{KIMI_CALL}<|im_end|>{KIMI_RESULT}<|im_end|>{KIMI_PROMPT}"
    ),
    "Kimi-K2-Thinking.jinja": (
        f"{KIMI_START}<think>They want the weather.</think>Let me look.{KIMI_CALL}<|im_end|>"
        f"{KIMI_RESULT}<|im_end|>{KIMI_PROMPT}"
    ),
    "moonshotai-Kimi-K2.jinja": (
        f"{KIMI_START}Let me look.{KIMI_CALL}<|im_end|><|im_system|>tool<|im_middle|>"
        '## Return of call_1\\n{"sky": "sunny"}<|im_end|>' + KIMI_PROMPT
    ),
    # Kimi-Linear's: tools as compact JSON, no default system prompt, no reasoning written back,
    # and the call's id the request's own (`id`, then `tool_call_id` before the result)
    "Kimi-Linear-48B-A3B-Instruct.jinja": (
        "<|im_system|>tool_declare<|im_middle|>"
        f"{json.dumps([WEATHER], separators=(',', ':'))}<|im_end|>"
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        f"<|im_assistant|>assistant<|im_middle|>Let me look.{KIMI_CALL.replace(KIMI_ID, 'call_1')}"
        '<|im_end|><|im_system|>tool<|im_middle|>## Return of call_1\n{"sky": "sunny"}<|im_end|>'
        + KIMI_PROMPT
    ),
    "MiniMax-M2.jinja": (
        "]~!b[]~b]system\nYou are terse.\n\n# Tools\nYou may call one or more tools to assist "
        "with the user query.\nHere are the tools available in JSONSchema format:\n\n<tools>\n"
        f"<tool>{json.dumps(WEATHER['function'])}</tool>\n</tools>\n\n"
        "When making tool calls, use XML format to invoke tools and pass parameters:\n\n"
        '<minimax:tool_call>\n<invoke name="tool-name-1">\n'
        '<parameter name="param-key-1">param-value-1</parameter>\n'
        '<parameter name="param-key-2">param-value-2</parameter>\n...\n</invoke>\n'
        "</minimax:tool_call>[e~[\n"
        "]~b]user\nWeather in Paris?[e~[\n"
        "]~b]ai\n<think>\nThey want the weather.\n</think>\n\nLet me look.\n"
        '<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n'
        "</invoke>\n</minimax:tool_call>[e~[\n"
        ']~b]tool\n<response>{"sky": "sunny"}</response>[e~[\n'
        "]~b]ai\n<think>\n"
    ),
}


def test_the_fixtures_are_the_recorded_templates_unchanged():
    readme = (TEMPLATES / "README-kimi-minimax.md").read_text()
    sums = dict(re.findall(r"\| `([\w.-]+\.jinja)` \|.*\| `([0-9a-f]{64})` \|", readme))
    assert set(sums) == set(EXPECTED)
    for name, digest in sums.items():
        assert hashlib.sha256((TEMPLATES / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_tool_use_conversation_renders_as_the_template_writes_it(name):
    source = (TEMPLATES / name).read_text()
    assert chat_template.render(source, CHAT, [WEATHER]) == EXPECTED[name]


@pytest.mark.parametrize(
    "name", ["MiniMax-M2.jinja", "moonshotai-Kimi-K2.jinja", "Kimi-Linear-48B-A3B-Instruct.jinja"]
)
def test_templates_transformers_renders_render_the_same_here(name):
    # (transformers' immutable sandbox refuses the other two: they append to and pop from a
    # list, which chat_template.py allows, see its docstring)
    from transformers.utils.chat_template_utils import render_jinja_template

    source = (TEMPLATES / name).read_text()
    [theirs], _ = render_jinja_template(
        conversations=[CHAT], tools=[WEATHER], chat_template=source, add_generation_prompt=True
    )
    assert chat_template.render(source, CHAT, [WEATHER]) == theirs


def test_kimi_thinking_keeps_only_the_reasoning_since_the_last_answer():
    source = (TEMPLATES / "Kimi-K2-Thinking.jinja").read_text()
    before = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."},
    ]
    text = chat_template.render(source, before + CHAT[1:], [WEATHER])
    # the answered turn's reasoning is dropped, the turn in progress keeps its own
    assert "<|im_middle|><think></think>Hello.<|im_end|>" in text
    assert "<think>They want the weather.</think>Let me look." in text
    # and the caller's messages are left as they were, though the template pops its ids
    assert CHAT[2]["tool_calls"][0]["id"] == "call_1" and len(CHAT) == 4
