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


def test_split_or_fill_tries_both_then_keeps_the_faster():
    from freetoken.moe.split import SplitOrFill

    chooser = SplitOrFill(explore_every=4, window=3, min_samples=2)
    timings = [(True, 9.0), (True, 0.030), (True, 0.032), (False, 9.0), (False, 0.020),
               (False, 0.021)]  # fmt: skip
    for split, seconds in timings:
        assert chooser.choose(1) is split  # split, then fill everything, each 1 + 2 times
        chooser.observe(1, split, seconds)  # the first of each is a warm-up, not counted
    assert (chooser.median(1, True), chooser.median(1, False)) == (0.032, 0.021)
    picks = [chooser.choose(1) for _ in range(6)]  # steps 7..12
    assert picks == [False, True, False, False, False, True]  # explores on steps 8 and 12
    # Batch sizes are learned apart.
    assert chooser.choose(4) is True
    # One outlier (a step that captured a graph, say) does not move the median...
    chooser.observe(1, False, 5.0)
    assert chooser.median(1, False) == 0.021 and chooser.choose(1) is False
    # ...but fills that stay slower do.
    chooser.observe(1, False, 0.060)
    chooser.observe(1, False, 0.061)
    assert chooser.median(1, False) == 0.061
    assert chooser.choose(1) is True
