"""CUDA graphs of the decode step, cut at the MoE layers whose experts need the host.

Eager PyTorch launches each of a decode step's ~50 kernels per layer from Python; on the H200
machine that cost 10-25 us each, several times the GPU work at batch 1. A captured graph
replays them in one launch.

An MoE executor whose call runs on the device alone (`capturable`: `fused`, and `offload`
deciding on the device, moe/device_control.py) is captured with the rest, so the whole step is
one graph. The other strategies decide on the host, per layer, which experts to copy or run on
the CPU: the step is captured as one graph per stretch between those decisions. During capture
the model runs its ordinary forward; when it reaches an MoE executor, the current graph ends, a
static output buffer stands in for the executor's result, and the next graph begins. A replay
then alternates: graph 0, executor of MoE layer 0 (eager, its result copied into the buffer
that graph 1 reads), graph 1, ... An executor that splits into a host and a device phase (the
offload runtime's `host_phase` / `device_phase`) is folded instead: the host phase runs between
the graphs and leaves each route's slot and the CPU partial in buffers, and the next graph
begins with the layer's GPU experts, so the host launches no kernel of its own for them (three
Triton launches cost ~250 us of host time per layer on the H200 machine, one graph launch ~120
us). Attention reads each sequence's length and page-table row on the device
(kernels/paged_attention.py), so one capture serves a batch size at every context length; a
replay copies in one packed buffer of the step's values (tokens, positions, write slots, rows,
lengths, and the recurrent state slots that linear-attention layers gather and scatter their
sequences' states by), and the page table the graphs read is the cache's own, kept up to date by
ForwardBatch.build.

A verify step of speculative decoding (a few tokens per sequence, every token's logits) is
captured the same way, per (tokens, sequences): attention takes each token as a sequence of its
own (`ForwardBatch.per_query`), its row and length data like a decode step's.

A shape is captured the second time it is seen: the first run is eager and warms up what a
capture cannot do (kernel compilation, library handles).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from freetoken.kv.batch import ForwardBatch
from freetoken.kv.paged import PagedKVCache
from freetoken.kv.recurrent import RecurrentStatePool
from freetoken.layers import concurrent

log = logging.getLogger(__name__)

# Captured shapes kept (each holds its own activation memory): batch sizes, and verify steps
# by their tokens.
MAX_CAPTURES = 16


@dataclass
class _HostStep:
    """An MoE executor call between two graphs: its inputs are outputs of the graph before it.
    Either its result goes into `out`, an input of the graph after it; or (a folded layer) its
    host phase fills `slots` and `partial`, from which the graph after it computes the
    layer's GPU share itself."""

    executor: object
    moe_layer: int
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    partial: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # the host phase's inputs, packed by the graph before

    def run(self) -> None:
        if self.out is None:
            self.executor.host_phase(
                self.moe_layer,
                self.x,
                self.ids,
                self.weights,
                self.slots,
                self.partial,
                self.packed,
            )
        else:
            self.out.copy_(self.executor(self.moe_layer, self.x, self.ids, self.weights))


