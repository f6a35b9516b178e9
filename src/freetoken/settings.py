"""The environment: every variable freetoken reads, declared here once and read nowhere else.

Each is a `Variable` (its name, what leaving it unset means, what it does, when it is read);
the functions below read them, typed. docs/configuration.md's table lists them all, and
tests/test_configuration.py checks that it does and that no other module of the package names
one or reads `os.environ` (a child process's environment is made here too: `for_child`).

A variable is read when its function is called, each time (nothing is cached here), so a test's
`monkeypatch.setenv` reaches it; those of the early start (`EARLY_*`, `PRELOAD`) are read before
torch is imported, `TRITON_INTERPRET` when `freetoken.kernels` is. This module imports only the
standard library: `ft --help`, the early start and the kernels all read it.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    name: str
    default: str  # what unset means
    meaning: str  # what it does (docs/configuration.md says more)
    read: str  # when it is read

    def value(self) -> str | None:
        """As set, or None where it is not."""
        return os.environ.get(self.name)

    def off(self) -> bool:
        """Set to 0: how the switches below are turned off (any other value leaves them on)."""
        return self.value() == "0"


VARIABLES: list[Variable] = []


def _variable(name: str, default: str, meaning: str, read: str) -> Variable:
    VARIABLES.append(variable := Variable(name, default, meaning, read))
    return variable


# -- freetoken's own ---------------------------------------------------------------------

CACHE_DIR = _variable(
    "FREETOKEN_CACHE_DIR",
    "the user cache directory (`~/.cache/freetoken` on Linux)",
    "where freetoken keeps what it makes or fetches: the demo models, the Qwen3 tokenizer it "
    "builds, compiled C kernels, GGUF conversions, packaged models, `ft bench bw` profiles, "
    "`ft launch`'s server logs",
    "each time a cached file is looked up",
)
API_KEY = _variable(
    "FREETOKEN_API_KEY",
    "no key",
    "the server's API key where `--api-key` is not given (`ft serve`: required on every "
    "endpoint but /health; `ft ctl`, `ft launch`: sent to the server)",
    "when `ft serve`, `ft ctl` or `ft launch` starts",
)
NATIVE = _variable(
    "FREETOKEN_NATIVE",
    "on",
    "0: never build or load the C kernels; torch computes the CPU experts (about half as fast)",
    "when a C kernel is first used",
)
NATIVE_FLAGS = _variable(
    "FREETOKEN_NATIVE_FLAGS",
    "none",
    "compiler flags added after `-O3 -march=native` (part of the build's cache key): "
    "`-mno-avx512f` builds the AVX2 paths, `-mno-avx` the scalar ones",
    "when a C kernel is first used",
)
FLA = _variable(
    "FREETOKEN_FLA",
    "on",
    "0: keep flash-linear-attention's kernels (fla-core) off; prompts of hybrid models use "
    "the torch rule",
    "at the first prompt of a hybrid model on CUDA",
)
EARLY_READ = _variable(
    "FREETOKEN_EARLY_READ",
    "on a GPU start",
    "0: never read a weight directory's files before the imports; 1: on a CPU start too",
    "when `ft serve` or `ft generate` starts, before torch is imported",
)
EARLY_READERS = _variable(
    "FREETOKEN_EARLY_READERS",
    "4 (fewer on small machines)",
    "threads reading a weight directory beside the imports",
    "when `ft serve` or `ft generate` starts, before torch is imported",
)
EARLY_MAP = _variable(
    "FREETOKEN_EARLY_MAP",
    "on",
    "0: read an expert pool the page cache holds whole, rather than map it",
    "when `ft serve` or `ft generate` starts, before torch is imported",
)
EARLY_LOCK = _variable(
    "FREETOKEN_EARLY_LOCK",
    "on",
    "0: page-lock the early read's expert pool after the imports (by the loader), rather than "
    "beside them",
    "when `ft serve` or `ft generate` starts, before torch is imported",
)
PRELOAD = _variable(
    "FREETOKEN_PRELOAD",
    "on",
    "0: leave opening torch's native libraries and making the CUDA context to torch, rather "
    "than a thread beside the imports",
    "when `ft serve` or `ft generate` starts, before torch is imported",
)

# -- other programs' variables, read for what they mean to them ---------------------------

CC = _variable(
    "CC",
    "`cc`, else `gcc`, on PATH",
    "the C compiler that builds the C kernels",
    "when a C kernel is first used",
)
CUDA_VISIBLE_DEVICES = _variable(
    "CUDA_VISIBLE_DEVICES",
    "every GPU",
    "CUDA's GPU list (torch reads it too); empty or -1 hides them all, and `--device cuda` "
    "is refused while the arguments are parsed",
    "when `--device cuda` or `cuda:N` is parsed",
)
OMP_NUM_THREADS = _variable(
    "OMP_NUM_THREADS",
    "not set",
    "where set, torch's intra-op pool is left to it (else a CPU engine sizes the pool itself)",
    "when a CPU engine loads",
)
TRITON_INTERPRET = _variable(
    "TRITON_INTERPRET",
    "not set",
    "1: Triton's interpreter runs the GPU kernels on the CPU (tests); kernels take it where "
    "its arithmetic differs from the GPU's",
    "when `freetoken.kernels` is imported",
)
LD_LIBRARY_PATH = _variable(
    "LD_LIBRARY_PATH",
    "not set",
    "where it holds CUDA libraries torch links (a toolkit's), the native preload leaves "
    "torch's libraries to torch's import",
    "when `ft serve` or `ft generate` starts, before torch is imported",
)


# -- typed reads -------------------------------------------------------------------------


def cache_dir() -> Path | None:
    """FREETOKEN_CACHE_DIR, expanded; None where unset or empty."""
    value = CACHE_DIR.value()
    return Path(value).expanduser() if value else None


def api_key() -> str | None:
    """FREETOKEN_API_KEY as set (an empty one too: `ft serve` refuses it), or None."""
    return API_KEY.value()


def native() -> bool:
    """Whether the C kernels may be built and loaded."""
    return not NATIVE.off()


def native_flags() -> list[str]:
    """FREETOKEN_NATIVE_FLAGS, split as a shell would."""
    return shlex.split(NATIVE_FLAGS.value() or "")


def fla() -> bool:
    """Whether fla-core's kernels may run prompts (where installed)."""
    return not FLA.off()


