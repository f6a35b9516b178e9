"""Decode speed of every MoE strategy on a Qwen3-30B-A3B-shaped random bf16 model.

    python benchmarks/decode_offload.py --layers 16 --cache 8GiB --cache 37% --out results.md
    python benchmarks/decode_offload.py --shape gpt-oss-20b --layers 24 \
        --routing trace:../shared/traces/gpt-oss-20b-decode.npz --cache 10% --cache 25%

Builds the model in memory (random weights: no checkpoint to write or read), measures B_P,
B_H and both at once with the same code as `ft bench bw`, then for each cache size builds every
strategy and batch size, warms each up, and times them in turns for `--rounds` rounds of
`--steps` tokens; it reports the median round's tokens/s and the rounds' spread, the expert-cache
hit rate, mean fills q and CPU misses m - q per layer step, PCIe bytes per token, and the
ratio to a roofline: the time the step's expert bytes need at the measured bandwidths (hits
at HBM speed, fills at B_P', CPU misses at B_H', or both together for hybrid), which ignores
attention and every overhead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from freetoken.config import EXPERT_FORMATS, MoEOptions
from freetoken.engine.runner import ModelRunner
from freetoken.kernels import expert_fill
from freetoken.layers import concurrent
from freetoken.models.decoder import DecoderModel
from freetoken.models.families import family_for
from freetoken.models.loading import LoadedModel
from freetoken.moe.bandwidth import measure
from freetoken.moe.store import HostExpertStore
from freetoken.weights.expert_format import DENSE, ExpertFormat, expert_format

# Host phases of a layer step that the runtime times (telemetry `<name>_s`).
HOST_PHASES = ("round_trip", "plan", "cpu_start", "fill", "policy")
HBM_BANDWIDTH = 4.0e12  # H200 device-to-device copy measured at ~4.3 TB/s (read + write)


def qwen3_30b_a3b(layers: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2048,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    }


def gpt_oss_20b(layers: int) -> dict:
    """gpt-oss-20b (24 layers of 32 experts, top-4, hidden and expert width 2880): attention
    sinks, sliding-window (128) and full layers in turn, biased experts, YaRN (the release
    stores its experts MXFP4: `--expert-format mxfp4`)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 201088,
        "hidden_size": 2880,
        "num_hidden_layers": layers,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 2880,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "attention_bias": True,
        "layer_types": [
            ("sliding_attention" if i % 2 == 0 else "full_attention") for i in range(layers)
        ],
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    }


def deepseek_v3(layers: int) -> dict:
    """DeepSeek-V3's shapes (latent attention; 256 experts of 84 MiB, top-8 in groups), its
    first layer dense (the release has three), cut to `layers`."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 129280,
        "hidden_size": 7168,
        "num_hidden_layers": layers,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
    }


def glm_4_5_air(layers: int) -> dict:
    """GLM-4.5-Air's shapes: 128 experts of 33 MiB, top-8, a shared expert, partial RoPE."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "vocab_size": 151552,
        "hidden_size": 4096,
        "num_hidden_layers": layers,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    }


def qwen3_5_35b_a3b(layers: int) -> dict:
    """Qwen3.5-35B-A3B's text model: gated DeltaNet layers, full attention every fourth, 256
    experts of 6 MiB, top-8, a shared expert."""
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "layer_types": [
            ("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)
        ],
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e7,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
    }


def qwen3_next_80b_a3b(layers: int) -> dict:
    """Qwen3-Next-80B-A3B: gated DeltaNet layers, full attention every fourth, 512 experts of
    6 MiB, top-10, a shared expert."""
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2048,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "intermediate_size": 5120,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e7,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "partial_rotary_factor": 0.25,
    }


def kimi_linear_48b_a3b(layers: int) -> dict:
    """Kimi-Linear-48B-A3B (its release's config.json, cut to `layers`): KDA layers with MLA
    (no RoPE) every fourth and last, 256 experts of 13.5 MiB, top-8, a shared expert, the first
    layer dense."""
    full = [i for i in (4, 8, 12, 16, 20, 24, 27) if i <= layers]
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 163840,
        "hidden_size": 2304,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 9216,
        "moe_intermediate_size": 1024,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-5,
        "model_max_length": 1048576,
        "tie_word_embeddings": False,
        "linear_attn_config": {
            "full_attn_layers": full,
            "num_heads": 32,
            "head_dim": 128,
            "kda_layers": [i for i in range(1, layers + 1) if i not in full],
            "short_conv_kernel_size": 4,
        },
    }


