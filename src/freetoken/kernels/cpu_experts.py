"""Routed experts on the CPU from the host pool: the native kernel (`cpu_experts.c`, a part of
the native library) behind a thin wrapper, with the torch reference as the fallback.

A job is a list of routes (row of x, flat expert id, gate weight). The library groups them by
expert (so each expert's weights stream from DRAM once however many tokens use it) and converts
x to fp32 itself: on the H200 machine the dozen numpy and torch calls that did this in Python
cost ~0.1 ms per decode layer step.

Experts kept quantized (weights/expert_format.py: each projection a `QuantizedBank`) are
decoded by the kernel as it computes, row by row, into the model's dtype: a job on them gives
the job on their dequantized banks bit for bit, and reads only the quantized bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.activations import activation_code, supported
from freetoken.kernels.cpu_banks import DTYPES, projection, ptr
from freetoken.kernels.cpu_team import I64, INT, U64, P, Signatures, declare, library
from freetoken.kernels.grouped_reference import reference_grouped_experts
from freetoken.weights.expert_format import SPLIT_FORMATS, QuantizedBank

# The experts' arguments of the entry points that take them (ft_cpu_experts_submit, and
# ft_listener_start: moe/doorbell.py): the gate/up and down projections' formats
# (weights/expert_format.py's kernel codes), then per projection (gate_up, down) its weights,
# scales, per-row scales and fp8 block (rows, cols), then the gate/up bias bank (or NULL).
EXPERT_ARGS = [INT, INT, *[P, P, P, I64, I64] * 2, P]
SIGNATURES: Signatures = {  # the experts' (cpu_experts.c)
    # dtype, experts, H, I, x, x_bf16, n_rows, n_routes, route_row, route_pair, route_w, out,
    # act, threads, experts (out)
    "ft_cpu_experts_submit": (
        [INT, *EXPERT_ARGS, I64, I64, P, INT, I64, I64, P, P, P, P, INT, INT, P],
        U64,
    ),
    # fmt, w, s, g, block rows, block cols, pair, N, K, row, other row, x (bf16), out [5]: one
    # row's dot products by each route, and two rows' at a time (tests)
    "ft_cpu_experts_row_dots": (
        [INT, P, P, P, I64, I64, I64, I64, I64, I64, I64, P, P],
        None,
    ),
}
declare(SIGNATURES)


def _format_code(bank) -> int:
    return bank.format.code if isinstance(bank, QuantizedBank) else 0


class NativeCPUExperts:
    """Computes jobs with the compiled kernel; build with `NativeCPUExperts.create`, which
    returns None when this machine cannot run it (no compiler, unsupported dtype or banks)."""

    def __init__(
        self,
        lib,
        w_gate_up,
        w_down,
        act: str,
        threads: int,
        b_gate_up,
        dtype: torch.dtype,
        projections: tuple[tuple, tuple],
    ):
        self.lib = lib
        self.w_gate_up, self.w_down, self.b_gate_up = w_gate_up, w_down, b_gate_up
        self.dtype = dtype  # the model's: what the experts compute in
        self.dtype_code = DTYPES[dtype]
        self.act_code = activation_code(act)
        self.threads = threads
        self.hidden = w_gate_up.shape[2]
        self.intermediate = w_down.shape[2]
        # What both entry points take for the experts (see the C source).
        args = [_format_code(w_gate_up), _format_code(w_down)]
        for w, s, g, block_rows, block_cols in projections:
            args += [ptr(w), ptr(s), ptr(g), block_rows, block_cols]
        self.expert_args = (*args, ptr(b_gate_up))

    @classmethod
    def create(
        cls,
        w_gate_up,
        w_down,
        act: str,
        threads: int,
        spin_seconds: float | None = None,
        b_gate_up=None,
        dtype: torch.dtype | None = None,
    ) -> NativeCPUExperts | None:
        """`w_gate_up` [P, 2I, H] and `w_down` [P, H, I]: dense banks, or both `QuantizedBank`s
        of one format, or of two but for mxfp4 and nvfp4 (a Q4_K_M file's q4_k or q5_0 and
        k_mixed); `dtype`: the model's, which the experts compute in (required with quantized
        banks; dense banks must hold it). `spin_seconds`: how long the job handoff
        spins before sleeping (see the C source; the library's one setting, left as it is when
        None); for machines where these cores have nothing else to run. `b_gate_up`: the
        gate/up biases [P, 2I] (in `dtype`) of experts that have them (moe/store.py)."""
        quantized = isinstance(w_gate_up, QuantizedBank)
        if quantized and dtype is None:
            raise ValueError("quantized experts need the model's dtype (dtype=)")
        dtype = dtype or w_gate_up.dtype
        if dtype not in DTYPES or not supported(act):
            return None
        if quantized != isinstance(w_down, QuantizedBank) or (
            quantized
            and w_gate_up.format.name != w_down.format.name
            and {w_gate_up.format.name, w_down.format.name} & SPLIT_FORMATS
        ):
            return None  # (the split routes read x split for the gate/up projection's format)
        if b_gate_up is not None and (
            b_gate_up.dtype != dtype
            or tuple(b_gate_up.shape) != tuple(w_gate_up.shape[:2])
            or not b_gate_up.is_contiguous()
            or b_gate_up.device.type != "cpu"
        ):
            return None
        h, i = w_gate_up.shape[2], w_down.shape[2]
        projections = (projection(w_gate_up, 2 * i, h, dtype), projection(w_down, h, i, dtype))
        if None in projections:
            return None
        lib = library()
        if lib is None:
            return None
        if spin_seconds is not None:
            lib.ft_cpu_experts_set_spin(spin_seconds)
        return cls(lib, w_gate_up, w_down, act, threads, b_gate_up, dtype, projections)

    def __call__(
        self, x: torch.Tensor, rows: torch.Tensor, pairs: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """fp32 [n, H]: row i holds the gate-weighted sum of the routes reading row i of x."""
        return self.submit(x, rows, pairs, weights).result()

    def set_spin(self, seconds: float) -> None:
        """How long idle team threads and waiters spin before sleeping (as `create`'s
        `spin_seconds`; the library's setting, shared by every kernel of the process)."""
        self.lib.ft_cpu_experts_set_spin(seconds)

    def prepare(self, seconds: float) -> None:
        """Wake the team ahead of a job expected within `seconds` (see the C source)."""
        self.lib.ft_cpu_experts_prepare(seconds)

    def submit(self, x: torch.Tensor, rows, pairs, weights) -> PendingJob:
        """Start the job on the library's threads and return at once; `.result()` waits for
        it. `rows`, `pairs` and `weights` are numpy arrays or CPU tensors; the library copies
        them and x before this returns."""
        if x.dtype not in DTYPES:
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
            self.dtype_code,
            *self.expert_args,
            self.hidden,
            self.intermediate,
            x.data_ptr(),
            x.dtype == torch.bfloat16,
            x.shape[0],
            len(rows),
            ptr(rows),
            ptr(pairs),
            ptr(weights),
            ptr(out),
            self.act_code,
            self.threads,
            ptr(experts),
        )
        if ticket == 0:
            raise RuntimeError("could not start a CPU expert job (threads or memory)")
        return PendingJob(self.lib, ticket, out, int(experts[0]))


