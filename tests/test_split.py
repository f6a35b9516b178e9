"""The miss split: q for given m, B_P', B_H'; the paper's formula as the full-contention case;
the minimum fill; the cap; the running bandwidth averages."""

import pytest

from freetoken.moe.split import BandwidthTracker, paper_split, split_misses


@pytest.mark.parametrize(
    ("m", "fill", "cpu", "q"),
    [
        (8, 54e9, 34e9, 5),  # measured on the GPU host with both paths running: 8 * 54 / 88
        (8, 50e9, 50e9, 4),
        (10, 30e9, 10e9, 8),  # 7.5 rounds to 8
        (3, 10e9, 90e9, 1),  # 0.3 rounds to 0, but one fill keeps the cache warming
        (5, 1e9, 0.0, 5),  # no CPU bandwidth: fill everything
        (5, 0.0, 1e9, 1),  # no PCIe bandwidth still fills the minimum one
        (0, 50e9, 34e9, 0),  # nothing missed, nothing filled
    ],
)
def test_split(m, fill, cpu, q):
    assert split_misses(m, fill, cpu) == q


def test_both_paths_finish_together():
    m, fill, cpu = 12, 48e9, 24e9
    q = split_misses(m, fill, cpu)
    assert q == 8
    assert q / fill == pytest.approx((m - q) / cpu)


def test_paper_formula_is_the_full_contention_case():
    # Full contention: the fill takes B_P of the host's B_H, the CPU gets B_H - B_P.
    for m, b_p, b_h in [(8, 25e9, 100e9), (16, 55e9, 119e9), (6, 10e9, 40e9)]:
        general = m * b_p / (b_p + (b_h - b_p))
        assert general == pytest.approx(paper_split(m, b_p, b_h))
        assert split_misses(m, b_p, b_h - b_p) == max(1, round(paper_split(m, b_p, b_h)))


def test_cap_and_minimum():
    assert split_misses(8, 90e9, 10e9, max_fill=3) == 3
    assert split_misses(8, 90e9, 10e9, max_fill=20) == 7
    assert split_misses(8, 1e9, 99e9, min_fill=2) == 2
    assert split_misses(1, 1e9, 99e9, min_fill=2) == 1  # never more than the misses


def test_tracker_follows_measurements():
    t = BandwidthTracker(50e9, 30e9, alpha=0.5)
    t.observe_fill(10e9, 1.0)  # a competing program halves PCIe: 10 GB/s seen
    assert t.fill == pytest.approx(30e9)
    t.observe_cpu(0, 1.0)  # nothing measured, nothing changes
    assert t.cpu == 30e9
    before = split_misses(8, 50e9, 30e9)
    assert split_misses(8, t.fill, t.cpu) < before


def run_steps(chooser, times, steps: int, batch: int = 1) -> list[str]:
    """Drive `chooser` as the runtime does (choose, run, observe); each way's step takes
    times(step, way) seconds. Returns the ways chosen."""
    picks = []
    for _ in range(steps):
        mode = chooser.choose(batch)
        chooser.observe(batch, mode, times(len(picks), mode))
        picks.append(mode)
    return picks


def test_step_modes_warm_up_then_try_each_way_in_turns_and_keep_the_fastest():
    from freetoken.moe.split import CPU, FILL, SPLIT, StepModes

    chooser = StepModes(warmup=2, rounds=3, retrial_every=30)
    true = {SPLIT: 0.030, FILL: 0.020, CPU: 0.025}
    picks = run_steps(chooser, lambda step, mode: true[mode], 2 + 18 + 3)
    # the split while warming up, then the trial: each way twice, in turns, three rounds
    assert picks[:2] == [SPLIT, SPLIT]
    assert picks[2:20] == [SPLIT, SPLIT, FILL, FILL, CPU, CPU] * 3
    assert picks[20:] == [FILL] * 3 and chooser.current(1) == FILL
    # the second of each pair counted: three samples a way
    assert [len(chooser._ways(1).samples[m]) for m in (SPLIT, FILL, CPU)] == [3, 3, 3]
    assert [chooser.median(1, m) for m in (SPLIT, FILL, CPU)] == [0.030, 0.020, 0.025]
    assert chooser.trials(1) == 1
    # Batch sizes are learned apart.
    assert chooser.choose(4) == SPLIT and chooser.trials(4) == 0


