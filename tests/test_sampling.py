from __future__ import annotations

import math

import pytest
import torch

from freetoken.engine.sampling import Sampler, SamplingParams, make_generator

GREEDY = SamplingParams(temperature=0.0)


def logits_for(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def kept(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Tokens that survive the filters for a single-row batch."""
    out = Sampler().filter_logits(logits, [params])
    return set(torch.isfinite(out[0]).nonzero().flatten().tolist())


def draw_many(logits: torch.Tensor, params: SamplingParams, n: int, seed: int) -> torch.Tensor:
    """n independent draws from one row, as one batch sharing a seeded generator."""
    generator = make_generator(seed, "cpu")
    return Sampler().sample(logits.expand(n, -1), [params] * n, [generator] * n)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    tokens = Sampler().sample(logits, [GREEDY] * 5, [None] * 5)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))
    assert GREEDY.greedy and not SamplingParams().greedy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_logits(dtype: torch.dtype) -> None:
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    before = logits.clone()
    tokens = Sampler().sample(logits, [GREEDY] * 3, [None] * 3, history=[[1, 2]] * 3)
    assert torch.equal(tokens, logits.float().argmax(-1))
    assert torch.equal(logits, before)  # the caller's tensor is not modified
    sampled = Sampler().sample(logits, [SamplingParams(seed=3)] * 3, [make_generator(3)] * 3)
    assert sampled.shape == (3,) and sampled.dtype == torch.int64


def _sequence(seed: int, steps: int = 40) -> list[int]:
    logits = torch.randn(steps, 50, generator=torch.Generator().manual_seed(7))
    params = SamplingParams(temperature=1.0, seed=seed)
    generator = make_generator(seed, "cpu")
    sampler = Sampler()
    return [int(sampler.sample(logits[t : t + 1], [params], [generator])) for t in range(steps)]


def test_seed_reproduces_and_different_seeds_differ() -> None:
    assert _sequence(1234) == _sequence(1234)
    assert _sequence(1234) != _sequence(4321)


def test_row_draw_does_not_depend_on_batch_neighbours() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.3, top_p=0.9)
    alone = [int(Sampler().sample(logits, [params], [make_generator(9)])) for _ in range(3)]
    batch = torch.cat([torch.randn(2, 50), logits])
    together = Sampler().sample(
        batch, [SamplingParams(), GREEDY, params], [None, None, make_generator(9)]
    )
    assert int(together[2]) == alone[0]


def test_make_generator() -> None:
    assert make_generator(None, "cpu") is None
    generator = make_generator(5, torch.device("cpu"))
    assert generator is not None and generator.initial_seed() == 5


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(8, 200, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1.5, top_k=1)] * 8
    generators = [make_generator(i) for i in range(8)]
    tokens = Sampler().sample(logits, params, generators)
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_keeps_k_best() -> None:
    logits = logits_for([0.1, 0.4, 0.05, 0.3, 0.15])
    assert kept(logits, SamplingParams(top_k=2)) == {1, 3}
    assert kept(logits, SamplingParams(top_k=99)) == {0, 1, 2, 3, 4}


def test_tiny_top_p_keeps_only_top_token() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=2.0, top_p=1e-6)] * 4
    tokens = Sampler().sample(logits, params, [make_generator(i) for i in range(4)])
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = logits_for([0.05, 0.5, 0.15, 0.3])
    assert kept(logits, SamplingParams(top_p=0.45)) == {1}
    assert kept(logits, SamplingParams(top_p=0.79)) == {1, 3}  # 0.5 + 0.3 reaches 0.79
    assert kept(logits, SamplingParams(top_p=0.81)) == {1, 3, 2}
    assert kept(logits, SamplingParams(top_p=1.0)) == {0, 1, 2, 3}
    # top-p sees the distribution left by top-k: with k=2 the mass is 0.5/0.8 and 0.3/0.8.
    assert kept(logits, SamplingParams(top_k=2, top_p=0.6)) == {1}
    assert kept(logits, SamplingParams(top_k=2, top_p=0.7)) == {1, 3}


def test_temperature_changes_what_top_p_keeps() -> None:
    logits = logits_for([0.05, 0.5, 0.15, 0.3])
    # At a low temperature the top token alone holds more than 0.79 of the mass.
    assert kept(logits, SamplingParams(temperature=0.3, top_p=0.79)) == {1}


def test_min_p_on_hand_made_distribution() -> None:
    logits = logits_for([0.5, 0.3, 0.15, 0.05])
    assert kept(logits, SamplingParams(min_p=0.2)) == {0, 1, 2}  # floor 0.1
    assert kept(logits, SamplingParams(min_p=0.35)) == {0, 1}  # floor 0.175
    assert kept(logits, SamplingParams(min_p=1.0)) == {0}
    assert kept(logits, SamplingParams(min_p=0.0)) == {0, 1, 2, 3}


def test_repetition_penalty_hand_worked() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # Token 1 appears twice but is penalised once; positives shrink, negatives grow.
    out = Sampler().filter_logits(logits, [params], history=[[0, 1, 1, 4]])
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0, 0.0]]
    # A penalty below 1 rewards repeats instead.
    reward = SamplingParams(temperature=0.0, repetition_penalty=0.5)
    out = Sampler().filter_logits(logits, [reward], history=[[0, 1]])
    assert out.tolist() == [[4.0, -0.5, 0.5, 3.0, 0.0]]


def test_frequency_and_presence_penalties_count_the_output_hand_worked() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=1.0)
    # Token 3 came twice in the output, token 1 once; the prompt (history) is not counted.
    out = Sampler().filter_logits(logits, [params], history=[[0, 0, 0]], outputs=[[3, 1, 3]])
    assert out.tolist() == [[2.0, 1.0 - 0.5 - 1.0, 0.5, 3.0 - 1.0 - 1.0]]
    # Greedy follows: token 0 wins once 3 is penalised.
    assert Sampler().sample(logits, [params], [None], outputs=[[3, 1, 3]]).tolist() == [0]
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=2.5)


def test_logit_bias_adds_to_chosen_tokens_per_row() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    params = [
        SamplingParams(temperature=0.0, logit_bias={2: 5.0, 0: -100}),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler().filter_logits(logits, params)
    assert out.tolist() == [[-98.0, 1.0, 5.0], [2.0, 1.0, 0.0]]
    assert Sampler().sample(logits, params, [None, None]).tolist() == [2, 0]
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={1: 101})


def test_repetition_penalty_changes_greedy_choice_per_row() -> None:
    logits = torch.tensor([[3.0, 2.0, -5.0], [3.0, 2.0, -5.0], [3.0, 2.0, -5.0]])
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.0),  # no penalty: history is ignored
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
    ]
    history = [[0], [0], []]
    tokens = Sampler().sample(logits, params, [None] * 3, history=history)
    assert tokens.tolist() == [1, 0, 0]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9th percentile of the chi-square distribution by degrees of freedom: with fixed seeds a
# correct sampler passes; one that ignores temperature or filters is far above it.
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_frequencies_match_softmax(temperature: float) -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5, 2.0]])
    n = 20_000
    tokens = draw_many(logits, SamplingParams(temperature=temperature), n, seed=11)
    counts = torch.bincount(tokens, minlength=5).double()
    probs = (logits[0].double() / temperature).softmax(-1)
    assert _chi_square(counts, probs) < _CHI2_999[4]


def test_frequencies_after_filters_are_renormalised() -> None:
    probs = [0.05, 0.4, 0.25, 0.2, 0.1]
    logits = logits_for(probs)
    params = SamplingParams(top_k=4, top_p=0.8)  # drops 0.05, then keeps 0.4, 0.25, 0.2
    tokens = draw_many(logits, params, 20_000, seed=12)
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[0] == 0 and counts[4] == 0
    expected = torch.tensor([0.4, 0.25, 0.2], dtype=torch.float64)
    assert _chi_square(counts[1:4], expected / expected.sum()) < _CHI2_999[2]


def test_unseeded_rows_use_global_rng() -> None:
    logits = logits_for([0.25, 0.25, 0.25, 0.25]).expand(4000, -1)
    params = [SamplingParams()] * 4000
    with torch.random.fork_rng():
        torch.manual_seed(0)
        a = Sampler().sample(logits, params, [None] * 4000)
        torch.manual_seed(0)
        b = Sampler().sample(logits, params, [None] * 4000)
    assert torch.equal(a, b)
    assert _chi_square(torch.bincount(a, minlength=4).double(), torch.full((4,), 0.25)) < 16.27


def test_shape_mismatches_are_rejected() -> None:
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="SamplingParams"):
        Sampler().sample(logits, [GREEDY], [None, None])
    with pytest.raises(ValueError, match="generators"):
        Sampler().sample(logits, [GREEDY] * 2, [None])
    with pytest.raises(ValueError, match="histories"):
        Sampler().sample(logits, [GREEDY] * 2, [None] * 2, history=[[]])
    with pytest.raises(ValueError, match="batch, vocab"):
        Sampler().sample(torch.zeros(4), [GREEDY], [None])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_k": 2.5}, "top_k must be an int"),
        ({"min_p": 1.2}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"seed": -3}, "seed must be >= 0"),
        ({"seed": 2**64}, "seed must be < 2"),
        ({"stop_token_ids": (1, -2)}, "stop_token_ids entries must be >= 0"),
        ({"stop": ("ok", "")}, "stop strings must be non-empty"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
    ],
)
def test_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_params_normalise_sequences() -> None:
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])  # type: ignore[arg-type]
    assert params.stop == ("a", "b") and params.stop_token_ids == (1, 2)
    assert SamplingParams(stop="END").stop == ("END",)  # type: ignore[arg-type]
    hash(params)


def test_filters_agree_with_transformers() -> None:
    # The same chain of HF logits processors must keep the same tokens with the same values.
    lp = pytest.importorskip("transformers.generation.logits_process")
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        logits = torch.randn(1, 50, generator=g) * 3
        history = torch.randint(0, 50, (1, 10), generator=g)
        t = float(torch.rand(1, generator=g)) * 2 + 0.1
        k = int(torch.randint(0, 20, (1,), generator=g))
        p = float(torch.rand(1, generator=g)) * 0.99 + 0.01
        m = float(torch.rand(1, generator=g)) * 0.3
        chain = [lp.RepetitionPenaltyLogitsProcessor(1.3), lp.TemperatureLogitsWarper(t)]
        chain += [lp.TopKLogitsWarper(k)] if k else []
        chain += [lp.TopPLogitsWarper(p), lp.MinPLogitsWarper(m)]
        expected = lp.LogitsProcessorList(chain)(history, logits.clone())
        params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=1.3)
        ours = Sampler().filter_logits(logits, [params], history=[history[0].tolist()])
        torch.testing.assert_close(ours, expected)