@dataclass
class _Capture:
    batch: ForwardBatch  # static inputs
    graphs: list[torch.cuda.CUDAGraph]
    steps: list[_HostStep]
    logits: torch.Tensor  # static output


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv: PagedKVCache,
        states: RecurrentStatePool | None = None,
        by_table_width: bool = False,
    ):
        """`by_table_width`: the model's decode reads as many page-table columns as a capture
        fixes (DSA's indexer, DeepSeek-V4's compressed attention): a shape is then also its
        width (`ForwardBatch.table_pages`), so short contexts do not read the whole table."""
        self.model, self.kv, self.states = model, kv, states
        self.by_table_width = by_table_width
        self.captures: OrderedDict[tuple, _Capture] = OrderedDict()
        self.seen: set[tuple] = set()
        self.eager: set[tuple] = set()  # shapes whose capture ran out of device memory
        self.replays = 0
        self.captured_now = False  # whether the last `run` captured its shape

    def reset(self) -> None:
        """Forget every capture (what they read was replaced: the expert cache resized)."""
        self.captures.clear()
        self.seen.clear()
        self.eager.clear()

    def key(self, batch: ForwardBatch, all_logits: bool = False) -> tuple:
        # (a verify step's tokens and sequences fix its shapes; how they split among the
        # sequences is data: each token's row and length, `ForwardBatch.per_query`)
        shape = (batch.num_tokens, len(batch.counts), all_logits)
        return (*shape, batch.table_pages()) if self.by_table_width else shape

    def run(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor | None:
        """Logits [B, V] of a decode batch (one new token per sequence) from its graphs, or
        of every token [T, V] (`all_logits`, a verify step: a few tokens per sequence),
        capturing them on the second sighting; None when the caller should run this step
        eagerly."""
        key = self.key(batch, all_logits)
        capture = self.captures.get(key)
        self.captured_now = False
        if capture is None:
            if key not in self.seen or key in self.eager:
                self.seen.add(key)
                return None
            try:
                capture = self._capture(batch, all_logits)
            except torch.cuda.OutOfMemoryError:
                # A graph keeps its activations (long key tables make them large): without
                # room for them this shape runs eagerly, as it would with graphs off.
                log.warning("no device memory to capture decode graphs for %s: eager", key)
                self.eager.add(key)
                torch.cuda.empty_cache()
                return None
            self.captures[key] = capture
            self.captured_now = True
            if len(self.captures) > MAX_CAPTURES:
                self.captures.popitem(last=False)
        self.captures.move_to_end(key)
        capture.batch.packed.copy_(batch.packed, non_blocking=True)
        with torch.inference_mode():  # the static tensors were made under it, by the capture
            for i, graph in enumerate(capture.graphs):
                graph.replay()
                if i < len(capture.steps):
                    capture.steps[i].run()
        self.replays += 1
        return capture.logits.clone()

    def _capture(self, batch: ForwardBatch, all_logits: bool) -> _Capture:
        static = batch.views_of(batch.packed.clone())
        device = batch.input_ids.device
        pool = torch.cuda.graph_pool_handle()
        graphs: list[torch.cuda.CUDAGraph] = []
        steps: list[_HostStep] = []
        moe_blocks = [layer.moe for layer in self.model.layers if hasattr(layer, "moe")]
        executors = [block.executor for block in moe_blocks]

        def begin() -> None:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            graphs.append(graph)

        def cut(executor):
            def at_executor(moe_layer, x, ids, weights):
                capturable = getattr(executor, "capturable", None)
                if capturable is not None and capturable(x.shape[0], ids.numel()):
                    return executor(moe_layer, x, ids, weights)  # no host decision: in-graph
                # (no branch of a layer may stay unjoined across the cut: layers/concurrent.py)
                concurrent.join_all()
                foldable = getattr(executor, "foldable", None)
                if foldable is not None and foldable(x.shape[0], ids.numel()):
                    # The graph packs what the host phase reads back; the layer's GPU kernel
                    # joins the next graph (one launch fewer per layer, from the host's point
                    # of view), reading what the host phase leaves.
                    packed = executor.pack_round_trip(x, ids, weights)
                    graphs[-1].capture_end()
                    slots = torch.full(ids.shape, -1, dtype=torch.long, device=x.device)
                    partial = torch.zeros_like(x)
                    steps.append(
                        _HostStep(
                            executor, moe_layer, x, ids, weights, None, slots, partial, packed
                        )
                    )
                    begin()
                    return executor.device_phase(x, slots, weights, partial)
                graphs[-1].capture_end()
                # Nothing ran during the capture, so there is nothing to compute yet: a buffer
                # of the result's shape stands in, filled by the executor at every replay.
                out = torch.empty_like(x)
                steps.append(_HostStep(executor, moe_layer, x, ids, weights, out))
                begin()
                return out

            return at_executor

        torch.cuda.synchronize(device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        for block, executor in zip(moe_blocks, executors, strict=True):
            block.executor = cut(executor)
        try:
            with torch.cuda.stream(stream):
                begin()
                logits = self.model(static, self.kv, all_logits=all_logits, states=self.states)
                graphs[-1].capture_end()
        except BaseException:
            # Leave no stream capturing (a failed capture, out of memory say): end the graph
            # in progress, if any; the original error is the one to report.
            with contextlib.suppress(Exception), torch.cuda.stream(stream):
                concurrent.join_all()
                graphs[-1].capture_end()
            raise
        finally:
            for block, executor in zip(moe_blocks, executors, strict=True):
                block.executor = executor
        torch.cuda.current_stream(device).wait_stream(stream)
        key = self.key(batch, all_logits)
        log.debug("captured decode graphs for %s: %d segments", key, len(graphs))
        return _Capture(static, graphs, steps, logits)
