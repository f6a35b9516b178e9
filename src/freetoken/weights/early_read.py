"""A weight directory's files read from a start's first moments, while Python imports torch
(issue 18: a warm start's reads, 3-4 s for 21 GB, had waited for ~2 s of imports).

`ft serve` / `ft generate` call `start(model)` before they import the engine: where the model is
a weight directory and a GPU is there (a CUDA start reads its pool; a CPU start of a directory
the page cache holds maps it instead), each of its files (`dense.bin`, then `experts.bin`) is
read whole on a pool of threads (os.preadv releases the GIL; direct I/O for a file the page
cache lacks, weight_dir.py's rule) into one anonymous mapping laid out as the file, so each
tensor is a view at its index offset. The mappings are advised MADV_HUGEPAGE: the reads fault in
fresh memory, and 2 MiB pages take a fault and a zeroing per 2 MiB where 4 KiB pages took one
per 4 KiB. The loader `claim`s the read (models/loading.py): the pool's banks and the dense
parameters become views of its memory, and the loader waits for each file where it would have
read it. Nothing here imports torch.

Not started (the loader reads as before) where the index cannot be read, where host memory
(cgroup limits included) lacks room for the files beside a margin, or on `--device cpu`.
FREETOKEN_EARLY_READ=0 turns it off; =1 starts it without a GPU too (CPU starts, benchmarks).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from freetoken.errors import FreetokenError
from freetoken.weights import memory
from freetoken.weights import weight_dir as wd

log = logging.getLogger(__name__)

# The files, in the order they are read: the dense parameters first (fewer bytes, needed first:
# they are checked and copied to the GPU while the banks are still read), then the expert pool.
FILES = (wd.DENSE_FILE, wd.EXPERTS_FILE)
MARGIN = 2 * 2**30  # host memory left beside the files for the rest of the model and Python
NVIDIA_NODE = "/dev/nvidiactl"  # (a GPU's driver is there: torch is not imported yet to ask)
ENV = "FREETOKEN_EARLY_READ"

_pending: dict[Path, EarlyRead] = {}
_lock = threading.Lock()


def reader_threads() -> int:
    """The loader's I/O threads, but two cores left to the imports they run beside (a warm
    read is memory copies: on the 2-core machine 8 readers stretched the imports from 1 s to
    10 s, and the start ended 2x later than without them)."""
    return max(1, min(wd.io_threads(), (os.cpu_count() or 1) - 2))


class EarlyRead:
    """Files of a weight directory, each read into a region of its own (same offsets), one file
    after another on a thread pool."""

    def __init__(self, weights: wd.WeightDir, files: tuple[str, ...], threads: int | None = None):
        self.path = weights.path
        self.sizes = {file: (weights.path / file).stat().st_size for file in files}
        self.regions = {file: memory.anonymous_region(n) for file, n in self.sizes.items()}
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}  # each file's, from the start, once read
        self.error: BaseException | None = None
        self.done_bytes = 0  # read so far (that memory is no longer free: the load's check)
        self._count = threading.Lock()
        self._done = {file: threading.Event() for file in files}
        self._threads = threads or reader_threads()
        threading.Thread(target=self._run, name="ft-early-read", daemon=True).start()

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(self.sizes)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())

    def _run(self) -> None:
        reads = wd.FileReads(self.path)
        try:
            with ThreadPoolExecutor(self._threads, thread_name_prefix="ft-early-read") as pool:
                for file, nbytes in self.sizes.items():
                    view = memoryview(self.regions[file])

                    def read(span: tuple[int, int], file=file, view=view) -> None:
                        a, b = span
                        reads.read_into(file, a, view[a:b], file)
                        with self._count:
                            self.done_bytes += b - a

                    try:
                        list(pool.map(read, wd.chunk_spans(nbytes)))
                    finally:
                        view.release()
                    self.seconds[file] = time.perf_counter() - self.started
                    self._done[file].set()
        except BaseException as e:  # (the loader raises it where it waits)
            self.error = e
        finally:
            reads.close()
            for done in self._done.values():  # (a failure ends every wait)
                done.set()

    def wait(self, file: str) -> None:
        """Until every byte of `file` is read; raises what a read raised (a file cut short)."""
        self._done[file].wait()
        if file not in self.seconds and self.error is not None:
            raise self.error


def start(model: str | Path | None, device: str | None = None) -> EarlyRead | None:
    """Begin reading `model`'s files if it is a weight directory a GPU start will read (see the
    module's docstring); the loader then `claim`s it."""
    wanted = os.environ.get(ENV)
    if wanted == "0" or model is None:
        return None
    if wanted != "1" and (device == "cpu" or not os.path.exists(NVIDIA_NODE)):
        return None
    path = Path(model)
    if not wd.is_weight_dir(path):
        return None
    try:
        weights = wd.WeightDir(path)  # (sizes checked: a cut file is the loader's to refuse)
        files = tuple(f for f in FILES if (path / f).is_file())
        if not files:
            return None
        nbytes = sum((path / f).stat().st_size for f in files)
        if nbytes + MARGIN > memory.available_host_bytes():
            return None
        read = EarlyRead(weights, files)
    except (OSError, FreetokenError) as e:
        log.debug("no early read of %s: %s", path, e)
        return None
    with _lock:
        _pending[path.resolve()] = read
    return read


def claim(path: str | Path) -> EarlyRead | None:
    """The early read of `path`'s files, once (None where none was started)."""
    with _lock:
        return _pending.pop(Path(path).resolve(), None)
