"""The GPU benchmark scripts run end to end on small shapes on the CPU, so they do not rot
between the sessions that have a GPU to run them."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run(script: str, *args: str, tmp_path: Path, tiny: bool = True) -> str:
    """The script's output; `tiny`: on its small shapes, on the CPU (the GPU scripts' flags)."""
    flags = ["--tiny", "--device", "cpu"] if tiny else []
    result = subprocess.run(
        [sys.executable, script, *flags, *args],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "FREETOKEN_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_decode_offload_table(tmp_path):
    out = tmp_path / "decode.md"
    run(
        "decode_offload.py",
        "--layers",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--batch",
        "1",
        "--cache",
        "all",
        "--cache",
        "40",
        "--strategy",
        "offload",
        "--strategy",
        "hybrid",
        "--cpu-threads",
        "1",
        "--cpu-threads",
        "2",
        "--out",
        str(out),
        tmp_path=tmp_path,
    )
    table = out.read_text()
    for strategy in ("fused", "offload", "hybrid"):
        for team in ("t1", "t2"):  # each strategy with each CPU team size
            assert f"| {strategy}/{team} | 1 |" in table
    header = next(line for line in table.splitlines() if line.startswith("| cache | strategy"))
    column = [c.strip() for c in header.split("|")].index("host ms")
    width = header.count("|")  # (the phase table below has fewer columns)
    rows = [
        line.split("|")
        for line in table.splitlines()
        if "/t1 | 1 |" in line and line.count("|") == width
    ]
    assert rows and all(float(row[column]) > 0 for row in rows)  # the host's time per step


def test_host_step_table(tmp_path):
    out = tmp_path / "host.md"
    result = subprocess.run(
        [
            sys.executable,
            "host_step.py",
            "--layers",
            "2",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--hidden",
            "64",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--strategy",
            "hybrid",
            "--strategy",
            "static",
            "--batch",
            "1",
            "--out",
            str(out),
        ],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        r.split("|")[1].strip(): r.split("|")[3:-1]
        for r in out.read_text().splitlines()
        if r.startswith(("| hybrid", "| static"))
    }
    assert set(rows) == {"hybrid", "static"}
    hybrid, static = ([float(c) for c in rows[name]] for name in ("hybrid", "static"))
    plan, policy, step, hit_rate = hybrid[0], hybrid[3], hybrid[4], hybrid[5]
    assert plan > 0 and step > plan and 0.0 <= hit_rate <= 1.0
    assert policy > static[3]  # only hybrid has a policy to update


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "kimi_linear"])
def test_agent_replay_recomputes_within_the_bound(tmp_path, family):
    """Each turn recomputes at most its new suffix plus the distance back to the deepest
    anchor (page boundary): the script checks it; without anchors a hybrid model recomputes
    every prompt."""
    out = tmp_path / "replay.md"
    run(
        "agent_replay.py",
        "--family",
        family,
        "--layers",
        "4",
        "--turns",
        "4",
        "--tool-tokens",
        "60",
        "--cache",
        "40",
        "--out",
        str(out),
        tmp_path=tmp_path,
    )
    # The script exits 1 when a turn of the reusing mode (with anchors, for a hybrid model)
    # recomputes more than the bound; `run` checks it exited 0.
    table = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line[:1] == "|"]
    columns = {name.strip(): i for i, name in enumerate(table[0])}
    rows = [[int(float(cell)) for cell in row] for row in table[2:]]
    checked = "reuse + anchors" if family != "qwen3_moe" else "reuse"
    recomputed = [row[columns[f"recomputed ({checked})"]] for row in rows]
    bound = [row[columns[f"bound ({checked})"]] for row in rows]
    assert all(r <= b for r, b in zip(recomputed, bound, strict=True)), (recomputed, bound)
    assert "- bound, " + checked + " (checked): held" in out.read_text()
    # Without reuse (and, for a hybrid model, without anchors) every prompt is recomputed.
    for mode in ("no reuse", "reuse, no anchors") if family != "qwen3_moe" else ("no reuse",):
        assert [row[columns[f"recomputed ({mode})"]] for row in rows] == [row[1] for row in rows]
    assert recomputed[0] == rows[0][1] and recomputed[-1] < rows[-1][1]


def test_soak_counts_answers_and_memory(tmp_path):
    out = tmp_path / "soak.md"
    result = subprocess.run(
        [
            sys.executable,
            "soak.py",
            "--minutes",
            "0.25",
            "--clients",
            "3",
            "--warmup-s",
            "2",
            "--sample-s",
            "1",
            "--kv-cache-tokens",
            "4096",
            "--out",
            str(out),
        ],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    row = next(
        r
        for r in out.read_text().splitlines()
        if r.startswith("| ") and "---" not in r and not r.startswith("| requests")
    )
    cells = [c.strip() for c in row.strip("|").split("|")]
    requests, errors, cancelled = int(cells[0]), int(cells[1]), int(cells[2])
    assert requests > 0 and errors == 0 and 0 <= cancelled <= requests
    assert cells[-2:] == ["0", "0"]  # nothing left running, no KV page held


def write_trace(path, tokens=40, layers=2, experts=32, top_k=4, seed=0):
    """A routing trace file in moe/trace.py's format: two requests."""
    import json

    import numpy as np

    rng = np.random.default_rng(seed)
    half = tokens // 2
    arrays = {}
    for r, n in enumerate((half, tokens - half)):
        arrays[f"experts_{r:04d}"] = np.stack(
            [[rng.choice(experts, top_k, replace=False) for _ in range(layers)] for _ in range(n)]
        ).astype(np.int8)
        arrays[f"probs_{r:04d}"] = rng.dirichlet(np.ones(top_k), (n, layers)).astype(np.float16)
    meta = {
        "num_layers": layers,
        "num_experts": experts,
        "top_k": top_k,
        "requests": [{"index": 0, "tokens": half}, {"index": 1, "tokens": tokens - half}],
    }
    meta_bytes = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, meta_json=meta_bytes, **arrays)
    return np.concatenate([arrays["experts_0000"], arrays["experts_0001"]])


