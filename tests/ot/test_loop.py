"""The loop at the final eps (otreg/ot/loop.py): over-relaxation and Anderson mixing reach
plain updates' solution in fewer iterations, fall back and say so, warm starts, stops."""

import math
import warnings

import pytest
import torch

import otreg
from otreg.datasets import noisy_sphere
from otreg.ot import newton
from otreg.ot.convergence import Anderson
from otreg.ot.kernels import make_kernel
from otreg.ot.loop import gradient_weighted_error
from otreg.ot.problem import Problem, SinkhornOptions
from tests.conftest import clouds

# each test runs on every reduction backend (tests/ot/conftest.py)
pytestmark = pytest.mark.usefixtures("each_backend")


def _spheres(dtype=torch.float64):
    x = noisy_sphere(600, seed=1, dtype=dtype)
    return x, noisy_sphere(700, radius=0.8, center=(0.3, 0.0, 0.0), seed=2, dtype=dtype)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
def test_gradient_weighted_error_equals_brute_force(symmetric, transpose):
    """|| delta_i w_i |x_i - T_i| ||_2 / || w_i |x_i - T_i| ||_2 at potentials off their fixed
    point, from the dense plan: delta_i the violation of one side's marginals (relative),
    T_i the barycentres of that side's rows."""
    x, y, a, b = clouds(n=40, m=50, d=3)
    if symmetric:
        y, b = x, a
    g = torch.Generator().manual_seed(3)
    f0 = 0.02 * torch.randn(1, 40, generator=g, dtype=x.dtype)
    g0 = f0 if symmetric else 0.02 * torch.randn(1, y.shape[0], generator=g, dtype=x.dtype)
    p = Problem.build("t", x, y, a, b, SinkhornOptions(blur=0.1))
    kernel = make_kernel(p, x[None], a[None], *((None, None) if symmetric else (y[None], b[None])))
    if transpose:  # the marginals of y, at f0 (and g0)
        x, y, a, b, f0, g0 = y, x, b, a, g0, f0
    eps = p.eps
    logits = (g0[0] - torch.cdist(x, y).square() / 2) / eps + b.log()
    s = -eps * torch.logsumexp(logits, 1)
    got = gradient_weighted_error(p, kernel, transpose)(f0, s[None], g0)
    delta = torch.exp((f0[0] - s) / eps) - 1
    size = a * (x - torch.softmax(logits, 1) @ y).norm(dim=1)
    want = float((delta * size).norm() / size.norm())
    assert got == pytest.approx(want, rel=1e-9)


def test_a_diverging_fixed_relaxation_stops_and_says_so(monkeypatch):
    from otreg.ot import loop

    # from the annealing's potentials (from converged ones at twice the blur, w = 1.9
    # converges: 320 iterations)
    monkeypatch.setattr(loop, "HALFWAY", math.inf)
    x, y = _spheres()
    with pytest.warns(otreg.ConvergenceWarning, match="diverged"):
        res = otreg.sinkhorn(x, y, blur=0.02, relaxation=1.9, max_iter=1000)
    assert res.stopped == "diverged" and res.n_iter < 1000  # (the default 'auto' converges)


def test_a_non_finite_error_under_auto_relaxation_does_not_advise_auto(monkeypatch):
    from otreg.ot import loop

    x, y = _spheres()
    monkeypatch.setattr(loop, "residual", lambda *a: torch.tensor([float("nan")]))
    with pytest.warns(otreg.ConvergenceWarning) as caught:
        res = otreg.sinkhorn(x, y, blur=0.1)
    assert res.stopped == "diverged"
    (message,) = [str(w.message) for w in caught]
    assert "relaxation='auto'" not in message and "NaN, infinite" in message


def test_warm_start_reaches_the_same_solution_in_fewer_iterations():
    x, y, a, b = clouds(n=60, m=50, seed=3)
    first = otreg.sinkhorn(x, y, a, b, blur=0.1, tol=1e-9)
    moved = x + 0.01 * torch.randn(
        x.shape, generator=torch.Generator().manual_seed(0), dtype=x.dtype
    )
    cold = otreg.sinkhorn(moved, y, a, b, blur=0.1, tol=1e-9)
    warm = otreg.sinkhorn(moved, y, a, b, blur=0.1, tol=1e-9, init=(first.f, first.g))
    assert warm.converged and warm.n_iter < cold.n_iter
    assert float(warm.cost) == pytest.approx(float(cold.cost), rel=1e-8)
    # balanced potentials are defined up to a constant: compare the plans' action
    v = torch.ones(len(y), 1, dtype=x.dtype)
    assert torch.allclose(warm.plan.apply(v), cold.plan.apply(v), atol=1e-8)


