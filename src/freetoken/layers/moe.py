"""The sparse MoE block: router, routed experts, optional shared expert.

The block owns its router and shared expert. Its routed experts live outside the module, in the
host expert pool (`moe/store.py`) and wherever the MoE runtime places them: the block hands
each token's routes to `self.executor`, which the runtime installs (`moe/runtime.py`).
Expert banks are stacked: `w_gate_up[e]` is [2 * I, H] (gate rows, then up rows) and
`w_down[e]` is [H, I]. Where experts have biases (gpt-oss), the gate/up bias travels with the
expert (moe/store.py) while the block keeps the down bias: sum_j w_j (W_d a_j + b_j) is the
executor's sum plus sum_j w_j b_j, so it is added here once, wherever the experts ran.
Gemma-4's layers run a dense MLP (the block's `shared` expert) beside the experts: the router
and the experts read the residual stream (`stream`), the experts through their own norm, and
each branch's output is normed before the sum (`MoEConfig.scaled_router`,
`ModelConfig.sandwich_norms`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels import norm_rope
from freetoken.layers.concurrent import beside
from freetoken.layers.linear import Linear
from freetoken.layers.mlp import GatedMLP
from freetoken.layers.norm import RMSNorm, rms_normalize
from freetoken.model_config import ModelConfig


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing. Returns (weights [T, k], expert ids [T, k]); the weights are in
    the logits' dtype unless `fp32_weights`."""
    if norm_rope.available(router_logits):  # one launch on the GPU (kernels/norm_rope.py)
        return norm_rope.route(router_logits, top_k, renormalize, fp32_weights)
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if fp32_weights else weights.to(router_logits.dtype)), ids


