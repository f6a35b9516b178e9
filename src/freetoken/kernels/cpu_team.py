"""The native CPU library (cpu_native.c and the parts it includes) and its team of threads
(cpu_team.c), shared by every CPU kernel: routed experts (cpu_experts.py), dense layers, stored
or kept quantized (cpu_linear.py), decode attention (paged_attention.py), a decode step's row
operations (norm_rope.py) and the device's doorbell (moe/doorbell.py). One place loads it; each
of those modules declares the functions it calls (`declare`), beside the code that calls them,
and this one the team's."""

from __future__ import annotations

import ctypes
import functools
import math
import os

from freetoken import settings
from freetoken.kernels import native

# The C types of the signatures: a pointer, int64_t, int, float, double, uint64_t.
P, I64, INT, F, D, U64 = (
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int,
    ctypes.c_float,
    ctypes.c_double,
    ctypes.c_uint64,
)
Signatures = dict[str, tuple[list, object]]  # a function's name: (argument types, result type)


class Library:
    """The loaded library's declared functions, as attributes (its ctypes functions, called as
    they would be on the CDLL): one that no imported module declared is not there, where ctypes
    would call it with argument types guessed from the values."""

    def __init__(self, cdll: ctypes.CDLL):
        self.cdll = cdll

    def declare(self, signatures: Signatures) -> None:
        for name, (args, result) in signatures.items():
            fn = getattr(self.cdll, name)
            fn.argtypes, fn.restype = args, result
            setattr(self, name, fn)


_declared: Signatures = {}
_lib: Library | bool | None = None


def declare(signatures: Signatures) -> None:
    """Declares functions of the library, as cpu_native.h prototypes them: each module declares
    those it calls when it is imported, and they are set on the library whenever it loads."""
    _declared.update(signatures)
    if _lib:
        _lib.declare(signatures)


SIGNATURES: Signatures = {  # the team's (cpu_team.c)
    # ticket: this thread works on the job until it is done; its seconds
    "ft_cpu_experts_wait": ([U64], D),
    "ft_cpu_experts_set_spin": ([D], None),
    "ft_cpu_experts_prepare": ([D], None),
    # out [3]: thread-seconds in phase 1 items, phase 2 items, between them, since the last
    # call; 1 in a build with -DITEM_TIMES (else 0 and zeros)
    "ft_cpu_experts_item_seconds": ([P], INT),
}
declare(SIGNATURES)


def library() -> Library | None:
    """The compiled library with the functions modules declared, or None where it cannot be
    built."""
    global _lib
    if _lib is None:
        cdll = native.load("cpu_native")
        _lib = Library(cdll) if cdll is not None else False
        if _lib:
            _lib.declare(_declared)
    return _lib or None


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup"):
    """The CPUs this process's cgroups let it run on at once (a container's `--cpus`: quota /
    period, the tightest of its cgroup and those above it), or None where none is set."""
    limits = []
    try:
        with open(proc_cgroup) as f:
            entries = [line.strip().split(":", 2) for line in f if line.strip()]
    except OSError:
        entries = []
    for _, controllers, path in entries:
        if controllers == "":  # cgroup v2: cpu.max holds "quota period" or "max period"
            parts = [p for p in path.strip("/").split("/") if p]
            for depth in range(len(parts), -1, -1):
                folder = os.path.join(root, *parts[:depth])
                try:
                    with open(os.path.join(folder, "cpu.max")) as f:
                        quota, period = f.read().split()[:2]
                except (OSError, ValueError):
                    continue
                if quota != "max" and int(period) > 0:
                    limits.append(int(quota) / int(period))
        elif "cpu" in controllers.split(","):  # cgroup v1
            for folder in (os.path.join(root, "cpu,cpuacct"), os.path.join(root, "cpu")):
                try:
                    with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
                        quota = int(f.read())
                    with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
                        period = int(f.read())
                except (OSError, ValueError):
                    continue
                if quota > 0 and period > 0:
                    limits.append(quota / period)
                break
    return min(limits) if limits else None


@functools.cache
def usable_cores() -> int:
    """The cores this process may actually use: its CPU affinity, within its cgroup's quota
    (rounded up: 1.5 CPUs keep two threads busy half the time each). Read once a process: every
    native job asks for the team's size, and reading the cgroup files each time (a dozen file
    opens) cost a 0.5B model's decode 6 ms of its 29 ms step."""
    cores = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return cores


def team_threads() -> int:
    """The team's default size: one thread per usable core but one (the caller that waits for
    a job works on it too)."""
    return max(1, usable_cores() - 1)


def size_torch_threads() -> int:
    """A CPU engine's torch intra-op pool: one thread where this library computes the model's
    heavy work (its team sizes itself), else one per usable core (torch's default counts the
    machine's cores, not a container's quota); OMP_NUM_THREADS, where set, is left to rule.
    torch's OpenMP team splits each op evenly and spins at its barriers: with one core of two
    taken by another process, `ft generate` fell from 37 to 10 tok/s beside the native team
    (benchmarks/results/2026-12-05-busy-core-cpu.md). Returns the count."""
    import torch

    if not settings.omp_threads_set():
        torch.set_num_threads(1 if library() is not None else usable_cores())
    return torch.get_num_threads()


def wait(ticket: int) -> float:
    """Work on job `ticket` until it is done (ctypes releases the GIL); its seconds."""
    return library().ft_cpu_experts_wait(ticket)
