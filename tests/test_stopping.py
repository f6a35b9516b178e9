from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from freetoken.engine.stopping import TextStream

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "你好世界，今天天气很好。我们去公园吧",
    "emoji 🎉🎉 party 👍 ok 👨‍👩‍👧 family",
    "naïve café résumé über straße",
    "The answer is 42.\n",
]
SPECIAL = "<|end|>"


@functools.lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    """A tiny byte-level BPE: every byte is a token, and a few merges give tokens that stop
    in the middle of CJK characters and emoji."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[SPECIAL],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return tok


def decode(ids: list[int]) -> str:
    return tokenizer().decode(ids, skip_special_tokens=True)


def encode(text: str) -> list[int]:
    return tokenizer().encode(text).ids


@functools.lru_cache(maxsize=1)
def _byte_token_ids() -> list[int]:
    # Byte-level BPE spells byte b as one printable character: printable Latin-1 bytes as
    # themselves, the others as U+0100 onwards in byte order.
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    spelled, extra = [], 0
    for b in range(256):
        if b in printable:
            spelled.append(chr(b))
        else:
            spelled.append(chr(0x100 + extra))
            extra += 1
    ids = [tokenizer().token_to_id(c) for c in spelled]
    assert None not in ids
    return ids


def byte_ids(text: str) -> list[int]:
    """One token per UTF-8 byte: the most hostile split a byte-level model can produce."""
    table = _byte_token_ids()
    return [table[b] for b in text.encode()]


def run(ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], str, TextStream]:
    stream = TextStream(decode, stop)
    deltas = [stream.push(i) for i in ids]
    return deltas, stream.flush(), stream


TEXTS = [
    "hello world",
    "你好世界，今天天气很好。",
    "emoji 🎉🎉 party 👍 ok",
    "👨‍👩‍👧 family 🧪 unseen 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "naïve café résumé, e\u0301 combining",
    "mixed 中文 and English 🎉 and 日本語",
]


def test_tokenizer_really_splits_characters() -> None:
    # Guards the premise of the tests below: some tokens hold partial UTF-8 characters.
    assert any("\ufffd" in decode([i]) for i in encode("你好世界 🎉 👍"))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("split", ["bpe", "bytes"])
def test_deltas_rebuild_full_decode(text: str, split: str) -> None:
    ids = encode(text) if split == "bpe" else byte_ids(text)
    assert decode(ids) == text
    deltas, tail, stream = run(ids)
    assert "".join(deltas) + tail == text
    assert tail == ""  # the text ends on a whole character, so nothing is left to flush
    assert not any("\ufffd" in d for d in deltas)
    assert not stream.stopped and stream.stop_reason is None


def test_incomplete_tail_comes_out_on_flush() -> None:
    ids = byte_ids("ok 🎉")[:-1]  # the emoji is missing its last byte
    deltas, tail, _ = run(ids)
    assert "".join(deltas) == "ok "
    assert tail == decode(ids)[len("ok ") :]
    assert tail.endswith("\ufffd")


def test_special_tokens_are_skipped() -> None:
    end = tokenizer().token_to_id(SPECIAL)
    ids = [*encode("hello "), end, *encode("world"), end]
    deltas, tail, _ = run(ids)
    assert "".join(deltas) + tail == "hello world"


def test_decode_window_stays_small() -> None:
    windows: list[int] = []

    def spy(ids: list[int]) -> str:
        windows.append(len(ids))
        return decode(ids)

    stream = TextStream(spy, ("never",))
    text = "the quick brown fox 你好 🎉 " * 50
    out = "".join(stream.push(i) for i in byte_ids(text)) + stream.flush()
    assert out == text
    assert max(windows) <= 8  # a 4-byte character plus context, not the whole history


def test_stop_split_across_tokens_never_leaks() -> None:
    text = "The answer is 42.\nEND of text"
    stream = TextStream(decode, ["\nEND"])
    emitted = ""
    for token in byte_ids(text):
        emitted += stream.push(token)
        # Nothing from the stop string may be shown, not even its first character.
        assert "\n" not in emitted
        if stream.stopped:
            break
    assert stream.stopped and stream.stop_reason == "\nEND"
    assert emitted == "The answer is 42."
    assert stream.push(encode("more")[0]) == ""
    assert stream.flush() == ""


def test_stop_with_bpe_tokens_drops_text_after_it() -> None:
    text = "你好世界，今天天气很好。我们去公园吧"
    deltas, tail, stream = run(encode(text), ("天气",))
    assert "".join(deltas) + tail == "你好世界，今天"
    assert stream.stop_reason == "天气"


def test_stop_inside_multibyte_characters() -> None:
    deltas, tail, stream = run(byte_ids("party 👍🎉 ok"), ("🎉",))
    assert "".join(deltas) + tail == "party 👍"
    assert stream.stopped


def test_false_start_is_released() -> None:
    stream = TextStream(decode, ["abc"])
    assert [stream.push(t) for t in byte_ids("xab")] == ["x", "", ""]
    assert stream.push(byte_ids("d")[0]) == "abd"
    assert [stream.push(t) for t in byte_ids("ab")] == ["", ""]
    assert stream.flush() == "ab"  # the sequence ended: a partial stop string is plain text
    assert not stream.stopped


def test_overlapping_false_start_keeps_the_real_match() -> None:
    # "aab" must be found even though the first "a" looked like a start that then failed.
    deltas, tail, stream = run(byte_ids("xaaab tail"), ("aab",))
    assert "".join(deltas) + tail == "xa"
    assert stream.stop_reason == "aab"


def test_first_completed_stop_wins_regardless_of_chunking() -> None:
    pieces = ["x", "abcd", "a", "b", "c", "d"]  # a toy vocabulary of whole strings

    def toy_decode(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids)

    # "bc" completes before "abcd" does, whether the text arrives in one chunk or char by char.
    for ids in ([0, 1], [0, 2, 3, 4, 5]):
        stream = TextStream(toy_decode, ["abcd", "bc"])
        out = "".join(stream.push(i) for i in ids) + stream.flush()
        assert (out, stream.stop_reason) == ("xa", "bc")
    # Two matches completing at the same place: the longer one, which starts earlier, wins.
    stream = TextStream(toy_decode, ["cd", "abcd"])
    out = "".join(stream.push(i) for i in [0, 1])
    assert (out, stream.stop_reason) == ("x", "abcd")


def test_stop_at_the_very_start() -> None:
    deltas, tail, stream = run(byte_ids("STOP here"), ("STOP",))
    assert deltas[-1] == "" and tail == ""
    assert "".join(deltas) == ""
    assert stream.stop_reason == "STOP"


def test_bare_string_and_validation() -> None:
    stream = TextStream(decode, "ab")
    assert "".join(stream.push(t) for t in byte_ids("xxaby")) == "xx"
    with pytest.raises(ValueError, match="non-empty"):
        TextStream(decode, ["ok", ""])


# A mix of whole BPE tokens, single bytes of multi-byte characters, and the special token.
_INTERESTING = sorted({*encode(" ".join(TEXTS)), *byte_ids("你好🎉é\n"), 0})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stream_matches_reference(data: st.DataObject) -> None:
    token = st.one_of(
        st.integers(0, tokenizer().get_vocab_size() - 1), st.sampled_from(_INTERESTING)
    )
    ids = data.draw(st.lists(token, max_size=30), label="ids")
    full = decode(ids)
    stops: list[str] = []
    for _ in range(data.draw(st.integers(0, 3), label="n_stops")):
        if full and data.draw(st.booleans()):
            # Substrings of the real text, so that stops actually fire.
            a = data.draw(st.integers(0, len(full) - 1))
            b = data.draw(st.integers(a + 1, min(len(full), a + 6)))
            stops.append(full[a:b])
        else:
            stops.append(data.draw(st.text(alphabet="ab你🎉\ufffd \n", min_size=1, max_size=4)))

    stream = TextStream(decode, stops)
    out = ""
    for i in ids:
        delta = stream.push(i)
        # Text is final once emitted: it is always a prefix of the finished output.
        assert full.startswith(out + delta)
        out += delta
    out += stream.flush()

    # Reference: cut the full text before the stop string that completes first.
    hits = [(full.find(s) + len(s), -len(s), s) for s in stops if s in full]
    if hits:
        end, _, s = min(hits)
        assert (out, stream.stop_reason) == (full[: end - len(s)], s)
        assert stream.stopped
    else:
        assert out == full
        assert not stream.stopped
