"""The checkpoint's tokenizer and chat template.

A checkpoint whose tokenizer.json transformers would take as it is (the classes in
`AS_STORED`, every added token of tokenizer_config.json already in it, a BPE model) is read
with `tokenizers` alone, and its chat template rendered by chat_template.py: importing
transformers costs a start seconds (4-9 s on the H200 machine). Any other goes through
transformers' own class (offline), imported alone, not through AutoTokenizer, whose module
imports transformers' model registry and with it, where installed, sklearn and scipy. Both give
the ids and the text transformers gives (tests check it).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from freetoken import chat_template
from freetoken.errors import CheckpointError

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
# Classes whose transformers implementation uses tokenizer.json unchanged (others rebuild
# parts of it from tokenizer_config.json: Llama's prefix space and legacy flags, ...).
# TokenizersBackend: transformers 5's own name for a tokenizer.json taken as it is (what it
# writes for a tokenizer it built, from a GGUF file for one).
AS_STORED = frozenset(
    {"PreTrainedTokenizerFast", "TokenizersBackend", "Qwen2Tokenizer", "Qwen2TokenizerFast"}
)
# The special tokens a template sees, as transformers names them.
SPECIAL_TOKENS = tuple(
    f"{name}_token" for name in ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
)


def tokenizer_class(path: Path):
    """The class AutoTokenizer would load the checkpoint's tokenizer with, imported alone where
    tokenizer_config.json names it. The fast class where the name has one, as AutoTokenizer
    picks (transformers 4; in 5 the names are one class); AutoTokenizer where the name is
    missing or unknown."""
    import transformers

    name = _read_json(path / "tokenizer_config.json").get("tokenizer_class")
    if isinstance(name, str) and name.isidentifier():
        for candidate in (name if name.endswith("Fast") else f"{name}Fast", name):
            try:
                cls = getattr(transformers, candidate, None)
            except Exception:  # (a lazy import that fails: AutoTokenizer decides)
                cls = None
            if isinstance(cls, type):
                return cls
    from transformers import AutoTokenizer

    return AutoTokenizer


class Tokenizer:
    """Text <-> ids, token names, and the chat template of a checkpoint directory."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path  # the checkpoint directory (a template sandbox loads it again)
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise CheckpointError(
                f"no tokenizer in {path}: expected one of {', '.join(TOKENIZER_FILES)}"
            )
        config = _read_json(path / "tokenizer_config.json")
        stored = _stored_tokenizer(path, config)
        self.vocab = StoredVocab(stored, config) if stored else TransformersVocab(path)
        self.template = (
            chat_template.find_template(path, config) if stored else self.vocab.hf.chat_template
        )
        self.generation_config = _read_json(path / "generation_config.json", warn=True)
        # Chat models end a turn with a token (e.g. <|im_end|>) that generation_config.json
        # lists beside the tokenizer's pretraining EOS.
        eos = self.token_id(self.vocab.special.get("eos_token", ""))
        ids = [eos] if eos is not None else []
        value = self.generation_config.get("eos_token_id")
        ids += [value] if isinstance(value, int) else list(value or [])
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))

    @property
    def uses_transformers(self) -> bool:
        return isinstance(self.vocab, TransformersVocab)

    # -- vocabulary ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Ids a request may name: the vocabulary with its added tokens."""
        return self.vocab.size

    def token_id(self, token: str) -> int | None:
        """The id of a token (by its name in the vocabulary, e.g. "<|im_end|>"), or None."""
        return self.vocab.token_id(token) if token else None

    def token(self, tid: int) -> str | None:
        """The name of token `tid`, or None."""
        return self.vocab.token(tid)

    def encode(self, text: str) -> list[int]:
        return self.vocab.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # (no "clean-up" of spaces before punctuation: transformers 5 skips it for BPE models
        # too, and it corrupts code)
        return self.vocab.decode(list(ids), skip_special_tokens)

    # -- generation settings --------------------------------------------------------------

    def sampling_defaults(self) -> dict[str, float]:
        """The checkpoint's recommended sampling settings (temperature, top_p, top_k, min_p)."""
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        cfg = self.generation_config
        if cfg.get("do_sample") is False:
            return {"temperature": 0.0}
        return {k: cfg[k] for k in keys if cfg.get(k) is not None}

    @property
    def default_max_new_tokens(self) -> int | None:
        """The checkpoint's output limit for a request that sets none (generation_config.json
        `max_new_tokens`), or None."""
        value = self.generation_config.get("max_new_tokens")
        valid = isinstance(value, int) and not isinstance(value, bool) and value > 0
        return value if valid else None

    # -- chat -----------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.template)

    @property
    def chat_template(self) -> str:
        """Every chat template's source in one string ("" without one): what the parsers and
        the edit markers are looked for in."""
        return chat_template.template_text(self.template)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The chat's text under the checkpoint's template (or `chat_template`: a named one of
        the checkpoint's, or a template's source)."""
        chosen = template_kwargs.pop("chat_template", None)
        if not self.has_chat_template and chosen is None:
            raise CheckpointError("this checkpoint's tokenizer has no chat template")
        source = chat_template.select(self.template or "", chosen, tools)
        return chat_template.render(
            source, messages, tools, add_generation_prompt, self.vocab.special, **template_kwargs
        )


# Tokenizers a start loaded before its imports of torch (`preload`), by resolved directory.
_preloaded: dict[Path, Tokenizer] = {}


def preload(path: str | Path) -> None:
    """Load the tokenizer of checkpoint directory `path` now, for `load` to return: a CUDA
    start calls it before it imports torch, while native_preload opens torch's libraries on a
    thread that does not hold the GIL (the tokenizer's load holds it: 0.3 s for Qwen's). Where
    it fails, nothing is kept: `load` fails as it would have."""
    path = Path(path)
    if not path.is_dir():
        return
    began = time.perf_counter()
    try:
        _preloaded[path.resolve()] = Tokenizer(path)
    except Exception as e:  # (load reports it, in its place)
        log.debug("no early tokenizer for %s: %s", path, e)
    else:
        log.debug("tokenizer loaded early in %.3f s", time.perf_counter() - began)


# A tokenizer of nothing: building one does a process's one-time set-up of `tokenizers`.
EMPTY_TOKENIZER = json.dumps(
    {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": None,
        "model": {"type": "BPE", "vocab": {}, "merges": []},
    }
)


def load_native() -> None:
    """What of `tokenizers` asks the dynamic loader, done now: a start does it before
    native_preload's loads of torch's libraries hold the loader's lock (each for the whole of
    its load). That is the import of its native module, and its first tokenizer: the keys of
    its hash maps are seeded once per process through the getrandom crate, which finds libc's
    getrandom with dlsym, and dlsym takes that lock (so the Qwen tokenizer's load, holding the
    GIL, waited out libtorch_cpu's load: on the CPU machine 0.33-0.37 s of wall time for
    0.25 s of CPU). A tokenizer of nothing does it here in a millisecond. Nothing where
    `tokenizers` is missing."""
    try:
        from tokenizers import Tokenizer as Stored
    except ImportError:
        return
    try:
        Stored.from_str(EMPTY_TOKENIZER)
    except Exception as e:  # (a version that refuses it: the real load seeds them instead)
        log.debug("no early set-up of tokenizers: %s", e)


def load(path: str | Path) -> Tokenizer:
    """The tokenizer of checkpoint directory `path`: the one `preload` loaded, or loaded now."""
    return _preloaded.pop(Path(path).resolve(), None) or Tokenizer(path)


class StoredVocab:
    """tokenizer.json through `tokenizers` alone; the special tokens as tokenizer_config.json
    names them."""

    def __init__(self, tok, config: Mapping[str, Any]):
        self.tok = tok
        self.special = {k: v for k in SPECIAL_TOKENS if (v := _content(config.get(k)))}
        self.size = tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def token(self, tid: int) -> str | None:
        return self.tok.id_to_token(tid)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


class TransformersVocab:
    """transformers' class for the checkpoint (offline), imported alone."""

    def __init__(self, path: Path):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        try:
            self.hf = tokenizer_class(path).from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot load the tokenizer in {path}: {e}") from e
        self.special = {
            k: str(v)
            for k, v in self.hf.special_tokens_map.items()
            if k in SPECIAL_TOKENS and v is not None
        }
        self.size = len(self.hf)

    def token_id(self, token: str) -> int | None:
        tid = self.hf.convert_tokens_to_ids(token)
        unknown = tid is None or (
            tid == self.hf.unk_token_id and token != self.special.get("unk_token")
        )
        return None if unknown else tid

    def token(self, tid: int) -> str | None:
        return self.hf.convert_ids_to_tokens(tid)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