def row_dots(
    bank: QuantizedBank, pair: int, row: int, x: torch.Tensor, other: int = 0
) -> list[float]:
    """Row `row` of expert `pair` dotted with x ([K], bf16) by each route a bf16 job may take
    (in registers, by the route that reads x split, decoded into a buffer), then rows `row` and
    `other` by the split route two at a time (nvfp4's block route), in fp32 before any rounding
    (for tests that the routes agree)."""
    _, rows, cols = bank.shape
    parts = projection(bank, rows, cols, torch.bfloat16)
    lib = library()
    if parts is None or lib is None:
        raise ValueError("the native kernel cannot decode this bank here")
    w, s, g, block_rows, block_cols = parts
    x = x.to(torch.bfloat16).contiguous()
    out = np.zeros(5, np.float32)
    lib.ft_cpu_experts_row_dots(
        bank.format.code,
        ptr(w),
        ptr(s),
        ptr(g),
        block_rows,
        block_cols,
        pair,
        rows,
        cols,
        row,
        other,
        x.data_ptr(),
        ptr(out),
    )
    return out.tolist()


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
    x, rows, pairs, weights, w_gate_up, w_down, act, b_gate_up=None, dtype=None
) -> torch.Tensor:
    """The same result with torch ops (the fallback, and the oracle in tests). The banks are
    dense or `QuantizedBank`s (dequantized expert by expert, as defined); `dtype`: the model's,
    which x is cast to (by default the dense banks'). `b_gate_up`: the bias bank [P, 2I],
    indexed by the same flat ids as the weight banks."""
    if dtype is None:
        if isinstance(w_gate_up, QuantizedBank):
            raise ValueError("quantized experts need the model's dtype (dtype=)")
        dtype = w_gate_up.dtype
    per_route = reference_grouped_experts(
        x.to(dtype)[rows], pairs[:, None], weights[:, None], w_gate_up, w_down, act, b_gate_up
    )
    return torch.zeros(x.shape, dtype=torch.float32).index_add_(0, rows, per_route.float())
