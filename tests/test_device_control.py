"""The expert cache's decisions on the device (moe/device_control.py), on the CPU twin: every
plan keeps the tables consistent, protects the hits, fills exactly the misses into the
lowest-scored slots, and leaves every routed expert's weights in its slot; the runtime
switches between device and host decisions without losing the placement; the fill kernel
copies what the plan says under Triton's interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.config import MoEOptions
from freetoken.kernels.cache_control import SEQ_WORD, SHAPE_WORD
from freetoken.kernels.expert_fill import fill_experts
from freetoken.moe.cache import ExpertCache
from freetoken.moe.device_control import DeviceControl
from freetoken.moe.policy import ExpectedNextUsePolicy
from test_moe_runtime import drive, tiny_store

LAYERS, EXPERTS = 3, 6


def check_tables(control: DeviceControl) -> None:
    slot_of, pair_of = control.slot_of[:-1].numpy(), control.pair_of[:-1].numpy()
    assert control.slot_of[-1] == -1 and control.pair_of[-1] == -1  # the sinks
    for pair in np.flatnonzero(slot_of >= 0):
        assert pair_of[slot_of[pair]] == pair
    for slot in np.flatnonzero(pair_of >= 0):
        assert slot_of[pair_of[slot]] == slot
    assert (slot_of >= 0).sum() == (pair_of >= 0).sum()


steps = st.lists(
    st.tuples(
        st.integers(0, LAYERS - 1),
        st.lists(
            st.lists(st.integers(0, EXPERTS - 1), min_size=2, max_size=2, unique=True),
            min_size=1,
            max_size=3,
        ),
    ),
    min_size=1,
    max_size=25,
)


def check_plans(steps, extra_slots: int, fused: bool = False, split=None) -> None:
    """Run the plans of `steps` (layer, routes) and check each against what a plan must do;
    `fused`: through the one-program Triton plan (under the interpreter on the CPU); `split`:
    hybrid's (f, lo, hi), None for offload's fill-every-miss."""
    store = tiny_store(num_layers=LAYERS, num_experts=EXPERTS)
    slots = min(6 + extra_slots, store.num_pairs)  # a slot for each of up to 3 x 2 routes
    policy = ExpectedNextUsePolicy()
    cache = ExpertCache(store, slots, torch.device("cpu"), policy=policy)
    split_values = None if split is None else torch.tensor(split, dtype=torch.float32)
    cpu_x = torch.zeros(3, store.shape.hidden)  # where a doorbell's activations would go
    pairs_buf, weights_buf = torch.empty(slots, dtype=torch.long), torch.empty(slots)
    # the doorbell's words and numbers, which the one-program plan rings (moe/doorbell.py)
    words, numbers = torch.zeros(192, dtype=torch.int32), torch.zeros(2, dtype=torch.long)
    bell = (words, numbers) if fused else None
    control = DeviceControl(cache, policy, split_values, (pairs_buf, weights_buf, cpu_x), bell)
    control.fused = fused
    gen = torch.Generator().manual_seed(len(steps))
    for layer, routes in steps:
        pairs = torch.tensor(routes) + layer * EXPERTS
        weights = torch.rand(pairs.shape, generator=gen)
        before_slot = control.slot_of.clone()
        before_pair = control.pair_of[:-1].clone()
        distinct = torch.unique(pairs)
        hits = distinct[before_slot[distinct] >= 0]
        misses = distinct[before_slot[distinct] < 0]
        scores = torch.as_tensor(policy.slot_scores(layer, before_pair)).float()
        pair_scores = torch.as_tensor(policy.pair_scores(layer, misses)).float()
        x = torch.randn(len(routes), store.shape.hidden, generator=gen)
        rung = int(numbers[0])
        before_x = cpu_x.clone()
        got, fill_pairs, fill_slots = control.plan(layer, pairs, weights, x, shape=100 + layer)
        check_tables(control)
        # The split: q misses filled, those the policy scores highest (ties: the lower pair).
        m = len(misses)
        if split is None:
            q = m
        else:
            f, lo, hi = split
            q = min(
                max(
                    int(np.floor(np.float32(m) * np.float32(f) + np.float32(0.5))), min(int(lo), m)
                ),
                min(int(hi), m),
            )
        best = sorted(zip((-pair_scores).tolist(), misses.tolist(), strict=True))[:q]
        filled = sorted(pair for _, pair in best)
        # GPU routes have their expert's slot, the CPU's -1; the hits kept theirs.
        gpu = got >= 0
        assert torch.equal(got, control.slot_of[pairs])
        assert torch.equal(control.slot_of[hits], before_slot[hits])
        on_gpu = set(hits.tolist()) | set(filled)
        assert torch.equal(gpu, torch.tensor([[p in on_gpu for p in r] for r in pairs.tolist()]))
        # The CPU's routes: the others, each with its gate weight.
        R = pairs.numel()
        cpu_pairs = control.cpu_pairs[:R]
        assert torch.equal(cpu_pairs, torch.where(gpu, -1, pairs).reshape(-1))
        assert torch.equal(control.cpu_weights[:R], weights.reshape(-1))
        assert bool(control.cpu_flag) == bool((~gpu).any())  # what the merge reads
        if fused:  # rung (a new number, the shape) exactly when the CPU has routes, and x
            # handed over for them (the twin's CPU reads it in place)
            if (~gpu).any():
                assert numbers.tolist() == [rung + 1, rung + 1]
                assert (int(words[SEQ_WORD]), int(words[SHAPE_WORD])) == (rung + 1, 100 + layer)
                assert torch.equal(cpu_x[: len(routes)], x)
            else:
                assert int(numbers[0]) == rung
                assert torch.equal(cpu_x, before_x)  # nothing crossed for nobody
        # Exactly the filled misses are copied, each into its own slot, none a hit's.
        real = fill_slots != slots
        assert sorted(fill_pairs[real].tolist()) == filled
        victims = fill_slots[real]
        assert len(set(victims.tolist())) == len(victims)
        assert not set(victims.tolist()) & set(before_slot[hits].tolist())
        # The victims are the lowest-scored of the slots the hits do not hold.
        free = torch.ones(slots, dtype=torch.bool)
        free[before_slot[hits]] = False
        lowest = scores[free].sort().values[: len(victims)]
        assert torch.equal(scores[victims].sort().values, lowest)
        # The fills put each GPU route's expert's weights in its slot.
        banks = ((cache.w_gate_up, store.w_gate_up), (cache.w_down, store.w_down))
        fill_experts(banks, fill_pairs, fill_slots, slots)
        for pair, slot in zip(pairs.reshape(-1).tolist(), got.reshape(-1).tolist(), strict=True):
            if slot >= 0:
                assert torch.equal(cache.w_gate_up[slot], store.w_gate_up[pair])
                assert torch.equal(cache.w_down[slot], store.w_down[pair])
    counts = control.take_counters()
    assert counts[:, 0].sum() == len(steps)
    distinct_per_step = [len({e for route in routes for e in route}) for _, routes in steps]
    assert counts[:, 1].sum() == sum(distinct_per_step)
    # accesses = hits + fills + the CPU's pairs
    assert (counts[:, 1] == counts[:, 2] + counts[:, 3] + counts[:, 4]).all()
    if split is None:
        assert (counts[:, 4:] == 0).all()
    assert (control.counters == 0).all()  # taken


splits = st.one_of(
    st.none(),
    st.tuples(
        st.sampled_from([0.0, 0.25, 0.5, 0.7, 1.0]),
        st.sampled_from([0.0, 1.0]),
        st.sampled_from([0.0, 1.0, 2.0, 2.0**30]),
    ),
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(steps=steps, extra_slots=st.integers(0, LAYERS * EXPERTS), split=splits)
def test_every_plan_keeps_the_cache_right(steps, extra_slots, split):
    check_plans(steps, extra_slots, split=split)


def test_the_device_update_of_the_policy_is_the_host_one_to_the_bit():
    host, masked = ExpectedNextUsePolicy(), ExpectedNextUsePolicy()
    for policy in (host, masked):
        policy.reset(LAYERS, EXPERTS, 4, torch.device("cpu"))
    rng = np.random.default_rng(0)
    for _ in range(50):
        layer = int(rng.integers(LAYERS))
        experts = rng.choice(EXPERTS, size=3, replace=False)
        host.observe(layer, experts)
        repeated = torch.tensor(np.concatenate([experts, experts[:2]]))
        mask = torch.tensor([True] * 3 + [False] * 2)
        masked.observe_masked(layer, repeated, mask)
        pairs = torch.arange(LAYERS * EXPERTS)
        assert np.array_equal(host.pair_scores(layer, pairs), masked.pair_scores(layer, pairs))


def test_the_runtime_moves_between_device_and_host_decisions():
    """Decode-sized calls decide on the device, calls with more routes than slots on the host:
    each sees the placement the other left, and every output is the reference's."""
    from freetoken.moe.runtime import build_runtime

    store = tiny_store(num_layers=2, num_experts=4)
    rt = build_runtime(store, torch.device("cpu"), MoEOptions("offload", "3"))
    assert rt.control is not None and rt.capturable(1, 1) and not rt.capturable(4, 4)
    steps = [
        (0, [[0]]),
        (1, [[1]]),
        (0, [[0], [1], [2], [3]]),
        (0, [[3]]),
        (1, [[2]]),
        (1, [[0], [1], [2], [3]]),
        (0, [[0]]),
    ]
    t = drive(rt, store, steps)
    assert t.total().calls == len(steps)
    check_tables(rt.control)
    rt.control.push_host_tables()
    assert torch.equal(rt.cache.slot_of, rt.control.slot_of[:-1])
    cached = torch.nonzero(rt.cache.slot_of >= 0).flatten()
    for pair in cached.tolist():
        assert torch.equal(rt.cache.w_gate_up[rt.cache.slot_of[pair]], store.w_gate_up[pair])


