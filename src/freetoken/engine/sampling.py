"""Per-request sampling parameters and a batched next-token sampler.

The transforms run in the order HF transformers and vLLM use, so a parameter set means what
users expect it to mean: repetition penalty, the OpenAI frequency and presence penalties
(counted over the output, as the OpenAI API and vLLM count them), logit bias, then either
greedy argmax or temperature, top-k, top-p, min-p and a random draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 turns top-k off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's: logit -= frequency_penalty * count + presence_penalty * (count > 0), count the
    # times the token came in the output so far; each in [-2, 2].
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) pairs
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings
    ignore_eos: bool = False
    # Keep special tokens in the output text (output formats written in them: Harmony's).
    keep_special_tokens: bool = False
    # Whether this request may draft where the engine drafts (engine/speculative.py); False
    # turns drafting off for it alone (the APIs' `speculative` extension field).
    speculative: bool = True

    def __post_init__(self) -> None:
        # Requests often arrive as JSON: accept lists (and a bare stop string, as the OpenAI API
        # does) but store tuples so the object stays immutable and hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias))

        _require_int("max_new_tokens", self.max_new_tokens, minimum=1)
        _require_real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        _require_int("top_k", self.top_k, minimum=0)
        _require_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _require_real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        _require_real("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 means off), got {self.repetition_penalty!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require_real(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        for token_id, bias in self.logit_bias:
            _require_int("logit_bias token ids", token_id, minimum=0)
            _require_real("logit_bias values", bias)
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r}")
        if self.seed is not None:
            _require_int("seed", self.seed, minimum=0)
            if self.seed >= 2**64:  # torch.Generator seeds are 64-bit
                raise ValueError(f"seed must be < 2**64, got {self.seed!r}")
        for token_id in self.stop_token_ids:
            _require_int("stop_token_ids entries", token_id, minimum=0)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool, got {self.speculative!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _require_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True as a top_k is almost certainly a bug upstream.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def _require_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for one sequence, on the device its logits live on; None without a seed
    (the sequence then draws from torch's global RNG)."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Picks one token per row of a batch, each row with its own parameters and generator."""

    def sample(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        history: Sequence[Sequence[int]] | None = None,
        outputs: Sequence[Sequence[int]] | None = None,
    ) -> Tensor:
        """`logits` is [B, V]; returns [B] int64 token ids on the logits' device.

        `history[i]` holds the tokens the repetition penalty looks at for row i (HF counts the
        prompt too; that choice is the caller's); `outputs[i]` the row's output so far, which
        the frequency and presence penalties count."""
        batch = _check_batch(logits, params, history)
        if len(generators) != batch:
            raise ValueError(f"got {len(generators)} generators for a batch of {batch}")
        x = _penalized(logits, params, history, outputs)
        # An argmax over every row costs next to nothing next to the model, and it already is
        # the answer for the greedy rows; sampled rows overwrite theirs below.
        tokens = x.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens
        index = torch.tensor(rows, device=x.device)
        probs = _warped(x[index], [params[i] for i in rows]).softmax(dim=-1)
        tokens[index] = _draw(probs, [generators[i] for i in rows])
        return tokens

    def verify(
        self,
        logits: Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        draft: Sequence[int],
        history: Sequence[Sequence[int]] | None = None,
        outputs: Sequence[Sequence[int]] | None = None,
    ) -> list[int]:
        """The tokens one request emits from a verify step: `logits` [len(draft) + 1, V] at
        the positions fed (its last token, then the draft), `history` and `outputs` per row as
        `sample` takes them. Greedy: the model's token at each position while the draft agrees,
        and the first that does not. Sampled, the speculative sampling rule for a draft that
        is certain (prompt lookup's): draft token d at position i is kept with probability
        p_i(d), else the token is drawn from p_i without d and the step ends; a draft kept
        whole adds a draw from the last row. Each emitted token is then distributed as
        sampling token by token would draw it: P(d) = p(d), P(x) = (1 - p(d)) p(x) / (1 - p(d))."""
        n = len(draft) + 1
        if logits.shape[0] != n:
            raise ValueError(f"{logits.shape[0]} rows of logits for a draft of {len(draft)}")
        rows = [params] * n
        if params.greedy:
            tokens = self.sample(logits, rows, [generator] * n, history, outputs).tolist()
            pairs = enumerate(zip(draft, tokens[:-1], strict=True))
            kept = next((i for i, (d, t) in pairs if d != t), n - 1)
            return tokens[: kept + 1]
        probs = self.filter_logits(logits, rows, history, outputs).softmax(dim=-1)
        emitted: list[int] = []
        for i, token in enumerate(draft):
            u = torch.rand((), generator=generator, device=probs.device)
            if bool(u < probs[i, token]):
                emitted.append(token)
                continue
            residual = probs[i : i + 1].clone()
            residual[0, token] = 0.0  # (the race draws in proportion: no renormalising)
            return emitted + _draw(residual, [generator]).tolist()
        return emitted + _draw(probs[n - 1 :].clone(), [generator]).tolist()

    def filter_logits(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        history: Sequence[Sequence[int]] | None = None,
        outputs: Sequence[Sequence[int]] | None = None,
    ) -> Tensor:
        """The fp32 logits `sample` draws from, with filtered-out tokens at -inf. Greedy rows
        only get the penalties and bias. Handy for logprobs and for tests."""
        _check_batch(logits, params, history)
        x = _penalized(logits, params, history, outputs)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            index = torch.tensor(rows, device=x.device)
            x[index] = _warped(x[index], [params[i] for i in rows])
        return x


