"""Binomial checkpointing schedules against Griewank-Walther's formula and a brute-force DP."""

from functools import cache
from math import comb

import pytest

from otreg.loops import binomial_schedule, min_recomputations


@cache
def brute_force(n, s):
    """Fewest untaped steps, by exhaustive recursion over every split (independent of ours)."""
    if n == 1:
        return 0
    if s == 1:
        return n * (n - 1) // 2
    return min(m + brute_force(n - m, s - 1) + brute_force(m, s) for m in range(1, n))


# (n, s, p) from the closed form p = t n - beta(s + 1, t - 1), worked by hand
TABLE = [
    (1, 1, 0),
    (2, 1, 1),
    (5, 1, 10),
    (3, 2, 2),
    (6, 2, 8),
    (10, 3, 15),
    (20, 4, 39),
    (100, 10, 222),
]


@pytest.mark.parametrize("n, s, expected", TABLE)
def test_min_recomputations_table(n, s, expected):
    t = next(t for t in range(n + 1) if comb(s + t, s) >= n)
    assert min_recomputations(n, s) == expected == (t * n - comb(s + t, s + 1) if n > 1 else 0)


def test_formula_equals_brute_force():
    for n in range(1, 45):
        for s in range(1, 7):
            assert min_recomputations(n, s) == brute_force(n, s), (n, s)


@pytest.mark.parametrize(
    "n, s",
    # (2000, 1500): more nested checkpoints than Python's recursion limit (it raised)
    [(1, 1), (7, 1), (30, 2), (50, 3), (200, 5), (1000, 10), (12, 20), (2000, 1500)],
)
def test_schedule_is_optimal_valid_and_within_budget(n, s):
    actions = binomial_schedule(n, s)
    slots, current, taped, advances, most = {0}, 0, [], 0, 1
    for a in actions:
        if a.kind == "advance":
            assert a.start == current and a.stop > a.start
            advances += a.stop - a.start
            current = a.stop
        elif a.kind == "store":
            assert a.start == current
            slots.add(a.start)
            most = max(most, len(slots))
        elif a.kind == "restore":
            assert a.start in slots
            current = a.start
        elif a.kind == "free":
            slots.remove(a.start)
        else:
            assert a.kind == "taped" and a.start == current
            taped.append(a.start)
    assert taped == list(range(n - 1, -1, -1))  # every step differentiated once, in reverse
    assert advances == min_recomputations(n, s)
    assert most <= s


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_steps is 0"):
        binomial_schedule(0, 3)
    with pytest.raises(ValueError, match="snapshots is 0"):
        min_recomputations(10, 0)
    with pytest.raises(TypeError, match="n_steps must be an integer"):
        min_recomputations(10.0, 2)