class Folded:
    """A runtime's calls as a decode graph folds one it cannot hold: the host phase between
    two graph segments, then the layer's GPU work in the next (engine/cuda_graphs.py)."""

    def __init__(self, rt):
        self.rt = rt

    def __call__(self, moe_layer, x, ids, weights):
        rt = self.rt
        if rt.capturable(x.shape[0], ids.numel()):
            return rt(moe_layer, x, ids, weights)
        assert rt.foldable(x.shape[0], ids.numel())
        slots = torch.full(ids.shape, -1, dtype=torch.long)
        partial = torch.zeros_like(x)
        rt.host_phase(moe_layer, x, ids, weights, slots, partial)
        return rt.device_phase(x, slots, weights, partial)

    @property
    def telemetry(self):
        return self.rt.telemetry


def test_a_folded_call_decides_on_the_placement_the_device_left():
    """A decode batch too large for the device's plan (more routes than it holds) is folded
    into the graph as a host phase: it must decide on the cache's tables as the device left
    them, and leave them back for the device's next plans (its host tables were stale)."""
    from freetoken.moe.runtime import build_runtime

    store = tiny_store(num_layers=2, num_experts=4)
    rt = build_runtime(store, torch.device("cpu"), MoEOptions("offload", "3"))
    steps = [
        (0, [[0]]),
        (1, [[1]]),
        (0, [[0], [1], [2], [3]]),  # folded
        (0, [[3]]),
        (1, [[2]]),
        (1, [[0], [1], [2], [3]]),  # folded
        (0, [[0]]),
        (1, [[3]]),
    ]
    drive(Folded(rt), store, steps)
    check_tables(rt.control)
    rt.control.push_host_tables()
    for pair in torch.nonzero(rt.cache.slot_of >= 0).flatten().tolist():
        assert torch.equal(rt.cache.w_gate_up[rt.cache.slot_of[pair]], store.w_gate_up[pair])