def qwen3_5_35b_a3b_full_attention(layers: int) -> dict:
    """Qwen3.5-35B-A3B's shape with every layer full attention: the hybrid model's peer of
    about the same active size (27 against 34 M parameters a layer outside the experts), to
    compare the hybrid model's decode with."""
    return {**qwen3_5_35b_a3b(layers), "layer_types": ["full_attention"] * layers}


def deepseek_v4_flash(layers: int) -> dict:
    """DeepSeek-V4-Flash's shapes (transformers' DeepseekV4Config defaults are the release's):
    256 experts of 24 MiB in bf16 (13 MiB as the release's MXFP4: `--expert-format mxfp4`),
    top-6, a shared expert, hidden 4096, one 512-wide K=V head for 64 query heads, hyper-
    connections of 4 streams; the first `layers` of its 43 layer kinds (hash-routed MoE in the
    first three; HCA, then CSA and HCA in turn)."""
    kinds = ["heavily_compressed_attention"] * 3 + [
        "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
        for i in range(3, 43)
    ]
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_hidden_layers": layers,
        "layer_types": kinds[:layers],
        "mlp_layer_types": (["hash_moe"] * 3 + ["moe"] * 40)[:layers],
        "max_position_embeddings": 1048576,
        "tie_word_embeddings": False,
    }


