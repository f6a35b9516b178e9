"""DeepSeek-V4's attention and hyper-connection kernels (kernels/compressed_decode.py,
kernels/hyper_mix.py) against their torch definitions, the whole tiny model run both ways:
under Triton's interpreter on the CPU (CI), compiled on CUDA where present. The prompt crosses
the window, several compression boundaries and the indexer's top-k, and decode steps follow,
so every kernel runs in prefill and in decode."""

from __future__ import annotations

import pytest
import torch

from compiled import COMPILED, run_compiled
from freetoken.engine.runner import ModelRunner
from freetoken.kernels import compressed_decode, hyper_mix, lightning_index
from freetoken.models.loading import load_model
from interpreted import run_interpreted
from tiny_models import build

needs_triton = pytest.mark.skipif(compressed_decode.triton is None, reason="needs Triton")
# (prompts of 21 and 14 tokens: past the window, CSA's and HCA's boundaries, the indexer's top-k
# of 5 entries; 4 steps: each sequence's decode crosses an HCA boundary, 21 -> 25 past 24, 14 ->
# 18 past 16. The interpreter's time is the prefill's programs, one a token: prompts of 45 and
# 38 took twice as long, 6 steps held a CI worker ~5 min on a 2-core Zen 1)
PROMPT, STEPS = 21, 4


KERNELS = [
    (compressed_decode, "rope_tail"),
    (compressed_decode, "pool_entries"),
    (compressed_decode, "attend"),
    (hyper_mix, "hc_normed"),
    (hyper_mix, "hc_collapse"),
    (hyper_mix, "hc_merge"),
    (lightning_index, "index_scores"),  # (decode steps only)
]