def test_a_slow_warm_up_does_not_decide_the_way():
    """The first steps of a batch size are slow whatever the way (a graph captured, kernels
    compiled, the CPU team woken), and a way's first step in a trial pays for the switch from
    the other (after filling everything, the CPU's cores come back slowly): neither is
    counted."""
    from freetoken.moe.split import CPU, FILL, SPLIT, StepModes

    true = {SPLIT: 0.010, FILL: 0.016, CPU: 0.012}
    chooser = StepModes(warmup=4, rounds=2)
    picks = []

    def times(step, mode):
        switched = step >= 4 and picks[-1:] != [mode]  # (picks: the ways before this one)
        picks.append(mode)
        return true[mode] * (5.0 if step < 4 or switched else 1.0)

    run_steps(chooser, times, 4 + 12 + 1)
    assert chooser.current(1) == SPLIT and chooser.median(1, SPLIT) == 0.010


def test_step_modes_keep_their_way_unless_another_is_clearly_faster():
    """Medians of a few steps are noisy: the way in use (the split at first) keeps its place
    against one faster by less than the margin, and gives way beyond it."""
    from freetoken.moe.split import CPU, FILL, SPLIT, StepModes

    chooser = StepModes(warmup=0, rounds=1, retrial_every=1, margin=0.1)
    run_steps(chooser, lambda step, mode: {SPLIT: 0.100, FILL: 0.120, CPU: 0.095}[mode], 7)
    assert chooser.current(1) == SPLIT  # cpu 5% faster: within the margin
    run_steps(chooser, lambda step, mode: {SPLIT: 0.100, FILL: 0.120, CPU: 0.080}[mode], 7)
    assert chooser.trials(1) == 2 and chooser.current(1) == CPU  # 20% faster


def test_step_modes_try_again_when_the_way_in_use_slows_down():
    """A new trial comes every `retrial_every` steps, or as soon as the way in use runs
    `drift` slower than in its trial, with fresh samples of every way."""
    from freetoken.moe.split import CPU, FILL, SPLIT, StepModes

    chooser = StepModes(warmup=0, rounds=1, retrial_every=1000, drift=0.25, window=3)
    fast_split = {SPLIT: 0.010, FILL: 0.016, CPU: 0.014}
    run_steps(chooser, lambda step, mode: fast_split[mode], 6 + 10)
    assert chooser.current(1) == SPLIT and chooser.trials(1) == 1
    # the CPU becomes busy elsewhere: the split slows, filling everything is now fastest
    busy_cpu = {SPLIT: 0.030, FILL: 0.016, CPU: 0.060}
    picks = run_steps(chooser, lambda step, mode: busy_cpu[mode], 2 + 6 + 2)
    assert picks[:2] == [SPLIT] * 2  # the median of the way in use's window rises...
    assert picks[2:8] == [SPLIT, SPLIT, FILL, FILL, CPU, CPU]  # ...and a trial follows at once
    assert chooser.current(1) == FILL and chooser.trials(1) == 2
    assert chooser.median(1, CPU) == 0.060  # fresh samples, not the first trial's


def test_a_way_slower_in_use_than_in_its_trials_is_charged_its_use():
    """`cpu` fills nothing: under routes that move on, its steps slow as the cache goes stale,
    while in each trial the other ways' fills have just refreshed the cache it is sampled
    with. The way in use is charged its steps in use, and the charge stays with it."""
    from freetoken.moe.split import CPU, FILL, SPLIT, StepModes

    chooser = StepModes(warmup=0, rounds=1, retrial_every=200, drift=0.25, window=3)
    stale = [0]  # steps since the cache was last filled

    def times(step, mode):
        stale[0] = stale[0] + 1 if mode == CPU else 0
        return {SPLIT: 0.010, FILL: 0.016, CPU: 0.006 + 0.001 * min(stale[0], 15)}[mode]

    picks = run_steps(chooser, times, 6 + 6)
    assert picks[5] == CPU and chooser.current(1) == CPU  # fresh, it looked fastest (8 ms)
    picks = run_steps(chooser, times, 200)
    # in use it slowed past the drift; the trials that followed charged it its use (more as
    # it slowed more), and the split took over
    assert chooser.current(1) == SPLIT
    charged, trials = chooser._ways(1).in_use[CPU], chooser.trials(1)
    assert charged >= 1.5  # its last steps in use (>= 12 ms) against its fresh 8 ms
    assert picks[-150:].count(CPU) == 0  # kept, not won back by cpu's fresh samples
    # the next retrial: cpu's fresh 8 ms, charged half as much, is still not 10% faster
    picks = run_steps(chooser, times, 40)
    assert chooser.trials(1) == trials + 1 and chooser.current(1) == SPLIT
    assert chooser._ways(1).in_use[CPU] == pytest.approx(1 + (charged - 1) / 2)


