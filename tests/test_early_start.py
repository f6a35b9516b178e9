"""What a start does before it imports torch (early_start.py): torch's native libraries and the
CUDA context on a thread that does not hold the GIL (native_preload.py), the tokenizer loaded
meanwhile. The driver is faked here (CI has no GPU); the libraries are the CPU build's own."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

from freetoken import early_start, native_preload, settings, tokenizer
from freetoken.errors import CheckpointError


def test_a_cuda_start_opens_torchs_libraries_and_makes_the_context_off_the_gil(driver):
    preload = native_preload.start("cuda:1")
    assert preload is not None and native_preload.started() is preload
    assert preload.wait(60) and preload.error is None
    opened = [n for n in preload.timings if n.endswith(".so")]
    # torch's global dependencies first (RTLD_GLOBAL, as its __init__ opens them), then
    # libtorch, which brings the others (the CPU build has no libtorch_cuda)
    assert opened[0] == "libtorch_global_deps.so"
    assert opened[1:] == [n for n in native_preload.LIBRARIES if (preload.lib_dir / n).is_file()]
    assert "libtorch_cpu.so" in opened and "libtorch.so" in opened
    assert [name for name, _ in driver.calls] == [
        "cuInit",
        "cuDeviceGet",
        "cuDevicePrimaryCtxRetain",
    ]
    assert driver.calls[1][1][1] == 1  # (the device asked for: cuda:1)
    assert preload.timings["cuda context"] >= 0
    assert native_preload.start("cuda") is None  # (once a process)


def test_the_libraries_open_through_a_foreign_call_that_releases_the_gil(driver, monkeypatch):
    """ctypes.CDLL's own loading keeps the GIL (the main thread would stand still for each
    library's load); libc's dlopen, called as a foreign function, does not. The libraries are
    open all the same."""
    loaded, cdll = [], ctypes.CDLL
    monkeypatch.setattr(
        ctypes, "CDLL", lambda name, *a, **k: loaded.append(name) or cdll(name, *a, **k)
    )
    preload = native_preload.start("cuda")
    assert preload.wait(60) and preload.error is None
    assert set(loaded) <= {None, native_preload.DRIVER}  # (libc itself, and the faked driver)
    maps = Path("/proc/self/maps").read_text()
    assert "libtorch_global_deps.so" in maps and "libtorch_cpu.so" in maps
    with pytest.raises(OSError, match="no-such-library"):
        native_preload.dlopen("/no-such-library.so", ctypes.DEFAULT_MODE)


def test_the_libraries_load_in_one_foreign_call_begun_before_the_tokenizer(driver, monkeypatch):
    """Between two foreign calls the preload's thread takes the GIL, which the tokenizer's load
    (begun meanwhile) holds for the whole of it: so torch's libraries are loaded by one call,
    libtorch's, and `wait_loading` returns only once the thread is past its short first call
    and into that one."""
    calls, real, started = [], native_preload.dlopen, threading.Event()

    def dlopen(path, mode):
        started.wait(60)  # (until `preload` below is there)
        calls.append((Path(path).name, preload._loading.is_set()))
        return real(path, mode)

    monkeypatch.setattr(native_preload, "dlopen", dlopen)
    preload = native_preload.start("cuda")
    started.set()
    preload.wait_loading()
    assert preload.wait(60) and preload.error is None
    assert calls[0] == ("libtorch_global_deps.so", False)
    assert calls[1] == ("libtorch.so", True)
    # libtorch's load brought libtorch_cpu (its needed library): in a fresh process, one call
    lib = preload.lib_dir / "libtorch.so"
    mapped = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ctypes, sys; ctypes.CDLL(sys.argv[1]); print(open('/proc/self/maps').read())",
            str(lib),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "libtorch_cpu.so" in mapped


def test_a_preload_that_fails_early_does_not_hold_the_start(driver, monkeypatch, tmp_path):
    monkeypatch.setattr(native_preload, "torch_lib_dir", lambda: tmp_path)
    (tmp_path / "libtorch_global_deps.so").write_text("not a library")
    preload = native_preload.start("cuda")
    preload.wait_loading()  # (returns: the thread has ended)
    assert preload.wait(60) and isinstance(preload.error, OSError)


def test_a_failing_driver_stops_only_the_preload(driver):
    driver.status = 100  # CUDA_ERROR_NO_DEVICE
    preload = native_preload.start(None)
    assert preload.wait(60)
    assert isinstance(preload.error, OSError) and "cuInit" in str(preload.error)
    assert "cuda context" not in preload.timings  # (the import's own start makes it)


def test_the_preload_begins_only_for_a_gpu_start(driver, monkeypatch, tmp_path):
    assert native_preload.start("cpu") is None
    monkeypatch.setenv(settings.PRELOAD.name, "0")
    assert native_preload.start("cuda") is None
    monkeypatch.delenv(settings.PRELOAD.name)
    monkeypatch.setattr(native_preload, "NVIDIA_NODE", str(tmp_path / "none"))
    assert native_preload.start("cuda") is None
    assert native_preload.started() is None


def test_with_cuda_libraries_on_ld_library_path_torchs_own_loading_picks_them(
    driver, monkeypatch, tmp_path
):
    toolkit, drivers = tmp_path / "cuda" / "lib64", tmp_path / "nvidia" / "lib64"
    for folder, name in ((toolkit, "libcublasLt.so.13"), (drivers, "libcuda.so.1")):
        folder.mkdir(parents=True)
        (folder / name).touch()
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{drivers}:{toolkit}:/missing")
    assert native_preload.cuda_libraries_on_path() == [str(toolkit / "libcublasLt.so.13")]
    preload = native_preload.start("cuda")
    assert preload.wait(60) and preload.error is None
    assert list(preload.timings) == ["libtorch_global_deps.so", "cuda context"]
    # (driver libraries alone, a container's usual LD_LIBRARY_PATH: torch's libraries opened)
    assert native_preload.cuda_libraries_on_path(str(drivers)) == []


@pytest.mark.parametrize(
    "device, index", [(None, 0), ("cuda", 0), ("cuda:3", 3), ("cpu", None), ("cuda:x", None)]
)
def test_the_device_a_start_uses(device, index):
    assert native_preload.device_index(device) == index


# -- the tokenizer, loaded while the libraries open ---------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    """A directory with a tokenizer.json that tokenizers reads as it is."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_preloaded_tokenizer_is_the_one_the_engine_takes_once(checkpoint):
    tokenizer.preload(checkpoint / ".." / checkpoint.name)  # (same directory, another spelling)
    early = tokenizer.load(checkpoint)
    assert early.encode("hello world") == [1, 2]
    later = tokenizer.load(checkpoint)  # (taken once: a later load reads the files again)
    assert later is not early and later.encode("hello world") == [1, 2]