def _counted(module, name: str, counts: dict):
    launch = getattr(module, name)

    def counting(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return launch(*args, **kwargs)

    return counting


def _run(loaded, device: str, kernels: bool, counts: dict, batch=2) -> list[torch.Tensor]:
    """Logits of a prompt per sequence (different lengths), then of STEPS decode steps, with
    the kernels on or off (on the CPU, they run under the interpreter), counting launches."""
    takes = (lambda x: True) if kernels else (lambda x: False)
    saved = (
        compressed_decode.kernel_takes,
        hyper_mix.streams_kernel_takes,
        lightning_index.kernel_takes,
    )
    launches = [getattr(module, name) for module, name in KERNELS]
    compressed_decode.kernel_takes = hyper_mix.streams_kernel_takes = takes
    lightning_index.kernel_takes = takes
    for module, name in KERNELS:
        setattr(module, name, _counted(module, name, counts))
    try:
        runner = ModelRunner(loaded, kv_cache_tokens=512, page_size=8)
        gen = torch.Generator().manual_seed(5)
        seqs = [runner.new_sequence() for _ in range(batch)]
        prompts = [
            torch.randint(0, 160, (PROMPT - 7 * i,), generator=gen).tolist() for i in range(batch)
        ]
        out = [runner.forward(seqs, prompts, all_logits=True).float().cpu()]
        for _ in range(STEPS):
            ids = [[int(torch.randint(0, 160, (1,), generator=gen))] for _ in seqs]
            out.append(runner.forward(seqs, ids).float().cpu())
        return out
    finally:
        (
            compressed_decode.kernel_takes,
            hyper_mix.streams_kernel_takes,
            lightning_index.kernel_takes,
        ) = saved
        for (module, name), launch in zip(KERNELS, launches, strict=True):
            setattr(module, name, launch)


def largest_error(path: str, dtype: str = "float32", device: str = "cpu", typical=False):
    """(the kernels' largest (`typical`: median) logit difference from the torch path, the
    launches of each kernel (none with the kernels off)), blocks made small so that the prompt
    crosses many (a pooled window's 8 rows in 2 blocks)."""
    compressed_decode.POOL_ROWS, compressed_decode.KEYS, lightning_index.KEYS = 4, 16, 16
    loaded = load_model(path, dtype=dtype, device=device)
    off: dict = {}
    ref = _run(loaded, device, False, off)
    counts: dict = {}
    ours = _run(loaded, device, True, counts)
    assert not off, off
    errors = torch.cat([(a - b).abs().flatten() for a, b in zip(ours, ref, strict=True)])
    return (errors.median() if typical else errors.max()).item(), counts


def _check(error: float, counts: dict, bound: float, graphs: bool = False) -> None:
    assert error < bound
    # every kernel ran, in prefill and in each decode step (1 + STEPS forwards; the indexer's
    # scores in the decode steps, which on CUDA are graph replays after the first few: those
    # launch the kernels without calling their Python)
    assert all(counts.get(name, 0) >= 1 + STEPS for _, name in KERNELS[:-1]), counts
    assert counts.get("index_scores", 0) >= (1 if graphs else STEPS), counts


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    path, _ = build("deepseek_v4", tmp_path_factory.mktemp("v4k") / "m")
    return str(path)


@needs_triton
def test_the_kernels_compute_the_reference_under_the_interpreter(v4_path):
    error, counts = run_interpreted(
        "test_compressed_decode", "largest_error", v4_path, "float32", "cpu", timeout=900
    )
    _check(error, counts, 1e-4)


def _split_against_whole() -> dict:
    """The decode attention with its keys split across programs and walked by one program, on
    the same pages (two sequences, a window and entries, some of them none): the largest
    difference, the largest output and the splits. (The model-level case above checks the
    walk by one program against torch; run whole under the interpreter with every walk split,
    the tiny model took ~2 min more of CI, nearly all of it in the other kernels.)"""
    gen = torch.Generator().manual_seed(7)
    b, heads, d, page, window, ratio, n_entries = 2, 16, 32, 8, 16, 4, 40
    pool = torch.randn(256, 1, 2 * d, generator=gen)  # K=V rows in columns [0, d), entries [d, 2d)
    table = torch.randperm(32, generator=gen).view(b, 16)  # 16 pages of 8 rows a sequence
    positions = torch.tensor([120, 70])
    ids = torch.randint(0, 17, (b, n_entries), generator=gen)  # windows that end before 70
    ids[1, -5:] = -1
    q, sinks = torch.randn(b, heads, d, generator=gen), torch.randn(heads, generator=gen)
    args = (q, pool, table, torch.arange(b), positions, page, window, 0, ids, ratio, d, sinks, 0.1)
    compressed_decode.KEYS = 16
    compressed_decode.SPLIT_BLOCKS = 10**6
    whole = compressed_decode.attend(*args)
    compressed_decode.SPLIT_BLOCKS = 1
    split = compressed_decode.attend(*args)
    blocks = -(-(window + n_entries) // compressed_decode.KEYS)
    return {
        "splits": compressed_decode.key_splits(b, blocks),
        "difference": (split - whole).abs().max().item(),
        "largest": whole.abs().max().item(),
    }


@needs_triton
def test_split_keys_attend_as_one_program_walking_them_all():
    got = run_interpreted("test_compressed_decode", "_split_against_whole")
    assert got["splits"] == 4 and got["largest"] > 0.1
    assert got["difference"] < 1e-5 * got["largest"], got


def test_keys_split_only_where_few_programs_walk_many_blocks():
    programs, blocks = compressed_decode.SPLIT_PROGRAMS, compressed_decode.SPLIT_BLOCKS
    assert compressed_decode.key_splits(programs, 100 * blocks) == 1  # enough programs
    assert compressed_decode.key_splits(4, 2 * blocks - 1) == 1  # keys too few
    assert compressed_decode.key_splits(4, 2 * blocks) == 2
    assert compressed_decode.key_splits(4, 100 * blocks) == programs // 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_kernels_compute_the_reference_on_cuda(v4_path):
    _check(*largest_error(v4_path, "float32", "cuda"), 1e-4, graphs=True)
    # bf16: the kernels round as the torch code does, but sums run in other orders, and a last-bit
    # difference may tip a near-tie (an expert's or a window's choice) at a few positions: most
    # logits agree to bf16 rounding
    _check(*largest_error(v4_path, "bfloat16", "cuda", typical=True), 0.02, graphs=True)


def _compile_release_attention() -> list[dict]:
    """The decode attention compiled for sm_90 (tests/compiled.py) at DeepSeek-V4-Flash's
    shapes (64 heads of 512, a window of 128, an HCA layer's 1,024 entries at 128k tokens), bf16:
    at batch 1 (its keys split) and batch 16 (one program a head block)."""
    for batch in (1, 16):
        q = torch.randn(batch, 64, 512).bfloat16()
        pool = torch.randn(4096, 1, 1536).bfloat16()
        table = torch.arange(256).view(1, -1).expand(batch, -1).contiguous()
        rows, positions = torch.arange(batch), torch.full((batch,), 4000)
        ids = torch.arange(1024).expand(batch, -1).contiguous()
        args = (q, pool, table, rows, positions, 16, 128, 0, ids, 128, 512, torch.zeros(64), 0.04)
        compressed_decode.attend(*args)
    return COMPILED


@needs_triton
def test_the_decode_attention_compiles_for_sm90_with_its_keys_split_and_not():
    compiled = run_compiled("test_compressed_decode", "_compile_release_attention")
    names = [c["name"] for c in compiled]
    assert names.count("_attend_split_kernel") == 2 and "_attend_kernel" in names, names
