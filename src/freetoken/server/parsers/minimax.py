"""MiniMax-M2's output format (M2, M2.1), parsed as it streams.

What the model writes (its generation prompt opens `<think>\\n`, so the output starts in
reasoning: `prompt_opens_reasoning`)::

    reasoning ...
    </think>

    answer text ...
    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    <invoke name="list_files">
    </invoke>
    </minimax:tool_call>

Reasoning and answer text follow the Qwen parser's rules (parsers/qwen.py). A block of calls
is held until `</minimax:tool_call>` (or the next block, or the end of output) and parsed
whole (parsers/typed_calls.py): each `<invoke>` is a call, its `<parameter>`s the arguments,
each value the text between its tags (kept exactly: the template writes a value unpadded, so
a string's own leading or trailing newline is part of it), typed by the request's tool schema.
A block that is not only invokes (and whitespace between them), or holds none, is given back as
answer text, tags included.

The tags are plain text in MiniMax's tokenizer (servers that drop special tokens pass them on),
so this parser does not need special tokens kept.
"""

from __future__ import annotations

import re

from freetoken.server.parsers.json_stream import WHITESPACE
from freetoken.server.parsers.qwen import THINK_CLOSE
from freetoken.server.parsers.typed_calls import HeldCallParser, typed_arguments

BLOCK_OPEN, BLOCK_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_INVOKE = re.compile(r'\s*<invoke name="([^"<>]+)"\s*>')
_PARAMETER = re.compile(r'\s*<parameter name="([^"<>]+)"\s*>(.*?)</parameter>', re.DOTALL)
_INVOKE_END = re.compile(r"\s*</invoke>")


def parse_invokes(body: str, strings: dict[str, set[str]]) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each invoke in a whole block, or None if it is not only
    invokes. Read in order, so a value may hold `</invoke>` (code that writes XML)."""
    calls, pos, end_of_calls = [], 0, len(body.rstrip(WHITESPACE))
    while pos < end_of_calls:
        invoke = _INVOKE.match(body, pos)
        if invoke is None:
            return None
        name, pairs, pos = invoke[1].strip(WHITESPACE), [], invoke.end()
        while parameter := _PARAMETER.match(body, pos):
            pairs.append((parameter[1].strip(WHITESPACE), parameter[2]))
            pos = parameter.end()
        end = _INVOKE_END.match(body, pos)
        if end is None:
            return None  # text beside the parameters, or a parameter cut short
        calls.append((name, typed_arguments(name, pairs, strings)))
        pos = end.end()
    return calls or None


class MiniMaxParser(HeldCallParser):
    """Streaming parser for MiniMax-M2 output (see the module docstring for the rules)."""

    call_open, call_close = BLOCK_OPEN, BLOCK_CLOSE

    @staticmethod
    def forced_call(tool: str | None, in_reasoning: bool) -> str:
        """A block's opening as MiniMax writes it; with a name, up to its first parameter."""
        head = f"{THINK_CLOSE}\n\n" if in_reasoning else ""
        opening = f"{head}{BLOCK_OPEN}\n"
        return opening if tool is None else f'{opening}<invoke name="{tool}">\n'

    def parse_call(self, body: str) -> list[tuple[str, str]] | None:
        return parse_invokes(body, self._strings)
