"""Host-to-device copies of expert rows, many in one native call (`host_copies.c`).

A decode step fills a few experts per layer, two rows each (gate/up and down). Queued through
torch, each copy cost 30-50 us of host time on the H200 machine, against a few for the driver
call itself; over 16 layers that was several milliseconds per token.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from freetoken.kernels import native

_P = ctypes.c_void_p


class HostToDeviceCopier:
    """Build with `create`, which returns None where the library or the CUDA driver is not
    there (the caller then copies with torch)."""

    def __init__(self, lib):
        self._lib = lib

    @classmethod
    def create(cls) -> HostToDeviceCopier | None:
        lib = native.load("host_copies")
        if lib is None:
            return None
        lib.ft_copies_init.restype = ctypes.c_int
        lib.ft_copy_h2d.argtypes = [ctypes.c_int64, _P, _P, _P, _P]
        lib.ft_copy_h2d.restype = ctypes.c_int
        if lib.ft_copies_init() != 0:
            return None
        return cls(lib)

    def copy(
        self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, stream: torch.cuda.Stream
    ) -> None:
        """Queue copies of nbytes[i] from host address src[i] to device address dst[i] on
        `stream` (uint64 arrays of one length)."""
        dst, src, nbytes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dst, src, nbytes))
        err = self._lib.ft_copy_h2d(
            len(dst), dst.ctypes.data, src.ctypes.data, nbytes.ctypes.data, stream.cuda_stream
        )
        if err != 0:
            raise RuntimeError(f"host-to-device copy failed (CUDA error {err})")
