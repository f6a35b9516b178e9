"""Chat templates: found in a checkpoint's files and rendered as transformers renders them,
without importing transformers (its import is seconds of a start on a slow file system).

A template is a Jinja program run in Jinja's sandbox with what transformers gives it:
`trim_blocks` and `lstrip_blocks`, the loop controls, a `tojson` that leaves non-ASCII and HTML
characters alone, `raise_exception`, `strftime_now`, a `{% generation %}` block that renders its
body, and the special tokens (`bos_token`, `eos_token`, ...) beside the messages, the tools and
`add_generation_prompt`. One filter transformers lacks is added: `from_json`, tojson's inverse
(JSON text -> its value; not JSON text is the template's error), with which the DeepSeek-V3.2 and
V4 templates recorded in llama.cpp read a past call's arguments given as JSON text. Messages are
normalised first, as transformers 5 does: keys whose value is None are dropped (templates print
"None" or fail on them), and a message's reasoning is offered under each name templates read it
by (`reasoning_content`: Qwen's; `thinking`: gpt-oss's).

One difference: a template may change the lists and dicts it holds (`append`, `pop`, ...).
transformers runs templates in Jinja's immutable sandbox, which refuses that; llama.cpp's
template engine allows it, and Kimi-K2's templates (Instruct, Thinking) need it: they queue the
ids of the calls they write with `ids.append(...)` and take them back for the tool results with
`ids.pop(0)` (transformers 5 fails on them). A template that renders under transformers renders
the same here. What a template is given is a copy (`_copied`), so the caller's messages, tools
and arguments are never changed whatever it does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES = "additional_chat_templates"  # a directory of NAME.jinja
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def find_template(path: Path, tokenizer_config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """A checkpoint's chat template as transformers finds it: `chat_template.jinja` (and the
    named ones in `additional_chat_templates/`) over tokenizer_config.json's `chat_template`
    (a string, or a list of {name, template}). Several: a dict by name ("default", "tool_use")."""
    templates: dict[str, str] = {}
    if (path / TEMPLATE_FILE).is_file():
        templates["default"] = (path / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (path / NAMED_TEMPLATES).is_dir():
        for file in sorted((path / NAMED_TEMPLATES).glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if not templates:
        value = tokenizer_config.get("chat_template")
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return {t["name"]: t["template"] for t in value if isinstance(t, dict)} or None
        return None
    if list(templates) == ["default"]:
        return templates["default"]
    return templates


def template_text(template: str | Mapping[str, str] | None) -> str:
    """Every template's source in one string (what parsers and markers are looked up in)."""
    if template is None:
        return ""
    return template if isinstance(template, str) else "\n".join(template.values())


def select(template: str | Mapping[str, str], chosen: str | None, tools) -> str:
    """The template a render uses: `chosen` (a name, or a template's own source), else the
    tool-use one when there are tools and the checkpoint has one, else the default."""
    if isinstance(template, Mapping):
        if chosen is not None:
            return template.get(chosen, chosen)
        if tools is not None and "tool_use" in template:
            return template["tool_use"]
        if "default" in template:
            return template["default"]
        raise ValueError(
            "this checkpoint has several chat templates and none is the default: "
            f"{', '.join(sorted(template))}"
        )
    return template if chosen is None else chosen


def normalise(messages: list[Any]) -> list[dict[str, Any]]:
    """Copies of the messages, as a template sees them: None-valued keys dropped, reasoning
    under every name it is read by."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be objects, got {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(_copied(message))
    return out


def _copied(value: Any) -> Any:
    """`value` with its dicts and lists (at any depth) copied: a template may change its own
    (see the module docstring), never the caller's."""
    if isinstance(value, Mapping):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    return value


def render(
    source: str,
    messages: list[Any],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """The text of `messages` under the template `source`. kwargs (enable_thinking,
    reasoning_effort, ...) override the special tokens where both name one."""
    if kwargs.pop("continue_final_message", False):
        raise ValueError("continue_final_message is not supported")
    variables = _copied({**(special_tokens or {}), **kwargs})
    return _compiled(source).render(
        messages=normalise(messages),
        tools=_copied(tools),
        documents=variables.pop("documents", None),
        add_generation_prompt=add_generation_prompt,
        **variables,
    )


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` in a template, without the type itself (whose
    attributes lead out of the sandbox)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=16)  # the checkpoint's templates and a few a client sent
def _compiled(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import SandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for
        training masks): its body, rendered."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """`namespace()` that refuses underscored attributes (no way into Python's internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, *args, **kwargs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not set the attribute {name!r} of a namespace"
                )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # (Jinja's own escapes HTML characters, which a prompt must keep as they are)
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def from_json(text):
        try:
            return json.loads(text)
        except (TypeError, ValueError) as e:
            raise jinja2.exceptions.TemplateError(f"from_json: not JSON text: {e}") from e

    env = SandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.filters["from_json"] = from_json
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        namespace=Namespace,
        dict=_Dict(),
    )
    return env.from_string(source)
