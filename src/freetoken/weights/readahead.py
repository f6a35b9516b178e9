"""Reading a weight directory from disk while Python imports torch.

A start spends its first seconds importing torch and the engine (2.7 s cold on the H200
machine, where the weights' reads then took 13 s): the disk sits idle meanwhile. `start`, called
by the command line before those imports, reads the directory's files into the page cache on a
few threads (positioned reads into a scratch buffer; they release the GIL), chunk by chunk in
file order. When the loader begins it calls `claim`: the threads finish the chunks they are
reading and stop, and the loader reads the chunks they covered through the page cache (at memory
speed) and the rest as it would have (direct reads, where the file system allows). Once the
weights are in their buffers, `release` drops the covered pages from the page cache, so the
host holds one copy of the weights, not two.

Nothing here imports torch: it runs before torch is imported.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

INDEX = "freetoken-weights.json"
CHUNK = 64 * 2**20  # bytes a thread reads in one go (weight_dir.py's checksum chunk)
READ = 8 * 2**20  # bytes per read call (the scratch buffer's size)
THREADS = 4

_active: Readahead | None = None
_lock = threading.Lock()


def resident_fraction(path: Path) -> float:
    """The share of a file's pages in the page cache (mincore on a mapping of it); 0 where
    that cannot be asked."""
    size = path.stat().st_size
    if size == 0:
        return 1.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]  # fmt: skip
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return 0.0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return 0.0
        try:
            pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            if libc.mincore(addr, size, pages) != 0:
                return 0.0
            return 1.0 - bytes(pages).count(0) / len(pages)  # (bit 0: resident; others 0)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


class Readahead:
    """Chunks of a directory's files read into the page cache on background threads."""

    def __init__(self, root: Path, files: list[str], threads: int = THREADS):
        self.root = root.resolve()
        self._todo = [(f, offset) for f in files
                      for offset in range(0, (root / f).stat().st_size, CHUNK)]  # fmt: skip
        self._next = 0
        self._done: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._run, name=f"ft-readahead-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def _take(self) -> tuple[str, int] | None:
        with self._lock:
            if self._stopping or self._next == len(self._todo):
                return None
            self._next += 1
            return self._todo[self._next - 1]

    def _run(self) -> None:
        scratch = bytearray(READ)
        fds: dict[str, int] = {}
        try:
            while (job := self._take()) is not None:
                file, offset = job
                if file not in fds:
                    fds[file] = os.open(self.root / file, os.O_RDONLY)
                end = offset + CHUNK
                while offset < end and (n := os.preadv(fds[file], [scratch], offset)) > 0:
                    offset += n
                with self._lock:
                    self._done.add(job)
        except OSError as e:  # (the loader reads for itself and reports what is wrong)
            log.debug("readahead of %s stopped: %s", self.root, e)
        finally:
            for fd in fds.values():
                os.close(fd)

    def stop(self) -> None:
        """Let the threads finish the chunks they are reading; start no more."""
        with self._lock:
            self._stopping = True
        for t in self._threads:
            t.join()

    def covered(self, file: str, offset: int, nbytes: int) -> bool:
        """Whether bytes [offset, offset + nbytes) of `file` were read into the page cache."""
        first, last = offset // CHUNK, (offset + max(nbytes, 1) - 1) // CHUNK
        with self._lock:
            return all((file, c * CHUNK) in self._done for c in range(first, last + 1))

    @property
    def nbytes(self) -> int:
        with self._lock:
            return len(self._done) * CHUNK

    def release(self) -> None:
        """Drop the covered chunks from the page cache (the loader holds their bytes now)."""
        with self._lock:
            done = sorted(self._done)
            self._done.clear()
        for file in {f for f, _ in done}:
            fd = os.open(self.root / file, os.O_RDONLY)
            try:
                for f, offset in done:
                    if f == file:
                        os.posix_fadvise(fd, offset, CHUNK, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def start(path: str | Path | None) -> None:
    """Start reading the weight directory at `path` into the page cache, unless it is not one,
    or the page cache holds it already, or a read-ahead runs."""
    global _active
    if path is None or not hasattr(os, "posix_fadvise"):
        return
    root = Path(path)
    try:
        import json

        files = list(json.loads((root / INDEX).read_text())["files"])
        if all(resident_fraction(root / f) >= 0.5 for f in files):
            return
    except (OSError, ValueError, KeyError, TypeError):
        return  # not a weight directory (or a damaged one: the loader says what is wrong)
    with _lock:
        if _active is None:
            _active = Readahead(root, files)


def claim(path: Path) -> Readahead | None:
    """The read-ahead of `path`, stopped, for the loader to take over; None if none ran."""
    global _active
    with _lock:
        mine = _active if _active is not None and _active.root == Path(path).resolve() else None
        if mine is not None:
            _active = None
    if mine is not None:
        mine.stop()
        log.info("%s: %.1f GB read ahead while Python started", path, mine.nbytes / 1e9)
    return mine
