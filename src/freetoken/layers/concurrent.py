"""A layer's independent work run beside the stream it was called on, on a GPU.

At batch 1 a decode step's dense work is a chain of small kernels, each a few microseconds
however little it reads, and a CUDA graph runs one stream's kernels one after another. Work
that depends on nothing else the layer computes before its result is needed (the shared expert
beside the router and the routed experts; DeepSeek-V4's K=V and compressor projections beside
its queries) can run on a side stream instead: a captured graph then holds two branches, the GPU
runs them at once, and the chain the step waits for is shorter. Hybrid's MoE layer gains most:
its GPU waits on PCIe and the CPU while the shared expert runs beside.

The side branch computes the same tensors with the same kernels, so the outputs do not change,
only when each kernel runs. Its inputs are kept alive until it is joined (their memory must not
be reused by the calling stream while the branch reads it); its outputs are the caller's once
joined. On the CPU, or with `ON_GPU` off, the work runs where its result is first asked for, on
the calling stream: off the path to what the caller needs sooner (hybrid's plan, which starts
the CPU's share, comes before the shared expert).

A decode graph cut at a host-decided MoE layer (engine/cuda_graphs.py) must not leave a branch
unjoined across the cut: `join_all` joins every pending branch there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

# Off until a GPU has timed it (and run its CUDA tests, which turn it on): every branch then
# runs in order on the calling stream. benchmarks/gpu_deepseek_v4.sh `side` does both
# (decode_offload.py and profile_decode.py `--side-branches`).
ON_GPU = False

T = TypeVar("T")

_sides: dict[torch.device, torch.cuda.Stream] = {}
_pending: list[Beside] = []


class Beside(Generic[T]):
    """The result of work handed to `beside`: `result()` joins a side branch to the current
    stream, or runs work that was deferred (`later`: fn and its arguments)."""

    def __init__(
        self,
        value: T | None = None,
        done: torch.cuda.Event | None = None,
        held: tuple = (),
        later: tuple | None = None,
    ):
        self._value, self._done, self._held, self._later = value, done, held, later

    def result(self) -> T:
        if self._later is not None:
            fn, args = self._later
            self._later, self._value = None, fn(*args)
        self.join()
        return self._value

    def join(self) -> None:
        """The current stream waits for the branch (once; nothing to do if already joined)."""
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
            self._done, self._held = None, ()
            _pending.remove(self)


def beside(fn: Callable[..., T], *tensors: torch.Tensor) -> Beside[T]:
    """fn(*tensors), run on a side stream forked from the current one where that can help (a
    GPU, `ON_GPU`), else when its result is asked for."""
    device = tensors[0].device
    if device.type != "cuda" or not ON_GPU:
        return Beside(later=(fn, tensors))
    side = _sides.get(device)
    if side is None:
        side = _sides[device] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        value = fn(*tensors)
        done = torch.cuda.Event()
        done.record(side)
    branch = Beside(value, done, tensors)
    _pending.append(branch)
    return branch


def join_all() -> None:
    """The current stream waits for every branch not yet joined."""
    for branch in list(_pending):
        branch.join()
