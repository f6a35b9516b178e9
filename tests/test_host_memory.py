"""Host memory as the admission check and the pinning advice see it (weights/memory.py): a
container's memory cgroup limit (v2 and v1, at its own path or mounted at the root) lowers
what is free, counting its inactive page cache as reclaimable; no limit leaves MemAvailable;
the advice names the limits that are too small."""

from __future__ import annotations

import pytest

from freetoken.weights import memory

GIB = 2**30


def cgroup_v2(tmp_path, limit: str, current: int, inactive: int = 0, at_root: bool = False):
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/app\n")
    d = tmp_path / "fs" if at_root else tmp_path / "fs" / "user.slice" / "app"
    d.mkdir(parents=True)
    (d / "memory.max").write_text(limit + "\n")
    (d / "memory.current").write_text(f"{current}\n")
    (d / "memory.stat").write_text(f"anon 1\ninactive_file {inactive}\nactive_file 5\n")
    return proc, tmp_path / "fs"


def cgroup_v1(tmp_path, limit: int, usage: int, inactive: int = 0):
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text("12:pids:/\n4:memory:/docker/abc\n0::/\n")
    d = tmp_path / "fs" / "memory" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (d / "memory.stat").write_text(f"cache 9\ntotal_inactive_file {inactive}\n")
    return proc, tmp_path / "fs"


@pytest.mark.parametrize("at_root", [False, True], ids=["own-path", "mounted-at-root"])
def test_a_v2_limit_lowers_what_is_free(tmp_path, monkeypatch, at_root):
    proc, root = cgroup_v2(tmp_path, str(8 * GIB), 6 * GIB, inactive=1 * GIB, at_root=at_root)
    monkeypatch.setattr(memory, "_mem_available", lambda: 100 * GIB)
    assert memory.cgroup_limit(proc, root) == 8 * GIB
    assert memory.cgroup_room(proc, root) == 3 * GIB  # 8 - 6 + 1 reclaimable
    assert memory.available_host_bytes(proc, root) == 3 * GIB
    monkeypatch.setattr(memory, "_mem_available", lambda: 2 * GIB)
    assert memory.available_host_bytes(proc, root) == 2 * GIB  # the smaller of the two


def test_a_v1_limit_lowers_what_is_free(tmp_path, monkeypatch):
    proc, root = cgroup_v1(tmp_path, 16 * GIB, 10 * GIB, inactive=2 * GIB)
    monkeypatch.setattr(memory, "_mem_available", lambda: 100 * GIB)
    assert memory.cgroup_limit(proc, root) == 16 * GIB
    assert memory.available_host_bytes(proc, root) == 8 * GIB


def test_no_limit_leaves_mem_available(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "_mem_available", lambda: 7 * GIB)
    proc, root = cgroup_v2(tmp_path / "a", "max", 5 * GIB)
    assert memory.cgroup_limit(proc, root) is None
    assert memory.available_host_bytes(proc, root) == 7 * GIB
    proc, root = cgroup_v1(tmp_path / "b", 9223372036854771712, 5 * GIB)  # v1's "unlimited"
    assert memory.available_host_bytes(proc, root) == 7 * GIB
    missing = tmp_path / "none"
    assert memory.available_host_bytes(missing / "cgroup", missing) == 7 * GIB


def test_pinning_advice_names_the_limits_that_are_too_small(monkeypatch):
    monkeypatch.setattr(memory, "locked_memory_limit", lambda: 64 * 2**20)
    monkeypatch.setattr(memory, "cgroup_room", lambda: 4 * GIB)
    monkeypatch.setattr(memory, "cgroup_limit", lambda: 16 * GIB)
    advice = memory.pinning_advice(10 * GIB)
    assert "ulimit -l" in advice and "0.1 GiB" in advice
    assert "memory limit leaves 4.0 GiB free of 16.0 GiB" in advice
    monkeypatch.setattr(memory, "locked_memory_limit", lambda: None)
    monkeypatch.setattr(memory, "cgroup_room", lambda: None)
    assert "ulimit" not in memory.pinning_advice(10 * GIB)
    assert "free host memory" in memory.pinning_advice(10 * GIB)


def test_this_machine_reads_without_error():
    assert memory.available_host_bytes() > 0
    limit = memory.locked_memory_limit()
    assert limit is None or limit >= 0