def test_trace_routing_replays_the_trace_token_by_token(tmp_path, monkeypatch):
    """Every MoE layer's top-k is the trace's choice for its (token, layer), rows of a batch
    far apart in the trace, and the cursor moves one token per forward (benchmarks/
    decode_offload.py --routing trace:FILE)."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from decode_offload import random_model, tiny, use_trace_routing

    path = tmp_path / "trace.npz"
    want = write_trace(path, tokens=40, layers=2)
    loaded = random_model(tiny(3), torch.device("cpu"))  # 3 layers: layer 2 reads trace layer 0
    use_trace_routing(loaded, str(path), max_batch=4)
    routers = [layer.moe.router for layer in loaded.model.layers]
    x = torch.zeros(4, loaded.config.hidden_size)
    for step in range(12):
        for layer, router in enumerate(routers):
            ids = router(x).topk(4, dim=-1).indices.sort(-1).values
            rows = [(step + b * 10) % 40 for b in range(4)]  # stride 40 // 4
            expected = torch.as_tensor(want[rows, layer % 2]).long().sort(-1).values
            assert torch.equal(ids, expected), (step, layer)
    assert int(routers[0].cursor) == 12


def test_decode_offload_runs_on_a_trace(tmp_path):
    trace = tmp_path / "trace.npz"
    write_trace(trace, tokens=60, layers=2)
    out = tmp_path / "decode.md"
    run(
        "decode_offload.py",
        "--layers",
        "2",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--batch",
        "1",
        "--cache",
        "40",
        "--strategy",
        "hybrid",
        "--routing",
        f"trace:{trace}",
        "--expert-format",
        "mxfp4",
        "--out",
        str(out),
        tmp_path=tmp_path,
    )
    table = out.read_text()
    assert "| hybrid | 1 |" in table and "experts mxfp4" in table


def test_step_timeline_table(tmp_path):
    out = tmp_path / "timeline.md"
    run(
        "step_timeline.py",
        "--layers",
        "2",
        "--steps",
        "2",
        "--profiled",
        "2",
        "--contender",
        "fused@all",
        "--contender",
        "hybrid@50%",
        "--python-profile",
        "--out",
        str(out),
        tmp_path=tmp_path,
    )
    table = out.read_text()
    assert "| fused@all b1 |" in table and "| hybrid@50% b1 |" in table
    assert "Python profile of the 2 synced steps" in table


def test_load_time_starts_from_both_formats(tmp_path):
    out = tmp_path / "load.md"
    result = subprocess.run(
        [
            sys.executable,
            "load_time.py",
            "--tiny",
            "--layers",
            "1",
            "--work",
            str(tmp_path / "w"),
            "--strategy",
            "fused",
            "--cache",
            "none",
            "--out",
            str(out),
        ],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "FREETOKEN_CACHE_DIR": str(tmp_path / "cache"),
            "CUDA_VISIBLE_DEVICES": "",
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = out.read_text()
    for row in ("| safetensors | cold | off |", "| weight directory | warm | on |"):
        assert row in table


def test_import_profile_times_the_imports_alone_and_beside_a_python_thread(tmp_path):
    out = tmp_path / "imports.md"
    # An empty PYTHONPYCACHEPREFIX is no prefix: the bytecode pip compiled at install is used
    # (the script's own prefix would compile torch and transformers from source first: two
    # minutes of a CI run on a 2-core machine).
    result = subprocess.run(
        [sys.executable, "import_profile.py", "--repeat", "1", "--top", "5", "--out", str(out)],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPYCACHEPREFIX": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = out.read_text()
    row = next(line for line in table.splitlines() if line.startswith("| 0 |"))
    alone_wall, alone_cpu, beside_wall = (float(c) for c in row.split("|")[2:5])
    assert 0 < alone_cpu <= alone_wall * 1.05 and beside_wall > 0
    assert "| torch |" in table or "| torch._C |" in table  # (among the slowest modules)


def test_serve_start_times_ft_serve_to_its_first_answer(tmp_path):
    out = tmp_path / "serve.md"
    result = subprocess.run(
        [
            sys.executable,
            "serve_start.py",
            "--tiny",
            "--layers",
            "1",
            "--work",
            str(tmp_path / "w"),
            "--strategy",
            "fused",
            "--cache",
            "none",
            "--repeat",
            "1",
            "--page-cache",
            "warm",
            "cold",
            "--out",
            str(out),
        ],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "FREETOKEN_CACHE_DIR": str(tmp_path / "cache"),
            "CUDA_VISIBLE_DEVICES": "",
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [
        line.split("|")
        for line in out.read_text().splitlines()
        if line.startswith(("| warm |", "| cold |"))
    ]
    assert [r[1].strip() for r in rows] == ["warm", "cold"]
    # (the figures as measured, from its JSON lines: a tiny model's warm read can take under
    # the 5 ms the table's two decimals show)
    starts = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["page_cache"] for r in starts] == ["warm", "cold"]
    for r in starts:
        assert r["floor_s"] > 0 and 0 < r["listening_s"] <= r["answered_s"]


def test_a_random_weight_directory_written_straight_loads_and_checks(tmp_path, monkeypatch):
    """checkpoint.py's write_random_weight_dir: a weight directory without a safetensors copy
    first (load_time.py --direct), its checksums right, its config and tokenizer beside it, no
    scratch files left; its parameters and pool hold what was written."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from checkpoint import write_random_weight_dir
    from decode_offload import tiny

    from freetoken.models.loading import load_model

    out = write_random_weight_dir(tiny(2), tmp_path / "wd")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wd"]
    assert {"config.json", "tokenizer.json", "dense.bin", "experts.bin"} <= {
        p.name for p in out.iterdir()
    }
    loaded = load_model(out, verify=True)
    params = dict(loaded.model.named_parameters())
    assert params["layers.0.attn_norm.weight"].eq(1).all()
    assert 0.01 < float(params["layers.1.attn.q_proj.weight"].detach().float().std()) < 0.03
    assert 0.01 < float(loaded.experts.w_down.float().std()) < 0.03