def test_offload_without_device_control_decides_on_the_host():
    from freetoken.moe.runtime import build_runtime

    store = tiny_store()
    rt = build_runtime(store, torch.device("cpu"), MoEOptions("offload", "3", device_control=False))
    assert rt.control is None and not rt.capturable(1, 1)


_INTERPRETED = """
import json, torch
from freetoken.kernels.expert_fill import launch_fill
src, src1, src2 = torch.randn(10, 3, 50), torch.randn(10, 70), torch.randn(10, 9)
dst, dst1, dst2 = torch.zeros(4, 3, 50), torch.zeros(4, 70), torch.zeros(4, 9)
pairs = torch.tensor([7, 10, 2, 10])
slots = torch.tensor([1, 4, 3, 4])  # 4: the sink
# the kernel the device launches, on CPU tensors: gate/up, down and bias banks of odd rows
launch_fill(((dst, src), (dst1, src1), (dst2, src2)), pairs, slots, 4)
ok = all(torch.equal(d[1], s[7]) and torch.equal(d[3], s[2]) and (d[0] == 0).all()
         and (d[2] == 0).all() for d, s in ((dst, src), (dst1, src1), (dst2, src2)))
print(json.dumps({"ok": bool(ok)}))
"""


_INTERPRETED_PLANS = """
import random, sys
sys.path.insert(0, {tests!r})
from test_device_control import EXPERTS, LAYERS, check_plans
rng = random.Random(0)
for case in range(12):
    steps = [(rng.randrange(LAYERS), [rng.sample(range(EXPERTS), 2)
              for _ in range(rng.randint(1, 3))]) for _ in range(rng.randint(1, 12))]
    split = [None, (0.5, 1.0, 2.0**30), (0.0, 0.0, 0.0), (0.7, 0.0, 1.0)][case % 4]
    check_plans(steps, rng.randint(0, LAYERS * EXPERTS), fused=True, split=split)
print("ok")
"""


