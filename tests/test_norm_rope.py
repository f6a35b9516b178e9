"""The one-launch RMSNorm and rotary kernels (kernels/norm_rope.py) against the torch code they
replace on the GPU: under Triton's CPU interpreter (one subprocess: TRITON_INTERPRET must be
set before triton is imported; skipped without triton) and on CUDA when there is one."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (dev extras, Linux)"
)


def _cases(device: str) -> dict[str, float]:
    """Max abs difference between kernel and reference, per case."""
    from freetoken.kernels import norm_rope
    from freetoken.layers.moe import route_sigmoid, route_sqrtsoftplus
    from freetoken.layers.norm import RMSNorm
    from freetoken.layers.rope import RotaryEmbedding, pairs_to_halves, rotary_reference
    from freetoken.model_config import RopeConfig

    torch.manual_seed(0)
    res = {}
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        for shape in ((5, 72), (3, 4, 16), (1, 2048)):
            for zero_centered, scale_fp32 in ((False, False), (True, True), (False, True)):
                norm = RMSNorm(shape[-1], 1e-6, zero_centered, scale_fp32).to(device, dtype)
                with torch.no_grad():
                    norm.weight.normal_(0.5, 0.3)
                x = torch.randn(shape, device=device).to(dtype)
                ours = norm_rope.rms_norm(x, norm.weight, norm.eps, zero_centered, scale_fp32)
                ref = norm.reference(x)
                key = f"norm/{dtype}/{shape}/{zero_centered}/{scale_fp32}"
                res[key] = (ours.float() - ref.float()).abs().max().item()
                # the residual add joined to the norm: the sum as torch adds, then its norm
                delta = torch.randn(shape, device=device).to(dtype)
                total, ours = norm_rope.add_rms_norm(
                    x, delta, norm.weight, norm.eps, zero_centered, scale_fp32
                )
                res["add" + key + "/sum"] = (total.float() - (x + delta).float()).abs().max().item()
                ref = norm.reference(x + delta)
                res["add" + key] = (ours.float() - ref.float()).abs().max().item()
                # rows read at their stride: a stacked projection's columns, not copied first
                # (3-D: a head view of them, its rows not one stride apart)
                width = math.prod(shape[1:])
                wide = torch.randn(shape[0], width + 40, device=device).to(dtype)
                cols = wide[:, 8 : 8 + width].view(shape)
                ours = norm_rope.rms_norm(cols, norm.weight, norm.eps, zero_centered, scale_fp32)
                err = (ours.float() - norm.reference(cols).float()).abs().max().item()
                res["strided" + key] = err
                _, ours = norm_rope.add_rms_norm(
                    cols, delta, norm.weight, norm.eps, zero_centered, scale_fp32
                )
                ref = norm.reference(cols + delta)
                res["strided-add" + key] = (ours.float() - ref.float()).abs().max().item()
        for head_dim, partial in ((16, 1.0), (32, 0.5), (128, 1.0)):
            rope = RotaryEmbedding(RopeConfig(theta=1e4, partial_rotary_factor=partial), head_dim)
            positions = torch.arange(7, device=device) * 37
            cos, sin = rope.to(device).cos_sin(positions, dtype)
            x = torch.randn(7, 3, head_dim, device=device).to(dtype)
            ours = norm_rope.apply_rotary(x, cos, sin)
            ref = rotary_reference(x, cos, sin)
            res[f"rope/{dtype}/{head_dim}/{partial}"] = (
                (ours.float() - ref.float()).abs().max().item()
            )
            # heads read at their strides (a view of a stacked projection's columns), and
            # DeepSeek's interleaved pairs read as rotate-half's, each with no copy first
            wide = torch.randn(7, 3 * head_dim + 8, device=device).to(dtype)
            heads = wide[:, 8:].view(7, 3, head_dim)
            for pairs in (False, True):
                ours = norm_rope.apply_rotary(heads, cos, sin, pairs_first=pairs)
                laid = pairs_to_halves(heads, cos.shape[-1]) if pairs else heads
                ref = rotary_reference(laid, cos, sin)
                err = (ours.float() - ref.float()).abs().max().item()
                res[f"rope/{dtype}/{head_dim}/{partial}/strided/{pairs}"] = err
        for experts, k, renormalize in ((128, 8, True), (60, 4, False), (8, 2, True)):
            logits = torch.randn(5, experts, device=device).to(dtype)
            weights, ids = norm_rope.route(logits, k, renormalize, False)
            ref_w, ref_ids = route_reference(logits, k, renormalize)
            key = f"route/{dtype}/{experts}/{k}"
            res[key] = (weights.float() - ref_w.float()).abs().max().item()
            # bf16 logits tie often (128 normals in 8 bits): either of two tied experts is
            # a right choice, so the chosen logits are compared, not the ids
            chosen, ref_chosen = logits.gather(1, ids), logits.gather(1, ref_ids)
            res[key + "/ids"] = float((chosen != ref_chosen).sum().item())
        # DeepSeek-V4's sqrtsoftplus routing: chosen by score plus bias, or given (hash layers)
        moe = SimpleNamespace(top_k=6, routed_scaling=1.5)
        for experts, given in ((256, False), (64, True), (16, False)):
            logits = (torch.randn(5, experts, device=device) * 4).to(dtype)
            bias = torch.randn(experts, device=device) * 0.1
            ids = torch.stack([torch.randperm(experts, device=device)[:6] for _ in range(5)])
            ids = ids if given else None
            weights, chosen = norm_rope.route_sqrtsoftplus(logits, bias, 6, 1.5, ids)
            moe_reference = _torch_route(route_sqrtsoftplus)
            ref_w, ref_ids = moe_reference(logits, bias, moe, ids)
            key = f"sqrtsoftplus/{dtype}/{experts}/{given}"
            res |= _routing_errors(key, weights, chosen, ref_w, ref_ids)
        # sigmoid routing with a correction bias, in groups (DeepSeek-V3's 8 of 32, 4 kept; 15
        # of 4, 2 kept: groups not a power of two) or not (GLM's, Kimi's: 384 experts)
        for experts, groups, kept, k, normalize in (
            (256, 8, 4, 8, True),
            (60, 4, 2, 4, False),
            (384, 1, 1, 8, True),
        ):
            moe = SimpleNamespace(
                top_k=k,
                num_groups=groups,
                topk_groups=kept,
                norm_topk_prob=normalize,
                routed_scaling=2.5,
            )
            logits = torch.randn(5, experts, device=device) * 2
            bias = torch.randn(experts, device=device) * 0.1
            weights, chosen = norm_rope.route_sigmoid(logits, bias, moe)
            ref_w, ref_ids = _torch_route(route_sigmoid)(logits, bias, moe)
            key = f"sigmoid/{experts}/{groups}"
            res |= _routing_errors(key, weights, chosen, ref_w, ref_ids)
    return res


def _routing_errors(key, weights, ids, ref_weights, ref_ids) -> dict[str, float]:
    """A routing's largest weight difference from the reference's, each expert's weight set
    beside its own (the kernels' top-k order is theirs), and how many chosen ids differ."""
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    ours, ref = weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices)
    return {
        key: (ours - ref).abs().max().item(),
        key + "/ids": float((order.values != ref_order.values).sum().item()),
    }


