"""Issue 42's server points: one access-log line per request (method, path, status, prompt and
output tokens, time), and tools offered to a model whose chat template has no tool-call
format refused with the same 400, in each API's shape, whatever the tool_choice."""

from __future__ import annotations

import logging
import re
import time

import httpx
import pytest

from freetoken.server.access_log import line

TOOL = {"name": "get_weather", "description": "the weather", "parameters": {"type": "object"}}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def access(caplog):
    caplog.set_level(logging.INFO, logger="freetoken.server.access_log")
    return caplog


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "freetoken.server.access_log"]


def test_one_access_line_per_request(server, access):
    base, _ = server
    body = {"model": "test-model", "max_tokens": 3, "messages": HI}
    assert httpx.post(base + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    streamed = {**body, "stream": True, "max_tokens": 4}
    with httpx.stream("POST", base + "/v1/chat/completions", json=streamed, timeout=60) as r:
        r.read()
    assert httpx.get(base + "/health").status_code == 200
    bad = httpx.post(base + "/v1/chat/completions", json={"model": "test-model"}, timeout=60)
    assert bad.status_code == 400
    # A request's line is written once its response is sent, which the client may see first:
    # wait for the three POST lines, and match each line by what it says.
    deadline = time.monotonic() + 30
    while sum(" POST " in x for x in _lines(access)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = _lines(access)
    pattern = r"127\.0\.0\.1 POST /v1/chat/completions 200 prompt=(\d+) output=(\d+) \d+\.\d\ds"
    answered = [m for m in (re.fullmatch(pattern, x) for x in lines) if m]
    assert sorted(m[2] for m in answered) == ["3", "4"] and all(int(m[1]) > 0 for m in answered)
    assert any(re.fullmatch(r"127\.0\.0\.1 GET /health 200 \d+\.\d\ds", x) for x in lines)
    bad_line = r"127\.0\.0\.1 POST /v1/chat/completions 400 \d+\.\d\ds"
    assert sum(bool(re.fullmatch(bad_line, x)) for x in lines) == 1


def test_line_without_a_status_or_tokens():
    assert line("-", "GET", "/x", None, {}, 0.5) == "- GET /x - 0.50s"


@pytest.fixture
def no_tool_format(server, monkeypatch):
    """The shared server, its template taken as one without a tool-call format."""
    base, core = server
    monkeypatch.setattr(core, "parser_name", None)
    return base


@pytest.mark.parametrize(
    "choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}, None]
)
def test_chat_tools_without_a_format_are_refused_whatever_the_choice(no_tool_format, choice):
    body = {
        "model": "test-model",
        "max_tokens": 3,
        "messages": HI,
        "tools": [{"type": "function", "function": TOOL}],
    }
    if choice is not None:
        body["tool_choice"] = choice
    r = httpx.post(no_tool_format + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "tools" and "no tool-call format" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_chat_tools_with_choice_none_are_served(no_tool_format):
    body = {
        "model": "test-model",
        "max_tokens": 3,
        "messages": HI,
        "tool_choice": "none",
        "tools": [{"type": "function", "function": TOOL}],
    }
    assert httpx.post(no_tool_format + "/v1/chat/completions", json=body, timeout=60).is_success


@pytest.mark.parametrize("choice", [{"type": "auto"}, {"type": "any"}, None])
def test_anthropic_tools_without_a_format_are_refused(no_tool_format, choice):
    body = {"model": "test-model", "max_tokens": 3, "messages": HI, "tools": [ANTHROPIC_TOOL]}
    if choice is not None:
        body["tool_choice"] = choice
    r = httpx.post(no_tool_format + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert "no tool-call format" in r.json()["error"]["message"]


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_responses_tools_without_a_format_are_refused(no_tool_format, choice):
    body = {
        "model": "test-model",
        "max_output_tokens": 3,
        "input": "Hi",
        "tool_choice": choice,
        "tools": [{"type": "function", **TOOL}],
    }
    r = httpx.post(no_tool_format + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and "no tool-call format" in r.json()["error"]["message"]
