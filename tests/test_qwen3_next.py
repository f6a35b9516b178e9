"""Qwen3-Next (gated DeltaNet linear attention + gated full attention), and the other hybrid
families where the test is not Qwen3-Next's own (Kimi-Linear: Kimi Delta Attention + MLA):
exact against transformers' own cached decode; batched, chunked and single forwards agree; the
recurrent state pool never leaks a slot."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.config import EngineConfig
from freetoken.engine.generate import LLMEngine
from freetoken.engine.runner import ModelRunner
from freetoken.engine.sampling import SamplingParams
from freetoken.errors import CheckpointError
from freetoken.kv.recurrent import OutOfStateSlotsError, RecurrentStatePool
from freetoken.models.families import family_for
from freetoken.models.loading import load_model
from tiny_models import build, build_chat_model

TOL = 1e-4  # against transformers
SAME = 1e-5  # our own forwards against each other
HYBRIDS = ["qwen3_next", "kimi_linear"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (checkpoint, transformers model, ours in fp32), each built once."""
    built = {}

    def get(family: str):
        if family not in built:
            path, hf = build(family, tmp_path_factory.mktemp("ckpt") / family)
            built[family] = (path, hf, load_model(path, dtype="float32"))
        return built[family]

    return get


@pytest.fixture(scope="module")
def tiny(models):
    return models("qwen3_next")[:2]


@pytest.fixture(scope="module")
def loaded(models):
    return models("qwen3_next")[2]


def random_ids(n: int, seed: int, vocab: int = 160) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_reads_the_hybrid_layout(loaded):
    cfg = loaded.config
    assert cfg.linear_layers == (True, False, True, False)
    assert cfg.attention_layers == (False, True, False, True)
    assert cfg.moe_layers == (True, True, False, True)
    assert cfg.rope.partial_rotary_factor == 0.25
    assert cfg.attn_output_gate and cfg.zero_centered_norm
    la = cfg.linear_attention
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim) == (
        2,
        4,
        16,
        8,
    )
    runner = ModelRunner(loaded, kv_cache_tokens=64, page_size=8, max_sequences=3)
    # Linear layers keep no K/V pages; their state lives in the pool instead.
    assert [k.numel() > 0 for k in runner.kv.k] == [False, True, False, True]
    assert runner.states.conv.shape == (2, 3, la.conv_dim, 3)
    assert runner.states.ssm.shape == (2, 3, 4, 16, 8)


def test_hub_config_spellings():
    """Hub configs give `full_attention_interval` instead of `layer_types`, and may leave
    `partial_rotary_factor` to the family default (a quarter of each head)."""
    raw = {
        "architectures": ["Qwen3NextForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 32,
        "num_hidden_layers": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "full_attention_interval": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "rope_theta": 1e6,
    }
    cfg = family_for(raw).parse_config(raw)
    assert cfg.linear_layer_ids == (0, 1, 2, 4, 5, 6)
    assert cfg.rope.partial_rotary_factor == 0.25
    assert cfg.moe.shared_expert_gated


@pytest.mark.parametrize("family", HYBRIDS)
def test_prefill_and_decode_match_transformers_cache(models, family):
    """150 prompt tokens (three chunks of the chunked rule) then 20 decode steps, each step
    against transformers' own cached decode (its recurrent kernel and conv update)."""
    _, hf, loaded = models(family)
    runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=8)
    prompt = random_ids(150, seed=1)
    seq = runner.new_sequence()
    ours = runner.forward([seq], [prompt], all_logits=True)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    worst = (ours - out.logits[0]).abs().max().item()
    # (transformers before 5.2x names the cache `past_key_values`, as the GPU machine's 5.17)
    name = "cache" if hasattr(out, "cache") else "past_key_values"
    cache = getattr(out, name)
    for _ in range(20):
        token = int(ours[-1].argmax())
        ours = runner.forward([seq], [[token]])
        with torch.no_grad():
            out = hf(torch.tensor([[token]]), **{name: cache}, use_cache=True)
        cache = getattr(out, name)
        worst = max(worst, (ours - out.logits[:, -1]).abs().max().item())
    assert worst < TOL, f"drifted from transformers by {worst}"


def decode(runner, prompts, steps):
    seqs = [runner.new_sequence() for _ in prompts]
    logits = runner.forward(seqs, prompts)
    history = [logits]
    for _ in range(steps):
        logits = runner.forward(seqs, [[int(t)] for t in logits.argmax(-1)])
        history.append(logits)
    for seq in seqs:
        runner.release(seq)
    return torch.stack(history, 1)  # [B, steps + 1, V]


