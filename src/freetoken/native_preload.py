"""Work a CUDA start can do before Python imports torch, on a thread that does not hold the GIL
(issue 18: a warm start is the imports and the work after them, one at a time, on the GIL).

`import torch` opens its native libraries (hundreds of MB of code with their relocations and
static initializers: the CUDA kernels' registrations) from the import machinery, which keeps
the GIL while it does, and the CUDA context is made later by the first tensor on the GPU, also
under the GIL. Here both are done first through ctypes' foreign calls, which release the GIL:
the libraries torch's import would open (`libtorch_global_deps` with RTLD_GLOBAL, as torch's
`__init__` does, then `libtorch`, which brings libtorch_cpu, libtorch_cuda and their CUDA
libraries by their own run paths), by libc's `dlopen` called as a foreign function
(`ctypes.CDLL`'s own loading keeps the GIL: the main thread stood still for the 0.16 s of
libtorch_cpu's load on the CPU machine), and the device's primary context through the driver
(`cuInit`, `cuDevicePrimaryCtxRetain`), which the CUDA runtime, and so torch, then takes as it
is.
Meanwhile the main thread does work that needs no torch (`freetoken.tokenizer.preload`), begun
once the thread is in libtorch's load (`wait_loading`); its `import torch` finds the libraries
open (or waits for the loader's lock) and the context made.
On that context the early read's expert pool is page-locked through the driver as soon as it is
there (`lock_host`, from `weights/early_read.EarlyRead.lock_pool`), also beside the imports:
19.3 GB in 0.38 s, which had kept the model's copy to the GPU waiting after them (a warm start
1.01-1.08x a plain read of its weights against 1.45-1.57x;
benchmarks/results/2026-12-03-early-pool-lock-h200.md).
On the H200 machine: libtorch_cpu 0.25-0.34 s, libtorch_cuda 0.12-0.16 s, the context
0.23-1.27 s, all on the thread; torch's import after them 4.15-4.19 s against 4.45-4.86 s, the
first tensor on the GPU 0.02 s against 0.34 s
(benchmarks/results/2026-12-03-warm-start-and-k-pairs-h200.md).

Nothing is opened that the import would not open: where a directory of LD_LIBRARY_PATH holds
CUDA libraries torch links (cuBLAS, cuDNN, NCCL, ...: a toolkit's, which the loader would find
before torch's own), torch's loading decides which it takes (it preloads some from its wheels
first), so only `libtorch_global_deps` and the context are done here (a container's
LD_LIBRARY_PATH of driver libraries, /usr/local/nvidia/lib64, holds none of them). A failure
only logs: the import then does the work as it would have. settings.PRELOAD (=0) turns it off.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import threading
import time
from pathlib import Path

from freetoken import settings

log = logging.getLogger(__name__)

NVIDIA_NODE = "/dev/nvidiactl"  # (a GPU's driver is there)
DRIVER = "libcuda.so.1"
# torch's native libraries after its global dependencies, each bringing its own (a CPU build
# has no libtorch_cuda). libtorch first: it needs the others, so its one foreign call loads them
# all (between two calls the thread takes the GIL, and the tokenizer's load, beside it, holds
# the GIL for its whole 0.3-0.6 s); the others' calls then find them open.
LIBRARIES = ("libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so")
# CUDA libraries torch links, by name prefix (torch's `_preload_cuda_deps` list)
CUDA_LIBRARIES = (
    "libcublas",
    "libcudnn",
    "libnvrtc",
    "libcudart",
    "libcupti",
    "libcufft",
    "libcurand",
    "libnvJitLink",
    "libcusparse",
    "libcusolver",
    "libnccl",
    "libnvshmem",
    "libcufile",
)

_started: Preload | None = None


class Preload:
    """The thread and what it did: seconds per step, by name (`timings`), once `done`."""

    def __init__(self, lib_dir: Path, device_index: int | None, libraries: tuple[str, ...]):
        self.lib_dir = lib_dir
        self.device_index = device_index
        self.libraries = libraries
        self.timings: dict[str, float] = {}
        self.error: BaseException | None = None
        self._handles: list[int] = []  # the libraries' (never closed)
        self._driver = None  # libcuda, once the context is made
        self._context = ctypes.c_void_p()
        self._done = threading.Event()
        self._loading = threading.Event()  # (`wait_loading`)
        self._thread = threading.Thread(target=self._run, name="ft-preload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._open("libtorch_global_deps.so", ctypes.RTLD_GLOBAL)
            self._loading.set()  # (the long calls come next)
            for name in self.libraries:
                if (self.lib_dir / name).is_file():
                    self._open(name, ctypes.DEFAULT_MODE)
            if self.device_index is not None:
                self._timed("cuda context", self._make_context)
        except BaseException as e:  # (the import and torch's own start do it instead)
            self.error = e
            log.debug("native preload stopped: %s", e)
        finally:
            self._loading.set()
            self._done.set()

    def wait_loading(self) -> None:
        """Until the thread has begun its long foreign calls (torch's libraries, else the
        context), or ended. Work that holds the GIL throughout, as the tokenizer's load does, is
        best begun after this: begun before, it holds the thread at its first return from a
        foreign call (so the libraries' load began only after the tokenizer's, on the CPU
        machine, and libtorch_cuda's after it on the H200 machine: then beside the import of
        torch, which waited for it, 0.2 s)."""
        self._loading.wait()

    def _open(self, name: str, mode: int) -> None:
        self._timed(name, lambda: self._handles.append(dlopen(str(self.lib_dir / name), mode)))

    def _make_context(self) -> None:
        """The device's primary context, retained (it lives as long as the process: torch's
        runtime takes the same one)."""
        with contextlib.suppress(OSError):  # (CDLL says why)
            dlopen(DRIVER, ctypes.DEFAULT_MODE)  # without the GIL: CDLL then finds it open
        cuda = ctypes.CDLL(DRIVER)
        device = ctypes.c_int()
        for call, args in (
            ("cuInit", (0,)),
            ("cuDeviceGet", (ctypes.byref(device), self.device_index)),
            ("cuDevicePrimaryCtxRetain", (ctypes.byref(self._context), device)),
        ):
            status = getattr(cuda, call)(*args)
            if status != 0:
                raise OSError(f"{call} returned CUDA error {status}")
        self._driver = cuda

    @property
    def has_context(self) -> bool:
        """Whether the preload has ended with the device's context made (waits for it)."""
        self.wait()
        return self._driver is not None

    def lock_host(self, start: int, nbytes: int, flags: int) -> int:
        """Page-lock host memory through the driver, on the preload's context (cudaHostRegister's
        flags, which the driver's call shares), before torch is there; CUDA's error code. The
        memory is then page-locked for torch's runtime too (one context: the device's primary
        one); `unlock_host` undoes it."""
        self._driver.cuCtxSetCurrent(self._context)  # (current on the calling thread)
        return self._driver.cuMemHostRegister_v2(
            ctypes.c_void_p(start), ctypes.c_size_t(nbytes), ctypes.c_uint(flags)
        )

    def unlock_host(self, start: int) -> None:
        self._driver.cuCtxSetCurrent(self._context)
        self._driver.cuMemHostUnregister(ctypes.c_void_p(start))

    def _timed(self, name: str, step) -> None:
        start = time.perf_counter()
        step()
        self.timings[name] = time.perf_counter() - start

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


