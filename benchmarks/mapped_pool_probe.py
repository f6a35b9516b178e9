"""Can a warm start's expert pool be the page cache itself? (issue 18, a probe for the design)

A warm start copies the pool's bytes from the page cache into anonymous memory (zeroed 2 MiB
pages, then written) and page-locks it; the copies run beside Python's imports and slow them
(1.6 -> 3.5 s on one H200 machine). Mapping the file instead copies nothing. This measures,
on `GIB` of a warm file, both ways to a page-locked buffer, and whether CUDA takes a read-only
shared file mapping as host memory for copies (cudaHostRegister with its ReadOnly flag): the
seconds of each step, the host-to-device bandwidth from each buffer, and that the bytes match.

    python benchmarks/mapped_pool_probe.py /tmp/lt/weight-dir/experts.bin --gib 4
"""

from __future__ import annotations

import argparse
import ctypes
import os
import threading
import time
from pathlib import Path

import torch

from freetoken.weights import memory
from freetoken.weights.memory import PORTABLE, READ_ONLY

MADV_POPULATE_READ = 22
CHUNK = 64 * 2**20


def in_threads(n: int, nbytes: int, work) -> float:
    """work(start, end) over `n` equal spans of [0, nbytes) on threads; seconds."""
    step = -(-nbytes // n // 2**21) * 2**21
    spans = [(a, min(nbytes, a + step)) for a in range(0, nbytes, step)]
    start = time.perf_counter()
    threads = [threading.Thread(target=work, args=s) for s in spans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def register(address: int, nbytes: int, flags: int) -> tuple[int, float]:
    start = time.perf_counter()
    status = memory.lock_pages(address, nbytes, flags)
    return status, time.perf_counter() - start


def h2d(address: int, nbytes: int) -> tuple[float, torch.Tensor]:
    """GB/s of one copy of the buffer's first GiB to the GPU, and what arrived."""
    n = min(nbytes, 2**30)
    src = torch.frombuffer((ctypes.c_uint8 * n).from_address(address), dtype=torch.uint8)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)  # (warm-up)
    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return n / (time.perf_counter() - start) / 1e9, dst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    nbytes = int(args.gib * 2**30) // 2**21 * 2**21
    nbytes = min(nbytes, os.path.getsize(args.file) // 2**21 * 2**21)
    fd = os.open(args.file, os.O_RDONLY)
    torch.empty(1, device="cuda")  # (the context first: its cost is neither way's)

    # 1. read into anonymous memory (2 MiB pages), then page-lock it (as the loader does)
    region = memory.anonymous_region(nbytes)
    view = memoryview(region)

    def read(a: int, b: int) -> None:
        while a < b:
            a += os.preadv(fd, [view[a : min(b, a + CHUNK)]], a)

    read_s = in_threads(args.threads, nbytes, read)
    base = memory.address(region)
    status, lock_s = register(base, nbytes, PORTABLE)
    copied_gbs, copied = h2d(base, nbytes) if status == 0 else (0.0, None)
    print(
        f"copy: {nbytes / 2**30:.1f} GiB read on {args.threads} threads {read_s:.3f} s "
        f"({nbytes / read_s / 1e9:.1f} GB/s), page-locked {lock_s:.3f} s (status {status}), "
        f"H2D {copied_gbs:.1f} GB/s",
        flush=True,
    )

    # 2. the file mapped shared and read-only, its pages mapped in on threads, then registered
    # (the early read's own mapping, memory.file_region; madvise through libc: Python's mmap
    # module does not name MADV_POPULATE_READ)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = time.perf_counter()
    region = memory.file_region(Path(args.file), nbytes)
    map_s = time.perf_counter() - start
    mapped = memory.address(region)
    errors = []

    def populate(a: int, b: int) -> None:
        if libc.madvise(mapped + a, b - a, MADV_POPULATE_READ) != 0:
            errors.append(os.strerror(ctypes.get_errno()))

    populate_s = in_threads(args.threads, nbytes, populate)
    results = {}
    for name, flags in (("read-only", PORTABLE | READ_ONLY), ("default", PORTABLE)):
        status, reg_s = register(mapped, nbytes, flags)
        results[name] = (status, reg_s)
        if status == 0:
            break
    name, (status, reg_s) = next(reversed(results.items()))
    tried = ", ".join(f"{k}: status {s} in {t:.3f} s" for k, (s, t) in results.items())
    line = (
        f"mapped: mmap {map_s:.4f} s, populated on {args.threads} threads {populate_s:.3f} s"
        f" ({'; '.join(errors) or 'ok'}), registered {tried}"
    )
    if status == 0:
        gbs, arrived = h2d(mapped, nbytes)
        same = copied is None or torch.equal(arrived, copied)
        line += f"; H2D {gbs:.1f} GB/s, bytes {'equal' if same else 'DIFFER'}"
        memory.unlock_pages(mapped)
    print(line, flush=True)
    if copied is not None:
        memory.unlock_pages(base)


if __name__ == "__main__":
    main()