@pytest.mark.parametrize("family", HYBRIDS)
def test_batched_decode_of_different_lengths_equals_each_alone(models, family):
    loaded = models(family)[2]
    prompts = [random_ids(n, seed=n) for n in (5, 70, 33, 9)]
    runner = ModelRunner(loaded, kv_cache_tokens=512, page_size=4)
    batched = decode(runner, prompts, steps=12)
    for i, p in enumerate(prompts):
        alone = decode(runner, [p], steps=12)[0]
        assert (batched[i] - alone).abs().max().item() < SAME
    assert runner.states.num_free == runner.states.num_slots


@pytest.mark.parametrize(
    ("chunks", "tol"),
    [
        # Chunks of 64 from the same start: the delta rule's chunks are the one-shot ones.
        ([64, 64, 22], SAME),
        # Other chunk boundaries (and token by token, the recurrent rule all along) sum in
        # another fp32 order: transformers' tolerance (measured 1.0e-5 at most).
        ([37, 64, 1, 48], TOL),
        ([1] * 150, TOL),
    ],
    ids=["aligned", "uneven", "token-by-token"],
)
@pytest.mark.parametrize("family", HYBRIDS)
def test_chunked_prefill_equals_one_shot(models, family, chunks, tol):
    """The conv and SSM states carry over chunk boundaries (chunks of one token take the
    recurrent path, longer ones the chunked rule)."""
    loaded = models(family)[2]
    prompt = random_ids(150, seed=5)
    runner = ModelRunner(loaded, kv_cache_tokens=512, page_size=8)
    whole_seq, split_seq = runner.new_sequence(), runner.new_sequence()
    whole = runner.forward([whole_seq], [prompt], all_logits=True)
    parts, start = [], 0
    for n in chunks:
        parts.append(runner.forward([split_seq], [prompt[start : start + n]], all_logits=True))
        start += n
    assert start == len(prompt)
    assert (torch.cat(parts) - whole).abs().max().item() < tol
    states = runner.states
    for pool in (states.conv, states.ssm):
        assert (pool[:, whole_seq.state_slot] - pool[:, split_seq.state_slot]).abs().max() < tol
    token = [[int(whole[-1].argmax())]]
    after = [runner.forward([seq], token) for seq in (whole_seq, split_seq)]
    assert (after[0] - after[1]).abs().max() < tol


def test_state_pool_slots():
    pool = RecurrentStatePool(2, 3, (6, 3), (2, 4, 4), torch.float32, "cpu")
    slots = [pool.alloc() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(OutOfStateSlotsError, match="all 3 recurrent state slots are in use"):
        pool.alloc()
    pool.ssm[:, slots[1]] = 1.0
    pool.conv[:, slots[1]] = 1.0
    pool.free(slots[1])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(slots[1])
    again = pool.alloc()
    assert again == slots[1]
    assert not pool.ssm[:, again].any() and not pool.conv[:, again].any()  # zeroed on alloc
    assert pool.slot_bytes == 2 * (6 * 3 + 2 * 4 * 4) * 4


def test_runner_sequences_hold_and_free_slots(loaded):
    runner = ModelRunner(loaded, kv_cache_tokens=64, page_size=8, max_sequences=2)
    a, b = runner.new_sequence(), runner.new_sequence()
    assert {a.state_slot, b.state_slot} == {0, 1}
    with pytest.raises(OutOfStateSlotsError):
        runner.new_sequence()
    runner.forward([a], [[1, 2, 3]])
    runner.release(a)
    assert a.state_slot is None and runner.states.num_free == 1
    c = runner.new_sequence()  # the freed slot, zeroed: same logits as a fresh sequence
    fresh = runner.forward([c], [[1, 2, 3]])
    runner.release(b)
    runner.release(c)
    d = runner.new_sequence()
    assert (runner.forward([d], [[1, 2, 3]]) - fresh).abs().max() == 0


def test_missing_linear_attention_tensor_is_named(tiny, tmp_path):
    path = tmp_path / "broken"
    shutil.copytree(tiny[0], path)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.2.linear_attn.A_log"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.2\.linear_attn\.A_log"):
        load_model(path)


@pytest.fixture(scope="module", params=HYBRIDS)
def chat_model(request, tmp_path_factory):
    return build_chat_model(request.param, tmp_path_factory.mktemp("chat") / "m")[0]


def chat_engine(path, **options) -> LLMEngine:
    config = EngineConfig(
        model=path,
        device="cpu",
        dtype="float32",
        kv_cache_tokens=4096,
        page_size=4,
        max_batch_size=2,
        **options,
    )
    return LLMEngine.from_config(config)


