"""The activation functions of MLPs and experts, by their Hugging Face config names.

One table for every implementation: torch's functions for the layers and the reference paths,
and the code each name has in the kernels (the Triton experts branch on it at compile time; the
C experts get the codes as -D defines when compiled, kernels/native.py).
"""

from __future__ import annotations

import torch.nn.functional as F

# name -> (the kernels' code, torch's function)
_TABLE = {
    "silu": (0, F.silu),
    "swish": (0, F.silu),
    "gelu": (1, F.gelu),
    "gelu_pytorch_tanh": (2, lambda x: F.gelu(x, approximate="tanh")),
    "relu": (3, F.relu),
}
# The kernels' names for the codes (the C source's ACT_* macros).
KERNEL_CODES = {"ACT_SILU": 0, "ACT_GELU": 1, "ACT_GELU_TANH": 2, "ACT_RELU": 3}


def _entry(name: str):
    try:
        return _TABLE[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_TABLE)}") from None


def activation(name: str):
    """Torch's function for an activation name."""
    return _entry(name)[1]


def activation_code(name: str) -> int:
    """The kernels' code for an activation name."""
    return _entry(name)[0]


def supported(name: str) -> bool:
    return name in _TABLE
