"""The tokenizer read without transformers (tokenizers + chat_template.py) against transformers
on the same files: ids, text, token names, and the rendered chats; the cases that go through
transformers instead; and what a template may and may not do."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer

from freetoken import chat_template, settings
from freetoken.errors import CheckpointError
from freetoken.qwen_vocab import write_qwen_tokenizer
from freetoken.tokenizer import Tokenizer
from server_fixtures import WEATHER

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": 'Be brief. Ünïcödé, <b>tags</b> & "quotes".'},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "thinking about Q1"},
        {"role": "user", "content": "Q2 <|im_end|> mid-text"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "21 °C.", "reasoning_content": "The tool says 21."},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "blocks "}, {"type": "text", "text": "of text"}],
        }
    ],
]
TEXTS = [
    "Hello, world! It's 3:45pm; we'll see.",
    "def f(x):\n\treturn {'k': [1, 2]}  # comment\r\n\n\n",
    "你好，世界！ 日本語 한국어 😀👍🏽 👨‍👩‍👧‍👦",
    "<|im_start|>user\nspecial tokens inside text<|im_end|><think>x</think>",
    "   spaces   and\ttabs  x . , ? n't 're",
    "",
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(settings.CACHE_DIR.name, str(cache))
        return write_qwen_tokenizer(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def ours(qwen_dir) -> Tokenizer:
    return Tokenizer(qwen_dir)


@pytest.fixture(scope="module")
def theirs(qwen_dir):
    return AutoTokenizer.from_pretrained(qwen_dir)


def test_qwen_is_read_without_transformers(qwen_dir: Path) -> None:
    code = (
        "import sys; from freetoken.tokenizer import Tokenizer; t = Tokenizer(sys.argv[1]); "
        "t.render_chat([{'role': 'user', 'content': 'hi'}]); t.decode(t.encode('hi')); "
        "print(t.uses_transformers, 'transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(qwen_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_are_transformers(ours, theirs, text: str) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_vocabulary_and_special_tokens_are_transformers(ours, theirs) -> None:
    assert ours.vocab_size == len(theirs)
    for token in ("<|im_end|>", "<think>", "</tool_call>", "hello", "Ġworld"):
        assert ours.token_id(token) == theirs.convert_tokens_to_ids(token)
        assert ours.token(ours.token_id(token)) == token
    assert ours.token_id("<no such token>") is None
    assert ours.eos_token_ids[0] == theirs.eos_token_id


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"add_generation_prompt": False},
        {"enable_thinking": False},
        {"tools": [WEATHER]},
    ],
)
def test_chats_render_as_transformers_renders_them(ours, theirs, conversation, options) -> None:
    messages = CONVERSATIONS[conversation]
    options = {"add_generation_prompt": True, **options}
    expected = theirs.apply_chat_template(messages, tokenize=False, **options)
    assert ours.render_chat(messages, **options) == expected


@pytest.fixture(scope="module")
def harmony_dir(qwen_dir, tmp_path_factory) -> Path:
    """A tokenizer saved by transformers with tokens added and its template in
    chat_template.jinja (as transformers 5 writes it), reading `reasoning_effort`, the
    special tokens and `thinking` (gpt-oss's name for the reasoning)."""
    dst = tmp_path_factory.mktemp("harmony")
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|channel|>", "<|message|>"]})
    tok.chat_template = (
        "{{ bos_token if bos_token else '' }}Reasoning: {{ reasoning_effort | default('medium') }}"
        "{% for m in messages %}<|im_start|>{{ m.role }}"
        "{% if m.thinking %}<|channel|>analysis<|message|>{{ m.thinking }}{% endif %}"
        "<|message|>{{ m.content | tojson }}{{ eos_token }}{% endfor %}"
    )
    tok.save_pretrained(dst)
    return dst


def test_a_saved_template_and_added_tokens(harmony_dir: Path) -> None:
    ours, theirs = Tokenizer(harmony_dir), AutoTokenizer.from_pretrained(harmony_dir)
    assert not ours.uses_transformers
    messages = CONVERSATIONS[1]
    for kwargs in ({}, {"reasoning_effort": "high"}):
        text = ours.render_chat(messages, **kwargs)
        assert text == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert "<|channel|>analysis<|message|>thinking about Q1" in text  # (reasoning_content)
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.token_id("<|channel|>") == theirs.convert_tokens_to_ids("<|channel|>")


def test_named_templates_pick_tool_use_with_tools(qwen_dir: Path, tmp_path: Path) -> None:
    for f in qwen_dir.iterdir():
        shutil.copy(f, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "x"}]
    for tools in (None, [WEATHER]):
        assert ours.render_chat(messages, tools) == theirs.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
    assert ours.render_chat(messages, chat_template="tool_use", tools=[WEATHER]) == "tools:1"
    assert "plain:" in ours.chat_template and "tools:" in ours.chat_template