@pytest.mark.parametrize("anchors", [16, 0], ids=["anchors", "no-anchors"])
def test_engine_resumes_only_where_a_state_was_saved(chat_model, anchors):
    """A repeated prompt reuses its cached prefix only up to an anchor (here the end of the
    user turn); without anchors it is computed whole, though its KV pages are cached. The
    tokens are the same either way."""
    engine = chat_engine(chat_model, state_anchors=anchors)
    tok = engine.tokenizer
    prompts = [
        tok.encode(tok.render_chat([{"role": "user", "content": t}]))
        for t in (
            "Write a haiku about the sea.",
            "List three prime numbers.",
            "Say hello.",
        )
    ]
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    together = engine.generate(prompts, greedy)  # three prompts through two batch slots
    im_end = tok.token_id("<|im_end|>")
    for p, done in zip(prompts, together, strict=True):
        req = engine.add_request(p, greedy)
        turn_end = p.index(im_end) + 1
        assert req.cached_tokens == (turn_end if anchors else 0)
        assert req.recomputed_tokens == len(p) - req.cached_tokens
        while not req.finished:
            engine.step()
        assert req.output_ids == done.output_ids
    states = engine.runner.states
    assert states.num_free == 2  # every sequence slot back (anchor slots are set aside)
    kv = engine.runner.kv
    assert kv.allocator.num_free + len(engine.prefix_cache.pages()) == kv.num_pages


# -- the decode step's kernel (kernels/gated_delta.py), under Triton's CPU interpreter ---------


def _reference_step(q, k, v, a, b, a_log, dt_bias, ssm, slots):
    """The layer's torch step (layers/gated_deltanet.py) on the same inputs."""
    import torch.nn.functional as F

    from freetoken.layers.gated_deltanet import _prepare, recurrent_gated_delta_rule

    beta = b.sigmoid()
    if a.dim() == 3:  # (KDA: a decay per key channel)
        a_log, dt_bias = a_log[:, None], dt_bias.view(a.shape[1], -1)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    prepared = _prepare(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None])
    out, state = recurrent_gated_delta_rule(*prepared, ssm[slots])
    return out[:, :, 0], state


def _step_kernel_cases() -> dict[str, float]:
    """The kernel against the torch step: largest differences of the outputs and of the states
    it advanced in place (relative to their largest values), and whether the other slots were
    left alone; fp32 and bf16 inputs, value heads sharing key heads, a ragged last block; a
    decay per head (gated DeltaNet) and per key channel (KDA)."""
    from freetoken.kernels.gated_delta import recurrent_step

    res = {}
    gen = torch.Generator().manual_seed(0)
    cases = [
        (dtype, name, kda)
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
        for kda in (False, True)
    ]
    for dtype, name, kda in cases:
        n, hk, hv, dk, dv, pool = 3, 4 if kda else 2, 4, 16, 40, 6
        decays = hv * dk if kda else hv  # (KDA: a and dt_bias per key channel)
        # q, k and v as column ranges of the conv's output rows, a and b of one projection's:
        # read where they lie, by their row strides
        y = torch.randn(n, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
        q, k, v = y.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.view(n, hk, dk), k.view(n, hk, dk), v.view(n, hv, dv)
        ab = torch.randn(n, decays + hv, generator=gen) * 3
        ab[0, 0] = 25.0  # (softplus past its threshold)
        ab[1, 0] = -30.0  # (and where 1 + exp would round exp away)
        a, b = ab.to(dtype).split([decays, hv], dim=-1)
        a = a.view(n, hv, dk) if kda else a
        assert q.stride(0) == y.shape[1] and not q.is_contiguous()
        a_log = torch.randn(hv, generator=gen).to(dtype)
        dt_bias = torch.randn(decays, generator=gen).to(dtype)
        name = "kda_" + name if kda else name
        ssm = torch.randn(pool, hv, dk, dv, generator=gen)
        slots = torch.tensor([4, 0, 2])
        want_out, want_state = _reference_step(q, k, v, a, b, a_log, dt_bias, ssm.clone(), slots)
        before = ssm.clone()
        out = recurrent_step(q, k, v, a, b, a_log, dt_bias, ssm, slots)
        res[f"{name}_out"] = ((out - want_out).abs().max() / want_out.abs().max()).item()
        res[f"{name}_state"] = (
            (ssm[slots] - want_state).abs().max() / want_state.abs().max()
        ).item()
        others = torch.tensor([1, 3, 5])
        res[f"{name}_others"] = 0.0 if torch.equal(ssm[others], before[others]) else 1.0
    return res


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="needs triton")
def test_the_decode_step_kernel_is_the_torch_step():
    from interpreted import run_interpreted

    res = run_interpreted("test_qwen3_next", "_step_kernel_cases", timeout=300)
    # (bf16: the interpreter's fp32 -> bf16 cast truncates where the GPU's rounds: beta a bf16
    # step apart, ~1e-3 of the output; a wrong decay, norm or update is off by far more)
    tolerance = {"fp32_out": 2e-6, "fp32_state": 2e-6, "bf16_out": 5e-3, "bf16_state": 5e-3}
    for case, err in res.items():
        assert err < tolerance.get(case.removeprefix("kda_"), 1e-9), (case, err)


