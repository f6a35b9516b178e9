"""The doorbell's listener (moe/doorbell.py, kernels/cpu_listener.c) driven by hand from the
host, as the plan and the merge drive it on CUDA: each new number in `seq` is answered in `done`
once the fp32 partial of the routes marked for the CPU is in `out`; a shape it cannot serve
is counted and still answered, so a merge waiting on it never hangs; nothing is answered
while the number stays the same; the counters add up."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from freetoken.kernels.cpu_experts import NativeCPUExperts, torch_cpu_experts
from freetoken.kernels.cpu_team import library
from freetoken.moe.doorbell import DONE, EXPERTS, JOBS, ROUTES, SECONDS, SEQ, SHAPE, CPUDoorbell
from test_moe_runtime import tiny_store

pytestmark = pytest.mark.skipif(library() is None, reason="needs the native CPU library")


def answer(words: np.ndarray, shape: int, timeout: float = 10.0) -> None:
    """Ring as the plan does (the shape, then a new number) and wait as the merge does."""
    number = int(words[SEQ]) + 1
    words[SHAPE] = shape
    words[SEQ] = number
    deadline = time.monotonic() + timeout
    while words[DONE] != number:
        assert time.monotonic() < deadline, "the listener did not answer"
        time.sleep(1e-4)
    assert words[SEQ] == number and words[SHAPE] == shape  # the listener writes neither


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "swiglu_oai"])
def test_the_listener_answers_every_bell_with_the_cpu_share(dtype, act):
    store = tiny_store(num_layers=3, num_experts=5, hidden=16, inter=8, dtype=dtype)
    k = 2
    # gpt-oss's experts: a distinct gate/up bias per pair, which the listener's jobs must read
    bias = None
    if act == "swiglu_oai":
        bias = torch.randn(15, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    native = NativeCPUExperts.create(store.w_gate_up, store.w_down, act, threads=1, b_gate_up=bias)
    bell = CPUDoorbell(
        native, store.num_layers, threads=1, max_routes=8, device=torch.device("cpu")
    )
    words = bell.words.numpy()
    gen = torch.Generator().manual_seed(0)
    jobs = routes = 0
    try:
        for step in range(12):
            layer, tokens = step % 3, 1 + step % 4
            experts = torch.stack([torch.randperm(5, generator=gen)[:k] for _ in range(tokens)])
            pairs = experts + layer * 5
            ours = torch.rand(pairs.shape, generator=gen) < 0.6
            if step % 5 == 0:
                ours[:] = False  # a layer step with nothing for the CPU
            flat = torch.where(ours, pairs, -1).reshape(-1)
            weights = torch.rand(tokens * k, generator=gen)
            x = torch.randn(tokens, 16, generator=gen).to(dtype)
            bell.x[:tokens] = x
            bell.pairs[: tokens * k] = flat
            bell.weights[: tokens * k] = weights
            bell.out.fill_(float("nan"))  # a stale partial would show
            answer(words, bell.shape_value(layer, tokens, k))
            keep = flat >= 0
            rows = torch.arange(tokens).repeat_interleave(k)[keep]
            want = torch_cpu_experts(
                x, rows, flat[keep], weights[keep], store.w_gate_up, store.w_down, act, bias
            )
            got = bell.out[:tokens]
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            if act == "swiglu_oai":  # (rounded once where torch rounds op by op: to scale)
                tol = (1e-5 if dtype == torch.float32 else 2 * 2**-8) * want.abs().max()
                assert (got - want).abs().max() <= tol, step
            else:
                assert torch.allclose(got, want, atol=tol, rtol=tol), step
            jobs += bool(keep.any())
            routes += int(keep.sum())
        # a bell naming a layer the listener does not know: counted, answered all the same
        answer(words, bell.shape_value(7, 1, k))
        assert bell.errors == 1
        # the same number again is no new job: nothing is run, nothing answered anew
        bell.out.fill_(float("nan"))
        words[DONE] = -1
        time.sleep(0.05)
        assert words[DONE] == -1 and torch.isnan(bell.out).all()
        counts = bell.fold()
        assert counts[:, JOBS].sum() == jobs and counts[:, ROUTES].sum() == routes
        assert (bell.fold() == 0).all()  # taken
        # the tracker's totals are kept apart: all of it still there once, then nothing
        seconds, experts = bell.totals()
        assert seconds == pytest.approx(counts[:, SECONDS].sum()) and seconds > 0
        assert experts == counts[:, EXPERTS].sum() >= jobs
        assert bell.totals() == (0.0, 0.0)
    finally:
        bell.close()


@pytest.mark.parametrize("name", ["fp8-128x128", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_listener_serves_quantized_experts(name, dtype):
    """Quantized banks through the listener: its partials are the native job's on their
    dequantized copies, bit for bit, and the x buffer holds the model's dtype."""
    from test_cpu_experts import FORMATS, quantized_experts

    w_gate_up, w_down = quantized_experts(FORMATS[name], 64, 32, pairs=15)
    native = NativeCPUExperts.create(w_gate_up, w_down, "silu", threads=1, dtype=dtype)
    dequantized = (bank.dequantize(slice(None), dtype) for bank in (w_gate_up, w_down))
    dense = NativeCPUExperts.create(*dequantized, "silu", threads=1)
    bell = CPUDoorbell(native, 3, threads=1, max_routes=8, device=torch.device("cpu"))
    assert bell.x.dtype == dtype
    words = bell.words.numpy()
    gen = torch.Generator().manual_seed(0)
    try:
        for step in range(6):
            layer, tokens, k = step % 3, 1 + step % 4, 2
            pairs = torch.stack([torch.randperm(5, generator=gen)[:k] for _ in range(tokens)])
            flat = (pairs + layer * 5).reshape(-1)
            flat[torch.rand(flat.shape, generator=gen) < 0.3] = -1  # some routes the GPU's
            flat[0] = layer * 5  # (at least one for the CPU)
            weights = torch.rand(tokens * k, generator=gen)
            x = torch.randn(tokens, 64, generator=gen).to(dtype)
            bell.x[:tokens] = x
            bell.pairs[: tokens * k] = flat
            bell.weights[: tokens * k] = weights
            bell.out.fill_(float("nan"))
            answer(words, bell.shape_value(layer, tokens, k))
            keep = flat >= 0
            rows = torch.arange(tokens).repeat_interleave(k)[keep]
            want = dense(x, rows, flat[keep], weights[keep])
            assert torch.equal(bell.out[:tokens], want), step
        assert bell.errors == 0
    finally:
        bell.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_merge_reads_the_partial_from_host_memory_and_rounds_as_torch(dtype):
    from freetoken.kernels.expert_fill import HostRows
    from freetoken.kernels.host_partial import add_host_partial_

    gen = torch.Generator().manual_seed(0)
    gpu = torch.randn(4, 2048, generator=gen).to(dtype).cuda()
    partial = torch.randn(8 * 2048, generator=gen).pin_memory()
    words = torch.zeros(256, dtype=torch.int32).pin_memory()
    seq = torch.tensor([5, 5], device="cuda")
    rang = torch.tensor(False, device="cuda")
    before = gpu.clone()
    add_host_partial_(gpu, HostRows(partial), HostRows(words), DONE, seq, rang)
    torch.cuda.synchronize()
    assert torch.equal(gpu, before)  # not rung: nothing added, no wait
    want = gpu + partial[: gpu.numel()].view(gpu.shape).cuda().to(dtype)
    words[DONE] = 5  # answered before the merge runs
    rang.fill_(True)
    out = add_host_partial_(gpu, HostRows(partial), HostRows(words), DONE, seq, rang)
    torch.cuda.synchronize()
    assert torch.equal(out, want) and out.data_ptr() == gpu.data_ptr()  # in place
