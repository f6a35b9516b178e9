"""A weight directory's files read from a start's first moments, while Python imports torch
(issue 18: a warm start's reads, 3-4 s for 21 GB, had waited for ~2 s of imports).

`ft serve` / `ft generate` call `start(model)` before they import the engine: where the model
is a weight directory and a GPU is there (a CUDA start reads its pool; a CPU start of a
directory the page cache holds maps it instead), each of its files (`dense.bin`, then
`experts.bin`) is read whole by reader threads (os.preadv releases the GIL; direct I/O for a
file the page cache lacks, weight_dir.py's rule) into one anonymous mapping laid out as the
file, so each tensor is a view at its index offset. Few readers while the imports run (they
slow them), the rest of the I/O threads once the loader claims the read. Where the page cache
holds `experts.bin` whole (a warm start), it is not read but mapped, shared and read-only
(`memory.file_region`): the pool is the page cache's own pages, nothing is copied, faulted in
or zeroed beside the imports (which such copies slowed from 1.6 to 3.5 s on one H200 machine),
and CUDA page-locks them read-only (`memory.READ_ONLY`: 8 GiB in 0.28 s there, as long as
memory of the pool's own; `benchmarks/mapped_pool_probe.py`); settings.EARLY_MAP (=0) reads
it instead. The regions read into are advised MADV_HUGEPAGE: the reads fault in fresh memory, and
2 MiB pages take a fault and a zeroing per 2 MiB where 4 KiB pages took one per 4 KiB. The
loader `claim`s the read (models/loading.py, through dir_io.DirLoad): the pool's banks and the
dense parameters become views of its memory (`adopt`), the loader waits for each file where it
would have read it, takes over the pool's page lock (`pool_lock_for_load`) and copies the dense
parameters to the GPU from their region page-locked (`page_locked`). Nothing here imports torch
until a view is asked for.

The file reads top to bottom as a start goes: `start` (before the imports), `EarlyRead` (its
readers, `lock_pool`, `wait`), then the loader's half: `claim` and what the load asks of it.

Not started (the loader reads as before) where the index cannot be read, where host memory
(cgroup limits included) lacks room for the files beside a margin, or on `--device cpu`.
settings.EARLY_READ: 0 turns it off; 1 starts it without a GPU too (CPU starts, benchmarks).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from pathlib import Path

from freetoken import native_preload, settings
from freetoken.errors import FreetokenError
from freetoken.weights import memory
from freetoken.weights import weight_dir as wd

log = logging.getLogger(__name__)

# The files, in the order they are read: the dense parameters first (fewer bytes, needed first:
# they are checked and copied to the GPU while the banks are still read), then the expert pool.
FILES = (wd.DENSE_FILE, wd.EXPERTS_FILE)
MARGIN = 2 * 2**30  # host memory left beside the files for the rest of the model and Python
MAPPABLE = (wd.EXPERTS_FILE,)  # (read-only: the dense parameters are copied to the GPU, cast)
# Readers beside the imports. Each slows them (memory copies and page faults on other cores):
# on the H200 machine, imports of 1.8-2.1 s alone took 2.1-2.6 s beside one reader, 2.5-2.9 s
# beside two, 3.0-3.3 s beside four and 3.3-3.7 s beside eight (`early_read_imports.py`), and a
# warm 16-layer start reached its first token in 6.0, 5.7, 5.0 and 6.6 s (6.8 s without an
# early read): four it is.
IMPORT_READERS = 4

_pending: dict[Path, EarlyRead] = {}
_lock = threading.Lock()


def reader_threads() -> int:
    """Readers while Python imports torch: few, so that the imports (seconds of work on one
    core) are not slowed by the copies (see IMPORT_READERS); the loader adds the rest of the I/O
    threads when it claims the read (`add_readers`)."""
    wanted = settings.early_readers()  # (benchmarks)
    if wanted is not None:
        return max(1, wanted)
    return max(1, min(IMPORT_READERS, wd.io_threads(), (os.cpu_count() or 1) - 2))


def start(model: str | Path | None, device: str | None = None) -> EarlyRead | None:
    """Begin reading `model`'s files if it is a weight directory a GPU start will read (see the
    module's docstring); the loader then `claim`s it."""
    wanted = settings.early_read()
    if wanted is False or model is None:
        return None
    if wanted is None and (device == "cpu" or not native_preload.gpu_driver_present()):
        return None
    path = Path(model)
    if not wd.is_weight_dir(path):
        return None
    try:
        weights = wd.WeightDir(path)  # (sizes checked: a cut file is the loader's to refuse)
        files = tuple(f for f in FILES if (path / f).is_file())
        if not files:
            return None
        mapped = tuple(f for f in files if f in MAPPABLE and _maps(path / f))
        nbytes = sum((path / f).stat().st_size for f in files if f not in mapped)
        if nbytes + MARGIN > memory.available_host_bytes():
            return None
        read = EarlyRead(weights, files, mapped=mapped)
    except (OSError, FreetokenError) as e:
        log.debug("no early read of %s: %s", path, e)
        return None
    with _lock:
        _pending[path.resolve()] = read
    return read