def test_every_benchmark_shape_builds_its_family(monkeypatch):
    """The shapes the GPU runs use (decode_offload.py SHAPES) parse as their family and build
    (on the meta device: nothing allocated), with experts of the size their releases have."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from decode_offload import SHAPES

    from freetoken.models.decoder import DecoderModel
    from freetoken.models.families import family_for
    from freetoken.moe.store import ExpertShape

    mib = {
        "qwen3-30b-a3b": 9.0,
        "gpt-oss-20b": 47.5,
        "deepseek-v3": 84.0,
        "glm-4.5-air": 33.0,
        "qwen3.5-35b-a3b": 6.0,
        "qwen3.5-35b-a3b-full-attention": 6.0,
        "qwen3-next-80b-a3b": 6.0,
        "deepseek-v4-flash": 48.0,
        "glm-5": 72.0,
        "kimi-linear-48b-a3b": 13.5,
        "minimax-m2": 27.0,
        "gemma-4-26b-a4b": 11.3,
        "kimi-k2.6": 84.0,
    }
    for name, shape in SHAPES.items():
        raw = shape(8)
        cfg = family_for(raw).parse_config(raw)
        with torch.device("meta"):
            model = DecoderModel(cfg).cast(torch.bfloat16)
        assert cfg.num_layers == 8 and sum(cfg.moe_layers) >= 7, name
        expert = ExpertShape(cfg.hidden_size, cfg.moe.intermediate_size, torch.bfloat16)
        assert abs(expert.nbytes / 2**20 - mib[name]) < 0.5, (name, expert.nbytes / 2**20)
        assert next(model.parameters()).dtype == torch.bfloat16


def test_decode_context_on_a_random_q8_0_gguf(tmp_path):
    """gguf_random.py writes a Q8_0 GGUF both engines read; decode_context.py runs on it (its
    experts kept Q8_0), with graphs on and off, and times a prefill."""
    file = tmp_path / "m.gguf"
    result = subprocess.run(
        [
            sys.executable,
            "gguf_random.py",
            str(file),
            "--tiny",
            "--layers",
            "2",
            "--max-context",
            "4096",
        ],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "context.md"
    run(
        "decode_context.py",
        "--checkpoint",
        str(file),
        "--layers",
        "2",
        "--contexts",
        "0",
        "16",
        "--strategy",
        "fused",
        "--batch",
        "1",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--graphs",
        "on",
        "off",
        "--prefill",
        "32",
        "--out",
        str(out),
        tmp_path=tmp_path,
    )
    table = out.read_text()
    assert "experts q8_0" in table.splitlines()[0]
    for graphs in ("on", "off"):
        row = next(line for line in table.splitlines() if f"graphs {graphs} |" in line)
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert cells[0] == "freetoken" and all(float(c) > 0 for c in (cells[3], cells[4], cells[6]))


def test_a_gguf_f32_copy_holds_the_files_values_and_metadata(tmp_path, monkeypatch):
    """gguf_f32_copy.py (llama.cpp against freetoken without llama.cpp's 8-bit activations):
    every tensor F32 with the values the gguf package dequantizes, every metadata field kept."""
    import gguf
    import numpy as np

    from tiny_gguf import build_byte_qwen3, write_qwen3_gguf

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from gguf_f32_copy import f32_copy

    # (the byte tokenizer: metadata of the same kinds as Qwen's, without 151k tokens to parse)
    src, _ = build_byte_qwen3("qwen3", tmp_path / "src")
    quantized = write_qwen3_gguf(src, tmp_path / "q8_0.gguf", "Q8_0")
    assert f32_copy(str(quantized), str(tmp_path / "f32.gguf")) > 0
    before, after = gguf.GGUFReader(quantized), gguf.GGUFReader(tmp_path / "f32.gguf")
    kinds = {t.tensor_type for t in before.tensors}
    assert gguf.GGMLQuantizationType.Q8_0 in kinds
    assert {t.tensor_type for t in after.tensors} == {gguf.GGMLQuantizationType.F32}
    for a, b in zip(before.tensors, after.tensors, strict=True):
        assert a.name == b.name
        assert np.array_equal(gguf.dequantize(a.data, a.tensor_type), b.data), a.name
    names = {n for n in before.fields if not n.startswith("GGUF.")}
    assert names == {n for n in after.fields if not n.startswith("GGUF.")}
    for name in names:
        assert before.fields[name].contents() == after.fields[name].contents(), name


def test_dense_quantized_kernel_table(tmp_path):
    """dense_quantized.py --kernel: a row per format and dtype (and layer), with its speeds."""
    out = run(
        "dense_quantized.py",
        "--kernel",
        "--formats",
        "q8_0",
        "q4_k",
        "--repeats",
        "1",
        tmp_path=tmp_path,
    )
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| q")]
    assert {(r[0].strip(), r[3].strip()) for r in rows} == {
        (f, d) for f in ("q8_0", "q4_k") for d in ("bfloat16", "float32")
    }
    # (numbers: their size is the machine's load, which a test cannot judge)
    assert all(float(cell) >= 0 for r in rows for cell in r[4:])


@pytest.mark.parametrize("family", ["kimi-linear", "deepseek-v4-flash"])
def test_llama_cpp_families_checkpoints_load_whole(tmp_path, monkeypatch, caplog, family):
    """llama_cpp_families.py writes its checkpoints in the release layouts llama.cpp's converter
    reads (Kimi-Linear's dense layer under `mlp`; DeepSeek-V4's own names, its `attn.kv_norm`,
    MXFP4 experts under `X.scale`): freetoken reads every tensor of them, V4's experts kept
    MXFP4."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from llama_cpp_families import FAMILIES, family_config, write_checkpoint

    from freetoken.models.loading import load_model

    raw = family_config(FAMILIES[family], tiny=True)
    write_checkpoint(raw, tmp_path / "m", None, "qwen")
    with caplog.at_level("INFO"):
        loaded = load_model(tmp_path / "m", "bfloat16")
    assert "ignored" not in caplog.text
    assert loaded.config.num_layers == raw["num_hidden_layers"]
    assert loaded.experts.format.name == ("mxfp4" if family == "deepseek-v4-flash" else "dense")


def test_decode_offload_with_a_prefetch_models_its_predictions(tmp_path):
    out = tmp_path / "decode.md"
    run(
        "decode_offload.py",
        *("--layers", "3", "--steps", "2", "--warmup", "1", "--batch", "1", "--cache", "40"),
        *("--strategy", "offload", "--prefetch", "0", "--prefetch", "3"),
        *("--prediction-recall", "1.0", "--out", str(out)),
        tmp_path=tmp_path,
    )
    table = out.read_text()
    rows = {
        line.split("|")[2].strip(): line.split("|")
        for line in table.splitlines()
        if line.startswith("| 40 ")
    }
    header = next(line for line in table.splitlines() if line.startswith("| cache | strategy"))
    column = [c.strip() for c in header.split("|")].index("prefetched")
    assert float(rows["offload"][column]) == 0 and float(rows["offload+p3"][column]) > 0


def test_prefetch_recall_sets_predictions_beside_routes(tmp_path):
    from tiny_models import build_chat_model

    path, _ = build_chat_model("qwen3_moe", tmp_path / "m", mlp_only_layers=[])
    out = tmp_path / "recall.md"
    args = [str(path), "--tokens", "4", "--prompt-tokens", "24", "--out", str(out)]
    run("prefetch_recall.py", *args, tmp_path=tmp_path, tiny=False)
    text = out.read_text()
    recall = float(text.split("recall over the predicted layers: ")[1].split("*")[0])
    assert 0.0 <= recall <= 1.0
    layers = [line for line in text.splitlines() if line.startswith("| ") and "recall" not in line]
    assert len(layers) == 2  # the tiny model's MoE layers but the first (no layer before it)


def test_speculative_decode_keeps_the_tokens_with_a_prefetch(tmp_path):
    out = tmp_path / "spec.md"
    run(
        "speculative_decode.py",
        *("--layers", "2", "--strategies", "offload", "--cache", "40", "--batches", "1"),
        *("--tokens", "12", "--prompt", "32", "--prefetch", "2", "--out", str(out)),
        *("--rounds", "2"),
        tmp_path=tmp_path,
    )
    table = out.read_text()
    lines = table.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| offload | 1 | edit |"))
    assert lines[at].split("|")[-2].strip() == "1.000"  # auto's tokens are off's
    assert "prefetch 2 a layer" in table
    # --rounds 2: off, auto, off, auto, off; the ratio is the medians'
    runs = ast.literal_eval(lines[at + 1].split(": ", 1)[1].removesuffix(" -->"))
    assert len(runs["off"]) == 3 and len(runs["auto"]) == 2
    off, auto = sorted(runs["off"])[1], sum(runs["auto"]) / 2
    assert float(lines[at].split("|")[7]) == pytest.approx(auto / off, abs=0.01)


def test_speculative_routing_by_position_follows_the_trace(tmp_path, monkeypatch):
    """speculative_decode.py --routing trace:FILE: position p routes as trace token p (mod its
    length), MoE layer l as trace layer l mod 2, whatever the batch: a verify step's tokens
    route as they would one by one."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from decode_offload import random_model, tiny
    from speculative_decode import route_by_position, steered_token

    path = tmp_path / "trace.npz"
    want = write_trace(path, tokens=40, layers=2)
    loaded = random_model(tiny(3), torch.device("cpu"))
    vocab = loaded.config.vocab_size
    loaded.model.forward = lambda batch, *a, **k: torch.randn(len(batch.positions), vocab)
    holder = route_by_position(loaded, torch.device("cpu"), f"trace:{path}")
    positions = torch.tensor([0, 1, 2, 41, 79, 500])
    batch = type("Batch", (), {"positions": positions})()
    holder.steer.fill_(1.0)
    logits = loaded.model.forward(batch)
    assert torch.equal(holder.now, positions)
    x = torch.zeros(len(positions), loaded.config.hidden_size)
    for layer, block in enumerate(layer.moe for layer in loaded.model.layers):
        ids = block.router(x).topk(4, dim=-1).indices.sort(-1).values
        expected = torch.as_tensor(want[positions % 40, layer % 2]).long().sort(-1).values
        assert torch.equal(ids, expected), layer
    # the greedy token is fixed by position while steering, the model's own otherwise
    assert torch.equal(logits.argmax(-1), steered_token(positions, vocab))
    holder.steer.fill_(0.0)
    assert loaded.model.forward(batch).abs().max() < 100


def test_speculative_decode_on_a_trace_keeps_the_tokens(tmp_path):
    trace = tmp_path / "trace.npz"
    write_trace(trace, tokens=200, layers=2)
    out = tmp_path / "spec.md"
    run(
        "speculative_decode.py",
        *("--layers", "2", "--strategies", "hybrid", "--cache", "40", "--batches", "2"),
        *("--tokens", "12", "--prompt", "32", "--routing", f"trace:{trace}", "--out", str(out)),
        tmp_path=tmp_path,
    )
    table = out.read_text()
    assert f"routing trace:{trace}" in table
    edit = next(line for line in table.splitlines() if line.startswith("| hybrid | 2 | edit |"))
    assert edit.split("|")[-2].strip() == "1.000"  # auto's tokens are off's


def test_launch_count_charges_each_layers_launches_to_its_modules(tmp_path):
    """A decode step's launches on the GPU's code path, counted on the CPU (Triton's
    interpreter): every layer's attention launches its projections and its RoPE kernel, the
    norms their kernel, and the table says so."""
    out, counts = tmp_path / "launches.md", tmp_path / "launches.json"
    args = ["--family", "qwen3_moe", "--out", str(out), "--json", str(counts)]
    run("launch_count.py", *args, tmp_path=tmp_path, tiny=False)
    got = json.loads(counts.read_text())
    layers, ops = got["layers"], got["ops"]
    assert ops["attn"]["linear"] == 4 * layers  # q, k, v, o
    assert ops["attn"]["triton:_rotary_kernel"] % layers == 0 < ops["attn"]["triton:_rotary_kernel"]
    assert ops["attn"]["triton:_rms_norm_kernel"] == 2 * layers  # (Qwen3's q and k norms)
    assert ops["moe"]["triton:_route_kernel"] == got["moe_layers"] > 0
    assert "| attn |" in out.read_text()


def test_profile_decode_times_the_dense_work_stacked_and_not(tmp_path):
    """profile_decode.py --stacked: the step without routed experts, then with each layer's
    projections stacked (what `gpu_deepseek_v4.sh stacked` compares); decode_offload.py's
    --stacked says so in its table."""
    out = run(
        "profile_decode.py",
        "--layers",
        "2",
        "--steps",
        "2",
        "--strategy",
        "fused",
        "--stacked",
        "--no-cuda-graphs",
        "--out",
        str(tmp_path / "profile"),
        tmp_path=tmp_path,
    )
    lines = (tmp_path / "profile" / "profile-summary.txt").read_text().splitlines()
    assert lines[0].startswith("fused: ") and lines[0] in out
    assert lines[1].startswith("no routed experts: ")
    assert lines[2].startswith("no routed experts, projections stacked: ")
    table = tmp_path / "decode.md"
    run(
        "decode_offload.py",
        *("--layers", "2", "--steps", "1", "--warmup", "1", "--batch", "1", "--cache", "all"),
        *("--stacked", "--out", str(table)),
        tmp_path=tmp_path,
    )
    assert "projections stacked" in table.read_text().splitlines()[0]
