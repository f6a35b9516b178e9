"""How much host memory is free and how much may be page-locked, for checks made before
loading anything and for the advice given when the expert pool cannot be pinned.

Free memory is the kernel's MemAvailable, lowered to what the process's memory cgroup still
allows where one sets a limit (containers: cgroup v2's `memory.max`, v1's
`memory.limit_in_bytes`), counting the cgroup's inactive page cache as reclaimable.

Large host buffers that are filled once and then page-locked (the expert pool) take memory of
their own advised MADV_HUGEPAGE (`anonymous_region`): their first touch is the fill, and 2 MiB
pages take a fault and a zeroing per 2 MiB, not per 4 KiB. On the H200 machine, 4 GiB of a warm
file read on 16 threads and page-locked: 0.16 + 0.08 s so, 0.27 + 0.16 s in 4 KiB pages
(benchmarks/pool_fill_bench.py; results/2026-12-03-k-mixed-and-early-read.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import resource
import threading
import time
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value
_V1_UNLIMITED = 2**62


def available_host_bytes(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int:
    """Memory that can be allocated without swapping or the cgroup's OOM killer."""
    free = _mem_available()
    room = cgroup_room(proc_cgroup, root)
    return free if room is None else min(free, room)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cgroup_limit(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int | None:
    """The memory limit of this process's cgroup in bytes, or None where there is none."""
    found = _cgroup_files(proc_cgroup, root)
    return None if found is None else found[0]


def cgroup_room(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int | None:
    """Bytes the cgroup still allows (limit - usage + its inactive page cache), or None."""
    found = _cgroup_files(proc_cgroup, root)
    if found is None:
        return None
    limit, usage, reclaimable = found
    return max(0, limit - usage + reclaimable)


def _cgroup_files(proc_cgroup: Path, root: Path) -> tuple[int, int, int] | None:
    """(limit, usage, inactive file cache) of the memory cgroup, or None without a limit."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        rel = path.lstrip("/")
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy
            found = _read_v2(root, rel)
        elif "memory" in controllers.split(","):
            found = _read_v1(root / "memory", rel)
        else:
            continue
        if found is not None:
            return found
    return None


def _candidates(base: Path, rel: str) -> list[Path]:
    # A container usually sees its own cgroup mounted at the root, not at the path it has in
    # the host's hierarchy: try both.
    return [base / rel, base] if rel else [base]


def _read_v2(root: Path, rel: str) -> tuple[int, int, int] | None:
    for d in _candidates(root, rel):
        raw = _read(d / "memory.max")
        if raw is None:
            continue
        if raw == "max":
            return None
        usage = int(_read(d / "memory.current") or 0)
        return int(raw), usage, _stat(d / "memory.stat", "inactive_file")
    return None


def _read_v1(base: Path, rel: str) -> tuple[int, int, int] | None:
    for d in _candidates(base, rel):
        raw = _read(d / "memory.limit_in_bytes")
        if raw is None:
            continue
        if int(raw) >= _V1_UNLIMITED:
            return None
        usage = int(_read(d / "memory.usage_in_bytes") or 0)
        return int(raw), usage, _stat(d / "memory.stat", "total_inactive_file")
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat(path: Path, key: str) -> int:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def anonymous_region(nbytes: int) -> mmap.mmap:
    """Fresh memory of its own (page-aligned, zeroed on first touch), advised to take 2 MiB
    pages where the kernel has transparent huge pages."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # (kernels without transparent huge pages)
            region.madvise(mmap.MADV_HUGEPAGE)
    return region


def file_region(path: Path, nbytes: int) -> mmap.mmap:
    """The first `nbytes` of a file mapped shared and read-only: its pages in the page cache as
    they are (nothing copied or zeroed; a write to them is a segmentation fault, not a change to
    the file). CUDA page-locks such pages only as READ_ONLY."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)


class _Buffer(ctypes.Structure):  # (CPython's Py_buffer)
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


def address(buffer) -> int:
    """Where a buffer's memory starts (an `anonymous_region`, or a read-only `file_region`,
    whose address ctypes' `from_buffer` refuses: asked through the buffer protocol, so that a
    start can page-lock it before torch is imported)."""
    view = _Buffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(buffer), ctypes.byref(view), 0)
    try:  # (a TypeError above for what is no buffer)
        return view.buf or 0
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(view))


# cudaHostRegister flags (READ_ONLY: the device only reads it; needed for read-only mappings)
PORTABLE, MAPPED, READ_ONLY = 1, 2, 8


def lock_pages(start: int, nbytes: int, flags: int = PORTABLE) -> int:
    """Page-lock host memory for CUDA's copies (cudaHostRegister); CUDA's error code, 0 where
    it is locked (-1: no CUDA here). Imports torch."""
    import torch

    if not torch.cuda.is_available():
        return -1
    return int(torch.cuda.cudart().cudaHostRegister(start, nbytes, flags))


def unlock_pages(start: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(start)


@contextlib.contextmanager
def page_locked(start: int, nbytes: int):
    """Memory page-locked for the copies made in the block (copies to the GPU from pageable
    memory go through the driver's staging buffers, at a fraction of the link's speed); left
    as it is where CUDA cannot lock it: the copies still work. Yields whether it is locked."""
    locked = lock_pages(start, nbytes) == 0
    try:
        yield locked
    finally:
        if locked:
            unlock_pages(start)


class PageLock:
    """[start, start + nbytes) page-locked on a thread once `after` returns (its reads ended,
    the CUDA context made), while the caller goes on: an early read's expert pool, locked as
    soon as it is read (weights/early_read.py: beside the imports, through the driver, where the
    native preload made the context; `pool_lock_for_load` otherwise, once torch is there). `lock`
    and `unlock` are cudaHostRegister/Unregister by default. One range: a copy from pinned
    memory that spans two registrations is refused (CUDA error 1, on the H200 machine, for a
    pool locked in 1 GiB pieces). `wait` says whether it is locked; `release` unlocks it."""

    def __init__(self, start: int, nbytes: int, flags: int, after, lock=None, unlock=None):
        self.start, self.nbytes, self.locked = start, nbytes, False
        self.seconds: float | None = None  # the locking's own, once locked
        self.error: int | None = None  # CUDA's error code where it was refused
        self._unlock = unlock or (lambda start: unlock_pages(start))  # (found when called)
        lock = lock or (lambda *args: lock_pages(*args))

        def run() -> None:
            with contextlib.suppress(Exception):  # (a failed read: its waiter raises it)
                after()
                began = time.perf_counter()
                err = lock(start, nbytes, flags)
                if err != 0:
                    self.error = err
                    return
                self.locked, self.seconds = True, time.perf_counter() - began

        self._thread = threading.Thread(target=run, name="ft-page-lock", daemon=True)
        self._thread.start()

    def wait(self) -> bool:
        self._thread.join()
        return self.locked

    def release(self) -> None:
        if self.wait():
            self._unlock(self.start)
            self.locked = False


def locked_memory_limit() -> int | None:
    """RLIMIT_MEMLOCK (what `ulimit -l` shows) in bytes, or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def pinning_advice(nbytes: int) -> str:
    """What may keep `nbytes` of host memory from being page-locked, and how to change it."""
    hints = []
    locked = locked_memory_limit()
    if locked is not None and locked < nbytes:
        hints.append(
            f"the locked-memory limit is {gib(locked)} (`ulimit -l`): raise it, e.g. "
            "`ulimit -l unlimited`, `LimitMEMLOCK=infinity` in a systemd unit, or "
            "`--ulimit memlock=-1` for docker"
        )
    room = cgroup_room()
    if room is not None and room < nbytes:
        hints.append(
            f"this container's memory limit leaves {gib(room)} free of "
            f"{gib(cgroup_limit() or 0)}: raise it (docker `--memory`, Kubernetes "
            "resources.limits.memory)"
        )
    if not hints:
        hints.append("free host memory, or use a smaller model or dtype")
    return "; ".join(hints)


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
