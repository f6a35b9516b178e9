"""Anchor checkpoints for hybrid models: where they are saved, that resuming from one is the
same computation as recomputing, and how they are kept within their budget."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.generate import LLMEngine
from freetoken.engine.runner import ModelRunner
from freetoken.engine.sampling import SamplingParams
from freetoken.kv.anchors import AFTER, BEFORE, AnchorStore, boundary_tokens
from freetoken.kv.paged import KVSequence
from freetoken.kv.radix import RadixCache
from freetoken.kv.recurrent import RecurrentStatePool
from freetoken.models.loading import load_model
from freetoken.tokenizer import Tokenizer
from tiny_models import build_chat_model

SAME = 1e-5


@pytest.fixture(scope="module", params=["qwen3_next", "kimi_linear"])
def chat_model(request, tmp_path_factory):
    """Each hybrid family (gated DeltaNet; Kimi's KDA + MLA) behind Qwen3's tokenizer."""
    return build_chat_model(request.param, tmp_path_factory.mktemp("chat") / "m")[0]


def test_boundaries_come_from_the_tokenizer_and_its_template(chat_model):
    tok = Tokenizer(chat_model)
    ids = tok.token_id
    assert boundary_tokens(tok) == {
        ids("</think>"): AFTER,
        ids("<tool_call>"): BEFORE,
        ids("</tool_call>"): AFTER,
        ids("</tool_response>"): AFTER,
        ids("<|im_end|>"): AFTER,  # end of a turn; <|endoftext|> is EOS but not in the template
    }
    # A template that writes no tool markers gets no tool boundaries.
    tok.template = "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}"
    assert boundary_tokens(tok) == {ids("<|im_end|>"): AFTER}


def test_resuming_from_an_anchor_is_recomputing(chat_model):
    """Save anchors mid-page during a forward, donate the pages, resume a new sequence from
    each anchor: its logits over the rest of the prompt and 5 decode steps equal those of the
    uninterrupted sequence."""
    runner = ModelRunner(
        load_model(chat_model, dtype="float32"),
        kv_cache_tokens=512,
        page_size=8,
        max_sequences=2,
        state_anchors=6,
    )
    cache = RadixCache(8)
    runner.kv.reclaim = cache.evict
    store = AnchorStore(runner.states, runner.anchor_slots, boundaries={})
    cache.on_evict = store.drop_node
    prompt = torch.randint(0, 150000, (120,), generator=torch.Generator().manual_seed(7)).tolist()

    seq = runner.new_sequence()
    anchors = store.reserve([17, 64, 101], pending=[])
    captures = [[(a.position, a.slot) for a in anchors]]
    whole = runner.forward([seq], [prompt], all_logits=True, captures=captures)
    steps, token = [], int(whole[-1].argmax())
    for _ in range(5):
        steps.append(runner.forward([seq], [[token]])[0])
        token = int(steps[-1].argmax())
    full = seq.length // 8
    spare = cache.insert((prompt + [0] * 5)[: full * 8], seq.pages[:full])
    assert not spare
    store.attach(anchors, cache.match(prompt[: full * 8]), 8)
    seq.pages = seq.pages[full:]
    runner.release(seq)
    assert store.num_attached == 3

    for limit in (30, 64, 110):  # the deepest anchor at or before position limit
        other = runner.new_sequence()
        held, anchor = store.resume(cache, runner.kv, other, [*prompt[:limit], 1])
        position = anchor.position
        assert position == max(p for p in (17, 64, 101) if p <= limit)
        assert other.length == position and len(held) == position // 8
        # The resumed run saves the deeper anchors again, as the engine does: the recurrence
        # then runs in the same segments as the uninterrupted one.
        again = store.reserve([p for p in (17, 64, 101) if p > position], pending=[])
        again_captures = [[(a.position - position, a.slot) for a in again]]
        rest = runner.forward(
            [other], [prompt[position:]], all_logits=True, captures=again_captures
        )
        store.discard(again)
        assert (rest - whole[position:]).abs().max().item() < SAME
        token = int(rest[-1].argmax())
        for expected in steps:
            logits = runner.forward([other], [[token]])[0]
            assert (logits - expected).abs().max().item() < SAME
            token = int(logits.argmax())
        cache.unlock(held)
        other.pages = other.pages[len(held) :]  # the shared pages stay the tree's
        runner.release(other)


def test_anchors_are_evicted_lru_within_their_budget_and_with_their_node():
    pool = RecurrentStatePool(1, 4, (2, 1), (1, 2, 2), torch.float32, "cpu")
    store = AnchorStore(pool, [pool.alloc() for _ in range(3)], boundaries={5: AFTER, 7: BEFORE})
    # Tokens at positions 10..13: after the 5 at 11 and before the 7 at 12 are both 12.
    assert store.positions([1, 5, 7, 5], start=10) == [12, 14]
    assert store.positions([7], start=0) == []  # the empty state is no anchor

    cache = RadixCache(page_size=2)
    cache.on_evict = store.drop_node
    tokens = list(range(20))
    cache.insert(tokens, list(range(10)))
    path = cache.match(tokens)

    def save(*positions):
        store.attach(store.reserve(list(positions), pending=[]), path, 2)

    def attached():
        return sorted(a.position for n in cache.match(tokens) for a in n.anchors.values())

    save(4, 10)
    save(16)
    assert attached() == [4, 10, 16] and store.num_free == 0
    # A resume touches the anchor at 10; the next save evicts the least recently used (4).
    seq = KVSequence(state_slot=3)
    held, used = store.resume(cache, _NoKV(), seq, [*tokens[:11], 99])
    assert used.position == 10 and seq.length == 10 and seq.pages == [0, 1, 2, 3, 4]
    cache.unlock(held)
    save(18)
    assert attached() == [10, 16, 18]
    # Evicted nodes take their anchors along, and the slots come back: the last two pages go
    # (tokens 16-19), and with them anchor 18 (its last token, 17, is on the first of them).
    cache.evict(2)
    assert attached() == [10, 16] and store.num_free == 1
    # Free slots first, then those of attached anchors (LRU); a request's own pending anchors
    # give theirs up only to a deeper position.
    pending = store.reserve([3], pending=[])
    pending += store.reserve([40], pending=pending)  # evicts attached 16
    store.attach(store.reserve([2], pending=[]), path, 2)  # evicts attached 10
    pending += store.reserve([50], pending=pending)  # evicts attached 2
    assert attached() == [] and [a.position for a in pending] == [3, 40, 50]
    deeper = store.reserve([45], pending=pending)  # takes the slot of 3
    assert [a.position for a in deeper] == [45] and [a.position for a in pending] == [40, 50]
    assert store.reserve([1], pending=pending) == []  # nothing shallower to give up
    assert store.evicted == 4


class _NoKV:
    """Stands in for the KV cache when a resume lands on a page boundary (no copy)."""

    def reserve(self, seq, n):
        raise AssertionError("no partial page expected")


GREEDY = SamplingParams(max_new_tokens=5, temperature=0)


def engine(path, **options) -> LLMEngine:
    return LLMEngine.from_config(
        EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_tokens=8192, **options)
    )


def spy_logits(engine: LLMEngine) -> list[torch.Tensor]:
    """Every logits row the engine samples from, in order."""
    seen: list[torch.Tensor] = []
    sample = engine.sampler.sample

    def spy(logits, *args, **kwargs):
        seen.extend(logits.clone())
        return sample(logits, *args, **kwargs)

    engine.sampler.sample = spy
    return seen


def test_multi_turn_resume_equals_recompute(chat_model):
    """A tool-using conversation, turn by turn, on pages of 16 (anchors land mid-page): the
    engine resuming from anchors samples from the same logits and emits the same tokens as
    engines that recompute every prompt. Against a fresh engine per turn (which saves anchors
    at the same boundaries, so its recurrence runs in the same segments) within 1e-5; against
    one without prefix cache (one segment per prompt: another fp32 summation order in the
    chunked delta rule) within transformers' 1e-4."""
    resuming, plain = engine(chat_model, page_size=16), engine(chat_model, prefix_cache=False)
    seen, unsplit = spy_logits(resuming), spy_logits(plain)
    tok = resuming.tokenizer
    messages = [{"role": "user", "content": "List the files, then read the largest."}]
    call = {"name": "ls", "arguments": {"path": "."}}
    resumed_at, fresh_logits = [], []
    for turn in range(4):
        messages.append(
            {
                "role": "assistant",
                "content": f"<think>turn {turn}</think>Looking.",
                "tool_calls": [{"type": "function", "function": call}],
            }
        )
        messages.append({"role": "tool", "content": f"a.py b.py {turn}"})
        prompt = tok.encode(tok.render_chat(messages))
        fresh = engine(chat_model, page_size=16)
        fresh_seen = spy_logits(fresh)
        done = [e.generate([prompt], GREEDY)[0].output_ids for e in (resuming, fresh, plain)]
        assert done[0] == done[1] == done[2]
        fresh_logits += fresh_seen
        resumed_at.append(resuming.reuse.recent[-1]["anchor"])
    assert all(resumed_at[1:]) and any(p % 16 for p in resumed_at[1:])

    def worst(a, b):
        assert len(a) == len(b)
        return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))

    assert worst(seen, fresh_logits) < SAME
    assert worst(seen, unsplit) < 1e-4
    store = resuming.anchors
    assert store.num_free + store.num_attached == store.capacity  # no pending leftovers
    assert resuming.runner.states.num_free == resuming.max_batch_size
