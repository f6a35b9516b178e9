"""The CPU's share of a layer the device decides, handed to the CPU team from inside the decode
graph, so `hybrid`'s decode step, like `offload`'s, is one graph replay with no host call.

Per layer step of T tokens (R = T x k routes), in the graph's stream order:

    the plan (moe/device_control.py)      writes the CPU's routes, gate weights and the
                                          activations straight into `pairs`, `weights` and
                                          `x` (mapped pinned memory)
    bell = T << 20 | k << 12 | layer + 1  a stream memory write, fenced after all of the above
    fills, the GPU's experts              while the CPU team computes its share
    wait until done == bell; done = 0     stream memory operations (kernels/stream_memops.py)
    merge                                 GPU output + the fp32 partial read from `out` in
                                          host memory, in the layer's dtype
                                          (kernels/host_partial.py)

The listener (a native thread of kernels/cpu_experts.c) watches the bell, runs the job on the
team and answers in `done`. Layers are strictly in order (a layer rings only after the last
one's answer came), so one set of buffers serves every layer and batch size. The listener
counts jobs, routes, seconds and experts per layer; `fold` feeds them to the bandwidth
tracker and the telemetry between steps.

On the CPU tier (CI) there is no graph and no listener: the runtime runs the same routes on
the executor at once (`MoERuntime._cpu_share`).
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.kernels import stream_memops
from freetoken.kernels.cpu_experts import NativeCPUExperts
from freetoken.kernels.expert_fill import HostRows
from freetoken.kernels.host_partial import add_host_partial

# int32 words of `words`, 256 bytes apart: never in one line of the GPU's L2 (128 bytes)
BELL, DONE = 0, 64
JOBS, ROUTES, SECONDS, EXPERTS = range(4)  # the listener's counters per layer
# How long the listener spins after a job before it polls every 20 us: decode steps come
# back to back, and a step's first layer should not wait for a sleeping thread.
IDLE_SPIN_SECONDS = 0.05


class CPUDoorbell:
    def __init__(
        self,
        experts: NativeCPUExperts,
        num_layers: int,
        threads: int,
        max_routes: int,
        device: torch.device,
        prepare_seconds: float = 2e-3,
    ):
        """`experts`: the native kernel's view of the host pool (the CPU executor's), whose
        banks, dtype and activation the listener's jobs use; `threads`: the team threads of
        each job."""
        on_cuda = device.type == "cuda"
        if on_cuda and not stream_memops.available():
            raise RuntimeError("the device's doorbell needs CUDA's stream memory operations")
        self.device, self.max_routes = device, max_routes
        routes, hidden = max_routes, experts.hidden
        bf16 = experts.w_gate_up.dtype == torch.bfloat16
        self.words = torch.zeros(128, dtype=torch.int32, pin_memory=on_cuda)
        self.pairs = torch.full((routes,), -1, dtype=torch.long, pin_memory=on_cuda)
        self.weights = torch.zeros(routes, dtype=torch.float32, pin_memory=on_cuda)
        self.x = torch.zeros(routes, hidden, dtype=experts.w_gate_up.dtype, pin_memory=on_cuda)
        self.out = torch.zeros(routes, hidden, dtype=torch.float32, pin_memory=on_cuda)
        self._out_rows = HostRows(self.out)  # what the merge reads
        self.stats = np.zeros((num_layers, 4))
        self._folded = self.stats.copy()
        self._lib = experts.lib
        self._handle = self._lib.ft_listener_start(
            self._word(BELL), self._word(DONE), self.pairs.data_ptr(), self.weights.data_ptr(),
            self.x.data_ptr(), bf16, self.out.data_ptr(), routes, experts.dtype_code,
            experts.w_gate_up.data_ptr(), experts.w_down.data_ptr(), hidden,
            experts.intermediate, experts.act_code, threads, self.stats.ctypes.data, num_layers,
            IDLE_SPIN_SECONDS, prepare_seconds,
        )  # fmt: skip
        if not self._handle:
            raise RuntimeError("could not start the CPU doorbell's listener thread")

    def _word(self, index: int) -> int:
        return self.words.data_ptr() + 4 * index

    @property
    def inputs(self) -> tuple[HostRows, HostRows, HostRows]:
        """Where the plan writes the CPU's share (DeviceControl's `cpu_inputs`)."""
        return HostRows(self.pairs), HostRows(self.weights), HostRows(self.x)

    @staticmethod
    def bell_value(moe_layer: int, tokens: int, top_k: int) -> int:
        """The bell of a layer step: what the listener reads the step's shape from."""
        assert moe_layer < 4095 and top_k < 256 and tokens < 4096
        return tokens << 20 | top_k << 12 | (moe_layer + 1)

    def ring(self, moe_layer: int, tokens: int, top_k: int) -> None:
        stream_memops.write(self._word(BELL), self.bell_value(moe_layer, tokens, top_k))

    def merge(self, moe_layer: int, top_k: int, gpu: torch.Tensor) -> torch.Tensor:
        """gpu [T, H] + the CPU's partial, once the listener has answered."""
        bell = self.bell_value(moe_layer, gpu.shape[0], top_k)
        stream_memops.wait_equal(self._word(DONE), bell)
        stream_memops.write(self._word(DONE), 0)
        return add_host_partial(gpu.contiguous(), self._out_rows)

    def fold(self) -> np.ndarray:
        """The listener's counters per layer since the last call: [L, 4] (jobs, routes,
        seconds, experts). Read while steps run: each is a double the listener adds to."""
        now = self.stats.copy()
        delta, self._folded = now - self._folded, now
        return delta

    @property
    def errors(self) -> int:
        """Layer steps the listener could not serve (computed as a zero partial)."""
        return int(self._lib.ft_listener_errors(self._handle)) if self._handle else 0

    def close(self) -> None:
        """Stop the listener (after the device has finished every step that rings it)."""
        if self._handle:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._lib.ft_listener_stop(self._handle)
            self._handle = None

    def __del__(self) -> None:
        if getattr(self, "_handle", None):
            self.close()
