"""The checkpoint's tokenizer and chat template, loaded with transformers (offline)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from freetoken.errors import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def tokenizer_class(path: Path):
    """The class AutoTokenizer would load the checkpoint's tokenizer with, imported alone where
    tokenizer_config.json names it: AutoTokenizer's own module imports transformers' model
    registry, and through it (where they are installed) sklearn, scipy and sympy, 4-9 s of a
    start on the H200 machine. The fast class where the name has one, as AutoTokenizer picks
    (transformers 4; in 5 the names are one class); AutoTokenizer where the name is missing or
    unknown."""
    import transformers

    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
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
    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path  # the checkpoint directory (a template sandbox loads it again)
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise CheckpointError(
                f"no tokenizer in {path}: expected one of {', '.join(TOKENIZER_FILES)}"
            )
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        try:
            self.hf = tokenizer_class(path).from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot load the tokenizer in {path}: {e}") from e
        self.generation_config = _read_generation_config(path)
        # Chat models end a turn with a token (e.g. <|im_end|>) that generation_config.json
        # lists beside the tokenizer's pretraining EOS.
        ids = [self.hf.eos_token_id] if self.hf.eos_token_id is not None else []
        value = self.generation_config.get("eos_token_id")
        ids += [value] if isinstance(value, int) else list(value or [])
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))

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

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        if not self.has_chat_template:
            raise CheckpointError("this checkpoint's tokenizer has no chat template")
        return self.hf.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **template_kwargs,
        )


def _read_generation_config(path: Path) -> dict[str, Any]:
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError):
        logging.getLogger(__name__).warning("ignoring unreadable %s", file)
        return {}
    return value if isinstance(value, dict) else {}
