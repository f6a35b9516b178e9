"""The sparse MoE block: router, routed experts, optional shared expert.

Routed experts of a layer are stored stacked: `w_gate_up[e]` is [2 * I, H] (gate rows, then up
rows) and `w_down[e]` is [H, I], so one expert is one row of each bank. The expert computation
goes through `self.executor`, which by default runs the layer's own weights here; the offload
runtime swaps in an executor that serves experts from the host pool and the device cache.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.layers.mlp import GatedMLP, activation
from freetoken.models.config import ModelConfig


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing. Returns (weights [T, k], expert ids [T, k]); the weights are in
    the logits' dtype unless `fp32_weights`."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if fp32_weights else weights.to(router_logits.dtype)), ids


class ExpertExecutor(Protocol):
    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Gate-weighted sum over each token's routed experts: [T, H]."""
        ...


def grouped_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    act,
) -> torch.Tensor:
    """Reference expert computation: group routes by expert, one GEMM pair per used expert.

    `ids` index the first dimension of the banks (logical expert ids here, slot ids in a
    cache). Each route is computed exactly once and summed with its gate weight.
    """
    out = torch.zeros_like(x)
    k = ids.shape[1]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    token_of = order // k
    flat_weights = weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start : start + n]
        h = x[rows] @ w_gate_up[e].t()
        gate, up = h.chunk(2, dim=-1)
        y = (act(gate) * up) @ w_down[e].t()
        out.index_add_(0, rows, (y * flat_weights[start : start + n, None]).to(out.dtype))
        start += n
    return out


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.layer, self.top_k, self.renormalize = layer, moe.top_k, moe.norm_topk_prob
        self.fp32_gate_weights = moe.fp32_gate_weights
        h, i, e = cfg.hidden_size, moe.intermediate_size, moe.num_experts
        self.router = nn.Linear(h, e, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w_down = nn.Parameter(torch.empty(e, h, i))
        self.act = activation(cfg.hidden_act)
        self.shared = None
        self.shared_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared = GatedMLP(h, moe.shared_expert_intermediate_size, cfg.hidden_act)
            if moe.shared_expert_gated:
                self.shared_gate = nn.Linear(h, 1, bias=False)
        self.executor: ExpertExecutor = self._local_experts

    def _local_experts(self, layer, x, ids, weights):
        return grouped_experts(x, ids, weights, self.w_gate_up, self.w_down, self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router(x), self.top_k, self.renormalize, self.fp32_gate_weights)
        out = self.executor(self.layer, x, ids, weights)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out
