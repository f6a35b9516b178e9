"""Dense layers of decode-sized batches on the CPU through the native kernel's thread team.

A decode step multiplies a few rows of activations by each weight matrix: a matrix-vector
product bound by how fast the weights stream from memory. torch's bf16 GEMV streamed them at
about 8 GB/s on the 2-core test machine, a third of its memory bandwidth; the lm_head alone
(152k x 2048 in bf16, 622 MB on Qwen3-30B-A3B) then took most of a step. The native kernel
(cpu_experts.c, `ft_cpu_linear_submit`) reads each weight row once for all rows of x, on the
same team of threads as the CPU experts. Results follow torch's: a dot product in fp32, the
bias added, one rounding to the layer's dtype (only the order of the sums differs).
"""

from __future__ import annotations

import torch

from freetoken.kernels.cpu_team import library, team_threads, wait

_DTYPES = {torch.bfloat16: 0, torch.float32: 1}
# Below this many weight bytes torch's own call, which costs no handoff to the team, is as
# fast (a router of 128 x 2048 in bf16, 512 KiB, still gained).
MIN_WEIGHT_BYTES = 1 << 18
MAX_ROWS = 16  # decode batches; longer inputs (prefill) are GEMMs, which torch does well


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the native kernel computes this layer: CPU tensors of a decode-sized batch, a
    large enough weight in bf16 or fp32, the activations in the same dtype."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.dtype in _DTYPES
        and x.dtype == weight.dtype
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and weight.numel() * weight.element_size() >= MIN_WEIGHT_BYTES
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
        and library() is not None
    )


def native_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int | None = None
) -> torch.Tensor:
    """x [T, H] . weight [N, H]^T + bias, in x's dtype (check `takes` first)."""
    x = x.contiguous()
    t, h = x.shape
    n = weight.shape[0]
    out = torch.empty(t, n, dtype=torch.float32)
    bias = bias.contiguous() if bias is not None else None  # held until the job is done
    ticket = library().ft_cpu_linear_submit(
        _DTYPES[weight.dtype], weight.data_ptr(), bias.data_ptr() if bias is not None else None,
        n, h, x.data_ptr(), x.dtype == torch.bfloat16, t, out.data_ptr(),
        threads or team_threads(),
    )  # fmt: skip
    if ticket == 0:
        raise RuntimeError("could not start a CPU linear job (threads or memory)")
    wait(ticket)  # this thread works on it too
    return out.to(x.dtype)  # exact: every value is already rounded to x's dtype
