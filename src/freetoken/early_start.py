"""What `ft serve` and `ft generate` do before they import torch (issue 18: a warm start is
the imports and the work after them, one after another on the GIL; the weights' reads and the
native libraries' loading need no GIL and run beside them).

1. weights/early_read: reader threads read a weight directory's files (or map them from the
   page cache);
2. native_preload: a thread opens torch's native libraries and makes the GPU's CUDA context
   through ctypes' foreign calls (GIL-free), work `import torch` and the first tensor on the
   GPU would do holding the GIL; the expert pool is page-locked on its context as soon as
   both are there (settings.EARLY_LOCK=0: by the loader, after the imports);
3. meanwhile the main thread loads the tokenizer (GIL work that needs no torch, all of it
   holding the GIL: begun once the preload is inside its libraries' one foreign call, which
   it would otherwise hold at its return), then imports the engine, torch with it.

The early read's set-up and what of `tokenizers` asks the dynamic loader (its native module's
import, its one-time seeding through dlsym: `tokenizer.load_native`) come before the preload,
whose load of torch's libraries holds the loader's lock for the whole of it (else the
tokenizer's load, holding the GIL, waits that load out).

Python's cyclic garbage collector is off from here until `started()`: a start makes about a
million objects (torch's modules, the model) and little garbage, and the collector would walk
them all at each of its full passes (0.2-0.3 s of a 1.3-1.6 s import on the CPU machine).

Nothing here imports torch.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

from freetoken import native_preload, settings, tokenizer
from freetoken.weights import early_read

log = logging.getLogger(__name__)


def before_imports(model: str | Path | None, device: str | None = None) -> None:
    """Begin what can begin for a start of `model` on `device` (each part decides whether it
    applies: a GPU's driver, a weight directory, room in memory)."""
    gc.disable()
    read = early_read.start(model, device)
    if model is not None:
        tokenizer.load_native()
    preload = native_preload.start(device)
    log.debug(
        "early start: native preload %s, early read %s",
        "begun" if preload else "none",
        "begun" if read else "none",
    )
    if read is not None and preload is not None and settings.early_lock():
        read.lock_pool(preload)
    if preload is not None and model is not None:  # (while the preload opens the libraries)
        preload.wait_loading()
        tokenizer.preload(model)


def started() -> None:
    """The engine is built: what the start made lives as long as the process. It is frozen
    (never walked by the collector again: no pause of tens of ms in a decode step when a full
    pass comes), and the collector runs again for what comes after. The start's own garbage
    is frozen with it until `collect_start_garbage`."""
    gc.freeze()
    gc.enable()


def collect_start_garbage() -> None:
    """Free what of the start was garbage (a frozen cycle is never freed otherwise): one full
    pass over everything (0.08 s on the CPU machine, 0.1-0.15 s on the H200 machine's start),
    for a moment no request waits on (the server's engine thread, once idle), then frozen
    again."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