def _check_batch(
    logits: Tensor, params: Sequence[SamplingParams], history: Sequence[Sequence[int]] | None
) -> int:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if len(params) != batch:
        raise ValueError(f"got {len(params)} SamplingParams for a batch of {batch}")
    if history is not None and len(history) != batch:
        raise ValueError(f"got {len(history)} histories for a batch of {batch}")
    return batch


def _penalized(
    logits: Tensor,
    params: Sequence[SamplingParams],
    history: Sequence[Sequence[int]] | None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> Tensor:
    """An fp32 copy of `logits` (never the caller's tensor) with the CTRL repetition penalty,
    the frequency and presence penalties and the logit bias."""
    x = logits.to(torch.float32, copy=True)
    if history is not None:
        _repetition_penalty(x, params, history)
    for i, p in enumerate(params):
        if (p.frequency_penalty or p.presence_penalty) and outputs is not None and outputs[i]:
            ids = torch.tensor(outputs[i], device=x.device)
            counts = torch.zeros(x.shape[1], device=x.device).index_add_(
                0, ids, torch.ones(len(ids), device=x.device)
            )
            x[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=x.device)
            bias = torch.tensor([b for _, b in p.logit_bias], device=x.device)
            x[i].index_add_(0, ids, bias)
    return x


def _repetition_penalty(
    x: Tensor, params: Sequence[SamplingParams], history: Sequence[Sequence[int]]
) -> None:
    """The CTRL repetition penalty, in place."""
    rows: list[int] = []
    seen: list[list[int]] = []
    for i, (p, past) in enumerate(zip(params, history, strict=True)):
        if p.repetition_penalty != 1.0 and len(past) > 0:
            rows.append(i)
            seen.append(list(set(past)))  # each token is penalised once, however often it came
    if not rows:
        return
    width = max(len(ids) for ids in seen)
    # Pad each row with its own first id: re-writing the same value there is harmless, and one
    # gather/scatter then serves rows with histories of any length.
    padded = [ids + ids[:1] * (width - len(ids)) for ids in seen]
    index = torch.tensor(padded, device=x.device)
    row_index = torch.tensor(rows, device=x.device)
    penalty = torch.tensor(
        [params[i].repetition_penalty for i in rows], dtype=torch.float32, device=x.device
    ).unsqueeze(1)
    sub = x[row_index]
    old = sub.gather(1, index)
    # Dividing a negative logit would raise it, so negatives are multiplied instead.
    new = torch.where(old > 0, old / penalty, old * penalty)
    x[row_index] = sub.scatter_(1, index, new)


def _warped(x: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Temperature, top-k, top-p and min-p on fp32 rows that all sample (x may be modified)."""
    vocab = x.shape[1]
    device = x.device
    inf = float("inf")
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    x = x.div_(temperature.unsqueeze(1))

    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    use_k = any(k < vocab for k in top_k)
    use_p = any(p < 1 for p in top_p)
    if use_k or use_p:
        # One descending sort serves both filters; the drop mask is mapped back afterwards.
        ordered, order = x.sort(dim=-1, descending=True)
        drop = torch.zeros_like(ordered, dtype=torch.bool)
        if use_k:
            k = torch.tensor(top_k, device=device).unsqueeze(1)
            kth = ordered.gather(1, k - 1)
            drop |= ordered < kth  # ties with the k-th logit survive, as in HF
            ordered = ordered.masked_fill(drop, -inf)
        if use_p:
            p = torch.tensor(top_p, dtype=torch.float32, device=device).unsqueeze(1)
            probs = ordered.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs  # probability strictly ahead of a token
            # A token stays while the tokens ahead of it hold < top_p: that keeps the smallest
            # set reaching top_p, and the top token always (its mass_before is exactly 0).
            # Rows at top_p == 1 are exempt, or cumsum rounding could clip their tail.
            drop |= (mass_before >= p) & (p < 1)
        x = x.masked_fill_(torch.zeros_like(drop).scatter_(1, order, drop), -inf)

    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    if bool((min_p > 0).any()):
        probs = x.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        x = x.masked_fill_(probs < floor, -inf)
    return x


def _draw(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """One categorical draw per row, as argmax(probs / E) with E ~ Exponential(1).

    That race picks token i with probability probs[i], and lets each row take its noise from
    its own generator while a single argmax serves the whole batch. A row's draw then depends
    only on its generator, not on what else is in the batch."""
    noise = torch.empty_like(probs)
    if all(g is None for g in generators):
        noise.exponential_()
    else:
        for row, generator in enumerate(generators):
            noise[row].exponential_(generator=generator)
    # exponential_ can return exactly 0; 0/0 would be NaN, which argmax treats as the maximum.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)
