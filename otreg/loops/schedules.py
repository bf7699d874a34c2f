r"""Binomial checkpointing (Griewank 1992; Griewank and Walther, ACM TOMS 2000, "revolve").

To reverse a loop of n steps with s checkpoint slots, the fewest forward steps is

.. math::

    p(n, s) = t\,n - \beta(s + 1, t - 1), \qquad \beta(s, t) = \binom{s + t}{s},

with t the unique integer such that beta(s, t - 1) < n <= beta(s, t). The schedule reaching it
is recursive: from a checkpoint at i, advance m steps, store a checkpoint there, reverse the
upper part with one slot fewer, then the lower part with all slots; m is any split with
m + p(l - m, s - 1) + p(m, s) = p(l, s).

Counting convention (that of revolve): checkpoints include the slot holding the initial state;
``advance`` counts every forward step evaluated without a tape, the first sweep included; each
step is also evaluated once with a tape (``taped``) to differentiate it, which is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import comb

from .._checks import check_int

__all__ = ["binomial_schedule", "min_recomputations"]


@dataclass(frozen=True)
class Action:
    """One instruction of a reversal schedule.

    kind: ``"advance"`` (run steps ``start`` to ``stop`` - 1 without a tape, from the current
    state), ``"store"`` (save the current state, at index ``start``, in a checkpoint),
    ``"restore"`` (make checkpoint ``start`` the current state), ``"taped"`` (differentiate
    step ``start`` from the current state x_start), ``"free"`` (drop checkpoint ``start``).
    """

    kind: str
    start: int
    stop: int | None = None


def max_steps(s: int, t: int) -> int:
    """beta(s, t) = C(s + t, s): the most steps s checkpoints reverse with t repetitions."""
    return comb(s + t, s)


def min_recomputations(n_steps: int, snapshots: int) -> int:
    """Griewank and Walther's p(n, s): the fewest untaped forward steps to reverse n steps.

    Example:
        >>> from otreg.loops import min_recomputations
        >>> min_recomputations(10, 1), min_recomputations(10, 10), min_recomputations(100, 10)
        (45, 9, 222)
    """
    n = check_int("min_recomputations", "n_steps", n_steps, 1)
    s = check_int("min_recomputations", "snapshots", snapshots, 1)
    return _p(n, s)


def _p(n: int, s: int) -> int:
    if n <= 1:
        return 0
    t = 0
    while max_steps(s, t) < n:
        t += 1
    return t * n - max_steps(s + 1, t - 1)


@lru_cache(maxsize=4096)
def _split(length: int, s: int) -> int:
    """An optimal number of steps to advance before storing the next checkpoint."""
    best = _p(length, s)
    # Optimal splits form an interval; the largest keeps the upper part short.
    for m in range(length - 1, 0, -1):
        if m + _p(length - m, s - 1) + _p(m, s) == best:
            return m
    raise AssertionError("no optimal split")  # pragma: no cover


def binomial_schedule(n_steps: int, snapshots: int) -> list[Action]:
    """The optimal (revolve) action list reversing ``n_steps`` steps with ``snapshots`` slots.

    The initial state x_0 sits in a slot when the schedule starts. The list's ``advance``
    steps add up to :func:`min_recomputations`, and at most ``snapshots`` states are stored
    at once.

    Example:
        >>> from otreg.loops import binomial_schedule
        >>> actions = binomial_schedule(10, 3)
        >>> len(actions) > 10
        True
    """
    n = check_int("binomial_schedule", "n_steps", n_steps, 1)
    s = check_int("binomial_schedule", "snapshots", snapshots, 1)
    actions: list[Action] = []
    # reverse(i, j, slots), x_i current and stored: an explicit stack of what is left to do
    # (recursion would nest once per stored state: a thousand steps with as many slots
    # exceeded Python's recursion limit)
    todo: list = [(0, n, s)]
    while todo:
        item = todo.pop()
        if isinstance(item, Action):
            actions.append(item)
            continue
        i, j, slots = item
        length = j - i
        if length == 1:
            actions.append(Action("taped", i))
            continue
        if slots == 1:
            for k in range(j - 1, i, -1):
                actions.append(Action("advance", i, k))
                actions.append(Action("taped", k))
                actions.append(Action("restore", i))
            actions.append(Action("taped", i))
            continue
        m = _split(length, slots)
        actions.append(Action("advance", i, i + m))
        actions.append(Action("store", i + m))
        # then: reverse the upper part, free its checkpoint, restore x_i, reverse the lower
        todo.extend(
            [(i, i + m, slots), Action("restore", i), Action("free", i + m), (i + m, j, slots - 1)]
        )
    return actions