def dlopen(path: str, mode: int) -> int:
    """Open a shared library (RTLD_NOW, as ctypes does) through libc's dlopen, a foreign call
    that releases the GIL while the loader works; its handle (kept open: never closed)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.dlopen.restype, libc.dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
    libc.dlerror.restype = ctypes.c_char_p
    handle = libc.dlopen(path.encode(), mode | os.RTLD_NOW)
    if not handle:
        raise OSError((libc.dlerror() or b"dlopen failed").decode(errors="replace"))
    return handle


def gpu_driver_present() -> bool:
    """Whether an NVIDIA GPU's driver is there (asked before torch is imported: its node)."""
    return os.path.exists(NVIDIA_NODE)


def torch_lib_dir() -> Path | None:
    """torch's `lib` directory, found without importing torch (None where torch is missing)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "lib"


def device_index(device: str | None) -> int | None:
    """The GPU a start will use (`--device`: none or "cuda" is 0, "cuda:N" is N), or None for
    a CPU start."""
    if device in (None, "cuda"):
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def start(device: str | None = None) -> Preload | None:
    """Begin the preload for a start on `device` where a GPU's driver is there (see the
    module's docstring); None where it is not begun."""
    global _started
    if not settings.preload() or _started is not None:
        return None
    index = device_index(device)
    lib_dir = torch_lib_dir()
    if index is None or lib_dir is None or not gpu_driver_present():
        return None
    if not (lib_dir / "libtorch_global_deps.so").is_file():
        return None
    libraries = () if cuda_libraries_on_path() else LIBRARIES
    _started = Preload(lib_dir, index, libraries)
    return _started


def cuda_libraries_on_path(value: str | None = None) -> list[str]:
    """The CUDA libraries torch links that LD_LIBRARY_PATH's directories hold (by file name)."""
    found = []
    for folder in (settings.library_path() if value is None else value).split(":"):
        try:
            names = os.listdir(folder) if folder else []
        except OSError:
            continue
        found += [os.path.join(folder, n) for n in names if n.startswith(CUDA_LIBRARIES)]
    return found


def started() -> Preload | None:
    """The preload this process began, if it did (its timings are logged by the loader)."""
    return _started