def test_steps_of_nearby_sizes_share_a_key():
    """A verify step's tokens vary with its drafts' lengths: steps are keyed by the power of
    two at or above their tokens, so a batch's shapes share a few keys."""
    from freetoken.moe.split import step_key

    assert [step_key(t) for t in (1, 2, 3, 4, 5, 8, 9, 12, 16, 20)] == [
        1, 2, 4, 4, 8, 8, 16, 16, 16, 32,
    ]  # fmt: skip


def test_larger_steps_follow_a_smaller_split_without_trials_of_their_own():
    """A trial costs steps of the slower ways. Where the nearest smaller key settled on the
    split (or has not settled yet), a larger key follows it untimed: the split's saving grows
    with the misses. Below a key that settled on another way, a larger key tries the ways."""
    from freetoken.moe.split import CPU, FILL, SPLIT, StepModes

    true = {SPLIT: 0.010, FILL: 0.030, CPU: 0.012}
    chooser = StepModes(warmup=2, rounds=1)
    run_steps(chooser, lambda step, mode: true[mode], 2 + 6 + 1, batch=4)
    assert chooser.current(4) == SPLIT and chooser.trials(4) == 1
    # verify steps of 8 to 20 tokens: all on the split, none in a trial, nothing timed
    for tokens in (8, 12, 16, 20) * 10:
        assert chooser.choose(tokens) == SPLIT
        chooser.observe(tokens, SPLIT, 0.050)
    assert [chooser.trials(t) for t in (8, 16, 32)] == [0, 0, 0]
    assert chooser.median(16, SPLIT) is None
    # while the smaller key is still unsettled, a larger key waits on the split too, for
    # `retrial_every` steps at most: then it tries the ways itself
    fresh = StepModes(warmup=2, rounds=1, retrial_every=30)
    fresh.choose(1)
    assert run_steps(fresh, lambda step, mode: true[mode], 30, batch=2) == [SPLIT] * 30
    assert fresh.trials(2) == 0
    picks = run_steps(fresh, lambda step, mode: true[mode], 7, batch=2)
    assert picks[:6] == [SPLIT, SPLIT, FILL, FILL, CPU, CPU] and fresh.trials(2) == 1

    # the smaller key settled on cpu: a larger one tries every way itself
    cpu_first = {SPLIT: 0.010, FILL: 0.030, CPU: 0.006}
    chooser = StepModes(warmup=2, rounds=1)
    run_steps(chooser, lambda step, mode: cpu_first[mode], 2 + 6 + 1, batch=1)
    assert chooser.current(1) == CPU
    picks = run_steps(chooser, lambda step, mode: true[mode], 2 + 6 + 1, batch=5)
    assert picks[2:8] == [SPLIT, SPLIT, FILL, FILL, CPU, CPU]
    assert chooser.trials(8) == 1 and chooser.current(5) == SPLIT
    # a key that tried the ways keeps its own, whatever a smaller key that came later does
    alone = StepModes(warmup=2, rounds=1)
    run_steps(alone, lambda step, mode: cpu_first[mode], 2 + 6 + 1, batch=4)
    alone.choose(1)  # (a smaller key appears, unsettled)
    assert alone.choose(4) == CPU and alone.current(4) == CPU


def test_the_device_form_of_the_split_gives_split_misses_q():
    """split_parameters' (f, lo, hi), applied as the device's plan applies them, gives the q
    split_misses gives, for every mode, bandwidth and cap (but at exact halves, where the
    device rounds them up and Python's round to even)."""
    import math

    from freetoken.moe.split import CPU, FILL, SPLIT, split_parameters

    def device_q(m, f, lo, hi):
        return min(max(math.floor(m * f + 0.5), min(int(lo), m)), min(int(hi), m))

    for m in range(0, 12):
        for fill, cpu in ((50e9, 34e9), (1e9, 3e9), (3e9, 1e9), (1e9, 0.0)):
            for cap in (None, 1, 3):
                f, lo, hi = split_parameters(SPLIT, fill, cpu, cap)
                if (m * f) % 1 != 0.5:
                    assert device_q(m, f, lo, hi) == split_misses(m, fill, cpu, cap)
                assert device_q(m, *split_parameters(FILL, fill, cpu, cap)) == split_misses(
                    m, fill, 0.0, cap
                )
                assert device_q(m, *split_parameters(CPU, fill, cpu, cap)) == 0