def test_a_tokenizer_that_fails_early_fails_where_the_engine_loads_it(tmp_path):
    tokenizer.preload(tmp_path)  # (no tokenizer files: nothing kept, nothing raised)
    tokenizer.preload(tmp_path / "model.gguf")  # (not a directory: left to the loader)
    with pytest.raises(CheckpointError, match="no tokenizer"):
        tokenizer.load(tmp_path)


@pytest.mark.parametrize("preloading", [True, False])
def test_a_start_loads_the_tokenizer_early_only_beside_the_preload(monkeypatch, preloading):
    done = []
    preload = type("Preload", (), {"wait_loading": lambda self: None})()
    monkeypatch.setattr(native_preload, "start", lambda device: preload if preloading else None)
    monkeypatch.setattr(early_start.early_read, "start", lambda m, d: done.append(("read", m)))
    monkeypatch.setattr(tokenizer, "preload", lambda m: done.append(("tokenizer", m)))
    monkeypatch.setattr(early_start.gc, "disable", lambda: None)  # (this is pytest's process)
    early_start.before_imports("/m", "cuda")
    # without the preload's thread, the tokenizer's load is better left to the loader's thread,
    # beside the weights' reads
    assert done == ([("read", "/m"), ("tokenizer", "/m")] if preloading else [("read", "/m")])


def test_a_start_runs_without_the_collector_and_freezes_what_it_made(monkeypatch):
    """The cyclic collector is off from before the imports until the engine is built, then
    what the start made is frozen (no full pass walks it again) and the collector is on; the
    start's garbage is freed later, in one pass (the server's engine thread, once idle)."""
    monkeypatch.setattr(native_preload, "start", lambda device: None)
    monkeypatch.setattr(early_start.early_read, "start", lambda m, d: None)
    done = []
    for name in ("freeze", "unfreeze", "collect"):
        monkeypatch.setattr(
            early_start.gc, name, lambda name=name: done.append((name, gc.isenabled()))
        )
    try:
        early_start.before_imports("/m", "cuda")
        assert not gc.isenabled()
        early_start.started()
        assert done == [("freeze", False)]  # (frozen before the collector runs again)
        assert gc.isenabled()
        early_start.collect_start_garbage()
        assert done[1:] == [("unfreeze", True), ("collect", True), ("freeze", True)]
    finally:
        gc.enable()


