"""Manifold-Constrained Hyper-Connections (DeepSeek-V4): the residual is `hc_mult` streams
[T, n, H]. Before each attention and MoE block a projection of the normed streams gives `pre`
(how the streams collapse into the block's input), `post` (how the block's output spreads back)
and `comb` (how the streams mix), `comb` made doubly stochastic by Sinkhorn-Knopp; after the last
layer the hyper head collapses the streams once more. All in fp32, as transformers does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels import hyper_mix
from freetoken.kernels.hyper_mix import hc_mix
from freetoken.model_config import CompressedAttentionConfig


def _normed(streams: torch.Tensor, eps: float) -> torch.Tensor:
    if hyper_mix.streams_kernel_takes(streams):  # (one launch on a GPU, five in torch)
        return hyper_mix.hc_normed(streams, eps)
    flat = streams.reshape(streams.shape[0], -1).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def _collapsed(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    if hyper_mix.streams_kernel_takes(streams):
        return hyper_mix.hc_collapse(pre, streams)
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class HyperConnection(nn.Module):
    def __init__(self, c: CompressedAttentionConfig, hidden: int, eps: float):
        super().__init__()
        n = c.hc_mult
        self.n, self.iters, self.hc_eps, self.eps = n, c.hc_sinkhorn_iters, c.hc_eps, eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.zeros(3))

    def forward(self, streams: torch.Tensor):
        """streams [T, n, H] -> (post [T, n], comb [T, n, n], the block's input [T, H])."""
        mixes = F.linear(_normed(streams, self.eps), self.fn.float())
        # (one launch on a GPU for what torch needs ~120: kernels/hyper_mix.py)
        pre, post, comb = hc_mix(mixes, self.base, self.scale, self.n, self.iters, self.hc_eps)
        return post, comb, _collapsed(pre, streams)

    @staticmethod
    def merge(streams, post, comb, out) -> torch.Tensor:
        """The streams after a block: its output spread by `post`, plus the streams mixed by
        `comb` (transposed: stream k takes sum_j comb[j, k] streams[j])."""
        if hyper_mix.streams_kernel_takes(streams):
            return hyper_mix.hc_merge(streams, post, comb, out)
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    def __init__(self, c: CompressedAttentionConfig, hidden: int, eps: float):
        super().__init__()
        self.hc_eps, self.eps = c.hc_eps, eps
        self.fn = nn.Parameter(torch.zeros(c.hc_mult, c.hc_mult * hidden))
        self.base = nn.Parameter(torch.zeros(c.hc_mult))
        self.scale = nn.Parameter(torch.zeros(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(_normed(streams, self.eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return _collapsed(pre, streams)
