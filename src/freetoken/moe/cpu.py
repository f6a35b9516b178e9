"""CPU expert execution: compute routes from the host pool where the weights already lie.

Jobs run off the thread that drives the GPU, so it keeps issuing copies and kernels while the
CPU computes. The math is the native kernel (`kernels/cpu_experts.c`, a part of the native
library `kernels/cpu_native.c`, built for this CPU at first use), which runs each job on its own
team of threads, no GIL involved, and the thread that waits for a job works on it too; or, where
it cannot be built, the torch reference on a Python thread and torch's intra-op pool.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from freetoken.kernels.cpu_experts import NativeCPUExperts, torch_cpu_experts
from freetoken.kernels.cpu_team import team_threads
from freetoken.moe.store import HostExpertStore


@dataclass
class CPUJob:
    """The CPU share of one MoE layer: routes (row of x, flat expert id, gate weight)."""

    x: torch.Tensor  # [n, H] host activations of the tokens involved
    # numpy arrays or CPU tensors (the runtime builds them with numpy):
    rows: object  # [r] int64 row of x for each route
    pairs: object  # [r] int64 flat expert id (moe_layer * E + expert)
    weights: object  # [r] gate weights


@dataclass
class CPUResult:
    # [n, H] fp32 gate-weighted sum of the job's routes per row of x: partials stay fp32 until
    # the merge converts them, once, on the way to the device
    out: torch.Tensor
    seconds: float
    weight_bytes: int  # bytes of expert weights read


class NativeJob:
    """A job on the native kernel's own team of threads (kernels/cpu_team.c)."""

    def __init__(self, pending, expert_bytes: int):
        self._pending, self._expert_bytes = pending, expert_bytes

    def result(self) -> CPUResult:
        out = self._pending.result()
        p = self._pending
        return CPUResult(out, p.seconds, p.experts * self._expert_bytes)


class CPUExpertExecutor:
    def __init__(
        self,
        store: HostExpertStore,
        act: str = "silu",
        threads: int | None = None,
        native: bool = True,
        spin_us: float = 0.0,
        prepare_us: float = 2000.0,
    ):
        """`threads`: the native kernel's team (the thread waiting for a job works on it too),
        and torch's intra-op pool for the fallback; by default one fewer than the CPUs this
        process may use. `spin_us`, `prepare_us`: how idle threads wait (MoEOptions'
        cpu_spin_us and cpu_prepare_us say why)."""
        self.store = store
        self.act = act
        self.native = None
        if native:
            # The waiting caller joins the team, so one core fewer: on the 2-core CPU machine
            # one thread plus the caller ran at 23 GB/s, two plus the caller at 21. Beside a GPU
            # that core is the thread driving it until it waits. Counted from the CPUs this
            # process may use, not from torch's thread count, which the runtime lowers to 1
            # beside a GPU.
            team = threads or team_threads()
            w = store.weights
            self.native = NativeCPUExperts.create(
                w.gate_up,
                w.down,
                act,
                team,
                spin_seconds=spin_us * 1e-6,
                b_gate_up=w.bias,
                dtype=store.shape.dtype,
            )
        # torch's intra-op pool computes the fallback: an explicit count sizes it (process-wide,
        # so not on every job). Beside the native team it stays as the engine set it.
        if threads and self.native is None:
            torch.set_num_threads(threads)
        self.prepare_seconds = prepare_us * 1e-6
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-cpu-experts")

    def prepare(self) -> None:
        """A job is expected soon: wake the native team now, where the caller would wait
        anyway (for the device's routing), instead of when the job is submitted."""
        if self.native is not None and self.prepare_seconds > 0:
            self.native.prepare(self.prepare_seconds)

    def submit(self, job: CPUJob) -> Future[CPUResult] | NativeJob:
        """Start a job; `.result()` of the returned handle waits for its CPUResult."""
        if self.native is not None:
            pending = self.native.submit(job.x, job.rows, job.pairs, job.weights)
            return NativeJob(pending, self.store.shape.nbytes)
        return self._pool.submit(self.run_job, job)

    def run_job(self, job: CPUJob) -> CPUResult:
        """The torch fallback, run on this executor's thread."""
        start = time.perf_counter()
        store, w = self.store, self.store.weights
        rows, pairs, weights = map(torch.as_tensor, (job.rows, job.pairs, job.weights))
        out = torch_cpu_experts(
            job.x, rows, pairs, weights, w.gate_up, w.down, self.act, w.bias, store.shape.dtype
        )
        experts = len(torch.unique(pairs))
        return CPUResult(out, time.perf_counter() - start, experts * store.shape.nbytes)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
