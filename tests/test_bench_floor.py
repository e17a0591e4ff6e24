"""``benchmarks/bench_floor.py``'s design: the timed steps follow each engine after every
other equally often, in both orders, and each step is compared with the floor's step
nearest it in time (see [Note: balanced orders] there)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_floor  # noqa: E402


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_every_engine_follows_every_other_once_a_cycle_in_both_orders(n: int) -> None:
    names = ["floor", *(f"e{i}" for i in range(1, n))]
    cycle = bench_floor.balanced_order(names)
    assert Counter(cycle) == {name: n - 1 for name in names}
    for order in (cycle, cycle[::-1]):
        pairs = Counter(zip(order[-1:] + order[:-1], order, strict=True))  # round the cycle
        assert pairs == {(a, b): 1 for a in names for b in names if a != b}
    # the least bunched cycle of those tried: no engine waits more than twice its share
    assert bench_floor._widest_gap([names.index(x) for x in cycle]) <= 2 * n


def test_a_step_is_compared_with_the_floor_step_nearest_it() -> None:
    sequence = ["floor", "a", "b", "a", "floor", "b"]
    walls = [1.0, 1.1, 2.0, 1.6, 1.5, 3.0]
    # a's steps at 1 and 3: floors at 0 (distance 1) and 4 (distance 1)
    assert bench_floor.paired_ratios(sequence, walls, "a") == pytest.approx([1.1, 1.6 / 1.5])
    # b at 2: floors at 0 and 4 both 2 away, the earlier wins; b at 5: floor 4
    assert bench_floor.paired_ratios(sequence, walls, "b") == pytest.approx([2.0, 2.0])
    assert bench_floor.paired_ratios(sequence, walls, "floor") == [1.0, 1.0]
