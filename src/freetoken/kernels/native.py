"""Build and load freetoken's C kernels with the machine's own compiler.

The sources ship with the package (`kernels/*.c`) and are compiled at first use with
`-O3 -march=native`, so they use the vector units of the machine they run on (a wheel
built elsewhere could not), into the cache directory keyed by the source, the flags and the
CPU. Loading goes through ctypes, whose calls release the GIL. Without a C compiler the caller
falls back to torch; `settings.NATIVE=0` forces that fallback. `settings.NATIVE_FLAGS` adds
compiler flags after those (part of the cache key): `-mno-avx512f` builds the AVX2 code paths on
an AVX-512 machine, `-mno-avx` the scalar ones (the tests run both so).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from freetoken import settings
from freetoken.activations import KERNEL_CODES as ACTIVATION_CODES
from freetoken.paths import cache_dir
from freetoken.weights.expert_format import KERNEL_CODES as FORMAT_CODES
from freetoken.weights.expert_format import MIXED_K_TAG, MIXED_K_WIDTH

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-pthread", "-shared", "-fPIC", "-std=c11")
# Constants a source takes from Python's one definition of them, as -D macros.
DEFINES: dict[str, dict[str, int]] = {
    "cpu_native": {
        **ACTIVATION_CODES,
        **FORMAT_CODES,
        "MIXED_K_WIDTH": MIXED_K_WIDTH,
        "MIXED_K_TAG": MIXED_K_TAG,
    }
}
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
# A quoted include: a file of the library's own (a part of its one translation unit, a header).
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def sources(source: Path) -> list[Path]:
    """`source` and every file it includes by a quoted `#include`, and those theirs (each found
    beside the file that includes it, as the compiler finds it), once each in the order first
    included: everything a build of `source` reads from the package, which its cache key
    hashes. (An include inside `#if` counts whether or not it is taken: a build may take it.)"""
    found: list[Path] = []

    def visit(path: Path) -> None:
        found.append(path)
        for name in _INCLUDE.findall(path.read_text()):
            part = (path.parent / name).resolve()
            if part not in found and part.is_file():
                visit(part)

    visit(source.resolve())
    return found


def cache_key(source: Path, cc: str, flags: list[str]) -> str:
    """What names `source`'s build in the cache: a hash of its `sources` (a change to any file
    of it builds it anew), the compiler, the flags and the CPU (-march=native's)."""
    texts = [path.read_text() for path in sources(source)]
    digest = hashlib.sha256("\n".join([*texts, cc, *flags, _cpu_signature()]).encode())
    return digest.hexdigest()[:16]


def _compiler() -> str | None:
    return settings.compiler() or shutil.which("cc") or shutil.which("gcc")


def load(name: str) -> ctypes.CDLL | None:
    """The compiled library for `kernels/<name>.c`, or None (with one warning) when it cannot
    be built here."""
    with _lock:
        if name not in _loaded:
            macros = DEFINES.get(name, {})
            flags = [f"-D{key}={value}" for key, value in sorted(macros.items())]
            try:
                _loaded[name] = _build_and_load(name, flags)
            except OSError as e:  # an unwritable cache directory, a library that will not load
                log.warning("cannot build or load %s (%s): torch runs it instead (slower)", name, e)
                _loaded[name] = None
        return _loaded[name]


def extra_flags() -> list[str]:
    """Flags added after FLAGS, from settings.NATIVE_FLAGS."""
    return settings.native_flags()


def _build_and_load(name: str, defines: list[str]) -> ctypes.CDLL | None:
    if not settings.native():
        return None
    source = Path(__file__).with_name(f"{name}.c")
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found: %s runs on torch instead (slower)", name)
        return None
    flags = [*FLAGS, *extra_flags()]
    key = cache_key(source, cc, [*flags, *defines])
    target = cache_dir() / "native" / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: another process may be building the same file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        result = subprocess.run(
            [cc, *flags, *defines, str(source), "-o", tmp, "-lm", "-ldl"],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            os.unlink(tmp)
            log.warning(
                "could not compile %s (%s): it runs on torch instead (slower)\n%s",
                name,
                cc,
                result.stderr[-2000:],
            )
            return None
        os.replace(tmp, target)
    return ctypes.CDLL(str(target))
