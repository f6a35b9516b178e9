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


def test_step_modes_try_each_way_then_keep_the_fastest():
    from freetoken.moe.split import CPU, FILL, SPLIT, StepModes

    chooser = StepModes(explore_every=4, window=3, min_samples=2)
    timings = [(SPLIT, 9.0), (FILL, 9.0), (CPU, 9.0), (SPLIT, 0.030), (FILL, 0.020),
               (CPU, 0.025), (SPLIT, 0.032), (FILL, 0.021), (CPU, 0.026)]  # fmt: skip
    for mode, seconds in timings:
        assert chooser.choose(1) == mode  # each way 1 + 2 times, in turns
        chooser.observe(1, mode, seconds)  # the first of each is a warm-up, not counted
    assert [chooser.median(1, m) for m in (SPLIT, FILL, CPU)] == [0.032, 0.021, 0.026]
    picks = [chooser.choose(1) for _ in range(11)]  # steps 10..20
    # The fastest, but on steps 12, 16 and 20 the others in turn.
    assert picks == [FILL, FILL, CPU, FILL, FILL, FILL, SPLIT, FILL, FILL, FILL, CPU]
    # Batch sizes are learned apart.
    assert chooser.choose(4) == SPLIT
    # One outlier (a step that captured a graph, say) does not move the median...
    chooser.observe(1, FILL, 5.0)
    assert chooser.median(1, FILL) == 0.021 and chooser.best(1) == FILL
    # ...but fills that stay slower do.
    chooser.observe(1, FILL, 0.060)
    chooser.observe(1, FILL, 0.061)
    assert chooser.median(1, FILL) == 0.061
    assert chooser.best(1) == CPU


def test_step_modes_keep_their_way_unless_another_is_clearly_faster():
    """Medians timed steps apart are noisy: the way in use (the split at first) keeps its
    place against one faster by less than the margin, and gives way beyond it."""
    from freetoken.moe.split import CPU, FILL, SPLIT, StepModes

    chooser = StepModes(explore_every=4, window=3, min_samples=1, margin=0.1)
    for mode, seconds in [(SPLIT, 1.0), (FILL, 1.0), (CPU, 1.0), (SPLIT, 0.100),
                          (FILL, 0.120), (CPU, 0.095)]:  # fmt: skip
        assert chooser.choose(1) == mode
        chooser.observe(1, mode, seconds)
    assert chooser.best(1) == SPLIT  # cpu 5% faster: within the margin
    chooser.observe(1, CPU, 0.080)
    chooser.observe(1, CPU, 0.080)
    assert chooser.median(1, CPU) == 0.080 and chooser.best(1) == CPU  # 20% faster
    chooser.observe(1, SPLIT, 0.078)
    chooser.observe(1, SPLIT, 0.078)
    assert chooser.best(1) == CPU  # now the split is within the margin of the way in use


def test_step_modes_measure_in_turns_so_a_slow_start_weighs_on_every_way():
    """The first steps of a run are slow whatever the way (warming caches and threads); taken
    in turns, their cost lands on each way alike and the way that is fastest once warm wins
    (taken in blocks, the first way measured would carry it all)."""
    from freetoken.moe.split import CPU, FILL, SPLIT, StepModes

    true = {SPLIT: 0.010, FILL: 0.016, CPU: 0.012}  # warm step times
    chooser = StepModes(explore_every=1000, window=5, min_samples=3)
    for step in range(40):
        mode = chooser.choose(1)
        chooser.observe(1, mode, true[mode] * (2.0 if step < 9 else 1.0))  # a slow start
    assert chooser.best(1) == SPLIT


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
