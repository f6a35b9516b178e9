"""Triton's once-a-process cost, taken off a start's first step.

The first kernel a process compiles, even one Triton finds in its on-disk cache, computes
Triton's own cache key (`triton_key`), which hashes Triton's sources and its 415 MB compiler
library: 0.4-0.5 s on the main thread inside the first step's first launch (the H200
machine's profile of a warm start: 0.34 s of sha256 and 0.08 s of reads in the first rms_norm).
`begin()` computes it on a thread while the weights load: the reads and the hashing release
the GIL, so the main thread's work goes on beside it, and the key is cached for the process.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

_started = False


def begin() -> None:
    """Compute Triton's cache key on a thread (once a process; nothing where Triton is
    missing)."""
    global _started
    if _started:
        return
    _started = True
    threading.Thread(target=_key, name="ft-triton-key", daemon=True).start()


def _key() -> None:
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # (no Triton: the torch paths run)
        return
    try:
        triton_key()  # (functools.lru_cache: the compile's call then finds it)
    except Exception as e:  # (the first compile computes it instead, and reports any error)
        log.debug("Triton's cache key not computed ahead: %s", e)
