"""CPU threads sized from the cores this process may use (issue 42): its affinity within its
cgroup's CPU quota; torch's own pool one thread beside the native team."""

from __future__ import annotations

import os

import pytest

from freetoken.kernels import cpu_team


def _v2(tmp_path, quota: str, nested: str | None = None):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    leaf = tmp_path / "a" / "b"
    leaf.mkdir(parents=True, exist_ok=True)
    (leaf / "cpu.max").write_text(f"{quota} 100000\n")
    if nested is not None:
        (tmp_path / "a" / "cpu.max").write_text(f"{nested} 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    return str(tmp_path), str(proc)


def test_cgroup_v2_quota(tmp_path):
    assert cpu_team.cgroup_cpu_limit(*_v2(tmp_path, "150000")) == 1.5
    assert cpu_team.cgroup_cpu_limit(*_v2(tmp_path, "max")) is None


def test_cgroup_v2_the_tightest_ancestor_rules(tmp_path):
    assert cpu_team.cgroup_cpu_limit(*_v2(tmp_path, "400000", nested="100000")) == 1.0


def test_cgroup_v1_quota(tmp_path):
    folder = tmp_path / "cpu,cpuacct"
    folder.mkdir()
    (folder / "cpu.cfs_quota_us").write_text("200000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:cpu,cpuacct:/docker/x\n3:memory:/docker/x\n")
    assert cpu_team.cgroup_cpu_limit(str(tmp_path), str(proc)) == 2.0
    (folder / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_team.cgroup_cpu_limit(str(tmp_path), str(proc)) is None


def test_no_cgroup_file_means_no_limit(tmp_path):
    assert cpu_team.cgroup_cpu_limit(str(tmp_path), str(tmp_path / "missing")) is None


def test_usable_cores_within_the_quota(monkeypatch):
    def cores(affinity, limit):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: affinity)
        monkeypatch.setattr(cpu_team, "cgroup_cpu_limit", lambda: limit)
        cpu_team.usable_cores.cache_clear()
        return cpu_team.usable_cores(), cpu_team.team_threads()

    try:
        assert cores(set(range(16)), 2.5) == (3, 2)
        assert cores(set(range(16)), None) == (16, 15)
        assert cores({0, 1}, 8.0) == (2, 1)
    finally:
        cpu_team.usable_cores.cache_clear()


def test_usable_cores_read_once_a_process(monkeypatch):
    """Every native job asks for the team's size: the cgroup files are read once, not a job."""
    reads = []
    monkeypatch.setattr(cpu_team, "cgroup_cpu_limit", lambda: reads.append(1))
    cpu_team.usable_cores.cache_clear()
    try:
        for _ in range(5):
            cpu_team.team_threads()
        assert len(reads) == 1
    finally:
        cpu_team.usable_cores.cache_clear()


def test_torch_keeps_one_thread_beside_the_native_team(monkeypatch):
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        if cpu_team.library() is not None:
            assert cpu_team.size_torch_threads() == 1
        monkeypatch.setattr(cpu_team, "library", lambda: None)
        monkeypatch.setattr(cpu_team, "usable_cores", lambda: 2)
        assert cpu_team.size_torch_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(3)
        assert cpu_team.size_torch_threads() == 3  # (the user's setting rules)
    finally:
        torch.set_num_threads(before)


def test_a_cpu_engine_leaves_torch_one_thread(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    if cpu_team.library() is None:
        pytest.skip("no native library here")
    from server_fixtures import demo_engine

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path))
    torch.set_num_threads(2)
    try:
        demo_engine()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
