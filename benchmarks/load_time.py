"""Start to first token, from a safetensors checkpoint and from its weight directory (`ft
checkpoint convert`), beside the bytes / the file system's sequential read bandwidth (a plain
single-threaded read of the same files), with a cold page cache (every file's pages dropped
with posix_fadvise first) and a warm one.

    python benchmarks/load_time.py --layers 8 --work /tmp/lt --tokenizer .carry/tokenizer \
        --out load.md

Each start is a fresh Python process that builds the engine (`LLMEngine.from_config`: load,
runtime, KV) and runs one request to its first token, as `ft serve` does before it answers
(times are from the process's start: imports, weights loaded, engine built, first token)
(the HTTP layer is left out: serve_start.py times it). Random Qwen3-30B-A3B-shaped bf16
weights (benchmarks/checkpoint.py), `hybrid` with an 8 GiB expert cache on CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from checkpoint import write_random_checkpoint, write_random_weight_dir
from decode_offload import qwen3_30b_a3b, report, tiny

from freetoken import settings
from freetoken.models.loading import convert_checkpoint
from freetoken.weights.weight_dir import is_weight_dir

START = """
import json, logging, os, sys, time
t0 = float(sys.argv[2])
if os.environ.get("LOAD_TIME_LOG"):  # the engine's log, each line at its time from t0 (stderr)
    logging.basicConfig(level=logging.DEBUG, format="%(t).3f s %(name)s: %(message)s")
    _factory = logging.getLogRecordFactory()
    def _record(*a, **k):
        r = _factory(*a, **k)
        r.t = r.created - t0
        return r
    logging.setLogRecordFactory(_record)
from freetoken import early_start  # (as ft serve does, before the engine's imports)
early_start.before_imports(sys.argv[1])
from freetoken.config import EngineConfig, MoEOptions
from freetoken.engine import generate
from freetoken.engine.generate import LLMEngine
from freetoken.engine.sampling import SamplingParams
t_import = time.time() - t0
load, loaded_at = generate.load_model, []
def timed_load(*a, **k):
    out = load(*a, **k)
    loaded_at.append(time.time() - t0)
    return out
generate.load_model = timed_load
engine = LLMEngine.from_config(EngineConfig(model=sys.argv[1], kv_cache_tokens=4096,
    moe=MoEOptions(sys.argv[3], sys.argv[4] if sys.argv[4] != "none" else None), progress=False))
t_engine = time.time() - t0
profile = os.environ.get("LOAD_TIME_PROFILE")
if profile:  # (the first step only: a profiler slows the imports' Python 1.7x)
    import cProfile, pstats
    prof = cProfile.Profile()
    prof.enable()
cpu = time.thread_time()
first_req = engine.add_request([1, 2, 3, 4, 5, 6, 7, 8],
                               SamplingParams(max_new_tokens=1, temperature=0.0))
while not engine.step():
    pass
first = time.time() - t0
first_cpu = time.thread_time() - cpu  # (the main thread's; the rest of the step is waits)
if profile:
    prof.disable()
    with open(profile, "w") as f:
        stats = pstats.Stats(prof, stream=f)
        stats.sort_stats("cumulative").print_stats(80)
        stats.sort_stats("tottime").print_stats(40)
# the same step again (other tokens: no prefix reuse), its first-time costs paid
again = time.time()
engine.add_request([9, 10, 11, 12, 13, 14, 15, 16], SamplingParams(max_new_tokens=1,
                                                                   temperature=0.0))
while not engine.step():
    pass
second = time.time() - again
# greedy tokens through decode (untimed): every way of starting must give the same ones
decoded = engine.add_request([17, 3, 5, 7], SamplingParams(max_new_tokens=8, temperature=0.0))
while not decoded.finished:
    engine.step()
print(json.dumps(dict(import_s=t_import, loaded_s=loaded_at[0], engine_s=t_engine,
                      first_token_s=first, first_step_cpu_s=first_cpu, second_step_s=second,
                      tokens=first_req.output_ids + decoded.output_ids)))
