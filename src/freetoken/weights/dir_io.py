"""A model's tensors to and from freetoken's weight directory (weight_dir.py): the index's
names and `meta` for a model's parameters and its host expert pool, and one load's reads; the
loader (models/loading.py) builds the model and says where each tensor goes.

    write_model    the parameters (`param:NAME`, dense.bin) and the pool's banks
                   (`experts:NAME`, experts.bin), with how they are stored in `meta`
    stored_formats what `meta` says: the experts' format (and the down projection's)
    DirLoad        one load's reads, each file's tensors the fastest way there is:
      place_banks    views of the memory the start's early read read them into
                     (early_read.py), or, for a CPU start of a directory the page cache holds
                     whole, mappings of the file's pages; else the pool is read into
      read           the banks read on a thread while the model is given its memory
                     (`materialize`), then the dense parameters (views of the early read's
                     memory, or read into)
      checking_dense the dense tensors checked against their checksums on a thread while the
                     loader copies them to the device (page-locked where the early read
                     read them: `dense_locked`)
      check_banks    the banks checked at once, or on a background thread (IntegrityCheck)
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from freetoken.weights import weight_dir as wd
from freetoken.weights.early_read import EarlyRead
from freetoken.weights.expert_format import ExpertFormat, expert_format
from freetoken.weights.quantized import FP8_BLOCK

log = logging.getLogger(__name__)

Pairs = list[tuple[wd.Entry, torch.Tensor]]
PARAM, BANK = "param:", "experts:"  # (the index's name prefixes)


def write_model(
    dst: Path,
    params: Iterable[tuple[str, torch.Tensor]],
    banks: dict[str, torch.Tensor] | None,
    meta: dict,
    copy: list[Path],
    progress: bool | None = None,
) -> None:
    """A model's parameters (`params`, in CPU memory) and its host pool's banks (`banks`, None
    for a model without routed experts) as a weight directory at `dst`, with the files `copy`
    beside them and `meta` in its index (`expert_meta` for a quantized pool)."""
    files = {wd.DENSE_FILE: [(PARAM + n, p.detach()) for n, p in params]}
    if banks is not None:
        files[wd.EXPERTS_FILE] = [(BANK + name, bank) for name, bank in banks.items()]
    total = sum(t.numel() * t.element_size() for ts in files.values() for _, t in ts)
    show = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=total, unit="B", unit_scale=True, desc="Writing", disable=not show) as bar:
        wd.write(dst, files, meta, copy, bar.update)


def expert_meta(fmt: ExpertFormat, down: ExpertFormat | None) -> dict:
    """What the index's `meta` says of a quantized pool (`stored_formats` reads it)."""
    meta = {"expert_format": fmt.name, "expert_blocks": [fmt.row_block, fmt.col_block]}
    if down is not None:
        meta["expert_format_down"] = down.name
    return meta


def stored_formats(weights: wd.WeightDir) -> tuple[ExpertFormat, ExpertFormat | None]:
    """The pool's format in `weights`, and its down projection's where that differs."""
    blocks = weights.meta.get("expert_blocks") or FP8_BLOCK
    fmt = expert_format(weights.meta.get("expert_format", "dense"), tuple(blocks))
    down = weights.meta.get("expert_format_down")
    return fmt, None if down is None else expert_format(down)


