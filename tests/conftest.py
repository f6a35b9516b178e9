"""Fixtures shared by the HTTP API tests (a demo engine and a server around it). The server
modules are imported inside the fixtures, so tests that need no server run where the server's
dependencies are not installed (the GPU machine)."""

import ctypes
import os
import shutil

import pytest


def _workers_wait_passively() -> None:
    """Under pytest-xdist, torch's OpenMP threads (and those of each process a test starts)
    sleep at their barriers rather than spin: torch gives every worker one thread per core,
    and spinning ones took the cores the other workers computed on. On a 2-core VM,
    test_device_numerics.py's CPU tests took 437 s under 2 workers spinning, 36 s waiting
    passively. (One thread per worker cost as much the other way: a real model's tests ran on
    one core while the other worker sat waiting on a subprocess.) The user's setting rules."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0) > 1:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


_workers_wait_passively()

# The modules that hold a worker longest (minutes each on a 2-core Zen 1: the real models'
# tests, the Triton interpreter's, GGUF conversions, the benchmark scripts), longest first. Sent
# to the workers before the rest, so that the many short modules fill in behind them: by
# default xdist sends the modules with the most tests first, which left these for the end and
# one worker running them alone for minutes while the other idled.
LONGEST_FIRST = (
    "test_gguf.py",
    "test_grouped_experts.py",
    "test_moe_from_dense.py",
    "test_benchmark_scripts.py",
    "test_compressed_decode.py",
    "test_real_models.py",
    "test_real_tool_calls.py",
    "test_fuzz_api.py",
    "test_paged_attention.py",
    "test_speculative.py",
    "test_moe_runtime.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # (pytest-xdist's; keep the order below)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: the rest as found)


@pytest.fixture(scope="module", autouse=True)
def _module_temp_dirs_removed(tmp_path_factory):
    """What a module's tests write under pytest's base temp directory (checkpoints, conversions,
    caches: hundreds of MB a module) goes when the module ends: kept, a full run filled CI's
    disk ("No space left on device"). No session-scoped fixture writes there."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    for path in set(base.iterdir()) - before:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One demo engine per test module, its demo checkpoint in a private cache directory."""
    from server_fixtures import demo_engine

    mp = pytest.MonkeyPatch()
    mp.setenv("FREETOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    try:
        yield demo_engine()
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def server(engine):
    from server_fixtures import MODEL, running_server

    with running_server(engine, MODEL, max_running=8) as (base, core):
        yield base, core


@pytest.fixture
def fresh_engine(engine):
    """A demo engine of this test's own, for a server with its own settings in a module whose
    `server` fixture drives the shared one (one scheduler per engine at a time)."""
    from server_fixtures import demo_engine

    return demo_engine()


class FakeDriver:
    """libcuda's calls (those the native preload makes), each answering `status` (0: success)
    or its own answer in `answers`; `calls` lists them."""

    def __init__(self, status: int = 0):
        self.status, self.calls, self.answers = status, [], {}

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            return self.answers.get(name, self.status)

        return call


@pytest.fixture
def driver(monkeypatch, tmp_path):
    """A machine with a GPU's driver node and a fake libcuda (other libraries open for real)
    for the native preload (native_preload.py)."""
    from freetoken import native_preload, settings

    fake, real = FakeDriver(), ctypes.CDLL
    node = tmp_path / "nvidiactl"
    node.touch()
    monkeypatch.setattr(native_preload, "NVIDIA_NODE", str(node))
    monkeypatch.setattr(native_preload, "_started", None)
    monkeypatch.delenv(settings.PRELOAD.name, raising=False)
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.setattr(
        ctypes,
        "CDLL",
        lambda name, *a, **k: fake if name == native_preload.DRIVER else real(name, *a, **k),
    )
    return fake
