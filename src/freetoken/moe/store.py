"""The host expert pool: every routed expert of every MoE layer, in host memory.

Two banks, one row per expert: `w_gate_up [P, 2I, H]` (gate rows then up rows) and
`w_down [P, H, I]`, where P = MoE layers x experts and a row's flat id is
`moe_layer * E + expert`. One expert is one row of each bank, so filling a cache slot is a
contiguous copy per bank and the CPU executor reads an expert with no gather.

Experts kept quantized (weights/expert_format.py) hold each projection as its format's parts,
each a bank of its own in the same row order: `w_gate_up` / `w_down` then hold the packed codes,
`s_gate_up` / `s_down` the block scales and, for NVFP4, `g_gate_up` / `g_down` the per-row
scales. Whoever moves experts moves every bank; whoever computes with them takes the projections
as `ExpertWeights` (a dense tensor or a `QuantizedBank` each).

Models whose experts have biases (gpt-oss, MoEConfig.expert_bias) add `b_gate_up [P, 2I]`, the
gate/up projection's bias in the same row order: it sits inside the activation, so whoever runs
an expert needs it (the CPU kernels read it by flat id; the GPU runtime keeps the whole bank on
the device, a few MB, and gathers each route's row). The down projection's bias is linear in
the gate weights, so the MoE block adds it once after the routed sum (layers/moe.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from freetoken.model_config import ModelConfig
from freetoken.weights.expert_format import (
    DENSE,
    ExpertFormat,
    ExpertWeights,
    expert_weights,
    fill_random_,
)
from freetoken.weights.memory import (
    MAPPED,
    PORTABLE,
    PageLock,
    anonymous_region,
    lock_pages,
    pinning_advice,
    unlock_pages,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertShape:
    hidden: int
    intermediate: int
    dtype: torch.dtype  # the model's (what quantized experts compute in)
    bias: bool = False  # a gate/up bias row too (gpt-oss)
    format: ExpertFormat = DENSE
    # the down projection's where it differs (a Q4_K_M file's k_mixed beside q4_k or q5_0;
    # never beside mxfp4 or nvfp4: weights/expert_format.py's SPLIT_FORMATS)
    down_format: ExpertFormat | None = None

    @classmethod
    def of(
        cls,
        cfg: ModelConfig,
        dtype: torch.dtype,
        fmt: ExpertFormat = DENSE,
        down: ExpertFormat | None = None,
    ) -> ExpertShape:
        """The routed experts of a model `cfg` computing in `dtype`, stored in `fmt` (the down
        projection in `down` where given)."""
        moe = cfg.moe
        return cls(
            cfg.hidden_size,
            moe.intermediate_size,
            dtype,
            moe.expert_bias,
            fmt,
            None if down == fmt else down,
        )

    @property
    def formats(self) -> dict[str, ExpertFormat]:
        """Each projection's format."""
        return {"gate_up": self.format, "down": self.down_format or self.format}

    @property
    def projections(self) -> dict[str, tuple[int, int]]:
        """Each projection's [rows, cols]: gate and up stacked, then down."""
        h, i = self.hidden, self.intermediate
        return {"gate_up": (2 * i, h), "down": (h, i)}

    def bank_rows(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every bank's row (one expert's share of it): shape and dtype, in BANK_NAMES order."""
        rows = {}
        for proj, (n, k) in self.projections.items():
            for part, spec in self.formats[proj].parts(n, k, self.dtype).items():
                rows[f"{part}_{proj}"] = spec
        if self.bias:
            rows["b_gate_up"] = ((2 * self.intermediate,), self.dtype)
        return {name: rows[name] for name in BANK_NAMES if name in rows}

    @functools.cached_property  # (read on every host-decided layer step)
    def nbytes(self) -> int:
        """Bytes of one expert (gate, up and down projections, their scales when quantized, and
        its bias row if any): what a cache slot holds and a fill moves."""
        total = 0
        for shape, dtype in self.bank_rows().values():
            total += math.prod(shape) * dtype.itemsize
        return total


PAGE = 4096
# The host pool's banks, in the order a cache slot holds them (each only where the format or the
# experts have it: scales for quantized experts, per-row scales for NVFP4, biases for gpt-oss).
BANK_NAMES = ("w_gate_up", "w_down", "b_gate_up", "s_gate_up", "s_down", "g_gate_up", "g_down")


HUGE_PAGE = 2 * 2**20


def page_aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on a page boundary: from 2 MiB up, memory
    of its own advised to take huge pages (weights/memory.py's `anonymous_region`: a bank is
    filled once, then page-locked)."""
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if nbytes >= HUGE_PAGE:
        region = anonymous_region(nbytes)  # (the tensor holds it)
        return torch.frombuffer(region, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)