def _maps(file: Path) -> bool:
    """Whether `file` is mapped rather than read: the page cache holds all of it (a mapping
    of a file it lacks would read it at the page cache's pace, where direct reads run at the
    disk's), unless settings.EARLY_MAP is 0."""
    return settings.early_map() and wd.resident_fraction(file) >= 1.0


class EarlyRead:
    """Files of a weight directory, each read into a region of its own (same offsets), one file
    after another, 64 MiB chunks taken in order by reader threads (more can join); those in
    `mapped` are mapped read-only from the page cache instead (their region is the file's)."""

    def __init__(
        self,
        weights: wd.WeightDir,
        files: tuple[str, ...],
        threads: int | None = None,
        mapped: tuple[str, ...] = (),
    ):
        self.path = weights.path
        self.sizes = {file: (weights.path / file).stat().st_size for file in files}
        self.mapped = frozenset(mapped)
        self.regions = {
            file: memory.file_region(self.path / file, n)
            if file in self.mapped
            else memory.anonymous_region(n)
            for file, n in self.sizes.items()
        }
        self.started = time.perf_counter()
        self.seconds = {file: 0.0 for file in self.mapped}  # each file's, from the start
        self.error: BaseException | None = None
        # read so far, or mapped (memory no longer free, or none needed: the load's check)
        self.done_bytes = sum(self.sizes[file] for file in self.mapped)
        self._lock = threading.Lock()
        self._done = {file: threading.Event() for file in files}
        for file in self.mapped:
            self._done[file].set()
        read = {file: n for file, n in self.sizes.items() if file not in self.mapped}
        self._left = {file: len(wd.chunk_spans(n)) for file, n in read.items()}
        self._chunks = iter([(f, a, b) for f, n in read.items() for a, b in wd.chunk_spans(n)])
        self._views = {file: memoryview(self.regions[file]) for file in read}
        self._reads = wd.FileReads(self.path)
        self.readers = 0
        self._running = 0
        self.pool_lock: memory.PageLock | None = None  # (`lock_pool`)
        self.add_readers(threads or reader_threads())

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(self.sizes)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())

    def add_readers(self, n: int) -> None:
        """`n` more reader threads (none once every chunk is taken)."""
        with self._lock:
            if self._chunks is None:
                return
            self.readers += n
            self._running += n
        for _ in range(n):
            threading.Thread(target=self._read, name="ft-early-read", daemon=True).start()

    def _next(self) -> tuple[str, int, int] | None:
        with self._lock:
            chunk = next(self._chunks, None) if self._chunks is not None else None
            if chunk is None:
                self._chunks = None
            return chunk

    def _read(self) -> None:
        try:
            while (chunk := self._next()) is not None:
                file, a, b = chunk
                self._reads.read_into(file, a, self._views[file][a:b], file)
                with self._lock:
                    self.done_bytes += b - a
                    self._left[file] -= 1
                    if self._left[file] == 0:
                        self.seconds[file] = time.perf_counter() - self.started
                        self._done[file].set()
        except BaseException as e:  # (the loader raises it where it waits)
            with self._lock:
                self.error, self._chunks = e, None
            for done in self._done.values():  # (a failure ends every wait)
                done.set()
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0 and self._chunks is None
            if last:  # (every chunk taken and read, or a failure)
                self._reads.close()
                for view in self._views.values():
                    view.release()

    def lock_pool(self, preload: native_preload.Preload | None) -> None:
        """Page-lock the expert pool for CUDA's copies and fills as soon as it is read (a mapped
        one at once) and the native preload has made the context: through the driver, on a
        thread, while the imports run (19.3 GB took 0.4-0.6 s after them on the H200 machine,
        and the model's copy to the GPU waited for it; the loader adopts the lock). Where the
        preload made no context, torch's runtime locks it (the loader's call, `preload` None,
        once the imports are over)."""
        if wd.EXPERTS_FILE not in self.sizes:
            return
        region = self.regions[wd.EXPERTS_FILE]
        flags = memory.PORTABLE | memory.MAPPED
        if wd.EXPERTS_FILE in self.mapped:  # (as CUDA takes a read-only mapping)
            flags |= memory.READ_ONLY

        def by_driver() -> bool:  # (the same answer each time, once the preload has ended)
            return preload is not None and preload.has_context

        def after() -> None:  # (the pool there, and the preload's context made or not)
            self.wait(wd.EXPERTS_FILE)
            by_driver()

        def lock(start: int, nbytes: int, flags: int) -> int:
            if by_driver():
                return preload.lock_host(start, nbytes, flags)
            return memory.lock_pages(start, nbytes, flags)

        def unlock(start: int) -> None:
            (preload.unlock_host if by_driver() else memory.unlock_pages)(start)

        self.pool_lock = memory.PageLock(
            memory.address(region), len(region), flags, after, lock, unlock
        )

    def wait(self, file: str) -> None:
        """Until every byte of `file` is read; raises what a read raised (a file cut short)."""
        self._done[file].wait()
        if file not in self.seconds and self.error is not None:
            raise self.error

    # -- the loader's half (after `claim`) -------------------------------------------------

    def pool_lock_for_load(self, cuda: bool, dequantize: bool) -> memory.PageLock | None:
        """The expert pool's page lock for a load (the store adopts it), None where there is
        none: the pool is locked as soon as it is read, while the model is built (0.4 s for
        19 GB in 2 MiB pages on the H200 machine); begun beside the imports where the native
        preload ran (`lock_pool`), else now, through torch's runtime (a pool mapped from the
        page cache: its pages locked read-only, as CUDA takes them). None on the CPU, and
        where the experts are dequantized (copied: a lock the start began is released)."""
        if not cuda or wd.EXPERTS_FILE not in self.files:
            return None
        if self.pool_lock is None and not dequantize:
            self.lock_pool(None)
        if self.pool_lock is not None and dequantize:
            self.pool_lock.release()
            return None
        return self.pool_lock

    def holds(self, items: list, file: str) -> bool:
        """Whether the (entry, tensor) pairs `items` all lie in `file` and this read read it."""
        return bool(items) and file in self.files and all(e.file == file for e, _ in items)

    def adopt(self, weights: wd.WeightDir, items: list) -> list:
        """(entry, view) pairs: each tensor of `items` as a view of this read's memory (laid out
        as the file: each at its index offset), whose bytes arrive as the readers read them
        (`wait`). Imports torch."""
        import torch

        adopted = []
        for entry, tensor in items:
            weights.check(entry, tensor)
            with warnings.catch_warnings():  # (a read-only mapping: torch warns it is not writable)
                warnings.simplefilter("ignore", UserWarning)
                view = torch.frombuffer(
                    self.regions[entry.file],
                    dtype=torch.uint8,
                    count=entry.nbytes,
                    offset=entry.offset,
                )
            adopted.append((entry, view.view(tensor.dtype).view(tensor.shape)))
        return adopted

    def page_locked(self, file: str):
        """A block in which `file`'s region is page-locked (`memory.page_locked`)."""
        region = self.regions[file]
        return memory.page_locked(memory.address(region), len(region))


def claim(path: str | Path) -> EarlyRead | None:
    """The early read of `path`'s files, once (None where none was started), with the rest of
    the I/O threads added to its readers (the imports are over)."""
    with _lock:
        read = _pending.pop(Path(path).resolve(), None)
    if read is not None:
        read.add_readers(max(0, wd.io_threads() - read.readers))
    return read
