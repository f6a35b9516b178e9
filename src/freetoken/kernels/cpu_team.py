"""The native CPU library (cpu_native.c and the parts it includes) and its team of threads
(cpu_team.c), shared by every CPU kernel: routed experts (cpu_experts.py), dense layers, stored
or kept quantized (cpu_linear.py), decode attention (paged_attention.py), a decode step's row
operations (norm_rope.py) and the device's doorbell (moe/doorbell.py). One place loads it and
declares its functions."""

from __future__ import annotations

import ctypes
import functools
import math
import os

from freetoken.kernels import native

_P, _I64, _INT, _F, _D, _U64 = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float,
                               ctypes.c_double, ctypes.c_uint64)  # fmt: skip
# The experts' arguments of the entry points that take them: the gate/up and down projections'
# formats (weights/expert_format.py's kernel codes), then per projection (gate_up, down) its
# weights, scales, per-row scales and fp8 block (rows, cols), then the gate/up bias bank (or
# NULL).
EXPERT_ARGS = [_INT, _INT, *[_P, _P, _P, _I64, _I64] * 2, _P]
# seq, shape, done, pairs, weights, x, x_bf16, out, max_routes, dtype, experts, H, I, act,
# threads, stats, layers, idle_spin, prepare
LISTENER_ARGS = [_P, _P, _P, _P, _P, _P, _INT, _P, _I64, _INT, *EXPERT_ARGS, _I64, _I64, _INT,
                 _INT, _P, _I64, _D, _D]  # fmt: skip
SIGNATURES = {
    # dtype, experts, H, I, x, x_bf16, n_rows, n_routes, route_row, route_pair, route_w, out,
    # act, threads, experts (out)
    "ft_cpu_experts_submit": (
        [_INT, *EXPERT_ARGS, _I64, _I64, _P, _INT, _I64, _I64, _P, _P, _P, _P, _INT, _INT, _P],
        _U64,
    ),
    # dtype, fmt, w, s, g, block rows, block cols, pair, N, K, out: one expert row decoded
    "ft_cpu_experts_decode": ([_INT, _INT, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _P], None),
    "ft_cpu_experts_decoder_bits": ([], _INT),  # the decoders' vector width (tests)
    # fmt, w, s, g, block rows, block cols, pair, N, K, row, other row, x (bf16), out [5]: one
    # row's dot products by each route, and two rows' at a time (tests)
    "ft_cpu_experts_row_dots": (
        [_INT, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _P, _P],
        None,
    ),
    # dtype, w, bias, N, H, x, x_bf16, T, out, threads
    "ft_cpu_linear_submit": ([_INT, _P, _P, _I64, _I64, _P, _INT, _I64, _P, _INT], _U64),
    # dtype, fmt, w, s, g, block rows, block cols, bias, N, H, x, x_bf16, T, out, threads: a
    # dense layer kept quantized
    "ft_cpu_qlinear_submit": (
        [_INT, _INT, _P, _P, _P, _I64, _I64, _P, _I64, _I64, _P, _INT, _I64, _P, _INT],
        _U64,
    ),
    # dtype, fmt, w, s, g, block rows, block cols, N, K, out, threads: such a layer's weight
    # dequantized
    "ft_cpu_dequantize_submit": (
        [_INT, _INT, _P, _P, _P, _I64, _I64, _I64, _I64, _P, _INT],
        _U64,
    ),
    # dtype, q, k_pool, v_pool, table, width, page, rows, lengths, B, heads, kv_heads, D,
    # window, scale, sinks, out, threads
    "ft_cpu_attention_submit": (
        [_INT, _P, _P, _P, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _F, _P, _P, _INT],
        _U64,
    ),
    # dtype, x, delta, weight, T, H, eps, mode, sum, out: a decode step's RMSNorm
    "ft_cpu_rms_norm": ([_INT, _P, _P, _P, _I64, _I64, _F, _INT, _P, _P], None),
    # dtype, x, row stride, head stride, T, heads, D, cos, sin, cos row stride, rot, out
    "ft_cpu_rotary": ([_INT, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _P], None),
    "ft_listener_start": (LISTENER_ARGS, _P),
    "ft_listener_stop": ([_P], None),
    "ft_cpu_experts_wait": ([_U64], _D),
    "ft_cpu_experts_set_spin": ([_D], None),
    "ft_cpu_experts_prepare": ([_D], None),
    # out [3]: thread-seconds in phase 1 items, phase 2 items, between them, since the last
    # call; 1 in a build with -DITEM_TIMES (else 0 and zeros)
    "ft_cpu_experts_item_seconds": ([_P], _INT),
}
_lib: ctypes.CDLL | bool | None = None


def library() -> ctypes.CDLL | None:
    """The compiled library with its functions declared, or None where it cannot be built."""
    global _lib
    if _lib is None:
        lib = native.load("cpu_native")
        if lib is not None:
            for name, (args, result) in SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, result
        _lib = lib or False
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

    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1 if library() is not None else usable_cores())
    return torch.get_num_threads()


def wait(ticket: int) -> float:
    """Work on job `ticket` until it is done (ctypes releases the GIL); its seconds."""
    return library().ft_cpu_experts_wait(ticket)