def early_read() -> bool | None:
    """FREETOKEN_EARLY_READ: False (0: never), True (1: on a CPU start too), or None (unset or
    anything else: on a GPU start)."""
    return {"0": False, "1": True}.get(EARLY_READ.value() or "")


def early_readers() -> int | None:
    """FREETOKEN_EARLY_READERS, or None where unset or empty."""
    value = EARLY_READERS.value()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{EARLY_READERS.name}={value!r}: expects an integer") from None


def early_map() -> bool:
    """Whether a warm expert pool is mapped from the page cache rather than read."""
    return not EARLY_MAP.off()


def early_lock() -> bool:
    """Whether the early read's pool is page-locked beside the imports."""
    return not EARLY_LOCK.off()


def preload() -> bool:
    """Whether the native preload may run."""
    return not PRELOAD.off()


def compiler() -> str | None:
    """CC, or None where unset or empty."""
    return CC.value() or None


def gpus_hidden() -> bool:
    """Whether CUDA_VISIBLE_DEVICES hides every GPU."""
    return CUDA_VISIBLE_DEVICES.value() in ("", "-1")


def omp_threads_set() -> bool:
    """Whether OMP_NUM_THREADS is set (not empty)."""
    return bool(OMP_NUM_THREADS.value())


def triton_interpret() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1)."""
    return TRITON_INTERPRET.value() == "1"


def library_path() -> str:
    """LD_LIBRARY_PATH, or "" where unset."""
    return LD_LIBRARY_PATH.value() or ""


def for_child(drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """A child process's environment: this process's, less `drop`, with `extra` set."""
    return {k: v for k, v in os.environ.items() if k not in drop} | extra
