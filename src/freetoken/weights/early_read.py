"""A weight directory's expert banks read from a start's first moments, while Python imports
torch (issue 18: a warm start's reads, 3-4 s for 21 GB, had waited for ~2 s of imports).

`ft serve` / `ft generate` call `start(model)` before they import the engine: where the model is
a weight directory and a GPU is there (a CUDA start reads its pool; a CPU start of a directory
the page cache holds maps it instead), `experts.bin` is read whole on a pool of threads
(os.preadv releases the GIL; direct I/O for a file the page cache lacks, weight_dir.py's rule)
into one anonymous mapping laid out as the file, so each bank is a view at its index offset. The
mapping is advised MADV_HUGEPAGE: the reads fault in fresh memory, and 2 MiB pages take a fault
and a zeroing per 2 MiB where 4 KiB pages took one per 4 KiB. The loader `claim`s the read
(models/loading.py), builds the store's banks over it and waits for it where it would have read
them. Nothing here imports torch.

Not started (the loader reads as before) where the index cannot be read, where host memory
(cgroup limits included) lacks room for the banks beside a margin, or on `--device cpu`.
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

EXPERTS_FILE = "experts.bin"  # (models/loading.py writes the banks there)
MARGIN = 2 * 2**30  # host memory left beside the banks for the rest of the model and Python
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
    """A file of a weight directory read into `region` (same offsets) on a thread pool."""

    def __init__(self, weights: wd.WeightDir, file: str, threads: int | None = None):
        self.path, self.file = weights.path, file
        self.nbytes = (weights.path / file).stat().st_size
        self.region = memory.anonymous_region(self.nbytes)
        self.started = time.perf_counter()
        self.seconds: float | None = None  # once done
        self.error: BaseException | None = None
        self.done_bytes = 0  # read so far (that memory is no longer free: the load's check)
        self._count = threading.Lock()
        self._done = threading.Event()
        self._threads = threads or reader_threads()
        threading.Thread(target=self._run, name="ft-early-read", daemon=True).start()

    def _run(self) -> None:
        files = wd.FileReads(self.path)
        view = memoryview(self.region)

        def read(span: tuple[int, int]) -> None:
            a, b = span
            files.read_into(self.file, a, view[a:b], self.file)
            with self._count:
                self.done_bytes += b - a

        try:
            with ThreadPoolExecutor(self._threads, thread_name_prefix="ft-early-read") as pool:
                list(pool.map(read, wd.chunk_spans(self.nbytes)))
        except BaseException as e:  # (the loader raises it where it waits)
            self.error = e
        finally:
            view.release()
            files.close()
            self.seconds = time.perf_counter() - self.started
            self._done.set()

    def wait(self) -> None:
        """Until every byte is read; raises what a read raised (a file cut short, say)."""
        self._done.wait()
        if self.error is not None:
            raise self.error


def start(model: str | Path | None, device: str | None = None) -> EarlyRead | None:
    """Begin reading `model`'s expert banks if it is a weight directory a GPU start will read
    (see the module's docstring); the loader then `claim`s it."""
    wanted = os.environ.get(ENV)
    if wanted == "0" or model is None:
        return None
    if wanted != "1" and (device == "cpu" or not os.path.exists(NVIDIA_NODE)):
        return None
    path = Path(model)
    if not wd.is_weight_dir(path) or not (path / EXPERTS_FILE).is_file():
        return None
    try:
        weights = wd.WeightDir(path)  # (sizes checked: a cut file is the loader's to refuse)
        nbytes = (path / EXPERTS_FILE).stat().st_size
        if nbytes + MARGIN > memory.available_host_bytes():
            return None
        read = EarlyRead(weights, EXPERTS_FILE)
    except (OSError, FreetokenError) as e:
        log.debug("no early read of %s: %s", path, e)
        return None
    with _lock:
        _pending[path.resolve()] = read
    return read


def claim(path: str | Path) -> EarlyRead | None:
    """The early read of `path`'s banks, once (None where none was started)."""
    with _lock:
        return _pending.pop(Path(path).resolve(), None)
