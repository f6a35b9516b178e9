"""freetoken's own weight directory: tensors laid out as the engine holds them in memory, read
with parallel positioned reads straight into their final buffers.

    DST/freetoken-weights.json   the index: format, version, dtype, and per tensor its file,
                                 offset, bytes, shape and a CRC-32 of every chunk (64 MiB)
    DST/experts.bin              the host expert pool's two banks, byte for byte
                                 (moe/store.py: flat (layer, expert) rows)
    DST/dense.bin                every other parameter of the model
    DST/config.json, tokenizer files, ...   copied from the source, so the directory stands
                                 on its own

Every tensor starts on a 4 KiB boundary, so reads into page-aligned buffers can bypass the page
cache (O_DIRECT) where the file system allows: a file the page cache does not hold already
(mincore, on a mapping of it) is read so, sparing host memory a second copy of the weights;
one it holds is read through it, at memory speed (direct reads of a cached file go to the
disk: on the H200 machine 2 GB/s against 8), or mapped (`map`: the expert banks of a directory
the page cache holds whole are its pages, not a copy). Reads are
split into 64 MiB chunks over a pool of threads (os.preadv releases the GIL), short reads
continued. Opening a directory checks every file's size against the index (a truncated file
is refused there); `verify` recomputes the CRCs of tensors in memory and names the first one
that differs, with its file. The index is written last, so an interrupted conversion leaves
no directory that claims to be complete.

This module knows tensors and bytes only; dir_io.py names a model's tensors in it and reads
them for the loader (models/loading.py). It imports no torch until a tensor is asked for, so a
start can read the expert banks (early_read.py) while Python is still importing torch.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import mmap
import os
import shutil
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from freetoken.errors import CheckpointError, FreetokenError
from freetoken.weights import memory

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

INDEX = "freetoken-weights.json"
DENSE_FILE, EXPERTS_FILE = "dense.bin", "experts.bin"  # (dir_io.py writes them)
FORMAT, VERSION = "freetoken-weights", 1
ALIGN = 4096
CHUNK = 64 * 2**20  # bytes per read and per checksum


def io_threads() -> int:
    """Threads of a directory's reads and of an at-once checksum pass."""
    return min(8, os.cpu_count() or 1)


class WeightIntegrityError(FreetokenError):
    """A tensor's bytes differ from what the weight directory's index recorded."""


@dataclass(frozen=True)
class Entry:
    name: str
    file: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    crcs: tuple[int, ...]  # CRC-32 of each CHUNK of the tensor's bytes


def is_weight_dir(path: str | Path) -> bool:
    return (Path(path) / INDEX).is_file()


# what a weight directory copies from its source: everything but the weights and their index
_SKIPPED = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json")


def copied_files(src: Path) -> list[Path]:
    """The files of checkpoint directory `src` a weight directory copies (config, tokenizer)."""
    return [f for f in sorted(src.iterdir()) if f.is_file() and not f.name.endswith(_SKIPPED)]


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, writable, without a copy."""
    import torch

    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def chunk_spans(nbytes: int, chunk: int | None = None) -> list[tuple[int, int]]:
    chunk = chunk or CHUNK
    return [(a, min(a + chunk, nbytes)) for a in range(0, nbytes, chunk)] or [(0, 0)]


def _crcs(data: memoryview, chunk: int) -> tuple[int, ...]:
    return tuple(zlib.crc32(data[a:b]) for a, b in chunk_spans(len(data), chunk))


def write(
    dst: Path,
    files: dict[str, list[tuple[str, torch.Tensor]]],
    meta: dict,
    copy: list[Path] = (),
    progress=None,
) -> None:
    """Write `files` (file name -> [(tensor name, contiguous CPU tensor)]) and copy `copy`
    into `dst`, then the index with `meta` in it. `progress(nbytes)` is called as bytes go."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in copy:
        shutil.copy2(path, dst / path.name)
    entries: dict[str, dict] = {}
    sizes: dict[str, int] = {}
    for file, tensors in files.items():
        # A new file, not the old one cut short: a server started from this directory maps its
        # files (a warm start's pool is their page cache pages), and reads of a mapping whose
        # file was truncated fault (SIGBUS); an unlinked file lives on while it is mapped.
        (dst / file).unlink(missing_ok=True)
        with open(dst / file, "wb") as out:
            offset = 0
            for name, tensor in tensors:
                if name in entries:
                    raise ValueError(f"tensor {name} given twice")
                pad = -offset % ALIGN
                out.write(b"\0" * pad)
                offset += pad
                data = raw_bytes(tensor.contiguous())
                for a, b in chunk_spans(len(data)):
                    out.write(data[a:b])
                    if progress is not None:
                        progress(b - a)
                entries[name] = dict(
                    file=file,
                    offset=offset,
                    nbytes=len(data),
                    shape=list(tensor.shape),
                    dtype=str(tensor.dtype).removeprefix("torch."),
                    crcs=list(_crcs(data, CHUNK)),
                )
                offset += len(data)
            out.flush()
            os.fsync(out.fileno())
        sizes[file] = offset
    index = dict(
        format=FORMAT,
        version=VERSION,
        meta=meta,
        checksum_chunk=CHUNK,
        files=sizes,
        tensors=entries,
    )
    tmp = dst / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, dst / INDEX)


class WeightDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            index = json.loads((self.path / INDEX).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {self.path / INDEX}: {e}") from e
        if index.get("format") != FORMAT or index.get("version") != VERSION:
            raise CheckpointError(
                f"{self.path / INDEX} is not a freetoken weight index of version {VERSION} "
                f"(format {index.get('format')!r}, version {index.get('version')!r}): convert "
                "the checkpoint again with `ft checkpoint convert`"
            )
        self.meta: dict = index.get("meta", {})
        self.checksum_chunk: int = index["checksum_chunk"]
        for file, size in index["files"].items():
            have = (self.path / file).stat().st_size if (self.path / file).is_file() else None
            if have != size:
                state = "missing" if have is None else f"{have} bytes, the index says {size}"
                raise CheckpointError(
                    f"{self.path / file} is {state}: the weight directory is damaged "
                    "(truncated or not this index's); convert the checkpoint again"
                )
        self.entries = {
            name: Entry(
                name,
                e["file"],
                e["offset"],
                e["nbytes"],
                tuple(e["shape"]),
                e["dtype"],
                tuple(e["crcs"]),
            )
            for name, e in index["tensors"].items()
        }

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def pairs(self, targets: dict[str, torch.Tensor]) -> list[tuple[Entry, torch.Tensor]]:
        """(entry, tensor) for each named tensor of `targets`; every name must be indexed."""
        missing = sorted(set(targets) - set(self.entries))
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise CheckpointError(
                f"weight directory {self.path} is missing tensors: {', '.join(missing[:8])}{more}"
            )
        return [(self.entries[name], tensor) for name, tensor in targets.items()]

    def check(self, entry: Entry, tensor: torch.Tensor) -> None:
        """That `tensor` can take `entry` as it is stored."""
        want = (entry.shape, entry.dtype)
        have = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        if entry.nbytes != tensor.numel() * tensor.element_size():
            raise CheckpointError(
                f"{self.path}: tensor {entry.name} is indexed as {entry.nbytes} bytes, but its "
                f"shape and dtype make {tensor.numel() * tensor.element_size()}"
            )
        if want != have:
            raise CheckpointError(
                f"{self.path}: tensor {entry.name} is stored as {want[1]} {list(want[0])}, "
                f"but the model needs {have[1]} {list(have[0])}"
            )

    def read(
        self, items: list[tuple[Entry, torch.Tensor]], threads: int | None = None, progress=None
    ) -> None:
        """Read each entry into its tensor (contiguous, CPU, checked), chunks in parallel."""
        threads = threads or io_threads()
        fds = FileReads(self.path)
        jobs = []
        for entry, tensor in items:
            self.check(entry, tensor)
            data = raw_bytes(tensor)
            for a, b in chunk_spans(entry.nbytes):
                jobs.append((entry, data, a, b))
        lock = threading.Lock()

        def run(job) -> None:
            entry, data, a, b = job
            fds.read_into(entry.file, entry.offset + a, data[a:b], entry.name)
            if progress is not None:
                with lock:
                    progress(b - a)

        try:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(run, jobs))
        finally:
            fds.close()

    def resident(self, entries: list[Entry]) -> bool:
        """Whether the page cache holds every page of the files that store `entries`."""
        return all(resident_fraction(self.path / f) >= 1.0 for f in {e.file for e in entries})

    def map(self, entry: Entry) -> torch.Tensor:
        """The entry's tensor over a private mapping of its bytes in the file: no copy and no
        fresh memory, where a read into a new buffer faults in and zeroes every page before
        copying (for a file the page cache holds, reading 3 GiB this way took 0.02 s here
        against 0.6 s). Copy-on-write: a write would change this process's copy only."""
        import torch

        with open(self.path / entry.file, "rb") as f:
            mapping = mmap.mmap(
                f.fileno(),
                entry.nbytes,
                flags=mmap.MAP_PRIVATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=entry.offset,
            )
        data = torch.frombuffer(mapping, dtype=torch.uint8)  # (holds the mapping)
        return data.view(getattr(torch, entry.dtype)).view(entry.shape)

    def verify(
        self,
        items: list[tuple[Entry, torch.Tensor]],
        threads: int = 1,
        stop: threading.Event | None = None,
    ) -> bool:
        """Recompute each tensor's CRCs; raise WeightIntegrityError naming the first that
        differs from the index, with its file. False if `stop` was set before the end (what was
        checked is not reported), else True."""
        spans = [chunk_spans(entry.nbytes, self.checksum_chunk) for entry, _ in items]
        chunks = [
            raw_bytes(tensor)[a:b]
            for (_, tensor), of in zip(items, spans, strict=True)
            for a, b in of
        ]

        def crc(chunk: memoryview) -> int | None:
            return None if stop is not None and stop.is_set() else zlib.crc32(chunk)

        # every tensor's chunks at once (many tensors are small); zlib.crc32 releases the GIL.
        # One thread (the background check) computes them itself: an executor refuses work once
        # the interpreter begins to exit, and a process that exits mid-check would print that.
        if threads == 1:
            crcs = [crc(chunk) for chunk in chunks]
        else:
            with ThreadPoolExecutor(threads) as pool:
                crcs = list(pool.map(crc, chunks))
        chunks.clear()
        if stop is not None and stop.is_set():
            return False
        crcs = iter(crcs)
        for (entry, _), of in zip(items, spans, strict=True):
            if tuple(next(crcs) for _ in of) != entry.crcs:
                raise WeightIntegrityError(
                    f"tensor {entry.name} in {self.path / entry.file} does not match its "
                    "checksum: the weight directory is corrupt (convert the checkpoint again)"
                )
        return True