def route_sigmoid(
    router_logits: torch.Tensor, correction_bias: torch.Tensor, moe
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid routing with a correction bias and group-limited choice (MoEConfig.scoring):
    fp32 logits [T, E] -> (fp32 weights [T, k], ids [T, k])."""
    if norm_rope.available(router_logits):  # one launch on the GPU, ~15 in torch
        return norm_rope.route_sigmoid(router_logits, correction_bias, moe)
    scores = router_logits.sigmoid()
    choice = scores + correction_bias
    if moe.num_groups > 1:
        t, e = choice.shape
        grouped = choice.view(t, moe.num_groups, e // moe.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, k=moe.topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(e // moe.num_groups, 1), float("-inf"))
    ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling, ids


def route_sqrtsoftplus(
    router_logits: torch.Tensor, correction_bias: torch.Tensor, moe, ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's routing: scores sqrt(softplus(logits)); experts chosen by score plus the
    (fp32) correction bias, or given (`ids`: a hash layer's `tid2eid[token]`); their scores
    normalised and times `routed_scaling`, in the logits' dtype as transformers computes them.
    -> (weights [T, k], ids [T, k])."""
    if norm_rope.available(router_logits):  # one launch on the GPU, nine in torch
        return norm_rope.route_sqrtsoftplus(
            router_logits, correction_bias, moe.top_k, moe.routed_scaling, ids
        )
    scores = F.softplus(router_logits).sqrt()
    if ids is None:
        ids = torch.topk(scores + correction_bias, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling, ids


class ExpertExecutor(Protocol):
    def __call__(
        self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Gate-weighted sum over each token's routed experts: [T, H]."""
        ...


def _not_installed(moe_layer, x, ids, weights):
    raise RuntimeError("no MoE runtime installed: build the model through ModelRunner")


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, moe_layer: int):
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.moe_layer, self.top_k, self.renormalize = moe_layer, moe.top_k, moe.norm_topk_prob
        self.fp32_gate_weights = moe.fp32_gate_weights
        self.moe = moe
        h = cfg.hidden_size
        self.router = Linear(h, moe.num_experts, bias=moe.router_bias)
        self.down_proj_bias = None
        if moe.expert_bias:
            self.down_proj_bias = nn.Parameter(torch.zeros(moe.num_experts, h), requires_grad=False)
        self.correction_bias = None
        self.tid2eid = None
        if moe.hash_layers and moe.hash_layers[moe_layer]:  # (DeepSeek-V4: experts by token)
            self.tid2eid = nn.Parameter(
                torch.zeros(cfg.vocab_size, moe.top_k, dtype=torch.long), requires_grad=False
            )
        elif moe.scoring in ("sigmoid", "sqrtsoftplus"):
            self.correction_bias = nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)
            # (both kept fp32 in any model dtype: DecoderModel.cast)
        self.shared = None
        self.shared_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared = GatedMLP(h, moe.shared_expert_intermediate_size, cfg.hidden_act)
            if moe.shared_expert_gated:
                self.shared_gate = Linear(h, 1, bias=False)
        self.eps = cfg.rms_norm_eps
        if moe.scaled_router:
            self.router_scale = nn.Parameter(torch.ones(h), requires_grad=False)
            self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts), requires_grad=False)
        self.experts_norm = self.experts_post_norm = self.shared_post_norm = None
        if cfg.sandwich_norms:
            norm = (h, cfg.rms_norm_eps, cfg.zero_centered_norm, cfg.norm_scale_fp32)
            self.experts_norm, self.experts_post_norm = RMSNorm(*norm), RMSNorm(*norm)
            self.shared_post_norm = RMSNorm(*norm) if self.shared is not None else None
        self.executor: ExpertExecutor = _not_installed
        # the runtime's prefetch (moe/runtime.py `prefetcher`), or None: kept apart from the
        # executor, which a decode graph's capture stands in for
        self.prefetch_from = None

    def route(self, x, input_ids=None, stream=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate weights, expert ids) [T, k] of the normed input x, in the reference's order:
        softmax routing gives each token's best first, sigmoid and sqrtsoftplus scoring their
        k unsorted (as transformers does: the order is the sum's, which exactness keeps)."""
        if self.moe.scaled_router:
            scaled = rms_normalize(stream, self.eps) * self.router_scale * x.shape[-1] ** -0.5
            weights, ids = route(self.router(scaled), self.top_k, True, self.fp32_gate_weights)
            return weights * self.per_expert_scale[ids], ids
        if self.moe.scoring == "sqrtsoftplus":
            ids = None if self.tid2eid is None else self.tid2eid[input_ids]
            bias = None if self.correction_bias is None else self.correction_bias.float()
            return route_sqrtsoftplus(self.router(x), bias, self.moe, ids)
        if self.correction_bias is not None:
            logits = self.router(x.float()).float()  # (its weight is fp32: DecoderModel.cast)
            weights, ids = route_sigmoid(logits, self.correction_bias.float(), self.moe)
            return (weights if self.fp32_gate_weights else weights.to(x.dtype)), ids
        return route(self.router(x), self.top_k, self.renormalize, self.fp32_gate_weights)

    def prefetch(self, predict_input, held: tuple, input_ids=None) -> None:
        """Fill this layer's likely misses ahead of its call (moe/prefetch.py), where the
        runtime does so for a call of this shape: `predict_input()` -> (x, stream) the router
        would read, computed where the prefetch runs; `held`, the tensors it reads."""
        tokens = held[0].shape[0]
        prefetch = None
        if self.prefetch_from is not None:
            prefetch = self.prefetch_from(tokens, tokens * self.top_k)
        if prefetch is None:
            return
        with prefetch.ahead(held) as submit:
            x, stream = predict_input()
            weights, ids = self.route(x, input_ids, stream)
            # (each token's heaviest first, so a prefetch of p < k fills the likeliest: sigmoid
            # and sqrtsoftplus routing give their k unsorted)
            submit(self.moe_layer, ids.gather(1, weights.argsort(dim=1, descending=True)))

    def forward(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        stream: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's feed-forward output for its normed input x [T, H]; `input_ids` for
        hash-routed layers, `stream` (the residual stream x was normed from) for Gemma-4's."""
        # (the shared expert reads only x: on a GPU it runs beside the routing and the routed
        # experts, layers/concurrent.py)
        shared = None if self.shared is None else beside(self._shared, x)
        routed = x if self.experts_norm is None else self.experts_norm(stream)
        weights, ids = self.route(x, input_ids, stream)
        out = self.executor(self.moe_layer, routed, ids, weights)
        if self.experts_post_norm is not None:
            out = self.experts_post_norm(out)
        if self.down_proj_bias is not None:
            # sum_j w_j b[ids_j] as one [T, E] x [E, H] product (no [T, k, H] gather)
            dense = weights.new_zeros(x.shape[0], self.moe.num_experts).scatter_(1, ids, weights)
            out = out + dense.to(x.dtype) @ self.down_proj_bias
        if shared is not None:
            out = out + shared.result()
        return out

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared(x)
        if self.shared_gate is not None:
            out = torch.sigmoid(self.shared_gate(x)) * out
        if self.shared_post_norm is not None:
            out = self.shared_post_norm(out)
        return out