@pytest.mark.parametrize("relaxation", [1.8, "auto", "anderson"])
def test_accelerated_updates_reach_the_same_solution_in_fewer_iterations(relaxation):
    x, y, a, b = clouds(n=60, m=50, seed=5)
    plain = otreg.sinkhorn(x, y, a, b, blur=0.05, tol=1e-8, max_iter=20000, relaxation=1)
    fast = otreg.sinkhorn(x, y, a, b, blur=0.05, tol=1e-8, max_iter=20000, relaxation=relaxation)
    assert plain.converged and fast.converged
    assert fast.n_iter < plain.n_iter / 2
    assert float(fast.cost) == pytest.approx(float(plain.cost), rel=1e-7)
    v = torch.ones(len(y), 1, dtype=x.dtype)
    assert torch.allclose(fast.plan.apply(v), plain.plan.apply(v), atol=1e-7)
    with pytest.raises(ValueError, match="relaxation is 2.0; it must be 'anderson', 'auto' or in"):
        otreg.sinkhorn(x, y, a, b, relaxation=2.0)
    with pytest.raises(ValueError, match="relaxation is 'fast'"):
        otreg.sinkhorn(x, y, a, b, relaxation="fast")


@pytest.mark.parametrize("reach", [None, 0.5])
def test_adaptive_relaxation_costs_nothing_where_plain_updates_are_fast(reach):
    x, y, a, b = clouds(n=60, m=50, seed=5)
    b = b if reach is None else 1.5 * b
    plain = otreg.sinkhorn(x, y, a, b, blur=0.5, reach=reach, tol=1e-10, relaxation=1)
    auto = otreg.sinkhorn(x, y, a, b, blur=0.5, reach=reach, tol=1e-10)  # the default
    assert plain.converged and auto.converged
    assert auto.n_iter <= plain.n_iter + 2
    assert float(auto.cost) == pytest.approx(float(plain.cost), rel=1e-9)


def _gauge_fixed(res, a):
    """Balanced potentials are defined up to (f + c, g - c): fix <a, f> = 0."""
    c = (a * res.f).sum(-1, keepdim=True)
    return res.f - c, res.g + c


@pytest.mark.parametrize("reach", [None, 0.4])
@pytest.mark.parametrize("batch", [None, 3])
def test_anderson_reaches_the_potentials_of_plain_updates(reach, batch):
    x, y, a, b = clouds(n=70, m=50, d=3, seed=7, batch=batch)
    opts = dict(blur=0.05, reach=reach, tol=1e-13, max_iter=100_000)
    plain = otreg.sinkhorn(x, y, a, b, relaxation=1, **opts)
    fast = otreg.sinkhorn(x, y, a, b, relaxation="anderson", **opts)
    assert plain.converged and fast.converged
    assert fast.acceleration.startswith("anderson") and plain.acceleration.startswith("none")
    assert fast.n_iter < plain.n_iter / 3
    if reach is None:
        (fp, gp), (ff, gf) = _gauge_fixed(plain, a), _gauge_fixed(fast, a)
    else:
        (fp, gp), (ff, gf) = (plain.f, plain.g), (fast.f, fast.g)
    torch.testing.assert_close(ff, fp, rtol=0, atol=1e-10)
    torch.testing.assert_close(gf, gp, rtol=0, atol=1e-10)
    torch.testing.assert_close(fast.cost, plain.cost, rtol=1e-12, atol=0)


def test_anderson_that_cannot_help_falls_back_and_says_so(monkeypatch):
    # every extrapolated step counted as a failure: the safeguard resets, then gives up
    monkeypatch.setattr(Anderson, "RESET_FACTOR", 0.0)
    monkeypatch.setattr(newton, "check_at", lambda p: math.inf)  # (the updates, to the end)
    x, y, a, b = clouds(n=60, m=50, seed=5)
    res = otreg.sinkhorn(x, y, a, b, blur=0.05, tol=1e-8, max_iter=20000)
    plain = otreg.sinkhorn(x, y, a, b, blur=0.05, tol=1e-8, max_iter=20000, relaxation=1)
    assert res.converged
    assert res.acceleration.startswith(
        f"anderson, then over-relaxation after {Anderson.MAX_RESETS + 1} resets"
    )
    assert float(res.cost) == pytest.approx(float(plain.cost), rel=1e-7)