def glm_5(layers: int) -> dict:
    """GLM-5's shapes (transformers' GlmMoeDsaConfig defaults are the release's, 744B): hidden
    6144, latent attention with DSA's indexer (top-2048 tokens), 256 experts of 72 MiB in bf16
    (20 MiB as NVFP4: `--expert-format nvfp4`), top-8, a shared expert; its first layer dense (the
    release has three), cut to `layers`."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": 154880,
        "hidden_size": 6144,
        "num_hidden_layers": layers,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "q_lora_rank": 2048,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": 32,
        "indexer_types": ["full"] * layers,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 202752,
        "tie_word_embeddings": False,
    }


def minimax_m2(layers: int) -> dict:
    """MiniMax-M2's shapes (its release's config.json): 256 experts of 27 MiB, top-8 by sigmoid
    scores with a correction bias, q/k norms over all heads, RoPE on half of each head."""
    return {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "model_type": "minimax_m2",
        "vocab_size": 200064,
        "hidden_size": 3072,
        "num_hidden_layers": layers,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 1536,
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
        "rotary_dim": 64,
        "rope_theta": 5000000,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "qk_norm_type": "per_layer",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 196608,
        "tie_word_embeddings": False,
    }


def gemma4_26b_a4b(layers: int) -> dict:
    """Gemma-4-26B-A4B's text model (its release's text_config): 128 experts of 11 MiB, top-8,
    beside a dense MLP in every layer; five sliding layers (window 1024) to one full one, the
    full ones with 512-wide heads and values from the keys; tied embeddings."""
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": 262144,
        "hidden_size": 2816,
        "num_hidden_layers": layers,
        "intermediate_size": 2112,
        "moe_intermediate_size": 704,
        "num_experts": 128,
        "top_k_experts": 8,
        "enable_moe_block": True,
        "sliding_window": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "num_global_key_value_heads": 2,
        "global_head_dim": 512,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
        ],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": True,
    }


def kimi_k2_6(layers: int) -> dict:
    """Kimi-K2.6 (K2.5's layout): DeepSeek-V3's text model with 384 experts of 84 MiB, top-8,
    64 heads, one group, its first layer dense, in `text_config` beside a vision tower (kept
    small here: it takes no part in decoding text). The release's experts are INT4
    (compressed-tensors), which freetoken does not read: bf16 here."""
    text = {
        **deepseek_v3(layers),
        "model_type": "kimi_k2",
        "vocab_size": 163840,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "n_routed_experts": 384,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "rope_theta": 50000.0,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-5,
    }
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": dict(
            hidden_size=64, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2
        ),
        "tie_word_embeddings": False,
    }


SHAPES = {
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "gpt-oss-20b": gpt_oss_20b,
    "deepseek-v3": deepseek_v3,
    "deepseek-v4-flash": deepseek_v4_flash,
    "glm-5": glm_5,
    "glm-4.5-air": glm_4_5_air,
    "qwen3.5-35b-a3b": qwen3_5_35b_a3b,
    "qwen3.5-35b-a3b-full-attention": qwen3_5_35b_a3b_full_attention,
    "qwen3-next-80b-a3b": qwen3_next_80b_a3b,
    "kimi-linear-48b-a3b": kimi_linear_48b_a3b,
    "minimax-m2": minimax_m2,
    "gemma-4-26b-a4b": gemma4_26b_a4b,
    "kimi-k2.6": kimi_k2_6,
}


def tiny(layers: int) -> dict:
    """A small model of the same structure, to smoke-test this script on any machine."""
    raw = qwen3_30b_a3b(layers)
    raw.update(
        vocab_size=1000,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        moe_intermediate_size=64,
        num_experts=32,
        num_experts_per_tok=4,
    )
    return raw


def report(lines: list[str], out: Path | None) -> None:
    """Print a result table (the benchmarks' common ending) and write it to `out` if given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        out.write_text(text)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_model(raw: dict, device: torch.device, fmt: ExpertFormat = DENSE) -> LoadedModel:
    cfg = family_for(raw).parse_config(raw)
    model = DecoderModel.empty(cfg, torch.bfloat16, device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():  # (DeepSeek-V4's hash layers: experts by token id)
                p.random_(0, cfg.moe.num_experts)
            elif "norm" in name:  # unit scale: 1, or 0 where the norm applies 1 + w
                p.fill_(0.0 if cfg.zero_centered_norm else 1.0)
            else:
                p.normal_(0, 0.02)
    store = HostExpertStore.for_model(cfg, torch.bfloat16, fmt)
    # Random experts, a block of them repeated (the decode speed depends on the bytes moved,
    # not on their values; routing comes from the random router).
    store.fill_random_()
    return LoadedModel(model.eval(), cfg, Path("random"), raw, store)


def contender_options(label: str, **fields) -> MoEOptions:
    """MoEOptions of a contender label: a strategy, or `offload:host` / `hybrid:host` (the
    strategy with its decode decisions on the host, as before device control)."""
    strategy, _, variant = label.partition(":")
    if variant not in ("", "host"):
        raise SystemExit(f"unknown contender {label!r}: a strategy, or STRATEGY:host")
    return MoEOptions(strategy=strategy, device_control=variant != "host", **fields)


class UniformRouter(torch.nn.Module):
    """Router logits drawn at random for every token: each token's experts are a uniform
    random top-k, with no reuse between tokens or layers. A random-weight model's own router
    sends nearly every token to the same experts (98% cache hits at any size), which would
    measure nothing of the miss path; real models sit between the two.

    A prefetch's prediction (moe/prefetch.py) cannot be learned from random logits, so it is
    modelled: the prediction call draws the layer's logits for the coming call and keeps
    them, and gets them back with each of the chosen top-k dropped with probability
    1 - `recall` (the next best, random experts, take their places); the layer's own call then
    routes by the kept logits."""

    def __init__(self, num_experts: int, top_k: int, recall: float = 1.0):
        super().__init__()
        self.num_experts, self.top_k, self.recall = num_experts, top_k, recall
        self.predicting = False  # set around MoEBlock.prefetch (use_uniform_routing)
        self._kept: dict[int, torch.Tensor] = {}  # per call size: the predicted call's logits
        self._ready = None  # the prediction's event (it ran on the prefetch's side stream)
        self._pending = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The default generator: CUDA graphs advance it at every replay (a private one cannot
        # be captured).
        shape = (x.shape[0], self.num_experts)
        if self.predicting:
            logits = torch.randn(shape, device=x.device, dtype=x.dtype)
            kept = self._kept.setdefault(x.shape[0], torch.empty_like(logits))
            kept.copy_(logits)
            dropped = mispredicted(logits, self.top_k, self.recall)
            if x.device.type == "cuda":
                self._ready = torch.cuda.Event()
                self._ready.record()
            self._pending = True
            return logits.masked_fill(dropped, -1e4)
        if self._pending:
            self._pending = False
            if self._ready is not None:
                torch.cuda.current_stream(x.device).wait_event(self._ready)
            return self._kept[x.shape[0]]
        return torch.randn(shape, device=x.device, dtype=x.dtype)


def mispredicted(logits: torch.Tensor, top_k: int, recall: float) -> torch.Tensor:
    """Which of each row's top-k a prediction misses: each with probability 1 - recall (the
    next best take their places)."""
    chosen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    chosen.scatter_(1, logits.topk(top_k, dim=-1).indices, True)
    return chosen & (torch.rand(logits.shape, device=logits.device) >= recall)


def use_uniform_routing(loaded: LoadedModel, seed: int = 0, recall: float = 1.0) -> None:
    torch.manual_seed(seed)
    moe = loaded.config.moe
    for layer in loaded.model.layers:
        if hasattr(layer, "moe"):
            block = layer.moe
            block.router = UniformRouter(moe.num_experts, moe.top_k, recall)
            block.prefetch = predicting(block.prefetch, block.router)


def predicting(prefetch, router):
    """`prefetch` with the router told that it predicts meanwhile (`router.predicting`)."""

    def run(*args, **kwargs):
        router.predicting = True
        try:
            prefetch(*args, **kwargs)
        finally:
            router.predicting = False

    return run


class TraceRouter(torch.nn.Module):
    """Router logits that make top-k pick what a real routing trace picked (moe/trace.py): MoE
    layer l of the model routes row i of a call like layer l % L of trace token
    (cursor + i * stride) % N, with the trace's router probabilities as gate weights where it
    has them. Rows of one call are sequences of a batch: `stride` keeps them far apart in the
    trace (different requests, as in serving) rather than consecutive tokens of one. The
    cursor lives on the device and the last MoE layer advances it, so a CUDA graph replays the
    trace token after token."""

    def __init__(
        self, experts, probs, layer: int, num_experts: int, cursor, stride: int, last: bool
    ):
        super().__init__()
        self.experts, self.probs, self.layer = experts, probs, layer % experts.shape[1]
        self.num_experts, self.cursor, self.stride, self.last = num_experts, cursor, stride, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.experts.shape[0]
        rows = (self.cursor + torch.arange(x.shape[0], device=x.device) * self.stride) % n
        ids = self.experts[rows, self.layer]
        logits = torch.full((x.shape[0], self.num_experts), -1e4, device=x.device, dtype=x.dtype)
        logits.scatter_(1, ids, torch.log(self.probs[rows, self.layer]).to(x.dtype))
        if self.last:
            self.cursor.add_(1)
        return logits


def read_trace(loaded: LoadedModel, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing trace's experts and router probabilities (equal where it has none), tokens
    back to back ([tokens, layers, top_k] each, on the model's device), checked against the
    model's routing."""
    from freetoken.moe.trace import load_trace

    trace = load_trace(path)
    moe = loaded.config.moe
    if trace.top_k != moe.top_k or trace.num_experts > moe.num_experts:
        raise SystemExit(
            f"trace {path}: top-{trace.top_k} of {trace.num_experts} experts does not fit a "
            f"model of top-{moe.top_k} of {moe.num_experts} (use a shape that matches)"
        )
    device = next(loaded.model.parameters()).device
    experts = torch.as_tensor(trace.routes(), device=device)
    with np.load(path) as z:
        names = [f"probs_{int(r['index']):04d}" for r in trace.meta["requests"]]
        if all(name in z.files for name in names):
            probs = np.concatenate([z[name].astype(np.float32) for name in names])
        else:
            probs = np.full(experts.shape, 1.0 / trace.top_k, dtype=np.float32)
    return experts, torch.as_tensor(probs, device=device).clamp_min(1e-6)


def use_trace_routing(loaded: LoadedModel, path: str, max_batch: int = 8) -> dict:
    """Route every MoE layer by the trace at `path`; returns what was read (for the report)."""
    experts, probs = read_trace(loaded, path)
    moe = loaded.config.moe
    device = experts.device
    cursor = torch.zeros((), dtype=torch.long, device=device)
    blocks = [layer.moe for layer in loaded.model.layers if hasattr(layer, "moe")]
    stride = max(1, experts.shape[0] // max_batch)
    for i, block in enumerate(blocks):
        block.router = TraceRouter(
            experts, probs, i, moe.num_experts, cursor, stride, last=i == len(blocks) - 1
        )
    return {"tokens": experts.shape[0], "layers": experts.shape[1], "top_k": experts.shape[2]}


@dataclass
class Contender:
    """One (strategy, batch size) under test: its runner, its sequences, its decode inputs
    and the seconds of each timed round."""

    runner: ModelRunner
    seqs: list
    tokens: list  # decode steps still to run: [batch] token ids each
    batch: int
    seconds: list[float] = field(default_factory=list)
    host_seconds: float = 0.0  # in runner.forward (all the host's work of a step but the wait)
    side_streams: bool = False  # layers/concurrent.py ON_GPU while it runs
    fill_programs: int = 0  # kernels/expert_fill.py FILL_PROGRAMS while it runs (0: uncapped)

    def step(self) -> None:
        began = time.perf_counter()
        logits = self.runner.forward(self.seqs, [[t] for t in self.tokens.pop(0)])
        self.host_seconds += time.perf_counter() - began
        # The sampler's wait for the step, as in serving: the next step's inputs depend on it
        # (and hybrid times its ways of stepping from one step's start to the next's).
        logits[:, 0].max().item()


@contextmanager
def switches(side_branches: bool, fill_programs: int):
    """The engine's switches a contender runs under (read where a step is captured or runs
    eagerly): a layer's side branches (layers/concurrent.py) and the fill kernel's grid cap
    (kernels/expert_fill.py; 0: one program a block); the defaults again after."""
    concurrent.ON_GPU, expert_fill.FILL_PROGRAMS = side_branches, fill_programs or None
    try:
        yield
    finally:
        concurrent.ON_GPU, expert_fill.FILL_PROGRAMS = False, None


def prepare(loaded, options: MoEOptions, batch, steps, warmup, prompt, device) -> Contender:
    """A runner with `batch` sequences past their prompt and `warmup` decode steps, with
    inputs for `steps` more."""
    runner = ModelRunner(
        loaded, kv_cache_tokens=batch * (prompt + steps + warmup + 16), moe=options
    )
    gen = torch.Generator().manual_seed(0)
    seqs = [runner.new_sequence() for _ in range(batch)]
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(0, vocab, (prompt,), generator=gen).tolist() for _ in range(batch)]
    # Decode inputs are drawn at random: a random model's greedy output repeats one token, so
    # its routing would repeat too and every cache would look perfect.
    tokens = torch.randint(0, vocab, (warmup + steps, batch), generator=gen).tolist()
    contender = Contender(runner, seqs, tokens, batch)
    runner.forward(seqs, prompts)
    for _ in range(warmup):
        contender.step()
    runner.moe.telemetry.reset()
    contender.host_seconds = 0.0
    return contender


def time_round(contender: Contender, steps: int, device) -> None:
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        contender.step()
    sync(device)
    contender.seconds.append(time.perf_counter() - start)


def close(contender: Contender, device) -> tuple[str, int, dict]:
    """The contender's resolved strategy, cache slots and telemetry; frees its runner."""
    moe = contender.runner.moe
    snap = moe.telemetry.snapshot()
    slots = moe.cache.num_slots if moe.cache is not None else 0
    if moe.cpu is not None:
        moe.cpu.shutdown()
    contender.runner = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return moe.strategy, slots, snap


def roofline_tokens_per_s(strategy, snap, layers, expert_bytes, batch, bw, moe) -> float:
    """Tokens/s if each layer step took only its expert bytes at the measured bandwidths."""
    t = snap["total"]
    calls = max(1, t["calls"])
    per_step_layers = calls / layers  # layer steps per decode step (one per layer)
    hits = t["hits"] / per_step_layers
    # (experts prefetched a layer ahead crossed PCIe too: counted as fills)
    fills = (t["fills"] + t["prefetches"]) / per_step_layers
    cpu = t["cpu"] / per_step_layers
    if strategy == "fused":
        # Expected distinct experts of `batch` independent tokens, each routed to top_k of E.
        e, k = moe.num_experts, moe.top_k
        hits, fills, cpu = layers * e * (1 - (1 - k / e) ** batch), 0, 0
    gpu_time = hits * expert_bytes / HBM_BANDWIDTH
    if not bw["pcie"]:  # no GPU: everything is one memory pool
        return batch / ((hits + fills + cpu) * expert_bytes / bw["cpu_experts"])
    if strategy == "hybrid":
        miss_time = (fills + cpu) * expert_bytes / (bw["pcie_concurrent"] + bw["cpu_concurrent"])
    else:
        p = bw["pcie_concurrent"] if cpu else bw["pcie"]
        h = bw["cpu_concurrent"] if fills else bw["cpu_experts"]
        miss_time = max(fills * expert_bytes / p, cpu * expert_bytes / h)
    return batch / (gpu_time + miss_time)


def way_medians_ms(modes, batch: int) -> dict:
    """Hybrid's ways of stepping (StepModes): each way's median step in its last trial, ms
    (what the way chosen at the end was chosen over)."""
    medians = {mode: modes.median(batch, mode) for mode in modes.MODES}
    return {mode: round(s * 1e3, 3) for mode, s in medians.items() if s is not None}


def cpu_jobs(total: dict, steps: int, expert_bytes: int) -> dict:
    """The CPU team's share as its jobs ran inside the steps: ms of job time a step and the
    bandwidth they read the experts at (B_H' as the step sees it, handoffs included)."""
    seconds = total["cpu_time_s"]
    return dict(
        cpu_job_ms_per_step=seconds * 1e3 / steps,
        cpu_job_gbs=total["cpu"] * expert_bytes / seconds / 1e9 if seconds > 0 else None,
    )


def bandwidth_line(bw: dict) -> str:
    def gbs(v):
        return "n/a" if v is None else f"{v / 1e9:.1f} GB/s"

    return (
        f"B_P {gbs(bw['pcie'])}, B_H {gbs(bw['cpu_experts'])}, together B_P' "
        f"{gbs(bw['pcie_concurrent'])} and B_H' {gbs(bw['cpu_concurrent'])}"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument(
        "--cache", action="append", help="8GiB, a share of the pool like 37%%, or all (fused)"
    )
    ap.add_argument("--strategy", action="append")
    ap.add_argument("--batch", action="append", type=int)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per contender")
    ap.add_argument(
        "--cpu-threads",
        action="append",
        type=int,
        help="the CPU expert team's size (default: the engine's); given more than once, each "
        "strategy runs with each size, labelled strategy/tN",
    )
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes, for a smoke test")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument(
        "--prefetch",
        action="append",
        type=int,
        help="offload and hybrid: also with this many experts prefetched a layer ahead "
        "(moe/prefetch.py), labelled STRATEGY+pN (default: 0 only)",
    )
    ap.add_argument(
        "--prediction-recall",
        type=float,
        default=1.0,
        help="uniform routing: the share of a layer's experts its prefetch predicts right "
        "(modelled: see UniformRouter)",
    )
    ap.add_argument(
        "--routing",
        default="uniform",
        help="uniform: random top-k per token (see UniformRouter); model: the random router; "
        "trace:FILE: the choices of a real routing trace, token by token (see TraceRouter)",
    )
    ap.add_argument(
        "--expert-format",
        default="dense",
        choices=EXPERT_FORMATS,
        help="how the experts are stored: dense (bf16), or kept quantized (fp8 in 128x128 "
        "blocks, mxfp4, nvfp4)",
    )
    ap.add_argument(
        "--stacked",
        action="store_true",
        help="each layer's projections of one input as one GEMM and the MLPs' gated unit as one "
        "kernel (DecoderModel.stack_projections; on a GPU not the default yet)",
    )
    ap.add_argument(
        "--side-branches",
        action="store_true",
        help="also time each contender with a layer's independent work on a side stream "
        "(layers/concurrent.py ON_GPU; STRATEGY/side)",
    )
    ap.add_argument(
        "--fill-programs",
        type=int,
        action="append",
        help="time each contender with the fill kernel's grid capped at this many programs "
        "(kernels/expert_fill.py FILL_PROGRAMS; 0: one a block, the default; STRATEGY/fillN)",
    )
    args = ap.parse_args()
    caches = args.cache or ["all", "8GiB", "37%"]
    strategies = args.strategy or ["offload", "cpu", "static", "hybrid", "auto"]
    batches = args.batch or [1, 4]
    teams = args.cpu_threads or [None]
    device = torch.device(args.device)
    raw = tiny(args.layers) if args.tiny else SHAPES[args.shape](args.layers)
    loaded = random_model(raw, device, expert_format(args.expert_format))
    if args.stacked:
        loaded.model.stack_projections(dense=True)
    if args.routing == "uniform":
        use_uniform_routing(loaded, recall=args.prediction_recall)
    elif args.routing.startswith("trace:"):
        use_trace_routing(loaded, args.routing.removeprefix("trace:"))
    elif args.routing != "model":
        raise SystemExit(f"unknown --routing {args.routing!r}: uniform, model or trace:FILE")
    store = loaded.experts
    bw_profile = measure(store.shape, device, seconds=0.3 if args.tiny else 1.5)
    bw = {
        k: getattr(bw_profile, k)
        for k in ("pcie", "cpu_experts", "pcie_concurrent", "cpu_concurrent")
    }
    rows = []
    for cache in caches:
        size = cache
        if cache == "all":
            size = None
        elif cache.endswith("%"):
            size = str(int(store.num_pairs * float(cache[:-1]) / 100))
        # Every contender of a cache size is built first, then all are timed in turns, round
        # after round: each one's figure is the median of its rounds, so a drift of the
        # machine (another tenant, a clock change) hits all of them alike.
        contenders = []
        for strategy in ["fused"] if cache == "all" else strategies:
            if strategy == "cpu" and any(r["strategy"].startswith("cpu") for r in rows):
                continue  # no cache: the same at every cache size
            ahead = args.prefetch or [0]
            if not strategy.startswith(("offload", "hybrid")):
                ahead = [0]
            sides = [False, True] if args.side_branches else [False]
            caps = args.fill_programs or [0]
            for batch, threads, p, side, cap in itertools.product(
                batches, teams, ahead, sides, caps
            ):
                options = contender_options(
                    strategy, cache_size=size, cpu_threads=threads, prefetch_experts=p
                )
                total = args.steps * args.rounds
                with switches(side, cap):
                    contender = prepare(
                        loaded, options, batch, total, args.warmup, args.prompt, device
                    )
                contender.side_streams, contender.fill_programs = side, cap
                label = strategy if len(teams) == 1 else f"{strategy}/t{threads}"
                label += f"+p{p}" if p else ""
                label += "/side" if side else ""
                label += f"/fill{cap}" if cap else ""
                contenders.append((label, contender))
        for _ in range(args.rounds):
            for _, contender in contenders:
                with switches(contender.side_streams, contender.fill_programs):
                    time_round(contender, args.steps, device)
        for strategy, contender in contenders:
            batch = contender.batch
            per_round = sorted(batch * args.steps / s for s in contender.seconds)
            tps = per_round[len(per_round) // 2]
            moe = contender.runner.moe
            # hybrid's way of stepping at the end (StepModes), and its trials so far
            way, ways_ms = "", {}
            if moe.kind.splits:
                way = f"{moe.step_modes.current(batch)} ({moe.step_modes.trials(batch)})"
                ways_ms = way_medians_ms(moe.step_modes, batch)
            name, slots, snap = close(contender, device)
            steps = args.steps * args.rounds
            t = snap["total"]
            roof = roofline_tokens_per_s(
                name, snap, args.layers, store.shape.nbytes, batch, bw, loaded.config.moe
            )
            row = dict(
                cache=cache,
                slots=slots,
                strategy=strategy,
                resolved=name,
                batch=batch,
                tokens_per_s=tps,
                spread=(per_round[-1] - per_round[0]) / tps,
                hit_rate=snap["hit_rate"],
                q=snap["mean_fills_per_layer_step"],
                m_minus_q=snap["mean_cpu_per_layer_step"],
                prefetches=snap["mean_prefetches_per_layer_step"],
                pcie_mb_per_token=t["bytes_h2d"] / (steps * batch) / 1e6,
                roofline_tokens_per_s=roof,
                ratio=tps / roof,
                host_ms_per_step=t["host_time_s"] * 1e3 / steps,
                sync_ms_per_step=t["sync_wait_s"] * 1e3 / steps,
                cpu_wait_ms_per_step=t["cpu_wait_s"] * 1e3 / steps,
                phases_ms_per_step={k: t[f"{k}_s"] * 1e3 / steps for k in HOST_PHASES},
                step_ms=sum(contender.seconds) * 1e3 / steps,
                step_host_ms=contender.host_seconds * 1e3 / steps,
                way=way,
                ways_ms=ways_ms,
                **cpu_jobs(t, steps, store.shape.nbytes),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    lines = [
        f"# decode_offload: {'tiny' if args.tiny else args.shape} shape, {args.layers} layers, "
        f"random bf16 weights, experts {args.expert_format}"
        + (", projections stacked" if args.stacked else ""),
        "",
        f"- GPU: {bw_profile.gpu}; CPU: {bw_profile.cpu}; torch {torch.__version__}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; commit: {commit}",
        f"- expert pool: {store.num_pairs} experts, {store.nbytes / 2**30:.1f} GiB; "
        f"{store.shape.nbytes / 2**20:.1f} MiB per expert",
        f"- measured: {bandwidth_line(bw)}",
        f"- {args.rounds} rounds of {args.steps} timed decode steps after {args.warmup} warm-up "
        f"steps, every contender of a cache size timed in turn each round; tok/s is the median "
        f"round, spread (max - min) / median; prompt {args.prompt} tokens; decode inputs drawn "
        f"at random; routing: {args.routing}"
        + (f", prefetch predictions right {args.prediction_recall:.0%}" if args.prefetch else ""),
        "- q, m-q, prefetched: per layer step, fills, CPU misses, and experts copied a layer "
        "ahead (STRATEGY+pN, moe/prefetch.py); the roofline counts the prefetched as fills",
        "- roofline: the step's expert bytes at the measured bandwidths (hits at HBM speed); "
        "step ms is the whole decode step, host ms the host's time in it (the forward call: "
        "the batch, the graph's launch, every host decision; not the sampler's wait), MoE "
        "host ms the host time inside the MoE layers; way: hybrid's way of stepping at the "
        "end (moe/split.py StepModes) and its trials so far",
        "",
        "| cache | strategy | batch | tok/s | spread | hit rate | q | m-q | prefetched "
        "| PCIe MB/tok | roofline tok/s | ratio | step ms | host ms | MoE host ms "
        "| sync wait ms | CPU wait ms | way |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        strat = r["strategy"]
        if strat.startswith("auto"):
            strat = f"{strat} ({r['resolved']})"
        lines.append(
            f"| {r['cache']} ({r['slots']} slots) | {strat} | {r['batch']} | "
            f"{r['tokens_per_s']:.1f} | {r['spread']:.0%} | {r['hit_rate']:.3f} | {r['q']:.2f} | "
            f"{r['m_minus_q']:.2f} | {r['prefetches']:.2f} | {r['pcie_mb_per_token']:.0f} | "
            f"{r['roofline_tokens_per_s']:.1f} | {r['ratio']:.2f} | {r['step_ms']:.1f} | "
            f"{r['step_host_ms']:.2f} | {r['host_ms_per_step']:.1f} | "
            f"{r['sync_ms_per_step']:.1f} | {r['cpu_wait_ms_per_step']:.1f} | {r['way']} |"
        )
    # (hybrid's ways, and the CPU team's jobs inside the steps)
    split_rows = [r for r in rows if r["ways_ms"] or r["cpu_job_gbs"]]
    lines += (
        [
            "",
            "| cache | strategy | batch | split ms | fill ms | cpu ms | CPU job ms/step "
            "| CPU job GB/s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        if split_rows
        else []
    )
    for r in split_rows:
        ways = [r["ways_ms"].get(mode, "") for mode in ("split", "fill", "cpu")]
        gbs = f"{r['cpu_job_gbs']:.1f}" if r["cpu_job_gbs"] else ""
        lines.append(
            f"| {r['cache']} | {r['strategy']} | {r['batch']} | {' | '.join(map(str, ways))} "
            f"| {r['cpu_job_ms_per_step']:.2f} | {gbs} |"
        )
    # (the host's phases: only strategies that decide on the host have any)
    host_rows = [r for r in rows if r["host_ms_per_step"] > 0]
    lines += (
        []
        if not host_rows
        else [
            "",
            "Host time per step inside the MoE layers, by phase (ms; `rest`: moving slots and the "
            "CPU partial to the device, and where a step runs eagerly, the GPU kernels' launches; "
            "on a CPU device, the experts' computation):",
            "",
            "| cache | strategy | batch | " + " | ".join(HOST_PHASES) + " | CPU wait | rest |",
            "|---|---|---|" + "---|" * (len(HOST_PHASES) + 2),
        ]
    )
    for r in host_rows:
        phases = r["phases_ms_per_step"]
        rest = r["host_ms_per_step"] - sum(phases.values()) - r["cpu_wait_ms_per_step"]
        cells = " | ".join(f"{phases[k]:.1f}" for k in HOST_PHASES)
        lines.append(
            f"| {r['cache']} | {r['strategy']} | {r['batch']} | {cells} | "
            f"{r['cpu_wait_ms_per_step']:.1f} | {rest:.1f} |"
        )
    report(lines, args.out)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps({"bandwidth": bw, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
