"""The stopping rule, the adaptive over-relaxation and Anderson mixing as objects
(otreg/ot/convergence.py), on sequences with known answers."""

import math

import pytest
import torch

import otreg
from otreg.ot.convergence import Anderson, Relaxation, StoppingRule


def test_stopping_rule():
    rule = StoppingRule(tol=1e-4)
    assert not any(rule.stop(0.5**k, floor=lambda: 1e-6) for k in range(13))
    assert rule.stop(0.5**14, floor=lambda: 1e-6) and rule.reason == "tol"
    # a plateau far above the rounding floor is slow progress, not a stall
    rule = StoppingRule(tol=1e-4)
    assert not any(rule.stop(1e-2, floor=lambda: 1e-7) for _ in range(500))
    # within FLOOR times the floor, PATIENCE iterations without a 1% new low stop the loop
    rule = StoppingRule(tol=1e-4)
    stops = [
        rule.stop(2e-4 * (1 + 0.001 * (k % 3)), floor=lambda: 1e-4)
        for k in range(3 * StoppingRule.PATIENCE)
    ]
    assert stops.index(True) == StoppingRule.PATIENCE and rule.reason == "stalled"
    rule = StoppingRule(tol=1e-4)
    assert rule.stop(float("nan")) and rule.reason == "diverged"
    rule = StoppingRule(tol=1e-4)  # finite, but the plan's mass a million times the data's
    assert rule.stop(1.5e6) and rule.reason == "diverged"
    # a floor of 3 (in the exponent) moves the marginals by up to e^3 - 1 = 19: an error of
    # 50 that makes no progress there is a stall (against 10 x 3 it would run on)
    rule = StoppingRule(tol=1e-4)
    stops = [rule.stop(50.0, floor=lambda: 3.0) for _ in range(3 * StoppingRule.PATIENCE)]
    assert stops.index(True) == StoppingRule.PATIENCE and rule.reason == "stalled"
    rule = StoppingRule(tol=0.0)  # a fixed iteration count: nothing stops it
    assert not any(rule.stop(e, floor=lambda: 1.0) for e in (1.0, 0.0, float("inf"), 1.0))
    assert rule.reason == "max_iter"


def test_an_error_that_crawls_along_its_rounding_floor_stops_for_float64_at_once():
    """With ``ahead`` (a kernel that can go on in float64), an error within FLOOR times its
    floor that would need more than ``ahead`` updates at its recent rate stops as a stall
    once RATE_WINDOW updates show the rate, not after PATIENCE updates without a 1% low
    (float32 on two noisy spheres at N = 1,000 crept from 1.65e-3 to 1.34e-3 by such lows
    over 180 updates against tol 1e-3; float64 from there took 20)."""
    window = StoppingRule.RATE_WINDOW
    crawl = [2e-3 * 0.998**k for k in range(200)]  # 0.2% an update: 350 updates to 1e-3
    rule = StoppingRule(tol=1e-3, ahead=60)
    stops = [rule.stop(e, floor=lambda: 2e-3) for e in crawl]
    assert stops.index(True) == window and rule.reason == "stalled"
    rule = StoppingRule(tol=1e-3)  # (without ahead: each 1% low resets the patience)
    assert not any(rule.stop(e, floor=lambda: 2e-3) for e in crawl)
    # far above the floor, the same crawl is left alone (slow convergence, not rounding)
    rule = StoppingRule(tol=1e-3, ahead=60)
    assert not any(rule.stop(e, floor=lambda: 1e-6) for e in crawl)
    # near the floor but fast enough (3% an update: 23 updates to tol) it runs to tol
    rule = StoppingRule(tol=1e-3, ahead=60)
    fast = [2e-3 * 0.97**k for k in range(40)]
    stops = [rule.stop(e, floor=lambda: 2e-3) for e in fast]
    assert stops.index(True) == 23 and rule.reason == "tol"
    rule = StoppingRule(tol=1e-3, ahead=60)  # no progress at all: a stall as well
    stops = [rule.stop(1.5e-3, floor=lambda: 2e-3) for _ in range(50)]
    assert stops.index(True) == window and rule.reason == "stalled"


