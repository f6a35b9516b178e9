"""CPU expert execution: compute routes from the host pool where the weights already lie.

Jobs run on a dedicated thread, so the Python thread driving the GPU keeps issuing copies and
kernels while the CPU computes. The math is the native kernel (`kernels/cpu_experts.c`, built
for this CPU at first use; its OpenMP team runs with the GIL released) or, where it cannot be
built, the torch reference on torch's intra-op pool. Both use one thread per physical core by
default (`--moe-cpu-threads`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from freetoken.kernels.cpu_experts import NativeCPUExperts, torch_cpu_experts
from freetoken.moe.store import HostExpertStore


@dataclass
class CPUJob:
    """The CPU share of one MoE layer: routes (row of x, flat expert id, gate weight)."""

    x: torch.Tensor  # [n, H] host activations of the tokens involved
    rows: torch.Tensor  # [r] int64 row of x for each route
    pairs: torch.Tensor  # [r] int64 flat expert id (moe_layer * E + expert)
    weights: torch.Tensor  # [r] gate weights


@dataclass
class CPUResult:
    out: torch.Tensor  # [n, H] gate-weighted sum of the job's routes per row of x
    seconds: float
    weight_bytes: int  # bytes of expert weights read


class CPUExpertExecutor:
    def __init__(
        self,
        store: HostExpertStore,
        act: str = "silu",
        threads: int | None = None,
        native: bool = True,
    ):
        self.store = store
        self.act = act
        # torch's intra-op pool defaults to one thread per physical core; only an explicit
        # count changes it (process-wide, so not on every job).
        if threads:
            torch.set_num_threads(threads)
        self.native = None
        if native:
            # One core is left to the thread that drives the GPU: with every core in the team,
            # the kernel ran at 25 GB/s beside a copy thread instead of 34 with one fewer
            # (benchmarks/results/2026-11-29-cpu-experts-h200.md).
            team = threads or max(1, torch.get_num_threads() - 1)
            self.native = NativeCPUExperts.create(store.w_gate_up, store.w_down, act, team)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-cpu-experts")

    def submit(self, job: CPUJob) -> Future[CPUResult]:
        return self._pool.submit(self.run_job, job)

    def run_job(self, job: CPUJob) -> CPUResult:
        start = time.perf_counter()
        if self.native is not None:
            out = self.native(job.x, job.rows, job.pairs, job.weights)
        else:
            store = self.store
            out = torch_cpu_experts(
                job.x, job.rows, job.pairs, job.weights, store.w_gate_up, store.w_down, self.act
            )
        experts = len(torch.unique(job.pairs))
        return CPUResult(
            out.to(job.x.dtype), time.perf_counter() - start, experts * self.store.shape.nbytes
        )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
