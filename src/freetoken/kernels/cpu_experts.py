"""Routed experts on the CPU from the host pool: the native kernel (`cpu_experts.c`) behind a
thin wrapper, with the torch reference as the fallback.

A job is a list of routes (row of x, flat expert id, gate weight). The library groups them by
expert (so each expert's weights stream from DRAM once however many tokens use it) and converts
x to fp32 itself: on the H200 machine the dozen numpy and torch calls that did this in Python
cost ~0.1 ms per decode layer step.
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.activations import activation_code, supported
from freetoken.kernels.cpu_team import library
from freetoken.kernels.grouped_experts import reference_grouped_experts

_DTYPES = {torch.bfloat16: 0, torch.float32: 1}


def _ptr(a: np.ndarray | torch.Tensor) -> int:
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr()


class NativeCPUExperts:
    """Computes jobs with the compiled kernel; build with `NativeCPUExperts.create`, which
    returns None when this machine cannot run it (no compiler, unsupported dtype)."""

    def __init__(self, lib, w_gate_up: torch.Tensor, w_down: torch.Tensor, act: str, threads: int,
                 b_gate_up: torch.Tensor | None = None):  # fmt: skip
        self.lib = lib
        self.w_gate_up, self.w_down, self.b_gate_up = w_gate_up, w_down, b_gate_up
        self.dtype_code = _DTYPES[w_gate_up.dtype]
        self.act_code = activation_code(act)
        self.threads = threads
        self.hidden = w_gate_up.shape[2]
        self.intermediate = w_down.shape[2]

    @classmethod
    def create(
        cls, w_gate_up, w_down, act: str, threads: int, spin_seconds: float = 0.0, b_gate_up=None
    ) -> NativeCPUExperts | None:
        """`spin_seconds`: how long the job handoff spins before sleeping (see the C source);
        for machines where these cores have nothing else to run. `b_gate_up`: the gate/up
        biases [P, 2I] of experts that have them (moe/store.py)."""
        if w_gate_up.dtype not in _DTYPES or not supported(act):
            return None
        banks = (w_gate_up, w_down) + ((b_gate_up,) if b_gate_up is not None else ())
        if not all(bank.is_contiguous() for bank in banks):
            return None
        lib = library()
        if lib is None:
            return None
        lib.ft_cpu_experts_set_spin(spin_seconds)
        return cls(lib, w_gate_up, w_down, act, threads, b_gate_up)

    def __call__(
        self, x: torch.Tensor, rows: torch.Tensor, pairs: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """fp32 [n, H]: row i holds the gate-weighted sum of the routes reading row i of x."""
        return self.submit(x, rows, pairs, weights).result()

    @property
    def bias_address(self) -> int | None:
        """The bias bank's address for the C side (None: NULL, no biases)."""
        return None if self.b_gate_up is None else self.b_gate_up.data_ptr()

    def prepare(self, seconds: float) -> None:
        """Wake the team ahead of a job expected within `seconds` (see the C source)."""
        self.lib.ft_cpu_experts_prepare(seconds)

    def submit(self, x: torch.Tensor, rows, pairs, weights) -> PendingJob:
        """Start the job on the library's threads and return at once; `.result()` waits for
        it. `rows`, `pairs` and `weights` are numpy arrays or CPU tensors; the library copies
        them and x before this returns."""
        if x.dtype not in _DTYPES:
            x = x.float()
        x = x.contiguous()
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        pairs = np.ascontiguousarray(pairs, dtype=np.int64)
        if isinstance(weights, torch.Tensor):
            weights = weights.float().numpy()
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        out = np.empty((x.shape[0], self.hidden), np.float32)
        experts = np.zeros(1, np.int64)
        ticket = self.lib.ft_cpu_experts_submit(
            self.dtype_code, _ptr(self.w_gate_up), _ptr(self.w_down), self.bias_address,
            self.hidden, self.intermediate, x.data_ptr(), x.dtype == torch.bfloat16, x.shape[0],
            len(rows), _ptr(rows), _ptr(pairs), _ptr(weights), _ptr(out), self.act_code,
            self.threads, _ptr(experts),
        )  # fmt: skip
        if ticket == 0:
            raise RuntimeError("could not start a CPU expert job (threads or memory)")
        return PendingJob(self.lib, ticket, out, int(experts[0]))


class PendingJob:
    def __init__(self, lib, ticket: int, out: np.ndarray, experts: int):
        self._lib, self._ticket, self._out = lib, ticket, out
        self._running = True
        self.experts = experts  # distinct experts the job reads
        self.seconds = 0.0  # from submission to completion, known once done

    def result(self) -> torch.Tensor:
        if self._running:
            # This thread works on the job too until it is done; ctypes releases the GIL.
            self.seconds = self._lib.ft_cpu_experts_wait(self._ticket)
            self._running = False
        return torch.from_numpy(self._out)

    def __del__(self) -> None:
        # The team writes the job's output until it is done: a job dropped unwaited (an error
        # between submit and result) must not free it under the team.
        if getattr(self, "_running", False):
            self._lib.ft_cpu_experts_wait(self._ticket)


def torch_cpu_experts(
    x, rows, pairs, weights, w_gate_up, w_down, act, b_gate_up=None
) -> torch.Tensor:
    """The same result with torch ops (the fallback, and the oracle in tests). `b_gate_up`:
    the bias bank [P, 2I], indexed by the same flat ids as the weight banks."""
    per_route = reference_grouped_experts(
        x.to(w_gate_up.dtype)[rows], pairs[:, None], weights[:, None], w_gate_up, w_down, act,
        b_gate_up,
    )  # fmt: skip
    return torch.zeros(x.shape, dtype=torch.float32).index_add_(0, rows, per_route.float())