class IntegrityCheck:
    """A weight directory's tensors (the expert banks) verified against their checksums on a
    background thread while the engine starts serving; `error` is set if they differ (the
    engine then refuses to compute: `LLMEngine.check_weights`), `done` once the check ended."""

    def __init__(self, weights: WeightDir, items: list):
        self.error: WeightIntegrityError | None = None
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(weights, items), name="ft-verify", daemon=True
        )
        # A process that exits mid-check stops it first: a daemon thread that frees tensors
        # while Python finalizes aborts the process (torch retakes the GIL in C++ frames).
        atexit.register(self.stop)
        self._thread.start()

    def _run(self, weights: WeightDir, items: list) -> None:
        try:
            if weights.verify(items, stop=self._stop):
                log.info("weights verified against their checksums")
        except WeightIntegrityError as e:
            self.error = e
            log.error("%s", e)
        finally:
            self.done.set()
            atexit.unregister(self.stop)

    def stop(self) -> None:
        """End the check early (its chunk in hand finishes) and wait for it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


class FileReads:
    """Open descriptors per file: a direct one (O_DIRECT, where the file system has it) for
    aligned reads into aligned memory, a buffered one for the rest."""

    def __init__(self, root: Path):
        self.root = root
        self._buffered: dict[str, int] = {}
        self._direct: dict[str, int | None] = {}
        self._lock = threading.Lock()

    def _fds(self, file: str) -> tuple[int, int | None]:
        with self._lock:
            if file not in self._buffered:
                path = self.root / file
                self._buffered[file] = os.open(path, os.O_RDONLY)
                direct = None
                if hasattr(os, "O_DIRECT") and resident_fraction(path) < 0.5:
                    try:
                        direct = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    except OSError:  # tmpfs and some others refuse it
                        direct = None
                self._direct[file] = direct
            return self._buffered[file], self._direct[file]

    def read_into(self, file: str, offset: int, buf: memoryview, name: str) -> None:
        buffered, direct = self._fds(file)
        address = memory.address(buf) if len(buf) else 0
        aligned = (address | offset | len(buf)) % ALIGN == 0
        done = 0
        while done < len(buf):
            fd = direct if aligned and direct is not None else buffered
            try:
                n = os.preadv(fd, [buf[done:]], offset + done)
            except OSError:
                if fd is buffered:
                    raise
                with self._lock:  # the file system refuses direct reads: buffered from now on
                    if self._direct.get(file) is not None:
                        os.close(self._direct[file])
                        self._direct[file] = None
                direct = None
                continue
            if n == 0:
                raise CheckpointError(
                    f"{self.root / file} ended at {offset + done} bytes, inside tensor {name}: "
                    "the weight directory is damaged (truncated); convert the checkpoint again"
                )
            done += n
            aligned = aligned and done % ALIGN == 0

    def close(self) -> None:
        for fd in [*self._buffered.values(), *self._direct.values()]:
            if fd is not None:
                os.close(fd)


_LOW_BIT = bytes(b & 1 for b in range(256))


CACHESTAT = 451  # Linux 6.5's cachestat(2): the same number on every architecture


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


def resident_fraction(path: Path) -> float:
    """The share of a file's pages in the page cache; 0 where that cannot be asked. cachestat
    counts them in the kernel (1 ms for 10.7 GB on the CPU machine); where the kernel lacks it,
    mincore on a mapping asks page by page (60 ms: a warm start asks before its imports)."""
    size = path.stat().st_size
    if size == 0:
        return 1.0
    pages = -(-size // mmap.PAGESIZE)
    cached = _cached_pages(path)
    if cached is not None:
        return min(1.0, cached / pages)
    return _resident_fraction_by_mincore(path, size)


def _cached_pages(path: Path) -> int | None:
    """The file's pages in the page cache by cachestat(2), or None where it is missing."""
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        stat = _Cachestat()
        whole = _CachestatRange(0, 0)  # (a length of 0: to the file's end)
        if syscall(CACHESTAT, fd, ctypes.byref(whole), ctypes.byref(stat), 0) != 0:
            return None  # (ENOSYS before Linux 6.5)
        return stat.nr_cache
    finally:
        os.close(fd)


def _resident_fraction_by_mincore(path: Path, size: int) -> float:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
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
            # (bit 0 of each page's byte: resident; the other bits are reserved)
            return bytes(pages).translate(_LOW_BIT).count(1) / len(pages)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