class BanksByName:
    """`x.w_gate_up`, `x.s_down`, ...: each bank of `x.named_banks` by its name, None where `x`
    has none (the host pool's, a cache's)."""

    def __getattr__(self, name: str):
        if name in BANK_NAMES:
            try:  # (not through __getattr__ again: a half-built object has no banks yet)
                return object.__getattribute__(self, "named_banks").get(name)
            except AttributeError:
                return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class HostExpertStore(BanksByName):
    def __init__(self, shape: ExpertShape, num_layers: int, num_experts: int):
        """A pool of `num_layers` x `num_experts` experts of `shape` (`for_model`: a model's)."""
        self.num_layers, self.num_experts, self.shape = num_layers, num_experts, shape
        # Allocated unpinned: pinning first would cost a full zeroing pass of pinned pages.
        # Page-aligned: a weight directory reads them with direct I/O (weights/weight_dir.py).
        self.named_banks: dict[str, Tensor] = {
            name: page_aligned_empty((self.num_pairs, *row), row_dtype)
            for name, (row, row_dtype) in self.shape.bank_rows().items()
        }
        self.pinned = False
        self._locked: list[int] = []  # the page-locked ranges' starts, to unlock
        self._page_lock: PageLock | None = None  # one lock of every bank (`adopt_page_lock`)
        # The banks are a weight directory's file pages (mapped: models/loading.py): a CPU
        # start's private mapping, or a warm GPU start's shared read-only one, whose lock is
        # adopted; where the pool is locked bank by bank, copied into memory of its own first
        # (locking a private mapping's pages for writing did not end in minutes).
        self.mapped = False

    @classmethod
    def for_model(
        cls,
        cfg: ModelConfig,
        dtype: torch.dtype,
        fmt: ExpertFormat = DENSE,
        down: ExpertFormat | None = None,
    ) -> HostExpertStore:
        """The pool of a model's routed experts: `dtype` the model's, `fmt` how they are stored
        (`down`: the down projection's format where it differs)
        (dense: in `dtype`)."""
        assert cfg.moe is not None
        return cls(ExpertShape.of(cfg, dtype, fmt, down), cfg.num_moe_layers, cfg.moe.num_experts)

    @property
    def format(self) -> ExpertFormat:
        """The gate/up projections' format (the down projection's too where it does not
        differ: `formats`)."""
        return self.shape.format

    @property
    def formats(self) -> dict[str, ExpertFormat]:
        return self.shape.formats

    @property
    def banks(self) -> tuple[Tensor, ...]:
        """Every host bank, in the order a cache slot holds them (`named_banks`' order)."""
        return tuple(self.named_banks.values())

    @property
    def weights(self) -> ExpertWeights:
        """The pool's projections, for the CPU kernels (by flat id)."""
        return expert_weights(self.named_banks, *self.formats.values())

    def fill_random_(self, seed: int = 0, distinct: int = 64) -> None:
        """Random experts of the pool's format (benchmarks): `distinct` of them repeated, since
        drawing tens of GB of random values takes minutes and speed depends on bytes moved."""
        gen = torch.Generator().manual_seed(seed)
        for name, bank in self.named_banks.items():
            part, _, proj = name.partition("_")
            block = fill_random_(self.formats[proj], part, bank[:distinct], gen)
            for rows in bank[distinct:].split(distinct):
                rows.copy_(block[: rows.shape[0]])

    @property
    def num_pairs(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def nbytes(self) -> int:
        return self.num_pairs * self.shape.nbytes

    def layer_rows(self, moe_layer: int) -> slice:
        return slice(moe_layer * self.num_experts, (moe_layer + 1) * self.num_experts)

    def pin(self) -> bool:
        """Page-lock the filled banks in place (cudaHostRegister), so copies to the GPU run at
        full PCIe speed and asynchronously. Returns False, with a warning, if that fails."""
        if self.pinned:
            return True
        if self._page_lock is not None:
            if self._page_lock.wait():
                self.pinned = True
                log.debug(
                    "expert pool page-locked as it loaded: %.1f GB in %.2f s",
                    self.nbytes / 1e9,
                    self._page_lock.seconds,
                )
                return True
            log.debug(
                "the pool's lock as one range failed (CUDA error %s): bank by bank",
                self._page_lock.error,
            )
            self._page_lock = None  # (refused as one range: bank by bank, warning if refused)
        if not torch.cuda.is_available():
            return False
        if self.mapped:  # (see __init__)
            self._unmap()
        for bank in self.banks:
            start, size = bank.data_ptr(), bank.numel() * bank.element_size()
            # Portable and mapped: the device may also read the pool in place, by its host
            # address (unified addressing), as the device-launched fills do.
            err = lock_pages(start, size, PORTABLE | MAPPED)
            if err != 0:
                for p in self._locked:
                    unlock_pages(p)
                self._locked = []
                log.warning(
                    "could not page-lock the %.1f GiB expert pool (CUDA error %s); copies to the "
                    "GPU would be slow, so experts that miss the cache run on the CPU instead. "
                    "To pin it: %s",
                    self.nbytes / 2**30,
                    err,
                    pinning_advice(self.nbytes),
                )
                return False
            self._locked.append(start)
        self.pinned = True
        log.debug("expert pool page-locked: %.1f GB", self.nbytes / 1e9)
        return True

    def adopt_page_lock(self, lock: PageLock) -> None:
        """Take `lock` (begun as the banks were read: one range that holds them all, locked
        PORTABLE | MAPPED) as the pool's: `pin` waits for it rather than locking bank by bank,
        `unpin` releases it."""
        self._page_lock = lock

    def _unmap(self) -> None:
        """The banks copied out of their file mapping into memory of the pool's own."""
        log.info("copying the mapped expert pool into memory of its own, to page-lock it")
        for name, bank in self.named_banks.items():
            own = page_aligned_empty(tuple(bank.shape), bank.dtype)
            own.copy_(bank)
            self.named_banks[name] = own
        self.mapped = False

    def __del__(self) -> None:
        # Registered pages must be unregistered before the memory is freed: otherwise a later
        # allocation reusing the range is refused by CUDA ("invalid argument") when copied.
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
            self.unpin()

    def unpin(self) -> None:
        if self._page_lock is not None:
            self._page_lock.release()
            self._page_lock = None
        if self.pinned:
            for start in self._locked:
                unlock_pages(start)
            self._locked = []
            self.pinned = False