def test_the_final_eps_starts_from_potentials_converged_at_twice_the_blur(monkeypatch):
    """200 points a side, 0.5 apart, at blur 0.01 (points sparser than the blur: a plan
    near a permutation). From the annealing's potentials the final updates crawled: the
    default call ran its 2,000 iterations, warned, and was 3.6% off. From potentials
    converged at blur 0.02 it converges in a few hundred."""
    from otreg.ot import loop, newton

    x = noisy_sphere(200, seed=1)
    y = noisy_sphere(200, center=(0.5, 0.0, 0.0), seed=2)
    # (in float64 with Newton's final phase: 481 updates, not 2,392 without)
    ref = otreg.sinkhorn(x.double(), y.double(), blur=0.01, tol=1e-6, max_iter=100_000)
    assert ref.converged
    monkeypatch.setattr(newton, "check_at", lambda p: math.inf)  # (the updates)
    with warnings.catch_warnings():
        warnings.simplefilter("error", otreg.ConvergenceWarning)
        res = otreg.sinkhorn(x, y, blur=0.01)
    assert res.converged and res.n_iter < 1000
    assert "; from potentials converged at blur 0.0" in res.acceleration
    assert float(res.cost) == pytest.approx(float(ref.cost), rel=1e-5)
    monkeypatch.setattr(loop, "HALFWAY", math.inf)  # as before
    with pytest.warns(otreg.ConvergenceWarning, match="stopped after 2000 iterations"):
        before = otreg.sinkhorn(x, y, blur=0.01)
    assert float(before.cost) != pytest.approx(float(ref.cost), rel=1e-2)


def test_a_first_stage_that_diverges_leaves_the_final_eps_to_the_annealing(monkeypatch):
    from otreg.ot import loop

    solve = loop.solve

    def diverging_first_stage(p, *clouds, continuation=True, **kwargs):
        sol = solve(p, *clouds, continuation=continuation, **kwargs)
        if not continuation:  # the problem at twice the blur
            sol.rule.reason, sol.f, sol.g = "diverged", sol.f * math.nan, sol.g * math.nan
        return sol

    x, y, a, b = clouds(n=60, m=50, seed=3)
    monkeypatch.setattr(loop, "solve", diverging_first_stage)
    monkeypatch.setattr(newton, "check_at", lambda p: math.inf)  # (the updates, to the end)
    res = otreg.sinkhorn(x, y, a, b, blur=0.05, tol=1e-9, max_iter=20_000)
    assert res.converged and "diverged: from the annealing" in res.acceleration
    monkeypatch.setattr(loop, "HALFWAY", math.inf)
    plain = otreg.sinkhorn(x, y, a, b, blur=0.05, tol=1e-9, max_iter=20_000)
    assert float(res.cost) == pytest.approx(float(plain.cost), rel=1e-10)


@pytest.mark.slow  # 51 s for both backends (the default run stays under 20 minutes)
def test_the_self_terms_converge_where_a_jump_from_twice_the_blur_overflowed():
    """Two noisy spheres a diameter apart, float32: the divergence's OT(a, a) and OT(b, b),
    started at blur 0.01 straight from potentials converged at 0.039, overflowed in the
    first averaged update (a marginal error of inf, a warning); they went on through the
    schedule's remaining eps (0.02, then 0.01), and now start their final eps from the
    annealing (no half-way solve): either way they converge, without a warning."""
    x = noisy_sphere(1000, seed=1)
    y = noisy_sphere(1000, center=(2.0, 0.0, 0.0), seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", otreg.ConvergenceWarning)
        value = otreg.sinkhorn_divergence(x, y, blur=0.01)
    ref = otreg.sinkhorn_divergence(x.double(), y.double(), blur=0.01, tol=1e-6, max_iter=20_000)
    assert float(value) == pytest.approx(float(ref), rel=1e-5)
