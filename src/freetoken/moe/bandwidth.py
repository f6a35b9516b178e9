"""Measured bandwidths of the two miss paths, alone and together: `ft bench bw`.

B_P: pinned host-to-device copies of expert-shaped batches (what a cache fill does).
B_H: the real CPU executor on expert shapes, with weights streaming from RAM, not from the
     CPU cache (the pool cycled through is several times the last-level cache).
B_P', B_H': both at once, the figures the miss split uses (they contend for host memory).

The profile is stored as JSON under the user cache directory, keyed by GPU UUID, CPU model and
expert format, and read back by the runtime as the starting point of its running averages.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from freetoken.moe.cpu import CPUExpertExecutor, CPUJob
from freetoken.moe.store import ExpertShape, HostExpertStore
from freetoken.paths import cache_dir


@dataclass
class BandwidthProfile:
    key: str
    gpu: str | None
    cpu: str
    expert_format: str
    pcie: float | None  # B_P, bytes/s
    cpu_experts: float  # B_H
    pcie_concurrent: float | None  # B_P'
    cpu_concurrent: float | None  # B_H'

    @property
    def fill_fraction(self) -> float | None:
        """B_P' / (B_P' + B_H'): the share of misses the split fills."""
        if not self.pcie_concurrent or not self.cpu_concurrent:
            return None
        return self.pcie_concurrent / (self.pcie_concurrent + self.cpu_concurrent)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_uuid(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return f"{props.name} {getattr(props, 'uuid', '')}".strip()


def format_key(shape: ExpertShape) -> str:
    """The expert format a profile is for: the model dtype and shape, and how experts are
    stored when quantized (their bytes differ, and the CPU kernel's decoding with them)."""
    dtype = str(shape.dtype).removeprefix("torch.")
    fmt = shape.format
    stored = ""
    if fmt.quantized:
        blocks = f"-{fmt.row_block}x{fmt.col_block}" if fmt.name == "fp8" else ""
        stored = f" {fmt.name}{blocks}"
        if shape.down_format is not None:
            stored += f" down {shape.down_format.name}"
    return f"{dtype}{stored} H{shape.hidden} I{shape.intermediate}"


def profile_key(gpu: str | None, cpu: str, fmt: str) -> str:
    return hashlib.sha1(f"{gpu}|{cpu}|{fmt}".encode()).hexdigest()[:16]


def profile_path(key: str) -> Path:
    return cache_dir() / "profiles" / f"bw-{key}.json"


def load_profile(device: torch.device, shape: ExpertShape) -> BandwidthProfile | None:
    key = profile_key(gpu_uuid(device), cpu_model(), format_key(shape))
    path = profile_path(key)
    if not path.is_file():
        return None
    try:
        return BandwidthProfile(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def save_profile(profile: BandwidthProfile) -> Path:
    path = profile_path(profile.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(profile), indent=2))
    return path


def _expert_pool(shape: ExpertShape, pool_bytes: int, pin: bool) -> HostExpertStore:
    """A host pool of random experts several times the CPU cache, cycled through (no bias bank:
    a bias is 0.1% of an expert's bytes)."""
    shape = dataclasses.replace(shape, bias=False)
    pool = HostExpertStore(shape, 1, max(16, pool_bytes // shape.nbytes))
    pool.fill_random_()
    if pin:
        pool.pin()
    return pool


def _measure_copies(pool, device, batch: int, seconds: float, stop: threading.Event | None = None):
    """Copy `batch` experts at a time into device slots for about `seconds`; bytes/s."""
    banks = list(pool.named_banks.values())
    slots = [torch.empty((batch, *b.shape[1:]), dtype=b.dtype, device=device) for b in banks]
    stream = torch.cuda.Stream(device)
    copied, nxt = 0, 0
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds and not (stop and stop.is_set()):
        with torch.cuda.stream(stream):
            for j in range(batch):
                for dst, src in zip(slots, banks, strict=True):
                    dst[j].copy_(src[nxt], non_blocking=True)
                nxt = (nxt + 1) % pool.num_pairs
        stream.synchronize()
        copied += batch * pool.shape.nbytes
    return copied / (time.perf_counter() - start)


def _measure_cpu(executor: CPUExpertExecutor, pool, batch: int, seconds: float) -> float:
    """Run one-token jobs of `batch` experts through the real CPU executor; bytes/s."""
    x = torch.randn(1, pool.shape.hidden).to(pool.shape.dtype)  # (the model's dtype)
    read, nxt = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        pairs = torch.arange(nxt, nxt + batch) % pool.num_pairs
        nxt = (nxt + batch) % pool.num_pairs
        job = CPUJob(x, torch.zeros(batch, dtype=torch.long), pairs, torch.ones(batch))
        read += executor.submit(job).result().weight_bytes
    return read / (time.perf_counter() - start)


def measure(
    shape: ExpertShape,
    device: torch.device,
    pool_bytes: int = 2 * 2**30,
    batch: int = 8,
    seconds: float = 2.0,
    threads: int | None = None,
    spin_us: float = 0.0,
) -> BandwidthProfile:
    has_gpu = device.type == "cuda"
    pool = _expert_pool(shape, pool_bytes, pin=has_gpu)
    # (the team is the one the runtime would use)
    executor = CPUExpertExecutor(pool, threads=threads, spin_us=spin_us)
    try:
        _measure_cpu(executor, pool, batch, 0.3)  # warm-up: threads, allocator
        cpu_alone = _measure_cpu(executor, pool, batch, seconds)
        pcie = pcie_both = cpu_both = None
        if has_gpu:
            _measure_copies(pool, device, batch, 0.3)
            pcie = _measure_copies(pool, device, batch, seconds)
            result: dict[str, float] = {}
            stop = threading.Event()

            def copier():
                result["pcie"] = _measure_copies(pool, device, batch, seconds * 2, stop)

            t = threading.Thread(target=copier)
            t.start()
            time.sleep(0.1)
            cpu_both = _measure_cpu(executor, pool, batch, seconds)
            stop.set()
            t.join()
            pcie_both = result["pcie"]
    finally:
        executor.shutdown()
    gpu, cpu, fmt = gpu_uuid(device), cpu_model(), format_key(shape)
    return BandwidthProfile(
        key=profile_key(gpu, cpu, fmt),
        gpu=gpu,
        cpu=cpu,
        expert_format=fmt,
        pcie=pcie,
        cpu_experts=cpu_alone,
        pcie_concurrent=pcie_both,
        cpu_concurrent=cpu_both,
    )
