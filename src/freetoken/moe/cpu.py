"""CPU expert execution: compute routes from the host pool where the weights already lie.

Jobs run on a dedicated thread, so the Python thread driving the GPU keeps issuing copies and
kernels while the CPU computes (torch releases the GIL inside its kernels). The math inside a
job uses torch's intra-op pool, one thread per physical core by default. A native SIMD kernel
(issue: AVX-512 bf16, 64 GB/s vs torch's 40 on the GPU host) slots in behind `run_job`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from freetoken.kernels.grouped_experts import reference_grouped_experts
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
    def __init__(self, store: HostExpertStore, act: str = "silu", threads: int | None = None):
        self.store = store
        self.act = act
        # torch's intra-op pool already defaults to one thread per physical core; only an
        # explicit count changes it (process-wide, so not on every job).
        if threads:
            torch.set_num_threads(threads)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-cpu-experts")

    def submit(self, job: CPUJob) -> Future[CPUResult]:
        return self._pool.submit(self.run_job, job)

    def run_job(self, job: CPUJob) -> CPUResult:
        start = time.perf_counter()
        x = job.x.to(self.store.w_gate_up.dtype)
        # One route per row: the shared expert math (routes grouped by expert, one GEMM pair
        # each), indexed by flat pair id straight into the host banks.
        per_route = reference_grouped_experts(
            x[job.rows],
            job.pairs[:, None],
            job.weights[:, None],
            self.store.w_gate_up,
            self.store.w_down,
            self.act,
        )
        out = torch.zeros(x.shape, dtype=torch.float32).index_add_(0, job.rows, per_route.float())
        experts = len(torch.unique(job.pairs))
        return CPUResult(
            out.to(job.x.dtype), time.perf_counter() - start, experts * self.store.shape.nbytes
        )

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
