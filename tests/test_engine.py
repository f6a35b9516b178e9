"""The generation engine on the demo model: batching, stop conditions and streaming."""

from __future__ import annotations

import pytest

from freetoken.config import EngineConfig
from freetoken.demo import demo_checkpoint
from freetoken.engine.generate import ContextLengthError, LLMEngine
from freetoken.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FREETOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        yield LLMEngine.from_config(
            EngineConfig(
                model=demo_checkpoint(),
                device="cpu",
                dtype="float32",
                kv_cache_tokens=2048,
                max_batch_size=2,
            )
        )
    finally:
        mp.undo()


GREEDY = SamplingParams(max_new_tokens=10, temperature=0)


def prompts(engine):
    texts = ["Once upon a time", "def fibonacci(n):", "The capital of France is Paris, and"]
    return [engine.tokenizer.encode(t) for t in texts]


def test_batched_generation_equals_each_alone(engine):
    together = engine.generate(prompts(engine), GREEDY)  # 3 prompts through 2 batch slots
    for p, done in zip(prompts(engine), together, strict=True):
        [alone] = engine.generate([p], GREEDY)
        assert done.output_ids == alone.output_ids
        assert done.text == alone.text
        assert done.finish_reason == "length" and len(done.output_ids) == 10
    # Every page is free again or held by the prefix cache: none leaked.
    kv = engine.runner.kv
    assert kv.allocator.num_free + len(engine.prefix_cache.pages()) == kv.num_pages


def test_stream_yields_the_generated_text(engine):
    p = prompts(engine)[0]
    pieces = [out.text for out in engine.stream(p, GREEDY)]
    [done] = engine.generate([p], GREEDY)
    assert "".join(pieces) == done.text


def test_stop_string_cuts_text_and_stops(engine):
    p = prompts(engine)[1]
    [full] = engine.generate([p], GREEDY)
    stop = full.text[3:6]
    assert stop
    [done] = engine.generate([p], SamplingParams(max_new_tokens=10, temperature=0, stop=(stop,)))
    assert done.finish_reason == "stop"
    assert done.text == full.text[: full.text.index(stop)]


def test_stop_token_id(engine):
    p = prompts(engine)[2]
    [full] = engine.generate([p], GREEDY)
    token = full.output_ids[4]
    first = full.output_ids.index(token)
    [done] = engine.generate(
        [p], SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=(token,))
    )
    assert done.finish_reason == "stop"
    assert done.output_ids == full.output_ids[: first + 1]


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    a = engine.generate(prompts(engine)[:1], params)[0].output_ids
    b = engine.generate(prompts(engine)[:1], params)[0].output_ids
    assert a == b


def test_prompt_longer_than_context_is_rejected(engine):
    with pytest.raises(ContextLengthError, match="context holds"):
        engine.add_request([1] * 5000, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    assert not engine.running


def test_token_ids_outside_the_vocabulary_are_refused_at_admission(engine):
    """Refused before any step (a step with such an id fails; on CUDA a device-side assert
    would leave the engine unusable), and the engine goes on serving."""
    vocab = engine.runner.config.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is outside the model's vocab"):
            engine.add_request([1, 2, bad, 3], GREEDY)
    assert not engine.running
    [ok] = engine.generate([[1, 2, vocab - 1]], SamplingParams(max_new_tokens=2, temperature=0))
    assert len(ok.output_ids) == 2


def test_chunked_prefill_gives_the_same_tokens(engine):
    """A prompt split over several steps decodes exactly as one prefilled whole, and a short
    request admitted meanwhile keeps decoding while the long one is still prefilling."""
    long_prompt = engine.tokenizer.encode("word " * 40)
    [whole] = engine.generate([long_prompt], GREEDY)
    engine.max_prefill_chunk = 7
    prefix_cache, engine.prefix_cache = engine.prefix_cache, None  # prefill it all again
    try:
        short = engine.add_request(prompts(engine)[0], GREEDY)
        engine.step()  # the short prompt (4 tokens) and 3 tokens of nothing else yet
        long = engine.add_request(long_prompt, GREEDY)
        produced_while_prefilling = 0
        while long.seq.length < len(long_prompt):
            outs = engine.step()
            produced_while_prefilling += sum(o.request is short for o in outs)
        while engine.running:
            engine.step()
        assert long.output_ids == whole.output_ids
        assert produced_while_prefilling >= 5  # 41 prompt tokens at 7 per step
    finally:
        engine.max_prefill_chunk = 2048
        engine.prefix_cache = prefix_cache