class DirLoad:
    """One load of `weights` into a model's tensors (the module's docstring): its reads, their
    progress bar, and the start's early read they take over (None where it began none)."""

    def __init__(self, weights: wd.WeightDir, early: EarlyRead | None, progress: bool | None):
        self.weights, self.early = weights, early
        self.show = sys.stderr.isatty() if progress is None else progress
        self.early_banks = self.early_dense = False  # (whether the early read holds them)
        self.banks_mapped = False  # (the banks are a file's pages, mapped: nothing to read)

    def pairs(self, prefix: str, targets: Iterable[tuple[str, torch.Tensor]]) -> Pairs:
        """(entry, tensor) for each (name, tensor) of `targets` (PARAM or BANK names)."""
        return self.weights.pairs({prefix + name: tensor for name, tensor in targets})

    def place_banks(self, banks: Pairs, cuda: bool) -> Pairs | None:
        """The banks as tensors that hold their bytes already, before any read, where they can
        be: the early read's memory, or (a CPU start, the page cache holding experts.bin whole)
        private mappings of the file's pages; None where the pool is to be read into."""
        early = self.early
        if early is not None and early.holds(banks, wd.EXPERTS_FILE):
            self.early_banks = True
            self.banks_mapped = wd.EXPERTS_FILE in early.mapped
            return early.adopt(self.weights, banks)
        if banks and not cuda and self.weights.resident([e for e, _ in banks]):
            self.banks_mapped = True
            return [self._map(entry, bank) for entry, bank in banks]
        return None

    def _map(self, entry: wd.Entry, bank: torch.Tensor) -> tuple[wd.Entry, torch.Tensor]:
        """A warm CPU start's bank: a mapping of the directory's file pages, nothing to read or
        fault in. Private mappings: not for a pool to be page-locked for the GPU's fills
        (locking these pages did not end in 100 s for 18 GiB on the H200 machine); a GPU start
        maps the file shared and read-only instead, as its early read (early_read.py)."""
        self.weights.check(entry, bank)
        return entry, self.weights.map(entry)

    def read(self, banks: Pairs, materialize: Callable[[], Pairs]) -> Pairs:
        """Read `banks` on a thread while `materialize` gives the model its memory and returns
        its dense (entry, parameter) pairs (`pairs(PARAM, ...)`), then read those; the dense
        pairs, each parameter's data now what was read."""
        bar = tqdm(
            total=self.weights.nbytes,
            unit="B",
            unit_scale=True,
            desc="Loading weights",
            disable=not self.show,
        )
        lock = threading.Lock()

        def advance(n: int) -> None:
            with lock:
                bar.update(n)

        # The banks' reads run while the model is given its memory (whose first CPU op costs
        # 0.6-0.9 s on the H200 machine: the disk would sit idle), then the dense tensors'.
        with torch.no_grad(), bar, ThreadPoolExecutor(1, thread_name_prefix="ft-banks") as pool:
            banks_read = pool.submit(self._read_banks, banks, advance)
            dense = materialize()
            log.debug("model's memory given")
            self._read_dense(dense, advance)
            log.debug("dense tensors read")
            banks_read.result()
        return dense

    def _read_banks(self, banks: Pairs, advance: Callable[[int], None]) -> None:
        if self.banks_mapped and not self.early_banks:
            advance(sum(entry.nbytes for entry, _ in banks))
            return
        if not self.early_banks:
            self.weights.read(banks, progress=advance)
            return
        early, file = self.early, wd.EXPERTS_FILE
        early.wait(file)
        advance(sum(entry.nbytes for entry, _ in banks))
        if file in early.mapped:
            log.info("expert banks mapped from the page cache: %.1f GB", early.sizes[file] / 1e9)
        else:
            log.info(
                "expert banks read from the start: %.1f GB in %.2f s",
                early.sizes[file] / 1e9,
                early.seconds[file],
            )

    def _read_dense(self, dense: Pairs, advance: Callable[[int], None]) -> None:
        early = self.early
        self.early_dense = early is not None and early.holds(dense, wd.DENSE_FILE)
        if not self.early_dense:
            self.weights.read(dense, progress=advance)
            return
        # the parameters become views of what was read
        for (_, param), (_, view) in zip(dense, early.adopt(self.weights, dense), strict=True):
            param.data = view
        early.wait(wd.DENSE_FILE)
        advance(early.sizes[wd.DENSE_FILE])

    @contextlib.contextmanager
    def checking_dense(self, dense: Pairs):
        """The dense tensors (smaller) checked at once, on a thread (zlib.crc32 releases the
        GIL), while the block copies them to the GPU: nothing computes with them before both
        are done. (The check reads the host tensors as they are now: the copy points the
        parameters elsewhere.)"""
        host_dense = [(entry, tensor.detach()) for entry, tensor in dense]
        with ThreadPoolExecutor(1, thread_name_prefix="ft-verify-dense") as pool:
            checked = pool.submit(self.weights.verify, host_dense, threads=wd.io_threads())
            yield
            checked.result()
        log.debug("dense tensors verified")

    def dense_locked(self):
        """A block in which the dense tensors' memory, the early read's (`early_dense`), is
        page-locked: copies from it to the GPU run at the link's speed."""
        assert self.early_dense
        return self.early.page_locked(wd.DENSE_FILE)

    def check_banks(self, banks: Pairs, now: bool) -> wd.IntegrityCheck | None:
        """Check the banks against their checksums: `now`, or on a background thread (the
        check returned) while the engine starts serving."""
        if now:
            self.weights.verify(banks, threads=wd.io_threads())
        elif banks:
            return wd.IntegrityCheck(self.weights, banks)
        return None
