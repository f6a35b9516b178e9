import torch
from torch import nn

from freetoken.activations import activation
from freetoken.layers.linear import Linear


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): the dense MLP and the shared expert."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
