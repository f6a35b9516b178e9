"""The native host-to-device copier behind cache fills (CUDA only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernels.host_copies import HostToDeviceCopier

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_copies_rows_by_address_on_a_stream():
    copier = HostToDeviceCopier.create()
    assert copier is not None, "the CUDA driver entry point should be found beside torch"
    host = torch.randn(10, 3, 5).pin_memory()
    dev = torch.zeros(4, 3, 5, device="cuda")
    row = host[0].numel() * host.element_size()
    pairs, slots = np.array([7, 2, 9], np.uint64), np.array([3, 0, 1], np.uint64)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    copier.copy(
        dev.data_ptr() + slots * row, host.data_ptr() + pairs * row, np.full(3, row), stream
    )
    stream.synchronize()
    for p, s in zip(pairs.tolist(), slots.tolist(), strict=True):
        assert torch.equal(dev[s].cpu(), host[p])
    assert torch.count_nonzero(dev[2]) == 0  # untouched
