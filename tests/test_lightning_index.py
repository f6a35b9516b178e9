"""The Lightning Indexer's scores read in place from the pages (kernels/lightning_index.py)
against the torch definitions: the scores themselves (every token, DSA's candidates; each
window's closing row, DeepSeek-V4's), and DSA models' logits with the kernel on and off. Under
Triton's interpreter on the CPU (CI); compiled for sm_90 at the releases' shapes; on CUDA where
present (V4's whole-model comparison is tests/test_compressed_decode.py's)."""

from __future__ import annotations

import pytest
import torch

from compiled import COMPILED, SM90_SHARED, run_compiled
from freetoken.engine.runner import ModelRunner
from freetoken.kernels import lightning_index
from freetoken.kernels.lightning_index import PagedKeys, index_scores
from freetoken.models.loading import load_model
from interpreted import run_interpreted
from tiny_models import build

needs_triton = pytest.mark.skipif(lightning_index.triton is None, reason="needs Triton")
PAGE = 4


def _paged(heads: int, d: int, dtype, device="cpu", column=3, width=40, pages=24, seqs=2):
    """A pool of shuffled pages holding `seqs` sequences' rows, with queries and weights."""
    gen = torch.Generator().manual_seed(heads * 10 + d)
    pool = torch.randn(pages * PAGE, 1, width, generator=gen).to(dtype)
    table = torch.randperm(pages, generator=gen).view(seqs, -1)
    q = torch.randn(seqs, heads, d, generator=gen).to(dtype)
    weights = torch.randn(seqs, heads, generator=gen)
    rows = torch.arange(seqs)
    keys = PagedKeys(pool.to(device), column, table.to(device), rows.to(device), PAGE)
    return q.to(device), weights.to(device), keys


def _reference(q, weights, keys: PagedKeys, valid, scale, d):
    j = torch.arange(keys.count, device=q.device)
    positions = keys.first + j * keys.stride
    table = keys.page_table[keys.rows[:, None], positions // keys.page_size]
    slots = table * keys.page_size + positions % keys.page_size
    rows = keys.pool[slots, 0, keys.column : keys.column + d].float()  # [B, count, d]
    dots = torch.relu(torch.einsum("bhd,bkd->bhk", q.float(), rows)) * scale
    scores = (dots * weights[..., None]).sum(1)
    return scores.masked_fill(j[None] >= valid[:, None], float("-inf"))


CASES = [  # heads, d, dtype, DSA's candidates (else V4's)
    (4, 8, torch.float32, True),
    (20, 24, torch.float32, False),
    (3, 16, torch.bfloat16, True),
    (20, 24, torch.bfloat16, False),
]


def _score_errors(device: str = "cpu", bf16: bool = True) -> list[float]:
    """Per case: the largest difference from the reference where finite, or inf if the
    kernel's -inf (past `valid`) are elsewhere. (Not bf16 under the interpreter: its tl.dot of
    bf16 tiles is wrong, by 1e10 on a 16 x 16 product, in Triton 3.6.)"""
    lightning_index.KEYS = 16  # (so the candidates cross blocks)
    out = []
    for heads, d, dtype, every in CASES if bf16 else CASES[:2]:
        q, weights, keys = _paged(heads, d, dtype, device)
        keys = keys.every(45) if every else keys.closing(11, 4)
        valid = torch.tensor([45, 30] if every else [11, 5], device=device)
        if every:  # (DSA's: fp32 weights, scaled)
            ours = index_scores(q, weights, keys, valid, d**-0.5)
        else:  # (V4's: the columns of a stacked bf16 projection, scaled in the kernel)
            wide = torch.cat([weights, weights[:, :3]], dim=1).to(torch.bfloat16)
            weights = wide[:, :heads]
            ours = index_scores(q, weights, keys, valid, d**-0.5, weight_scale=heads**-0.5)
            weights = weights.float() * heads**-0.5
        ref = _reference(q, weights, keys, valid, d**-0.5, d)
        finite = ref.isfinite()
        if not torch.equal(finite, ours.isfinite()):
            out.append(float("inf"))
        else:
            out.append((ours - ref)[finite].abs().max().item())
    return out


def _dsa_error(path: str, device: str = "cpu") -> tuple[float, int]:
    """The largest logit difference of a DSA model's decode steps with the kernel on and off
    (prompts longer than the indexer's top-k, one of them crossing pages), and its launches."""
    lightning_index.KEYS = 16
    loaded = load_model(path, dtype="float32", device=device)
    launches = {"n": 0}
    launch = lightning_index.index_scores

    def counted(*args):
        launches["n"] += 1
        return launch(*args)

    lightning_index.index_scores = counted
    runs = []
    for on in (False, True):
        lightning_index.kernel_takes = lambda x, on=on: on
        runner = ModelRunner(loaded, kv_cache_tokens=512, page_size=8)
        gen = torch.Generator().manual_seed(2)
        seqs = [runner.new_sequence() for _ in range(2)]
        prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (45, 30)]
        out = [runner.forward(seqs, prompts)]
        for _ in range(6):
            out.append(runner.forward(seqs, [[int(t)] for t in out[-1].argmax(-1)]))
        runs.append(torch.stack(out).float().cpu())
    return (runs[0] - runs[1]).abs().max().item(), launches["n"]


def _compile_release_shapes() -> list[dict]:
    """The kernel compiled for sm_90 at DeepSeek-V4-Flash's (64 heads of 128) and GLM-5's (32
    of 128) indexer shapes, bf16 and fp32."""
    for heads in (64, 32):
        for dtype in (torch.bfloat16, torch.float32):
            q, weights, keys = _paged(heads, 128, dtype, width=704, pages=64)
            index_scores(q, weights, keys.every(200), torch.tensor([200, 90]), 128**-0.5)
    return COMPILED


@needs_triton
def test_the_scores_are_the_references_under_the_interpreter():
    errors = run_interpreted("test_lightning_index", "_score_errors", "cpu", False, timeout=300)
    assert max(errors) < 1e-5, errors


@needs_triton
@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_models_give_the_same_logits_with_the_kernel(tmp_path, family):
    path, _ = build(family, tmp_path / family)
    error, launches = run_interpreted("test_lightning_index", "_dsa_error", str(path))
    assert error < 1e-4
    assert launches >= 6  # every decode step's indexer layers took it


@needs_triton
def test_it_compiles_for_sm90_at_the_releases_shapes():
    compiled = run_compiled("test_lightning_index", "_compile_release_shapes", timeout=300)
    assert len(compiled) == 4
    assert all(c["shared"] <= SM90_SHARED for c in compiled), compiled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_scores_are_the_references_on_cuda(tmp_path):
    assert max(_score_errors("cuda")) < 1e-4
    path, _ = build("glm_moe_dsa", tmp_path / "m")
    assert _dsa_error(str(path), "cuda")[0] < 1e-4
