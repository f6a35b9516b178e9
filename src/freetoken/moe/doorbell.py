"""The CPU's share of a layer the device decides, handed to the CPU team from inside the decode
graph, so `hybrid`'s decode step, like `offload`'s, is one graph replay with no host call and
no host-facing graph node of its own (stream memory operations cost ~1.8 us of host launch
time and ~1.9 us of GPU time each on the H200 machine: three a layer added 0.15 ms of launch
to a 16-layer step).

Per layer step of T tokens (R = T x k routes), in the graph's stream order:

    the plan (moe/device_control.py)      writes the CPU's routes, gate weights and the
                                          activations straight into `pairs`, `weights` and
                                          `x` (mapped pinned memory); if the CPU has any
                                          route, `shape` = T << 20 | k << 12 | layer + 1 and,
                                          last, with a system-scope release, `seq` = a new
                                          number (also kept on the device, in `seq_device`)
    fills, the GPU's experts              while the CPU team computes its share
    merge (kernels/host_partial.py)       if the CPU had routes: spin until `done` holds the
                                          number, then GPU output += the fp32 partial read
                                          from `out` in host memory, in the layer's dtype

The listener (a native thread of kernels/cpu_listener.c) watches `seq`, runs the job on the
team and answers by writing the number to `done`. Each word is written by one side only and
never cleared (a store from the SMs to a word the CPU writes can sit in the GPU's L2 where the
device then reads it instead of the CPU's answer). A layer step with nothing for the CPU (every
one when the whole pool is cached) rings nothing and its merge returns at once. Layers are
strictly in order (a layer rings only after the last one's answer came), so one set of buffers
serves every layer and batch size. The listener counts jobs, routes, seconds and experts per
layer; `totals` feeds the bandwidth tracker between steps, `fold` the telemetry when it is
read.

On the CPU tier (CI) there is no graph and no listener: the runtime runs the same routes on
the executor at once (`MoERuntime._cpu_share`).
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.kernels.cache_control import SEQ_WORD, SHAPE_WORD
from freetoken.kernels.cpu_experts import EXPERT_ARGS, NativeCPUExperts
from freetoken.kernels.cpu_team import I64, INT, D, P, Signatures, declare
from freetoken.kernels.expert_fill import HostRows
from freetoken.kernels.host_partial import add_host_partial_

# int32 words of `words`, 256 bytes apart: never in one line of the GPU's L2 (128 bytes)
SEQ, SHAPE, DONE = SEQ_WORD, SHAPE_WORD, 128
JOBS, ROUTES, SECONDS, EXPERTS = range(4)  # the listener's counters per layer
# How long the listener spins after a job before it polls every 20 us: decode steps come
# back to back, and a step's first layer should not wait for a sleeping thread.
IDLE_SPIN_SECONDS = 0.05
# seq, shape, done, pairs, weights, x, x_bf16, out, max_routes, dtype, experts, H, I, act,
# threads, stats, layers, idle_spin, prepare
LISTENER_ARGS = [P, P, P, P, P, P, INT, P, I64, INT, *EXPERT_ARGS, I64, I64, INT, INT, P, I64, D, D]
SIGNATURES: Signatures = {  # the listener's (cpu_listener.c)
    "ft_listener_start": (LISTENER_ARGS, P),
    "ft_listener_stop": ([P], None),
}
declare(SIGNATURES)


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
        banks (dense or quantized), dtype and activation the listener's jobs use; `threads`: the
        team threads of each job."""
        on_cuda = device.type == "cuda"
        self.device, self.max_routes = device, max_routes
        routes, hidden = max_routes, experts.hidden
        bf16 = experts.dtype == torch.bfloat16  # the model's (quantized experts: decoded so)
        self.words = torch.zeros(DONE + 64, dtype=torch.int32, pin_memory=on_cuda)
        # [the last number rung, the one the current layer's merge waits for]
        self.seq_device = torch.zeros(2, dtype=torch.long, device=device)
        self.pairs = torch.full((routes,), -1, dtype=torch.long, pin_memory=on_cuda)
        self.weights = torch.zeros(routes, dtype=torch.float32, pin_memory=on_cuda)
        self.x = torch.zeros(routes, hidden, dtype=experts.dtype, pin_memory=on_cuda)
        self.out = torch.zeros(routes, hidden, dtype=torch.float32, pin_memory=on_cuda)
        self._out_rows, self._word_rows = HostRows(self.out), HostRows(self.words)  # for kernels
        # per layer [L, 4]; then their sums (what the tracker reads each step: two numbers,
        # where summing the layers' took 26-60 us of host time on the H200 machine), then the
        # steps not served (its first value)
        self.stats = np.zeros((num_layers + 2, 4))
        self._layers = num_layers
        self._folded = self.stats[:num_layers].copy()  # what `fold` last returned up to
        self._totalled = (0.0, 0.0)  # what `totals` last returned up to
        self._lib = experts.lib
        self._handle = self._lib.ft_listener_start(
            self._word(SEQ),
            self._word(SHAPE),
            self._word(DONE),
            self.pairs.data_ptr(),
            self.weights.data_ptr(),
            self.x.data_ptr(),
            bf16,
            self.out.data_ptr(),
            routes,
            experts.dtype_code,
            *experts.expert_args,
            hidden,
            experts.intermediate,
            experts.act_code,
            threads,
            self.stats.ctypes.data,
            num_layers,
            IDLE_SPIN_SECONDS,
            prepare_seconds,
        )
        if not self._handle:
            raise RuntimeError("could not start the CPU doorbell's listener thread")

    def _word(self, index: int) -> int:
        return self.words.data_ptr() + 4 * index

    @property
    def inputs(self) -> tuple[HostRows, HostRows, HostRows]:
        """Where the plan writes the CPU's share (DeviceControl's `cpu_inputs`)."""
        return HostRows(self.pairs), HostRows(self.weights), HostRows(self.x)

    @property
    def signal(self) -> tuple[HostRows, torch.Tensor]:
        """What the plan rings with (DeviceControl's `bell`): the words, the device's numbers."""
        return self._word_rows, self.seq_device

    @staticmethod
    def shape_value(moe_layer: int, tokens: int, top_k: int) -> int:
        """The `shape` word of a layer step: what the listener reads the step's shape from."""
        assert moe_layer < 4095 and top_k < 256 and tokens < 4096
        return tokens << 20 | top_k << 12 | (moe_layer + 1)

    def merge_(self, gpu: torch.Tensor, rang: torch.Tensor, stamp=None) -> None:
        """gpu [T, H] (contiguous) += the CPU's partial, once the listener has answered, if
        the plan rang (`rang`: its flag on the device); then, with a `stamp`, the device's
        clock written there (moe/split.py `StepClock`)."""
        add_host_partial_(gpu, self._out_rows, self._word_rows, DONE, self.seq_device, rang, stamp)

    def fold(self) -> np.ndarray:
        """The listener's counters per layer since the last call: [L, 4] (jobs, routes,
        seconds, experts). Read while steps run: each is a double the listener adds to."""
        now = self.stats[: self._layers].copy()
        delta, self._folded = now - self._folded, now
        return delta

    def totals(self) -> tuple[float, float]:
        """(seconds, experts) of every layer's jobs since the last call (kept apart from
        `fold`'s: the tracker reads these each step, the telemetry those when it is read)."""
        sums = self.stats[self._layers]
        now = (float(sums[SECONDS]), float(sums[EXPERTS]))
        (seconds, experts), self._totalled = self._totalled, now
        return now[0] - seconds, now[1] - experts

    @property
    def errors(self) -> int:
        """Layer steps the listener could not serve (computed as a zero partial)."""
        return int(self.stats[self._layers + 1, 0])

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