def test_the_one_program_plan_keeps_the_cache_right_in_the_interpreter():
    pytest.importorskip("triton")
    script = _INTERPRETED_PLANS.format(tests=os.path.dirname(__file__))
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "ok"


def test_the_fill_kernel_copies_the_planned_rows_in_the_interpreter():
    pytest.importorskip("triton")
    result = subprocess.run(
        [sys.executable, "-c", _INTERPRETED],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"ok": True}


def test_hybrid_on_the_device_splits_as_each_step_mode_says():
    """Hybrid decode calls decided on the device (the CPU tier's twin, with the CPU's routes
    run on the executor at once): before each decode step the host writes the split of the
    step's way (`StepModes`) where the plans read it; `cpu` gives every miss to the CPU,
    `fill` fills them all, `split` fills q = m * B_P / (B_P + B_H); the output is the
    reference's every time."""
    from freetoken.moe.runtime import build_runtime
    from freetoken.moe.split import CPU, FILL, SPLIT
    from test_moe_runtime import reference

    store = tiny_store(num_layers=2, num_experts=8)  # top-1
    rt = build_runtime(store, torch.device("cpu"), MoEOptions("hybrid", "4", warm_cache=False))
    assert rt.control is not None and rt.capturable(4, 4)
    rt.tracker.fill, rt.tracker.cpu, rt.tracker.alpha = 3e9, 1e9, 0.0  # q = round(m * 3 / 4)
    gen = torch.Generator().manual_seed(2)
    expected = {CPU: (0, 4), FILL: (4, 0), SPLIT: (3, 1)}  # (fills, CPU pairs) of 4 misses
    for step, mode in enumerate([CPU, FILL, SPLIT, CPU]):
        rt.step_modes.choose = lambda tokens, mode=mode: mode
        rt.begin_step(4, decode=True)
        layer = step % 2
        # four tokens on four experts this cache does not hold (the layer's other half)
        ids = torch.tensor([[e] for e in range(4)]) + (4 if step >= 2 else 0)
        x = torch.randn(4, store.shape.hidden, generator=gen)
        weights = torch.rand(ids.shape, generator=gen)
        rt.control.pull_host_tables()  # nothing cached of these (the host tables start empty)
        rt.control.slot_of[:-1] = -1
        rt.control.pair_of[:-1] = -1
        before = rt.telemetry.layers[layer]
        fills, cpu = before.fills, before.cpu
        out = rt(layer, x, ids, weights)
        assert torch.allclose(out, reference(store, layer, x, ids, weights), atol=1e-5)
        after = rt.telemetry.layers[layer]
        assert (after.fills - fills, after.cpu - cpu) == expected[mode], mode
    assert rt.telemetry.total().cpu_routes == 4 + 1 + 4


_INTERPRETED_MERGE = """
import json, torch
from freetoken.kernels.host_partial import MERGE_BLOCK, add_host_partial_
gen = torch.Generator().manual_seed(0)
ok = True
# fp32 only: the interpreter truncates fp32 -> bf16 where CUDA rounds to nearest even
# (the bf16 merge is checked on CUDA: tests/test_doorbell.py)
words = torch.zeros(256, dtype=torch.int32)
seq = torch.tensor([3, 3])
for rang in (False, True):
    gpu = torch.randn(3, MERGE_BLOCK + 5, generator=gen)
    partial = torch.randn(4 * (MERGE_BLOCK + 5), generator=gen)  # larger than T x H
    want = gpu + partial[: gpu.numel()].view(gpu.shape) if rang else gpu.clone()
    words[128] = 3 if rang else 0  # answered (the merge spins until it is)
    # (the tensors themselves: the interpreter reads CPU tensors; CUDA gets HostRows)
    out = add_host_partial_(gpu, partial, words, 128, seq, torch.tensor(rang))
    ok &= bool(torch.equal(out, want)) and out.data_ptr() == gpu.data_ptr()
print(json.dumps({"ok": ok}))
"""


