import numpy as np
import torch
from torch import nn

from freetoken.activations import glu
from freetoken.kernels import gated_unit
from freetoken.kernels.cpu_experts import NativeCPUExperts
from freetoken.kernels.cpu_linear import MAX_ROWS
from freetoken.kernels.cpu_team import team_threads
from freetoken.layers.linear import Linear, stacked
from freetoken.weights.expert_format import QuantizedBank, QuantizedWeight


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): the dense MLP and the shared expert."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act_name = act
        self.unit = glu(act)  # (gate, up) -> what down reads
        self.gate_up_proj: Linear | None = None  # gate and up as one, once stacked
        self.native: NativeCPUExperts | None = None  # the whole MLP as one CPU job
        self._routes: dict[int, tuple] = {}

    def stack_projections(self, dtype: torch.dtype, dense: bool) -> None:
        """Gate and up kept quantized in one format (or, with `dense`, dense in one dtype) are
        computed as one weight from now on (layers/linear.py's `stacked`; on a GPU the gated
        unit is then one kernel, kernels/gated_unit.py); with down kept quantized too, a
        decode step's MLP on the CPU is one job of the routed experts' kernel (cpu_experts.c):
        a single expert, gate/up, activation and down, with a weight of 1. That kernel rounds
        where torch does (each projection, the activation, the product), so its output is this
        module's, and the step hands the thread team one job where it handed three and ran two
        torch ops."""
        self.gate_up_proj = stacked(self.gate_proj, self.up_proj, dense=dense)
        down = self.down_proj.quantized
        if (
            self.gate_up_proj is None
            or down is None
            or down.device.type != "cpu"
            or self.gate_proj.bias is not None
        ):
            return
        self.native = NativeCPUExperts.create(
            _bank(self.gate_up_proj.quantized),
            _bank(down),
            self.act_name,
            team_threads(),
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        native = self.native
        if (
            native is not None
            and x.device.type == "cpu"
            and x.dtype == native.dtype
            and 0 < rows.shape[0] <= MAX_ROWS
            and not torch.is_grad_enabled()
        ):
            return native(rows, *self._single_expert(rows.shape[0])).to(x.dtype).view(x.shape)
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            if gated_unit.kernel_takes(gate_up, self.act_name):  # (one launch on a GPU)
                return self.down_proj(gated_unit.glu(gate_up, self.act_name))
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.unit(gate, up))

    def _single_expert(self, n: int) -> tuple:
        """The routes of n rows to the one expert: (rows, pairs, weights), made once per n."""
        if n not in self._routes:
            self._routes[n] = (
                np.arange(n, dtype=np.int64),
                np.zeros(n, dtype=np.int64),
                np.ones(n, dtype=np.float32),
            )
        return self._routes[n]


def _bank(weight: QuantizedWeight) -> QuantizedBank:
    """A weight as a bank of one expert."""
    return QuantizedBank(weight.format, *(t.unsqueeze(0) for t in weight.tensors))
