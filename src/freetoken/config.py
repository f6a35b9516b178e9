"""Engine settings, built once from CLI flags (or by library users) and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from freetoken.moe.runtime import MoEOptions


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class EngineConfig:
    model: Path | None = None  # None: the built-in demo checkpoint
    dtype: str = "auto"  # auto follows the checkpoint; float32 | bfloat16 | float16
    device: str | None = None  # None: cuda when available, else cpu
    # KV capacity shared by all running sequences; None: one sequence of max_model_len, within
    # a quarter of free memory (engine/runner.py).
    kv_cache_tokens: int | None = None
    max_model_len: int | None = None  # longest sequence served; None: the model's context
    page_size: int = 16
    max_batch_size: int = 4  # sequences decoded together
    # Prompt tokens per forward; longer prompts span several steps, with the running requests'
    # decode steps between them. With experts offloaded, every chunk streams the whole expert
    # pool over PCIe once (moe/prefill.py), so chunks are large: on the H200 machine an 8k
    # chunk ran at 1.09x that transfer's time, where 2k chunks would pay it four times as often
    # (benchmarks/results/2026-11-29-prefill-h200.md).
    max_prefill_chunk: int = 8192
    prefix_cache: bool = True  # reuse the KV of prompt prefixes seen before (kv/radix.py)
    # Hybrid models (linear attention): recurrent states kept at edit boundaries so a prefix
    # can be reused (kv/anchors.py); each costs one sequence's state (74 MiB on Qwen3-Next-80B).
    state_anchors: int = 16
    cuda_graphs: bool = True  # replay decode steps from CUDA graphs (engine/cuda_graphs.py)
    progress: bool | None = None  # loading progress bar; None: only on a terminal
    moe: MoEOptions = field(default_factory=MoEOptions)  # strategy, cache size, policy

    def resolved_device(self) -> torch.device:
        return torch.device(self.device or default_device())