# -- prompts through flash-linear-attention's chunked kernels (kernels/gated_delta.chunked) ---


def _fla_stand_in(
    q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel
):
    """fla's chunk_gated_delta_rule as its documentation defines it ([B, T, H, K] q and k, each
    key head serving HV / H consecutive value heads, q and k L2-normalised in the kernel,
    scaled by `scale`), in torch: for the layer's use of it on any machine."""
    from freetoken.layers.gated_deltanet import _prepare, chunk_gated_delta_rule

    assert use_qk_l2norm_in_kernel and output_final_state and scale == q.shape[-1] ** -0.5
    assert q.shape[:3] == k.shape[:3] and v.shape[2] % q.shape[2] == 0
    assert g.shape == beta.shape == v.shape[:3] and initial_state.dtype == torch.float32
    out, final = chunk_gated_delta_rule(*_prepare(q, k, v, g, beta), initial_state)
    return out.transpose(1, 2).to(v.dtype), final


def test_prompts_take_flas_kernels_where_they_apply(loaded, monkeypatch):
    """The layer hands a prompt's raw q, k, v, gates and states to fla's kernel in its layout
    (checked by a torch stand-in of its documented API): the same logits and states as the
    torch rule; decode steps and fp32 models keep their own paths; FREETOKEN_FLA=0 turns it
    off."""
    from freetoken import settings
    from freetoken.kernels import gated_delta

    prompt = random_ids(90, seed=11)

    def run():
        runner = ModelRunner(loaded, kv_cache_tokens=256, page_size=8)
        seq = runner.new_sequence()
        logits = runner.forward([seq], [prompt], all_logits=True)
        step = runner.forward([seq], [[int(logits[-1].argmax())]])
        return torch.cat([logits, step]), runner.states.ssm[:, seq.state_slot].clone()

    want = run()
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(args[0].shape)
        return _fla_stand_in(*args, **kwargs)

    monkeypatch.setattr(gated_delta, "_fla_chunk", lambda: stand_in)
    monkeypatch.setattr(gated_delta, "chunked_available", lambda x: x.shape[1] > 1)
    got = run()
    assert [shape[1] for shape in calls] == [90, 90]  # each linear layer's prompt, once
    assert (got[0] - want[0]).abs().max().item() < SAME
    assert (got[1] - want[1]).abs().max().item() < SAME
    # where it applies: CUDA, half precision, installed and not turned off
    monkeypatch.undo()
    gated_delta._fla_chunk.cache_clear()
    monkeypatch.setenv(settings.FLA.name, "0")
    assert gated_delta._fla_chunk() is None
    gated_delta._fla_chunk.cache_clear()
    assert not gated_delta.chunked_available(torch.zeros(1, 2, dtype=torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dims", [(2, 4, 16, 8), (16, 32, 128, 128)], ids=["tiny", "qwen3-next"])
def test_fla_prompts_on_cuda_stay_within_bf16_of_the_torch_rule(dims):
    """bf16 inputs on CUDA with fla-core installed: fla's chunked rule gives the torch rule's
    outputs and final states (fp32, on the same inputs, from a nonzero state) within bf16's
    rounding (6e-3 measured on the H200 machine), at the tiny model's head shapes and at
    Qwen3-Next's. (A first call per shape autotunes fla's kernels: tens of seconds, cached by
    Triton on disk.)"""
    import torch.nn.functional as F

    from freetoken.kernels import gated_delta
    from freetoken.layers.gated_deltanet import _prepare, chunk_gated_delta_rule

    if importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed")
    hk, hv, dk, dv = dims
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k = randn(1, 300, hk, dk).bfloat16(), randn(1, 300, hk, dk).bfloat16()
    v, a, b = randn(1, 300, hv, dv).bfloat16(), randn(1, 300, hv), randn(1, 300, hv)
    g, beta = -0.5 * F.softplus(a), b.bfloat16().sigmoid()
    state = randn(1, hv, dk, dv) * 0.1
    gated_delta._fla_chunk.cache_clear()
    assert gated_delta.chunked_available(v)
    want, want_state = chunk_gated_delta_rule(*_prepare(q, k, v, g, beta), state)
    got, got_state = gated_delta.chunked(q, k, v, g, beta, state)
    assert got.dtype == got_state.dtype == torch.float32
    for ours, ref in ((got, want.transpose(1, 2)), (got_state, want_state)):
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < 2e-2
