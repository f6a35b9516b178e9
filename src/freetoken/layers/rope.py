"""Rotary position embeddings and the scaling variants real configs use."""

from __future__ import annotations

import math

import torch

from freetoken.kernels import norm_rope
from freetoken.model_config import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """The head dims RoPE turns: the first `partial_rotary_factor` of them, or all of them for
    proportional RoPE (whose unturned angles are angles of 0)."""
    return head_dim if rope.type == "proportional" else int(head_dim * rope.partial_rotary_factor)


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [rotary_dim / 2], attention scaling applied to cos and sin)."""
    if rope.type == "proportional":
        return _proportional(rope, head_dim), 1.0
    dim = int(head_dim * rope.partial_rotary_factor)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = 1.0 / (rope.theta**exponents)
    if rope.type == "default":
        return base, 1.0
    if rope.type == "linear":
        return base / rope.factor, 1.0
    if rope.type == "llama3":
        return _llama3(base, rope), 1.0
    if rope.type == "yarn":
        return _yarn(rope, dim)
    raise ValueError(f"unknown rope type {rope.type!r}")


def _proportional(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    # Gemma-4's full layers: the pairs (i, i + head_dim / 2) of the whole head turn, the first
    # `partial_rotary_factor` of them at the frequencies of the whole width (theta^(-2i/head_dim),
    # not of the turned part's), the rest not at all
    angles = int(rope.partial_rotary_factor * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim
    turned = 1.0 / (rope.theta**exponents)
    return torch.cat((turned, torch.zeros(head_dim // 2 - angles))) / rope.factor


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are scaled down by `factor`, short ones kept, the band between blended.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    factor, base = rope.factor, rope.theta

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        max_pos = rope.original_max_position_embeddings
        return (dim * math.log(max_pos / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of each frequency kept from the unscaled (extrapolated) form
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        if torch.empty(()).is_meta:
            # Built on the meta device (as models are): the table is computed when the model
            # is given memory (DecoderModel.materialize). Here it would be the process's first
            # CPU op, 0.6-0.9 s of torch's lazy initialisation on the H200 machine, which the
            # loader runs while the weights' reads are under way; and on meta tensors torch's
            # reference ops import torch._dynamo.
            inv_freq, self.scaling = torch.empty(rotary_dim(rope, head_dim) // 2), 1.0
        else:
            inv_freq, self.scaling = inverse_frequencies(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, rotary_dim] for integer positions [T], in fp32 then cast to dtype."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def pairs_to_halves(x: torch.Tensor, dims: int) -> torch.Tensor:
    """The first `dims` values of x laid out as (evens, odds): DeepSeek's interleaved RoPE
    pairs (x0, x1), (x2, x3), ... become the rotate-half form's (i, i + dims/2). Queries and
    the keys they meet both get it, so their dot products are unchanged."""
    rot = x[..., :dims]
    return torch.cat([rot[..., 0::2], rot[..., 1::2], x[..., dims:]], dim=-1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs_first: bool = False
) -> torch.Tensor:
    """Rotate x [T, heads, head_dim]; with partial rotary only the first dims turn.
    `pairs_first`: x's rotated dims hold interleaved pairs, turned and returned as
    `pairs_to_halves` lays them out (on the GPU read so, in the same launch)."""
    if norm_rope.available(x):  # one launch on the GPU (kernels/norm_rope.py)
        return norm_rope.apply_rotary(x, cos, sin, pairs_first)
    if pairs_first:
        x = pairs_to_halves(x, cos.shape[-1])
    if (
        x.dim() == 3
        and cos.dim() == 2
        and cos.shape[0] == x.shape[0]
        and norm_rope.native_takes(x, cos, sin)
    ):  # one call on the CPU at decode
        return norm_rope.cpu_apply_rotary(x, cos, sin)
    return rotary_reference(x, cos, sin)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