def _stored_tokenizer(path: Path, config: Mapping[str, Any]):
    """tokenizer.json as a `tokenizers.Tokenizer`, where transformers would take it unchanged;
    else None (and why, in the log). What decides is read off the parsed tokenizer, not off a
    second parse of its JSON in Python (0.12 s of a 0.44 s load for Qwen's 151k vocabulary, all
    of it holding the GIL while the weights load)."""
    file = path / "tokenizer.json"
    name = config.get("tokenizer_class")
    if not file.is_file() or name not in AS_STORED:
        return None
    from tokenizers import Tokenizer as Stored

    try:
        tok = Stored.from_file(str(file))
    except Exception as e:  # (tokenizers raises its own Exception type)
        raise CheckpointError(f"cannot load the tokenizer in {path}: {e}") from e
    if type(tok.model).__name__ != "BPE":
        return None
    stored = {(tid, t.content) for tid, t in tok.get_added_tokens_decoder().items()}
    for tid, token in (config.get("added_tokens_decoder") or {}).items():
        if (int(tid), _content(token)) not in stored:
            log.info("%s: added token %s is not in tokenizer.json: through transformers", path, tid)
            return None
    return tok


def _content(token: Any) -> str | None:
    """A special token's text: tokenizer_config.json writes it as a string or as an object
    with its `content`."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _read_json(file: Path, warn: bool = False) -> dict[str, Any]:
    """A JSON object file's content; {} where the file is missing or not an object."""
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        if warn:
            log.warning("ignoring unreadable %s", file)
        return {}
    return value if isinstance(value, dict) else {}