"""


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file())


def drop_cache(path: Path) -> None:
    """Evict the directory's files from the page cache (clean pages go without root)."""
    for f in files_of(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_read(path: Path) -> tuple[int, float]:
    """(bytes, seconds) of reading every file once, in order, 16 MiB at a time."""
    total, start = 0, time.perf_counter()
    buf = bytearray(16 * 2**20)
    for f in files_of(path):
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total, time.perf_counter() - start


def start_once(
    model: Path,
    strategy: str,
    cache: str,
    profile: Path | None = None,
    early: bool = True,
    log: Path | None = None,
    readers: int | None = None,
    preload: bool = True,
    mapping: bool = True,
    lock: bool = True,
) -> dict:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        settings.EARLY_READ.name: "1" if early else "0",
        settings.PRELOAD.name: "1" if preload else "0",
        settings.EARLY_MAP.name: "1" if mapping else "0",
        settings.EARLY_LOCK.name: "1" if lock else "0",
    }
    if readers is not None:  # (beside the imports)
        env[settings.EARLY_READERS.name] = str(readers)
    if profile is not None:  # the main thread's calls by cumulative time (cProfile)
        env["LOAD_TIME_PROFILE"] = str(profile)
    if log is not None:
        env["LOAD_TIME_LOG"] = "1"
    t0 = time.time()
    done = subprocess.run(
        [sys.executable, "-c", START, str(model), repr(t0), strategy, cache],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if done.returncode:
        raise SystemExit(f"start from {model} failed:\n{done.stderr[-3000:]}")
    if log is not None:
        log.write_text(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--work", type=Path, default=Path("/tmp/load-time"))
    ap.add_argument("--tokenizer", type=Path, help="Qwen3 tokenizer files to copy")
    ap.add_argument("--strategy", default="hybrid")
    ap.add_argument("--cache", default="8GiB", help="expert cache, or none")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="small shapes, for a smoke test")
    ap.add_argument(
        "--direct",
        action="store_true",
        help="write the weight directory straight (no safetensors first: half the disk; "
        "the safetensors rows are left out)",
    )
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="--direct: a weight directory already at WORK/weight-dir is started "
        "as it is (an earlier run's, same --layers)",
    )
    ap.add_argument("--formats", nargs="+", default=["safetensors", "weight directory"])
    ap.add_argument(
        "--prime",
        action="store_true",
        help="one untimed start first, so kernels compiled on first use are in "
        "their on-disk caches for every timed start (a user's second start)",
    )
    ap.add_argument(
        "--profile", type=Path, help="directory for each start's cProfile of its first step"
    )
    ap.add_argument(
        "--logs",
        type=Path,
        help="directory for each start's engine log, its lines timed from the start",
    )
    ap.add_argument(
        "--early-readers",
        type=int,
        nargs="+",
        default=[None],
        help="early read: its reader threads beside the imports (default: its own "
        "choice), one start each",
    )
    ap.add_argument("--repeat", type=int, default=1, help="starts of each setting")
    ap.add_argument("--page-cache", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    ap.add_argument(
        "--preload",
        nargs="+",
        default=["on"],
        choices=["on", "off"],
        help="torch's native libraries and the CUDA context opened on a thread "
        "beside the tokenizer's load, before the imports (native_preload.py), "
        "as ft serve does, or not",
    )
    ap.add_argument(
        "--map",
        nargs="+",
        default=["on"],
        choices=["on", "off"],
        help="early read: a warm experts.bin mapped read-only from the page cache "
        "(early_read.py), as ft serve does, or read",
    )
    ap.add_argument(
        "--early-lock",
        nargs="+",
        default=["on"],
        choices=["on", "off"],
        help="early read with the preload: the pool page-locked through the driver "
        "beside the imports (early_start.py), as ft serve does, or by the loader "
        "after them",
    )
    ap.add_argument(
        "--early-read",
        nargs="+",
        default=["on"],
        choices=["on", "off"],
        help="weight directory: its banks read from the start (as ft serve does), or by the loader",
    )
    args = ap.parse_args()
    src, dst = args.work / "safetensors", args.work / "weight-dir"
    start = time.perf_counter()
    raw = tiny(args.layers) if args.tiny else qwen3_30b_a3b(args.layers)
    if args.direct:
        args.formats = [f for f in args.formats if f != "safetensors"]
        if not (args.reuse and is_weight_dir(dst)):
            write_random_weight_dir(raw, dst, tokenizer=args.tokenizer)
        written, converted = time.perf_counter() - start, 0.0
    else:
        write_random_checkpoint(raw, src, tokenizer=args.tokenizer)
        written = time.perf_counter() - start
        start = time.perf_counter()
        convert_checkpoint(src, dst, progress=False)
        converted = time.perf_counter() - start
    rows = []
    if args.prime:
        # and Python's bytecode: a read-only environment (the GPU machine's) compiles every
        # module from source at each start otherwise (2,578 of them, 6-8 s there)
        os.environ.setdefault("PYTHONPYCACHEPREFIX", str(args.work / "pycache"))
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # (set there, and here: none written)
        start = time.perf_counter()
        start_once(dst, args.strategy, args.cache)
        print(f"primed (one untimed start) in {time.perf_counter() - start:.1f} s", flush=True)
    for d in (args.profile, args.logs):
        if d:
            d.mkdir(parents=True, exist_ok=True)
    for label, path in (("safetensors", src), ("weight directory", dst)):
        if label not in args.formats:
            continue
        earlies = args.early_read if label == "weight directory" else ["off"]
        runs = [
            (e, r, p, m, k)
            for e in earlies
            for p in args.preload
            for m in (args.map if e == "on" else ["off"])
            for k in (args.early_lock if e == "on" and p == "on" else ["off"])
            for r in (args.early_readers if e == "on" else [None])
        ]
        for rep, cache_state, (early, readers, preload, mapping, lock) in itertools.product(
            range(args.repeat), args.page_cache, runs
        ):  # (repetitions interleaved: a machine's drift spreads over every setting)
            drop_cache(path)
            if cache_state == "warm":
                plain_read(path)  # into the page cache
            nbytes, seconds = plain_read(path)
            drop_cache(path)
            if cache_state == "warm":
                plain_read(path)
            if readers is not None:
                early = f"{early} ({readers} readers)"
            name = (
                f"{label.replace(' ', '-')}-{cache_state}-{early.split()[0]}{readers or ''}"
                f"-preload-{preload}-map-{mapping}-lock-{lock}"
                f"{f'-{rep}' if args.repeat > 1 else ''}"
                ".txt"
            )
            profile = args.profile / name if args.profile else None
            log = args.logs / name if args.logs else None
            t = start_once(
                path,
                args.strategy,
                args.cache,
                profile,
                early != "off",
                log,
                readers,
                preload == "on",
                mapping == "on",
                lock == "on",
            )
            floor = seconds  # the same bytes at the plain read's bandwidth
            rows.append(
                dict(
                    format=label,
                    page_cache=cache_state,
                    early_read=early,
                    preload=preload,
                    mapped=mapping,
                    early_lock=lock,
                    gb=nbytes / 1e9,
                    plain_read_gb_s=nbytes / seconds / 1e9,
                    floor_s=floor,
                    **t,
                    ratio=t["first_token_s"] / floor,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    lines = [
        f"# load_time: Qwen3-30B-A3B shape, {args.layers} layers, random bf16, "
        f"{args.strategy} {args.cache}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"checkpoint written in {written:.0f} s, converted in {converted:.0f} s"
        + (" (the weight directory written straight)" if args.direct else "")
        + ("; kernels compiled before the timed starts (--prime)" if args.prime else ""),
        "",
        "| format | page cache | early read | preload | pool mapped | early lock | GB | "
        "plain read GB/s | "
        "floor s | "
        "imports s | weights loaded s | engine built s | first token s | first token / floor | "
        "first step s (main thread's CPU s) | same step again s | greedy tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['page_cache']} | {r['early_read']} | {r['preload']} | "
            f"{r['mapped']} | {r['early_lock']} | "
            f"{r['gb']:.1f} | "
            f"{r['plain_read_gb_s']:.2f} | "
            f"{r['floor_s']:.1f} | {r['import_s']:.1f} | {r['loaded_s']:.1f} | "
            f"{r['engine_s']:.1f} | {r['first_token_s']:.1f} | {r['ratio']:.2f} | "
            f"{r['first_token_s'] - r['engine_s']:.2f} ({r['first_step_cpu_s']:.2f}) | "
            f"{r['second_step_s']:.2f} | {' '.join(map(str, r['tokens']))} |"
        )
    report(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