@pytest.mark.parametrize("change", ["class", "added token"])
def test_what_transformers_would_change_goes_through_transformers(
    qwen_dir: Path, tmp_path: Path, change: str
) -> None:
    for f in qwen_dir.iterdir():
        shutil.copy(f, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if change == "class":  # (Llama's class rebuilds parts of tokenizer.json)
        config["tokenizer_class"] = "GPT2Tokenizer"
    else:  # one tokenizer.json does not hold
        config["added_tokens_decoder"]["151669"] = {"content": "<|extra|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert ours.uses_transformers
    text = "Hi <|extra|> there"
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    assert ours.vocab_size == len(theirs)
    messages = CONVERSATIONS[2]
    assert ours.render_chat(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_a_checkpoint_without_a_template(qwen_dir: Path, tmp_path: Path) -> None:
    for f in qwen_dir.iterdir():
        shutil.copy(f, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(tmp_path)
    assert not tok.has_chat_template and tok.chat_template == ""
    with pytest.raises(CheckpointError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "x"}])


# --------------------------------------------------------------------------- the template's world


def render(source: str, **kwargs) -> str:
    return chat_template.render(source, [{"role": "user", "content": "é <b>"}], **kwargs)


def test_tojson_keeps_text_as_it_is_and_takes_options() -> None:
    assert render("{{ messages[0] | tojson }}") == '{"role": "user", "content": "é <b>"}'
    assert render("{{ {'b': 1, 'a': 2} | tojson(indent=1, sort_keys=True) }}") == (
        '{\n "a": 2,\n "b": 1\n}'
    )


def test_blocks_are_trimmed_and_loop_controls_work() -> None:
    source = "{% for i in range(5) %}\n  {% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    assert render(source) == "012"


def test_the_generation_block_renders_its_body() -> None:
    assert render("a{% generation %}b{{ 1 + 1 }}{% endgeneration %}c") == "ab2c"


def test_raise_exception_is_the_templates_error() -> None:
    with pytest.raises(jinja2.TemplateError, match="no system"):
        render("{{ raise_exception('no system') }}")


def test_strftime_now_and_special_tokens() -> None:
    assert render("{{ strftime_now('%Y') | length }}") == "4"
    assert (
        render(
            "{{ bos_token }}|{{ eos_token }}",
            special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
        )
        == "<s>|</s>"
    )
    assert (
        render("{{ eos_token }}", special_tokens={"eos_token": "</s>"}, eos_token="<end>")
        == "<end>"
    )  # (the caller's over the checkpoint's)


def test_the_sandbox_holds() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{{ ''.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{% set ns = namespace(_x=1) %}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        render("{% set ns = namespace() %}{% set ns._x = 1 %}")
    assert render("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}") == "2"
    assert render("{{ dict(a=1) | tojson }}|{{ dict.fromkeys(['k']) | tojson }}") == (
        '{"a": 1}|{"k": null}'
    )


def test_messages_are_normalised_and_never_changed() -> None:
    messages = [{"role": "assistant", "content": None, "reasoning": "why"}]
    text = chat_template.render(
        "{% for m in messages %}{{ 'content' in m }} {{ m.thinking }} {{ m.reasoning_content }}"
        "{% endfor %}",
        messages,
    )
    assert text == "False why why"
    assert messages == [{"role": "assistant", "content": None, "reasoning": "why"}]


def test_a_template_changes_only_its_own_copies() -> None:
    # (Kimi-K2's templates queue call ids so: llama.cpp allows it, transformers' immutable
    # sandbox does not; see chat_template.py)
    queue = (
        "{% set ns = namespace(ids=[]) %}{% set _ = ns.ids.append(1) %}"
        "{% set _ = ns.ids.append(2) %}{{ ns.ids.pop(0) }}{{ ns.ids }}"
    )
    assert render(queue) == "1[2]"
    messages = [{"role": "user", "content": "hi", "parts": [{"text": "a"}]}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = chat_template.render(
        "{% set _ = messages[0].parts.append(0) %}{% set _ = messages[0].update(role='x') %}"
        "{% set _ = tools[0].function.clear() %}{% set _ = messages.append(1) %}"
        "{{ messages[0].role }} {{ messages[0].parts | length }} {{ tools[0].function }}",
        messages,
        tools,
    )
    assert text == "x 2 {}"
    assert messages == [{"role": "user", "content": "hi", "parts": [{"text": "a"}]}]
    assert tools == [{"type": "function", "function": {"name": "f"}}]


def test_a_tokenizer_json_of_another_model_kind_goes_through_transformers(tmp_path: Path) -> None:
    """Only BPE tokenizer.json files are read as stored (the model kind read off the parsed
    tokenizer): a WordLevel one goes through transformers, and encodes as it does."""
    from tokenizers import Tokenizer as Stored
    from tokenizers import models, pre_tokenizers

    stored = Stored(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    stored.pre_tokenizer = pre_tokenizers.Whitespace()
    stored.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer(tmp_path)
    assert ours.uses_transformers
    assert ours.encode("hello world again") == [1, 2, 0]


def test_from_json_reads_json_text() -> None:
    assert render("""{{ ('{"a": [1, null], "b": "é"}' | from_json).a | tojson }}""") == "[1, null]"
    with pytest.raises(jinja2.TemplateError, match="from_json"):
        render("{{ 'not json' | from_json }}")


# ------------------------------------------------------------ real templates (tests/data/templates)

RECORDED = Path(__file__).parent / "data" / "templates"
BOS = "<｜begin▁of▁sentence｜>"
TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need the tool.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
            },
            {"type": "function", "function": {"name": "get_time", "arguments": {}}},
        ],
    },
    {"role": "tool", "content": '{"sky": "sunny"}'},
    {"role": "tool", "content": "12:00"},
]


def with_text_arguments(messages: list[dict]) -> list[dict]:
    """The chat with its calls' arguments as JSON text, as OpenAI clients send them."""
    out = json.loads(json.dumps(messages))
    for message in out:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return out


@pytest.mark.parametrize(
    "name",
    [
        "deepseek-ai-DeepSeek-V4.jinja",
        "deepseek-ai-DeepSeek-V4-Flash-0731.jinja",
        "deepseek-ai-DeepSeek-V3.2.jinja",
        "GLM-4.7-Flash.jinja",
    ],
)
@pytest.mark.parametrize("thinking", [True, False])
def test_recorded_templates_render_as_transformers_renders_them(name: str, thinking: bool) -> None:
    """The real templates against transformers' own renderer (arguments as objects, which it
    takes), and arguments as JSON text the same where the template parses them (DeepSeek's,
    through from_json, which transformers lacks)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    source = (RECORDED / name).read_text(encoding="utf-8")
    options = dict(
        add_generation_prompt=True, bos_token=BOS, enable_thinking=thinking, reasoning_effort="max"
    )
    theirs = render_jinja_template([TOOL_CHAT], tools=[WEATHER], chat_template=source, **options)
    theirs = theirs[0][0]  # (one conversation's text, beside its assistant masks)
    ours = chat_template.render(
        source,
        TOOL_CHAT,
        [WEATHER],
        True,
        {"bos_token": BOS},
        enable_thinking=thinking,
        reasoning_effort="max",
    )
    assert ours == theirs
    assert "get_weather" in ours and "12:00" in ours
    if "DeepSeek" in name:
        text_arguments = chat_template.render(
            source,
            with_text_arguments(TOOL_CHAT),
            [WEATHER],
            True,
            {"bos_token": BOS},
            enable_thinking=thinking,
            reasoning_effort="max",
        )
        assert text_arguments == ours


def test_deepseek_v4_renders_a_tool_conversation() -> None:
    """What DeepSeek-V4's template writes, read off the template: the system prompt, then the
    tools' section, the turns, the call in DSML (a string parameter as is, others as JSON; a
    call without arguments an empty line), the tool results in one user turn, and `<think>`
    opened for the reply."""
    source = (RECORDED / "deepseek-ai-DeepSeek-V4.jinja").read_text(encoding="utf-8")
    text = chat_template.render(
        source,
        with_text_arguments(TOOL_CHAT),
        [WEATHER],
        True,
        {"bos_token": BOS},
        enable_thinking=True,
    )
    assert text.startswith(f"{BOS}Be brief.\n\n## Tools\n\nYou have access to a set of tools")
    assert "\n\n### Available Tool Schemas\n\n" + json.dumps(WEATHER["function"]) + "\n" in text
    assert text.endswith(
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke "
        "tool calls.\n"
        "<｜User｜>Weather in Paris?<｜Assistant｜><think>Need the tool.</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_time">\n'
        "\n"
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        '<｜User｜><tool_result>{"sky": "sunny"}</tool_result>\n\n'
        "<tool_result>12:00</tool_result><｜Assistant｜><think>"
    )
    # thinking off: past reasoning dropped where no tools keep it, `</think>` closes the prompt
    plain = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
        {"role": "user", "content": "Bye"},
    ]
    assert chat_template.render(source, plain, None, True, {"bos_token": BOS}) == (
        f"{BOS}<｜User｜>Hi<｜Assistant｜></think>Hello<｜end▁of▁sentence｜>"
        "<｜User｜>Bye<｜Assistant｜></think>"
    )


def test_deepseek_v3_2_renders_a_tool_conversation() -> None:
    """V3.2's: calls in `function_calls`, results in `<function_results>` after the call's
    turn, and the reply's `<think>` opened after them (no assistant tag again)."""
    source = (RECORDED / "deepseek-ai-DeepSeek-V3.2.jinja").read_text(encoding="utf-8")
    text = chat_template.render(
        source,
        with_text_arguments(TOOL_CHAT),
        [WEATHER],
        True,
        {"bos_token": BOS},
        enable_thinking=True,
    )
    assert text.startswith(f"{BOS}Be brief.\n\n## Tools\n\n")
    assert "<functions>\n" + json.dumps(WEATHER["function"]) + "\n</functions>\n" in text
    assert text.endswith(
        "<｜User｜>Weather in Paris?<｜Assistant｜><think>Need the tool.</think>\n\n"
        "<｜DSML｜function_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_time">\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜function_calls><｜end▁of▁sentence｜>\n\n"
        "<function_results>\n"
        '<result>{"sky": "sunny"}</result>\n'
        "<result>12:00</result>\n"
        "</function_results>\n\n<think>"
    )
