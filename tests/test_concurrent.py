"""layers/concurrent.py: a layer's independent work forked onto a side stream and joined.

The fork and join are checked against stand-ins for torch.cuda's streams and events (this
machine has no GPU); the outputs of the layers that use it (the shared expert, DeepSeek-V4's
row projections) are checked against transformers by their families' suites, and on a GPU by
test_cuda_graphs.py's replays, which must capture every branch joined.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.layers import concurrent


class FakeStream:
    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_stream(self, other):
        self.waited.append(("stream", other.name))

    def wait_event(self, event):
        self.waited.append(("event", event.stream))


class FakeEvent:
    def __init__(self):
        self.stream = None

    def record(self, stream):
        self.stream = stream.name


class FakeCuda:
    """torch.cuda's stream calls, with the stream work is queued on."""

    def __init__(self):
        self.main = FakeStream("main")
        self.now = self.main
        self.made = 0

    def Stream(self, device):  # (torch.cuda.Stream)
        self.made += 1
        return FakeStream(f"side{self.made}")

    def current_stream(self, device=None):
        return self.now

    def stream(self, s):
        fake = self

        class Within:
            def __enter__(self):
                self.before, fake.now = fake.now, s

            def __exit__(self, *exc):
                fake.now = self.before

        return Within()

    Event = FakeEvent


class OnCuda:
    """A tensor's stand-in that reports a CUDA device."""

    device = torch.device("cuda", 0)


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("Stream", "current_stream", "stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(concurrent, "_sides", {})
    monkeypatch.setattr(concurrent, "_pending", [])
    monkeypatch.setattr(concurrent, "ON_GPU", True)  # (off by default until a GPU has timed it)
    return fake


def test_on_the_cpu_the_work_runs_where_its_result_is_asked_for():
    ran = []
    x = torch.ones(2)
    branch = concurrent.beside(lambda t: ran.append("side") or t * 2, x)
    ran.append("main")
    assert torch.equal(branch.result(), x * 2)
    assert ran == ["main", "side"]  # (hybrid's plan before the shared expert, say)
    assert torch.equal(branch.result(), x * 2) and ran == ["main", "side"]  # once
    assert concurrent._pending == []


def test_a_branch_runs_on_a_side_stream_forked_after_the_queued_work(cuda):
    where = []
    branch = concurrent.beside(lambda t: where.append(cuda.now.name) or "out", OnCuda())
    side = concurrent._sides[torch.device("cuda", 0)]
    assert where == [side.name]  # the work was queued on the side stream
    assert side.waited == [("stream", "main")]  # after everything the caller queued
    assert cuda.now is cuda.main  # and the caller's stream is current again
    assert cuda.main.waited == []  # not joined yet: the caller goes on beside it
    assert concurrent._pending == [branch]
    assert branch.result() == "out"
    assert cuda.main.waited == [("event", side.name)]  # joined at the branch's end
    assert concurrent._pending == []
    branch.result()
    assert cuda.main.waited == [("event", side.name)]  # once


def test_join_all_joins_every_pending_branch_once(cuda):
    first = concurrent.beside(lambda t: 1, OnCuda())
    second = concurrent.beside(lambda t: 2, OnCuda())
    assert cuda.made == 1  # one side stream a device
    concurrent.join_all()
    assert cuda.main.waited == [("event", "side1"), ("event", "side1")]
    assert concurrent._pending == []
    assert (first.result(), second.result()) == (1, 2)
    assert len(cuda.main.waited) == 2  # a cut's join stands for the later result()'s


def test_the_switch_off_runs_the_work_on_the_calling_stream_on_a_gpu_too(cuda, monkeypatch):
    monkeypatch.setattr(concurrent, "ON_GPU", False)
    where = []
    branch = concurrent.beside(lambda t: where.append(cuda.now.name), OnCuda())
    assert where == [] and cuda.made == 0 and concurrent._pending == []
    branch.result()
    assert where == ["main"] and cuda.main.waited == []


def test_a_branch_keeps_its_inputs_until_joined(cuda):
    x = OnCuda()
    branch = concurrent.beside(lambda t: None, x)
    assert branch._held == (x,)
    branch.result()
    assert branch._held == ()
