"""Engine settings, built once from CLI flags (or by library users) and passed down.

This module imports nothing heavy (no torch): `ft --help` and the CLI's parser read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# Where routed experts run (moe/runtime.py says what each does).
STRATEGIES = ("auto", "fused", "offload", "cpu", "hybrid", "static")
# How routed experts may be stored (weights/expert_format.py defines each).
EXPERT_FORMATS = (
    "dense",
    "fp8",
    "mxfp4",
    "nvfp4",
    "q8_0",
    "q4_k",
    "q5_k",
    "q6_k",
    "k_mixed",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
)
# The expert cache's eviction policies (moe/policy.py's POLICIES, by name); the first is the
# default.
POLICIES = ("reuse-density", "lru", "expected-next-use", "markov-density")
# The dtypes a model runs in (`--dtype`; auto: the checkpoint's).
DTYPES = ("auto", "float32", "bfloat16", "float16")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*$", re.IGNORECASE)
_UNITS = {
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: str) -> tuple[float, bool]:
    """A count ("300") or a byte size ("8GiB", "512MB"): (the number, whether it is bytes).
    ValueError for anything else."""
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"cannot read {value!r}: give a count (300) or a size (8GiB, 512MB)")
    return (float(m[1]) * _UNITS[m[2].lower()], True) if m[2] else (float(m[1]), False)


@dataclass(frozen=True)
class MoEOptions:
    strategy: str = "auto"
    cache_size: str | None = None  # slots ("512") or bytes ("8GiB"); None: from the budget
    policy: str | None = None  # eviction policy name; None: the default
    max_fetch: int | None = None  # hybrid: at most this many fills per layer step
    cpu_threads: int | None = None  # the CPU expert team; None: usable CPUs minus one
    # How long (microseconds) idle expert threads spin for the next job before sleeping. On the
    # H200 machine spinning 2 ms halved the team's bandwidth beside PCIe copies (46.6 -> 24.4
    # GB/s) and slowed every offload strategy's decode
    # (benchmarks/results/2026-11-29-decode-offload-h200-fold.md).
    cpu_spin_us: float = 0.0
    # How long (microseconds) a team woken ahead of a decode layer's job waits awake for it;
    # 0 turns the early wake-up off (+8-11% tok/s at batch 1 on the H200 machine).
    cpu_prepare_us: float = 2000.0
    # Chunks of at least this many tokens fill every miss they can: the CPU runs long chunks at
    # GEMM speed, far below the GPU, so splitting them loses (streamed prefill replaces this).
    fill_all_from_tokens: int = 32
    # Chunks of at least this many tokens stream whole layers through two buffers
    # (moe/prefill.py); None turns streaming off. A chunk of T tokens with top-k of E experts
    # routes to E * (1 - (1 - k/E)^T) experts per layer: for Qwen3-30B-A3B (k=8, E=128), 112 at
    # 32 tokens and all but 0.03% at 128; from there on-demand filling moves the same bytes as
    # streaming, without the overlap. Streaming ran at 0.97-1.09x the PCIe floor from 1k to 8k
    # tokens on the H200 machine (benchmarks/results/2026-11-29-prefill-h200.md).
    prefill_stream_threshold: int | None = 128
    # `offload` and `hybrid` decide their decode calls on the device (moe/device_control.py,
    # moe/doorbell.py), so a decode step is one CUDA graph with no host in the loop; False
    # keeps the host's decisions.
    device_control: bool = True
    # `offload` and `hybrid` start with every slot filled, the layers' experts in turn (slot
    # s: expert s // L of layer s % L), rather than empty: a slot left empty is a miss paid
    # later, and filling 8 GiB takes 0.2 s at load over PCIe 5.
    warm_cache: bool = True
    # Device-decided decode fills up to this many of the next MoE layer's misses a layer
    # ahead, on routes predicted from the residual stream, while its attention runs
    # (moe/prefetch.py); 0 turns it off.
    prefetch_experts: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown MoE strategy {self.strategy!r}; use one of {STRATEGIES}")
        if self.max_fetch is not None and self.max_fetch < 1:
            raise ValueError("--moe-hybrid-max-fetch must be at least 1")
        if self.prefetch_experts < 0:
            raise ValueError("--moe-prefetch must not be negative")
        if self.cpu_spin_us < 0 or self.cpu_prepare_us < 0:
            raise ValueError("--cpu-spin-us and --cpu-prepare-us must not be negative")


@dataclass(frozen=True)
class ServerConfig:
    """`ft serve`'s own settings (the engine's are EngineConfig's)."""

    api_key: str | None = None  # required on every endpoint but /health when set
    max_request_bytes: int = 8 * 2**20  # larger bodies get 413 before they are read
    # Client chat templates (`chat_template_kwargs.chat_template`) are refused unless allowed;
    # allowed ones render in a worker process killed after `template_timeout_s`.
    allow_request_chat_template: bool = False
    template_timeout_s: float = 2.0
    # SIGTERM: stop admitting, let requests finish for this long, then end the rest (streams
    # with their API's error event) and exit.
    shutdown_timeout_s: float = 10.0


@dataclass(frozen=True)
class EngineConfig:
    model: Path | None = None  # a checkpoint directory (the CLI puts the demo's here when none)
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
    # Drafted tokens verified in one step (engine/speculative.py): "ngram" (prompt lookup),
    # "mtp" (the checkpoint's next-token-prediction layer, engine/mtp.py), "auto" (where a
    # verify step costs about one, the CPU: MTP where the checkpoint has it, else n-gram), "off".
    speculative: str = "auto"
    progress: bool | None = None  # loading progress bar; None: only on a terminal
    # A weight directory's expert banks checked against their checksums before serving (else
    # on a background thread while serving starts; a mismatch stops the engine either way).
    verify_weights: bool = False
    # Quantized checkpoints: routed experts dequantized at load to `dtype` instead of kept
    # quantized (in the host pool, the fills, the cache and the kernels).
    dequantize_experts: bool = False
    moe: MoEOptions = field(default_factory=MoEOptions)  # strategy, cache size, policy