def test_the_merge_adds_the_host_partial_as_torch_rounds_it_in_the_interpreter():
    pytest.importorskip("triton")
    result = subprocess.run(
        [sys.executable, "-c", _INTERPRETED_MERGE],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"ok": True}


def test_hybrid_on_the_device_times_whole_steps_for_its_step_modes():
    """Each way of stepping is timed from begin_step to end_step (the device's clock on CUDA,
    wall time here) and tried in turns in a trial; a step that captured a graph
    (end_step(timed=False)) and a non-decode forward are not counted."""
    from freetoken.moe.runtime import build_runtime
    from freetoken.moe.split import CPU, FILL, SPLIT, StepModes

    store = tiny_store(num_layers=2, num_experts=8)
    rt = build_runtime(store, torch.device("cpu"), MoEOptions("hybrid", "4"))
    rt.step_modes = StepModes(warmup=1, rounds=3)
    gen = torch.Generator().manual_seed(4)
    chosen = []

    def step(timed=True, decode=True):
        rt.begin_step(2, decode=decode)
        chosen.append(rt._step[2] if rt._step is not None else None)
        for layer in range(2):
            ids = torch.randint(0, 8, (2, 1), generator=gen)
            rt(layer, torch.randn(2, store.shape.hidden, generator=gen), ids, torch.rand(2, 1))
        rt.end_step(timed=timed)

    step()  # the warm-up
    step(timed=False)  # (a capture): the trial's first step, not timed
    for _ in range(17):
        step()
    step(decode=False)  # a prefill chunk ends the last decode step's clock, uncounted
    assert chosen[1:19] == [SPLIT, SPLIT, FILL, FILL, CPU, CPU] * 3 and chosen[19] is None
    # each way's first step of a pair pays for the switch, not counted; the last step's time
    # is not in (read at the next decode step)
    medians = [rt.step_modes.median(2, m) for m in (SPLIT, FILL, CPU)]
    assert all(m is not None and m > 0 for m in medians)
    step()  # the trial ends: a way is kept
    assert rt.step_modes.trials(2) == 1
    # a step after a pause (the CPU's cores slow to wake) is not counted
    rt.step_modes = StepModes(warmup=0, rounds=1)
    step(), step()  # split (the switch), split (counted)
    assert len(rt.step_modes._ways(2).samples[SPLIT]) == 0  # read at the next step's start
    step()  # fill (the switch)
    assert len(rt.step_modes._ways(2).samples[SPLIT]) == 1
    time.sleep(0.01)
    step(), step()  # fill, after a pause: not counted; then cpu (the switch)
    assert len(rt.step_modes._ways(2).samples[FILL]) == 0


def test_the_device_clock_reads_a_step_only_once_it_is_stamped_whole():
    """On CUDA the first layer's plan and the last layer's merge stamp the device's clock into
    pinned memory (StepClock.stamps, in ns); the host reads them in place: a step is timed
    once, and not while the next one is under way (its start is past the last end)."""
    from freetoken.moe.split import StepClock

    clock = StepClock(torch.device("cpu"))
    clock.cuda, clock._stamped = True, np.zeros(2, dtype=np.int64)  # as on CUDA, by hand
    clock.start(), clock.stop()  # nothing for the host to do there on CUDA
    assert clock.seconds() is None  # nothing stamped yet
    clock._stamped[:] = (1_000_000, 3_500_000)  # a step from 1 ms to 3.5 ms
    assert clock.seconds() == (pytest.approx(2.5e-3), float("inf"))  # (none before it)
    assert clock.seconds() is None  # the same step again: not a new sample
    clock._stamped[0] = 4_000_000  # the next step began, has not ended
    assert clock.seconds() is None
    clock._stamped[1] = 5_000_000
    assert clock.seconds() == (pytest.approx(1e-3), pytest.approx(0.5e-3))  # 0.5 ms after


