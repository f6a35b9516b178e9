"""The host round trip of a layer step the host decides: the routing brought back to the host
in one transfer, and the host's decisions sent to the device without waiting.

Every buffer is pinned (on CUDA) and made once per name and shape: a copy from pageable memory
first waits for the stream, and here the stream holds the fills.
"""

from __future__ import annotations

import time

import numpy as np
import torch


class RoundTrip:
    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[tuple, object] = {}  # see `pinned` and `fetch`

    def to_device(self, host, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A host array or tensor (converted to `dtype`) on the device, through a pinned buffer
        on CUDA (from pageable memory a copy first waits for the stream, here for the fills)."""
        if self.device.type != "cuda":
            host = torch.as_tensor(host)
            return host if dtype is None else host.to(dtype)
        return self.pinned(host, name, dtype).to(self.device, non_blocking=True)

    def pinned(self, host, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`host` (an array or tensor) copied, as `dtype`, into this runtime's pinned buffer
        for `name` and its shape, so the copy to the device is truly asynchronous. One buffer
        serves every layer: the next layer's round trip waits for the stream, so the copy out
        of it is done by then. Numpy data of the buffer's dtype is copied by numpy (a torch op
        costs 5-40 us of host time on the H200 machine)."""
        dtype = dtype or torch.as_tensor(host).dtype
        key = (name, tuple(host.shape), dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(host.shape, dtype=dtype, pin_memory=self.device.type == "cuda")
            self._buffers[key] = buf
        if isinstance(host, np.ndarray) and dtype in (torch.int64, torch.float32):
            buf.numpy()[...] = host
        else:
            buf.copy_(torch.as_tensor(host))
        return buf

    def fetch(self, tensors: list[torch.Tensor], packed=None) -> tuple[list, float]:
        """Copy device tensors to the host as one transfer with one synchronisation (each
        copy costs ~30 us of host time on the H200 machine; packing them, one kernel, which a
        decode graph runs itself: `packed`). The host views of a shape are made once. Returns
        the views and the seconds spent waiting for the device."""
        if self.device.type != "cuda":
            return tensors, 0.0
        if packed is None:
            packed = pack_bytes(tensors)
        key = ("round trip", packed.numel(), *((t.shape, t.dtype) for t in tensors))
        staged = self._buffers.get(key)
        if staged is None:
            host = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=True)
            staged = self._buffers[key] = (host, unpack_bytes(host, tensors))
        host, views = staged
        host.copy_(packed, non_blocking=True)
        waited = time.perf_counter()
        torch.cuda.current_stream(self.device).synchronize()
        return views, time.perf_counter() - waited


def _packing_order(tensors: list[torch.Tensor]) -> list[int]:
    # Widest elements first: every part then starts at a multiple of its element size, so the
    # byte buffer can be viewed back as each dtype in place.
    return sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())


def pack_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, concatenated into one uint8 tensor (see `unpack_bytes`)."""
    return torch.cat(
        [tensors[i].contiguous().reshape(-1).view(torch.uint8) for i in _packing_order(tensors)]
    )


def unpack_bytes(packed: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `packed` with the shapes and dtypes of `like` (the tensors packed)."""
    out: list[torch.Tensor] = [packed] * len(like)
    offset = 0
    for i in _packing_order(like):
        t = like[i]
        nbytes = t.numel() * t.element_size()
        out[i] = packed[offset : offset + nbytes].view(t.dtype).reshape(t.shape)
        offset += nbytes
    return out