def test_stopping_rule_waits_for_the_gradient_weighted_error():
    """Below tol, the rule stops only once ``tails()`` is within TAIL_FACTOR times tol, and
    asks for it at most every TAIL_EVERY updates."""
    rule, calls = StoppingRule(tol=1e-3), []
    tails = iter([1.0, 1e-2, 4e-3])

    def measure():
        calls.append(rule._count)
        return next(tails)

    assert not rule.stop(2e-3, tails=measure)  # above tol: not asked
    assert calls == []
    stops = [rule.stop(5e-4, tails=measure) for _ in range(3 * StoppingRule.TAIL_EVERY)]
    first = calls[0]
    assert calls == [first + k * StoppingRule.TAIL_EVERY for k in range(3)]
    assert stops.index(True) == calls[-1] - first and rule.reason == "tol"
    assert rule.tail_error == 4e-3 <= StoppingRule.TAIL_FACTOR * 1e-3


def test_adaptive_relaxation_finds_the_optimal_weight_of_a_linear_iteration():
    # errors theta^k at w = 1: the estimate is theta, the weight 2 / (1 + sqrt(1 - theta))
    theta = 0.99
    relax = Relaxation("auto")
    k = 0
    while relax.w == 1.0:
        relax.observe(theta**k)
        k += 1
    assert k == Relaxation.SETTLE + Relaxation.WINDOW + 1
    assert relax.w == pytest.approx(2 / (1 + math.sqrt(1 - theta)), rel=1e-9)
    # at a weight above the optimum the rate is w - 1: the estimate returns w, which stays
    w = relax.w
    for j in range(50):
        relax.observe((w - 1) ** j)
    assert relax.w == w
    # no progress for three windows: back halfway to 1
    for _ in range(3 * Relaxation.WINDOW + 1):
        relax.observe(1.0)
    assert relax.w == pytest.approx(1 + (w - 1) / 2)
    fixed = Relaxation(1.5)
    for j in range(40):
        fixed.observe(0.5**j)
    assert fixed.w == 1.5


def test_anderson_history_is_bounded_and_its_step_is_exact_on_a_linear_map():
    # on an affine map g -> A g + c (a contraction), Anderson with m >= the dimension
    # finds the fixed point in at most m + 2 steps (it is then GMRES)
    gen = torch.Generator().manual_seed(0)
    n = 5
    A = torch.randn(n, n, generator=gen, dtype=torch.float64)
    A = 0.9 * A / torch.linalg.matrix_norm(A, 2)
    c = torch.randn(n, generator=gen, dtype=torch.float64)
    fixed = torch.linalg.solve(torch.eye(n, dtype=torch.float64) - A, c)
    mixer = Anderson(torch.ones(1, n, dtype=torch.float64), eps=1.0)
    g = torch.zeros(1, n, dtype=torch.float64)
    for _ in range(n + 2):
        update = g @ A.T + c
        g = mixer.step(g, update, float((update - g).norm()))
        assert mixer.filled <= mixer.memory
    torch.testing.assert_close(g[0], fixed, rtol=0, atol=1e-9)


def test_an_update_that_overflows_is_undone_not_the_end_of_the_solve(monkeypatch):
    """Forty points and one 42 units away at blur 0.1, float32: an extrapolated update
    overflowed and the solve ended 'diverged' at a value off in the second digit. The
    update is undone and the weight halved; the solve goes on to float32's rounding floor.
    (From the annealing's potentials: converged ones at twice the blur overflow nothing;
    and without far-point steps, which move the far point before any update overflows.)"""
    import warnings

    from otreg.ot import kernels, loop, newton

    monkeypatch.setattr(loop, "HALFWAY", math.inf)
    monkeypatch.setattr(kernels.DenseKernel, "cell_step", lambda self, *args: None)
    monkeypatch.setattr(newton, "check_at", lambda p: math.inf)  # (the updates here)

    g = torch.Generator().manual_seed(24)
    x = torch.randn(40, 2, generator=g)
    y = torch.cat([x + torch.tensor([1.0, 0.0]), torch.tensor([[30.0, 30.0]])])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", otreg.ConvergenceWarning)
        res = otreg.sinkhorn(x, y, blur=0.1, max_iter=5000)
    ref = otreg.sinkhorn(
        x.double(), y.double(), blur=0.1, tol=1e-6, max_iter=20_000, relaxation="auto"
    )
    assert ref.converged and res.stopped in ("tol", "stalled")
    assert "halved after 1 overflow" in res.acceleration
    assert float(res.cost) == pytest.approx(float(ref.cost), rel=1e-4)