def test_hybrid_gives_the_tracker_the_cpu_share_of_each_step_as_one_observation():
    """Between decode steps the listener's totals since the last step (all layers' jobs)
    become one observation of the CPU's bandwidth."""
    from freetoken.moe.runtime import build_runtime

    class Listener:
        errors = 0
        pending = (0.0, 0.0)

        def totals(self):
            taken, self.pending = self.pending, (0.0, 0.0)
            return taken

    store = tiny_store(num_layers=2, num_experts=8)
    rt = build_runtime(store, torch.device("cpu"), MoEOptions("hybrid", "4"))
    rt.doorbell = listener = Listener()
    before = rt.tracker.cpu
    rt.begin_step(1, decode=True)
    assert rt.tracker.cpu == before  # no job: nothing observed
    listener.pending = (2e-3, 10.0)  # 10 experts' bytes in 2 ms
    rt.begin_step(1, decode=True)
    measured = 10 * store.shape.nbytes / 2e-3
    assert rt.tracker.cpu == pytest.approx(before + rt.tracker.alpha * (measured - before))


def test_a_layer_step_the_listener_could_not_serve_fails_the_next_step():
    """The doorbell's listener counts the jobs it could not start (a zero partial went to the
    device); the runtime reports them once, before the next decode step, instead of serving
    outputs that lack a CPU share."""
    from freetoken.moe.runtime import build_runtime

    class Listener:
        errors = 0

        def fold(self):
            return np.zeros((2, 4))

        def totals(self):
            return 0.0, 0.0

    store = tiny_store(num_layers=2, num_experts=8)
    rt = build_runtime(store, torch.device("cpu"), MoEOptions("hybrid", "4"))
    rt.doorbell = Listener()
    rt.begin_step(1, decode=True)  # nothing failed
    Listener.errors = 2
    with pytest.raises(RuntimeError, match="could not run 2 layer step"):
        rt.begin_step(1, decode=True)
    rt.begin_step(1, decode=True)  # reported once; the engine goes on


# The one-program plan's variants, as the decode steps launch them: offload's (no CPU),
# hybrid's (the CPU's routes and activations handed over, the doorbell rung), hybrid's with the
# step clock's stamp, and the layer-ahead prefetch's (moe/prefetch.py); at batch 1 and 8 of
# DeepSeek-V4-Flash's top-6 over its 256 experts a layer.
PLAN_VARIANTS = ["offload", "hybrid", "hybrid+stamp", "ahead"]


def _compile_plans() -> dict[str, list[str] | str]:
    """Each variant's plan launched under compiled.py's compile-only driver: its kernels
    compiled, or its error."""
    import compiled

    store = tiny_store(num_layers=4, num_experts=256)
    res: dict[str, list[str] | str] = {}
    for variant in PLAN_VARIANTS:
        policy = ExpectedNextUsePolicy()
        cache = ExpertCache(store, 100, torch.device("cpu"), policy=policy)
        before = len(compiled.COMPILED)
        try:
            hybrid = variant.startswith("hybrid")
            cpu = (torch.empty(100, dtype=torch.long), torch.empty(100), torch.zeros(8, 8))
            bell = (torch.zeros(192, dtype=torch.int32), torch.zeros(2, dtype=torch.long))
            control = DeviceControl(
                cache,
                policy,
                torch.tensor([0.5, 1.0, 4.0]) if hybrid else None,
                cpu if hybrid else None,
                bell if hybrid else None,
            )
            control.fused = True
            stamp = torch.zeros(1, dtype=torch.long) if variant.endswith("stamp") else None
            for tokens in (1, 8):
                pairs = torch.arange(tokens * 6).reshape(tokens, 6) % 256 + 256
                x = torch.randn(tokens, 8)
                if variant == "ahead":
                    control.set_prefetch(2)
                    control.plan_ahead(1, pairs.t().reshape(-1))
                else:
                    control.plan(1, pairs, torch.rand(tokens, 6), x, 7, stamp)
        except Exception as e:  # (the test names it)
            res[variant] = f"{type(e).__name__}: {str(e)[-600:]}"
            continue
        res[variant] = [c["name"] for c in compiled.COMPILED[before:]]
    return res


@pytest.fixture(scope="module")
def compiled_plans() -> dict[str, list[str] | str]:
    from compiled import run_compiled

    return run_compiled("test_device_control", "_compile_plans")


@pytest.mark.parametrize("variant", PLAN_VARIANTS)
def test_the_plans_compile_for_the_gpu(compiled_plans, variant):
    """Triton's code generator and ptxas take each variant of the one-program plan as a decode
    step launches it on an H200, which the interpreter's tests do not check: compiled once per
    batch's block of routes (BLOCK_R 16 at batch 1, 64 at batch 8)."""
    pytest.importorskip("triton")
    kernels = compiled_plans[variant]
    assert kernels == ["_plan_kernel", "_plan_kernel"], kernels
