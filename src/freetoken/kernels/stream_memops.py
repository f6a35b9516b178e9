"""CUDA stream memory operations (the driver's cuStreamWriteValue32 / cuStreamWaitValue32),
through ctypes: a stream writes a 32-bit word, or waits until a word holds a value, in its
order with the kernels around it. Both are captured into CUDA graphs (as memory-operation
nodes), so a graph can signal the host and wait for its answer with no host call at replay:
the device side of moe/doorbell.py. Words live in mapped pinned host memory; under unified
addressing their host address is their device address.

A write is preceded by a system-wide memory fence (the default flags): everything the stream
wrote before it, to device or host memory, is visible to the host once the word is.
"""

from __future__ import annotations

import ctypes
import functools

import torch

WAIT_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ


@functools.cache
def _driver():
    """The driver's two functions, or None where they cannot be had."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fns = []
    for name in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
        fn = getattr(lib, name + "_v2", None) or getattr(lib, name, None)
        if fn is None:
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        fns.append(fn)
    return tuple(fns)


def available() -> bool:
    return torch.cuda.is_available() and _driver() is not None


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def write(address: int, value: int) -> None:
    """The current stream sets the word at `address` to `value` once its earlier work is done."""
    err = _driver()[0](_stream(), address, value, 0)
    if err:
        raise RuntimeError(f"cuStreamWriteValue32 failed (CUDA error {err})")


def wait_equal(address: int, value: int) -> None:
    """The current stream waits until the word at `address` equals `value`."""
    err = _driver()[1](_stream(), address, value, WAIT_EQ)
    if err:
        raise RuntimeError(f"cuStreamWaitValue32 failed (CUDA error {err})")
