"""`ft`'s argument parser, built a command at a time: each command's function adds its
parser and arguments (`ft launch`'s is launch.py's `add_parser`; the options commands share are
options.py's). A command's parser names the function that runs it (`func`, "module:function"),
imported only once it runs: nothing here imports torch, and `ft --help` stays instant."""

from __future__ import annotations

from pathlib import Path

from freetoken import __version__, settings
from freetoken.cli import args as check
from freetoken.cli import launch
from freetoken.cli.options import (
    CPU_THREADS_HELP,
    DEVICE_HELP,
    add_engine_args,
    add_sampling_args,
)
from freetoken.config import DTYPES, EXPERT_FORMATS, POLICIES, EngineConfig, ServerConfig

# The distribution's name on PyPI (`freetoken` there is another project's).
DISTRIBUTION = "freetoken-moe"
KEY_HELP = f"its key (default: ${settings.API_KEY.name}, if set)"


def build_parser() -> check.Parser:
    parser = check.Parser(
        prog="ft", description="freetoken: serve MoE models larger than your GPU, exactly."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, timed")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__} ({DISTRIBUTION})"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def add_generate(sub) -> None:
    """`ft generate`."""
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


def add_shell(sub) -> None:
    """`ft shell`."""
    shell = sub.add_parser("shell", help="interactive chat with the model")
    add_engine_args(shell)
    add_sampling_args(shell, max_tokens=512)
    shell.add_argument("--system", metavar="TEXT", help="a system prompt (default: none)")
    shell.set_defaults(func="freetoken.cli.shell:run")


def add_serve(sub) -> None:
    """`ft serve`."""
    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback)"
    )
    serve.add_argument(
        "--port", type=check.PORT, default=1919, help="port to bind, 1-65535 (default: %(default)s)"
    )
    serve.add_argument(
        "--api-key",
        help="require this key on every endpoint but /health (default: "
        f"${settings.API_KEY.name} if set, else none)",
    )
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


def add_ctl(sub) -> None:
    """`ft ctl status` and `ft ctl cache`."""
    ctl = sub.add_parser("ctl", help="look at a running server")
    ctl_sub = ctl.add_subparsers(dest="ctl", required=True, metavar="{status,cache}")
    _ctl_status(ctl_sub)
    _ctl_cache(ctl_sub)


def _ctl_status(ctl_sub) -> None:
    """`ft ctl status`."""
    status = ctl_sub.add_parser("status", help="the expert cache, its hit rate and split, KV use")
    status.add_argument(
        "--url", default=launch.DEFAULT_URL, help="the server (default: %(default)s)"
    )
    status.add_argument("--api-key", help=KEY_HELP)
    status.add_argument(
        "--json", action="store_true", help="print /v1/stats as it came (default: a summary)"
    )
    status.set_defaults(func="freetoken.cli.ctl:status")


def _ctl_cache(ctl_sub) -> None:
    """`ft ctl cache`."""
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
        "--url", default=launch.DEFAULT_URL, help="the server (default: %(default)s)"
    )
    resize.add_argument("--api-key", help=KEY_HELP)
    resize.set_defaults(func="freetoken.cli.ctl:cache")


def add_checkpoint(sub) -> None:
    """`ft checkpoint convert` and `ft checkpoint moe-from-dense`."""
    checkpoint = sub.add_parser("checkpoint", help="prepare a checkpoint for fast starts")
    checkpoint_sub = checkpoint.add_subparsers(
        dest="checkpoint", required=True, metavar="{convert,moe-from-dense}"
    )
    _convert(checkpoint_sub)
    _moe_from_dense(checkpoint_sub)


def _convert(checkpoint_sub) -> None:
    """`ft checkpoint convert`."""
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


def _moe_from_dense(checkpoint_sub) -> None:
    """`ft checkpoint moe-from-dense`."""
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


def add_bench(sub) -> None:
    """`ft bench bw` and `ft bench cache`."""
    bench = sub.add_parser("bench", help="measure this machine and the expert cache")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="{bw,cache}")
    _bench_bw(bench_sub)
    _bench_cache(bench_sub)


def _bench_bw(bench_sub) -> None:
    """`ft bench bw`."""
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


def _bench_cache(bench_sub) -> None:
    """`ft bench cache`."""
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


# The commands, in the order `ft --help` lists them.
COMMANDS = (
    add_generate,
    add_shell,
    add_serve,
    launch.add_parser,
    add_ctl,
    add_checkpoint,
    add_bench,
)