def test_the_start_asks_the_dynamic_loader_before_the_preload_holds_it(monkeypatch):
    """The early read's set-up and the import of the tokenizer's native module (both take the
    dynamic loader's lock) come before the preload's loads of torch's libraries, which hold
    it; the tokenizer loads beside them, once they have begun."""
    done = []
    monkeypatch.setattr(early_start.gc, "disable", lambda: None)  # (this is pytest's process)
    monkeypatch.setattr(early_start.early_read, "start", lambda m, d: done.append("read"))
    monkeypatch.setattr(tokenizer, "load_native", lambda: done.append("tokenizers imported"))
    preload = type("Preload", (), {"wait_loading": lambda self: done.append("loading")})()
    monkeypatch.setattr(native_preload, "start", lambda d: done.append("preload") or preload)
    monkeypatch.setattr(tokenizer, "preload", lambda m: done.append("tokenizer"))
    early_start.before_imports("/m", "cuda")
    assert done == ["read", "tokenizers imported", "preload", "loading", "tokenizer"]


HOLDER_C = r"""
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>
/* Runs inside dlopen, the dynamic loader's lock held: until the test opens the FIFO. */
__attribute__((constructor)) static void hold(void) {
    const char *held = getenv("FT_TEST_HELD"), *release = getenv("FT_TEST_RELEASE");
    char c;
    if (!held || !release) return;
    close(open(held, O_CREAT | O_WRONLY, 0600));
    int fd = open(release, O_RDONLY);
    if (fd >= 0) { read(fd, &c, 1); close(fd); }
}
"""

LOAD_WHILE_HELD = """
import ctypes, os, sys, threading, time
from freetoken import tokenizer
from tokenizers import Tokenizer
tokenizer.load_native()
libc = ctypes.CDLL(None)
libc.dlopen.restype, libc.dlopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_int]
holder = threading.Thread(target=libc.dlopen, args=(sys.argv[1].encode(), 2))
holder.start()
while not os.path.exists(os.environ["FT_TEST_HELD"]):
    time.sleep(0.001)
print("loading", flush=True)
Tokenizer.from_file(sys.argv[2])
print("loaded", flush=True)
holder.join()
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler for the lock's holder")
def test_a_tokenizer_loads_while_another_thread_holds_the_dynamic_loader(checkpoint, tmp_path):
    """After `load_native`, loading a tokenizer never asks the dynamic loader: a library's
    load on another thread (here one whose constructor waits, holding the loader's lock, as
    libtorch_cpu's load holds it for its whole load) does not hold it up. Without the set-up,
    the first tokenizer's seeding of its hash maps (dlsym) waits for that lock."""
    source, so = tmp_path / "holder.c", tmp_path / "holder.so"
    source.write_text(HOLDER_C)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(source)], check=True)
    held, release = tmp_path / "held", tmp_path / "release"
    os.mkfifo(release)
    env = {**os.environ, "FT_TEST_HELD": str(held), "FT_TEST_RELEASE": str(release)}
    child = subprocess.Popen(
        [sys.executable, "-c", LOAD_WHILE_HELD, str(so), str(checkpoint / "tokenizer.json")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in child.stdout], daemon=True).start()
    try:
        assert lines.get(timeout=60) == "loading\n"
        try:
            loaded_while_held = lines.get(timeout=30) == "loaded\n"
        except queue.Empty:
            loaded_while_held = False
    finally:
        with open(release, "w") as fifo:  # (the constructor returns, the lock is let go)
            fifo.write("x")
        child.wait(60)
    assert loaded_while_held
    assert child.returncode == 0


def test_the_cli_turns_the_collector_off_for_a_start_and_on_after_the_engine():
    """`ft generate` in a fresh process: off while it loads, frozen and on once the engine is
    built (checked from inside the command)."""
    seen = subprocess.run(
        [
            sys.executable,
            "-c",
            "import gc, sys\n"
            "from freetoken.cli import common, main\n"
            "load = common.load_engine\n"
            "def checked(args):\n"
            "    print('loading, collector on:', gc.isenabled())\n"
            "    engine = load(args)\n"
            "    print('built, collector on:', gc.isenabled(),\n"
            "          'frozen:', gc.get_freeze_count() > 0)\n"
            "    raise SystemExit(0)\n"
            "common.load_engine = checked\n"
            "import freetoken.cli.generate as g\n"
            "g.load_engine = checked\n"
            "main.main(['generate', '--model', 'random-demo', '--prompt', 'hi',\n"
            "           '--max-tokens', '1'])\n",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    ).stdout
    assert "loading, collector on: False" in seen
    assert "built, collector on: True frozen: True" in seen


# -- Triton's once-a-process cache key, ahead of the first step ----------------------------


def test_tritons_cache_key_is_computed_on_a_thread_once(monkeypatch):
    cache = pytest.importorskip("triton.runtime.cache")
    from freetoken.kernels import triton_start

    monkeypatch.setattr(triton_start, "_started", False)
    cache.triton_key.cache_clear()
    triton_start.begin()
    thread = next(t for t in threading.enumerate() if t.name == "ft-triton-key")
    thread.join(120)
    assert cache.triton_key.cache_info().currsize == 1  # (the first compile finds it)
    triton_start.begin()
    assert not any(t.name == "ft-triton-key" for t in threading.enumerate())  # (once)
