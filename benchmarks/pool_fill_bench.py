"""Ways to bring a weight file the page cache holds into page-locked host memory (issue 18: a
warm start's floor is a plain read of the files; the expert pool must end up read and pinned).

    python benchmarks/pool_fill_bench.py --gib 16 --file /tmp/pool.bin --out fill.md

Each way allocates fresh memory, reads the whole (warm) file into it with positioned reads
(os.preadv releases the GIL) on T threads in 64 MiB chunks, and page-locks it; the table gives
each phase's seconds and the whole's GB/s beside the floor, a single-threaded read into one
reused 16 MiB buffer. Ways: torch.empty (malloc: 4 KiB pages, what the loader does today), an
anonymous mapping advised MADV_HUGEPAGE (2 MiB pages: a fault and a zeroing per 2 MiB, not per
4 KiB), and cudaHostAlloc'd memory (locked and zeroed by the driver first). Pinning is timed
whole (one cudaHostRegister) and in 1 GiB pieces from threads. Also: the seconds of `import
torch` and of the CUDA context in a fresh process, the start's other fixed costs.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

CHUNK = 64 * 2**20
PORTABLE = 1  # cudaHostRegisterPortable


def chunks(size: int) -> list[tuple[int, int]]:
    return [(a, min(a + CHUNK, size)) for a in range(0, size, CHUNK)]


def read_into(path: str, view: memoryview, threads: int) -> float:
    """Seconds to read the file into `view` on `threads` threads."""
    fd = os.open(path, os.O_RDONLY)
    try:

        def run(span):
            a, b = span
            done = a
            while done < b:
                n = os.preadv(fd, [view[done:b]], done)
                if n <= 0:
                    raise OSError(f"short read at {done}")
                done += n

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(run, chunks(len(view))))
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def plain_read(path: str) -> float:
    buf = bytearray(16 * 2**20)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def pin(ptr: int, size: int, pieces: int) -> float:
    """Seconds to page-lock [ptr, ptr + size): one call, or `pieces` calls from threads."""
    cudart = torch.cuda.cudart()
    spans = [(ptr + a, b - a) for a, b in _split(size, pieces)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(spans)) as pool:
        errs = list(pool.map(lambda s: int(cudart.cudaHostRegister(s[0], s[1], PORTABLE)), spans))
    dt = time.perf_counter() - t0
    if any(errs):
        raise RuntimeError(f"cudaHostRegister failed: {errs}")
    for p, _ in spans:
        cudart.cudaHostUnregister(p)
    return dt


def _split(size: int, pieces: int) -> list[tuple[int, int]]:
    step = -(-size // pieces // 2**21) * 2**21
    return [(a, min(a + step, size)) for a in range(0, size, step)]


def way_torch_empty(path, size, threads, pieces):
    t0 = time.perf_counter()
    buf = torch.empty(size, dtype=torch.uint8)
    alloc = time.perf_counter() - t0
    read = read_into(path, memoryview(buf.numpy()), threads)
    pinned = pin(buf.data_ptr(), size, pieces) if torch.cuda.is_available() else 0.0
    return alloc, read, pinned


def way_hugepage(path, size, threads, pieces):
    t0 = time.perf_counter()
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    alloc = time.perf_counter() - t0
    view = memoryview(m)
    read = read_into(path, view, threads)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    pinned = pin(ptr, size, pieces) if torch.cuda.is_available() else 0.0
    view.release()
    return alloc, read, pinned


def way_host_alloc(path, size, threads, pieces):
    t0 = time.perf_counter()
    buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    alloc = time.perf_counter() - t0
    read = read_into(path, memoryview(buf.numpy()), threads)
    return alloc, read, 0.0


def fixed_costs() -> dict[str, float]:
    code = (
        "import time,sys; t0=time.perf_counter(); import torch; t1=time.perf_counter();"
        "torch.empty(1, device='cuda') if torch.cuda.is_available() else None;"
        "print(t1-t0, time.perf_counter()-t1)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imp, ctx = map(float, out.stdout.split())
    return {"import torch s": imp, "CUDA context s": ctx}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--file", default="/tmp/pool.bin")
    ap.add_argument("--gib", type=float, default=4.0, help="size of the file to write if absent")
    ap.add_argument("--threads", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--pieces", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeat", type=int, default=2, help="rounds of every way, in turn")
    ap.add_argument("--out")
    args = ap.parse_args()
    size = int(args.gib * 2**30) // CHUNK * CHUNK
    if not os.path.exists(args.file) or os.path.getsize(args.file) != size:
        block = os.urandom(CHUNK)
        with open(args.file, "wb") as f:
            for _ in range(size // CHUNK):
                f.write(block)
    plain_read(args.file)  # warm
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    lines = [
        f"file {size / 2**30:.1f} GiB; THP: {thp}; cpus {os.cpu_count()}; "
        f"torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| way | threads | pin pieces | alloc s | read s | pin s | total s | GB/s | / floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    floor = min(plain_read(args.file) for _ in range(2))
    lines.append(
        f"| plain read, reused 16 MiB buffer | 1 | | | {floor:.2f} | | {floor:.2f} | "
        f"{size / floor / 1e9:.1f} | 1.00 |"
    )
    print("\n".join(lines), flush=True)
    ways = {"torch.empty (4 KiB pages)": way_torch_empty, "mmap MADV_HUGEPAGE": way_hugepage}
    runs = [
        (name, way, threads, pieces)
        for _ in range(args.repeat)
        for name, way in ways.items()
        for threads in args.threads
        for pieces in args.pieces
    ]
    for name, way, threads, pieces in runs:
        alloc, read, pinned = way(args.file, size, threads, pieces)
        total = alloc + read + pinned
        line = (
            f"| {name} | {threads} | {pieces} | {alloc:.2f} | {read:.2f} | {pinned:.2f} | "
            f"{total:.2f} | {size / total / 1e9:.1f} | {total / floor:.2f} |"
        )
        lines.append(line)
        print(line, flush=True)
    if torch.cuda.is_available():
        for threads in args.threads:
            alloc, read, _ = way_host_alloc(args.file, size, threads, 1)
            line = (
                f"| cudaHostAlloc | {threads} | | {alloc:.2f} | {read:.2f} | | "
                f"{alloc + read:.2f} | {size / (alloc + read) / 1e9:.1f} | "
                f"{(alloc + read) / floor:.2f} |"
            )
            lines.append(line)
            print(line, flush=True)
            torch.cuda.empty_cache()
            torch._C._host_emptyCache()
    costs = fixed_costs()
    lines += ["", ", ".join(f"{k} {v:.2f}" for k, v in costs.items())]
    print(lines[-1])
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