def _torch_route(route):
    """The torch definition of a routing function, with the GPU kernel turned off."""
    from freetoken.kernels import norm_rope

    def reference(*args):
        available, norm_rope.available = norm_rope.available, lambda x: False
        try:
            return route(*args)
        finally:
            norm_rope.available = available

    return reference


def route_reference(logits, k, renormalize):
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w.to(logits.dtype), ids


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, float]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); "
        "import test_norm_rope as m; print(json.dumps(m._cases('cpu')))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_triton
def test_kernels_match_the_torch_code_in_the_interpreter(interpreter_results):
    results = interpreter_results
    assert len(results) == 72
    # fp32: the norm's sum of squares in another order (a few ulp; rows read at their stride
    # too), the residual sum and the rotation bit for bit, the routing's choice exactly and its
    # weights to a few ulp.
    norms = ("norm", "addnorm", "stridednorm", "strided-addnorm")
    assert max(v for k, v in results.items() if k.startswith(norms)) < 1e-5
    assert max(v for k, v in results.items() if k.endswith("/sum")) == 0.0
    assert max(v for k, v in results.items() if k.startswith("rope")) == 0.0
    assert max(v for k, v in results.items() if k.startswith("route") and "ids" not in k) < 1e-6
    assert max(v for k, v in results.items() if k.startswith("sqrt") and "ids" not in k) < 1e-5
    assert max(v for k, v in results.items() if k.startswith("sigm") and "ids" not in k) < 1e-5
    assert sum(v for k, v in results.items() if k.endswith("/ids")) == 0


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_match_the_torch_code_on_cuda():
    results = _cases("cuda")
    for key, value in results.items():
        # bf16: at most one step of a bf16 value near the norm's output scale (2^-7 of ~2).
        limit = 0 if key.endswith(("/ids", "/sum")) else 2**-6 if "bfloat16" in key else 1e-5
        assert value <= limit, (key, value)


@needs_triton
def test_the_kernels_compile_for_the_gpu():
    """The kernels compiled for sm_90 (tests/compiled.py: nothing launched): the sigmoid
    routing's grouped and ungrouped variants, the other routings, the norm of a strided head
    view with and without a residual, the rotation of one, plain and of interleaved pairs."""
    from compiled import run_compiled

    names = run_compiled("test_norm_rope", "_compiled", timeout=300)
    assert names == (
        ["_sigmoid_route_kernel"] * 2
        + ["_sqrtsoftplus_kernel", "_route_kernel"]
        + ["_rms_norm_kernel"] * 2
        + ["_rotary_kernel"] * 2
    )


def _compiled() -> list[str]:
    import compiled
    from freetoken.kernels import norm_rope

    logits = torch.zeros(2, 256)
    for groups, kept in ((8, 4), (1, 1)):
        moe = SimpleNamespace(
            top_k=8, num_groups=groups, topk_groups=kept, norm_topk_prob=True, routed_scaling=1.0
        )
        norm_rope.route_sigmoid(logits, torch.zeros(256), moe)
    norm_rope.route_sqrtsoftplus(logits.bfloat16(), torch.zeros(256), 6, 1.5)
    norm_rope.route(logits, 8, True, False)
    heads = torch.zeros(3, 4 * 64 + 32, dtype=torch.bfloat16)[:, 32:].view(3, 4, 64)
    weight = torch.ones(64, dtype=torch.bfloat16)
    norm_rope.rms_norm(heads, weight, 1e-6, False, False)
    delta = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    norm_rope.add_rms_norm(heads, delta, weight, 1e-6, False, True)
    cos = sin = torch.zeros(3, 64, dtype=torch.bfloat16)
    for pairs in (False, True):
        norm_rope.apply_rotary(heads, cos, sin, pairs_first=pairs)
    return [c["name"] for c in compiled.COMPILED]
