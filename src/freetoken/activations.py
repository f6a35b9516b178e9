"""The activation functions of MLPs and experts, by their Hugging Face config names.

One table for every implementation: torch's functions for the layers and the reference paths,
and the code each name has in the kernels (the Triton experts branch on it at compile time; the
C experts get the codes as -D defines when compiled, kernels/native.py).

A gated unit computes `glu(name)(gate, up)`: `act(gate) * up` for the plain activations, and
for `swiglu_oai` (gpt-oss's experts) `(clamp(up, -L, L) + 1) * g * sigmoid(ALPHA * g)` with
`g = min(gate, L)`, ALPHA = 1.702 and L = 7 (the constants gpt-oss was trained with; its family
refuses a config with others, so the kernels may hold them as constants).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# name -> (the kernels' code, torch's function)
_TABLE = {
    "silu": (0, F.silu),
    "swish": (0, F.silu),
    "gelu": (1, F.gelu),
    "gelu_pytorch_tanh": (2, lambda x: F.gelu(x, approximate="tanh")),
    "relu": (3, F.relu),
}
SWIGLU_OAI = "swiglu_oai"
SWIGLU_OAI_CODE = 4
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0
# DeepSeek-V4's experts and shared expert: `silu(min(gate, L)) * clamp(up, -L, L)` with the
# released `swiglu_limit` L = 10 (its family refuses others; the kernels hold it as a constant).
SWIGLU_CLAMP = "swiglu_clamp"
SWIGLU_CLAMP_CODE = 5
SWIGLU_CLAMP_LIMIT = 10
# The kernels' names for the codes (the C source's ACT_* macros).
KERNEL_CODES = {
    "ACT_SILU": 0,
    "ACT_GELU": 1,
    "ACT_GELU_TANH": 2,
    "ACT_RELU": 3,
    "ACT_SWIGLU_OAI": SWIGLU_OAI_CODE,
    "ACT_SWIGLU_CLAMP": SWIGLU_CLAMP_CODE,
    "SWIGLU_CLAMP_LIMIT": SWIGLU_CLAMP_LIMIT,
}


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU, op by op as transformers computes it (each op rounded to the
    inputs' dtype)."""
    gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    up = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's clamped SwiGLU, op by op as transformers computes it."""
    gate = gate.clamp(max=SWIGLU_CLAMP_LIMIT)
    up = up.clamp(-SWIGLU_CLAMP_LIMIT, SWIGLU_CLAMP_LIMIT)
    return F.silu(gate) * up


def _entry(name: str):
    if name in (SWIGLU_OAI, SWIGLU_CLAMP):
        raise ValueError(f"{SWIGLU_OAI!r} is a gated unit of two inputs: use glu({name!r})")
    try:
        return _TABLE[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_TABLE)}") from None


def activation(name: str):
    """Torch's function for an activation name."""
    return _entry(name)[1]


def glu(name: str):
    """Torch's gated unit for an activation name: (gate, up) -> the product the down
    projection reads."""
    if name == SWIGLU_OAI:
        return swiglu_oai
    if name == SWIGLU_CLAMP:
        return swiglu_clamp
    act = activation(name)
    return lambda gate, up: act(gate) * up


def activation_code(name: str) -> int:
    """The kernels' code for an activation name (of a gated unit: see the module's note)."""
    if name == SWIGLU_CLAMP:
        return SWIGLU_CLAMP_CODE
    return SWIGLU_OAI_CODE if name == SWIGLU_OAI else _entry(name)[0]


def supported(name: str) -> bool:
    return name in _TABLE or name in (SWIGLU_OAI, SWIGLU_CLAMP)
