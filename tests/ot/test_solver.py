"""otreg.sinkhorn against POT, closed forms, finite differences and an unrolled loop."""

import math
import warnings

import numpy as np
import ot
import pytest
import torch

import otreg
from otreg.costs import diameter, epsilon_schedule, get_cost
from otreg.datasets import noisy_sphere
from otreg.ot.convergence import Relaxation, StoppingRule
from tests.conftest import clouds

# each test runs on every reduction backend (tests/ot/conftest.py)
pytestmark = pytest.mark.usefixtures("each_backend")

TIGHT = dict(tol=1e-13, max_iter=20000)


def cost_matrix(x, y, cost):
    return get_cost(cost).dense(x[None], y[None])[0].numpy()


@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
@pytest.mark.parametrize("blur", [0.3, 0.1])
def test_plan_equals_pot_sinkhorn_log(cost, blur):
    x, y, a, b = clouds()
    res = otreg.sinkhorn(x, y, a, b, blur=blur, cost=cost, **TIGHT)
    assert res.converged and res.marginal_error < 1e-12
    P = ot.sinkhorn(
        a.numpy(),
        b.numpy(),
        cost_matrix(x, y, cost),
        reg=res.eps,
        method="sinkhorn_log",
        stopThr=1e-15,
        numItermax=200000,
    )
    ours = res.plan.dense().numpy()
    assert np.abs(ours - P).max() < 1e-8 * P.max()
    assert res.eps == pytest.approx(blur ** get_cost(cost).p)


def test_unbalanced_plan_equals_pot():
    x, y, a, b = clouds()
    b = 2 * b  # unequal masses are allowed when unbalanced
    reach, blur = 0.7, 0.2
    res = otreg.sinkhorn(x, y, a, b, blur=blur, reach=reach, **TIGHT)
    P = ot.unbalanced.sinkhorn_unbalanced(
        a.numpy(),
        b.numpy(),
        cost_matrix(x, y, "sqeuclidean"),
        reg=blur**2,
        reg_m=reach**2,
        reg_type="kl",
        method="sinkhorn_stabilized",
        stopThr=1e-15,
        numItermax=200000,
    )
    ours = res.plan.dense().numpy()
    assert np.abs(ours - P).max() < 1e-7 * P.max()


def test_cost_tends_to_emd_as_blur_vanishes():
    x, y, a, b = clouds(n=25, m=20, seed=3)
    emd = ot.emd2(a.numpy(), b.numpy(), cost_matrix(x, y, "sqeuclidean"))
    gaps = []
    for blur in [0.1, 0.03, 0.01]:
        res = otreg.sinkhorn(x, y, a, b, blur=blur, tol=1e-9, max_iter=50000)
        gap = float(res.cost) - emd
        # OT_eps = <pi, C> + eps KL(pi | a x b): between emd and emd + eps log(N M)
        assert -1e-9 <= gap <= res.eps * math.log(25 * 20)
        gaps.append(gap)
    assert gaps[0] > gaps[1] > gaps[2]
    assert gaps[2] < 2e-3 * emd


def test_log_and_scaling_forms_agree_where_both_are_stable():
    x, y, a, b = clouds()
    r_log = otreg.sinkhorn(x, y, a, b, blur=0.5, form="log", **TIGHT)
    r_sc = otreg.sinkhorn(x, y, a, b, blur=0.5, form="scaling", **TIGHT)
    assert torch.allclose(r_log.cost, r_sc.cost, rtol=1e-12)
    assert torch.allclose(r_log.f, r_sc.f, atol=1e-10)
    assert r_sc.form == "scaling"


def test_scaling_form_underflow_names_the_log_form():
    x, y, _, _ = clouds(dtype=torch.float32, shift=3.0)
    with pytest.raises(FloatingPointError, match="form='log'"):
        otreg.sinkhorn(x, y, blur=0.01, form="scaling")


@pytest.mark.parametrize("reach", [None, 0.5])
@pytest.mark.parametrize("debias", [False, True])
def test_gradients_match_finite_differences(reach, debias):
    x, y, a, b = clouds(n=8, m=10)

    def value(x, y, a, b):
        if debias:
            return otreg.sinkhorn_divergence(x, y, a, b, blur=0.3, reach=reach, **TIGHT)
        return otreg.sinkhorn(x, y, a, b, blur=0.3, reach=reach, **TIGHT).cost

    inputs = tuple(t.clone().requires_grad_() for t in (x, y, a, b))
    if reach is None:  # balanced: keep masses equal by moving points only
        assert torch.autograd.gradcheck(
            lambda x, y: value(x, y, a, b), inputs[:2], eps=1e-6, atol=1e-7
        )
    else:
        assert torch.autograd.gradcheck(value, inputs, eps=1e-6, atol=1e-7)


def test_weight_gradient_is_the_potential():
    # d OT / d a = f up to the constant shift (balanced potentials are defined up to one).
    x, y, a, b = clouds()
    a = a.clone().requires_grad_()
    res = otreg.sinkhorn(x, y, a, b, blur=0.2, **TIGHT)
    (ga,) = torch.autograd.grad(res.cost, a)
    diff = ga - res.f
    assert float(diff.max() - diff.min()) < 1e-9


def _unrolled_cost(x, y, a, b, eps, n_iter):
    """Plain log-domain Sinkhorn, differentiated through every iteration."""
    C = ((x[:, None] - y[None]) ** 2).sum(-1) / 2
    g = torch.zeros_like(b)
    for _ in range(n_iter):
        f = -eps * torch.logsumexp(b.log() + (g - C) / eps, dim=1)
        g = -eps * torch.logsumexp(a.log()[:, None] + (f[:, None] - C) / eps, dim=0)
    return (a * f).sum() + (b * g).sum()


def test_gradient_matches_an_unrolled_loop_at_convergence():
    x, y, a, b = clouds(n=20, m=15)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    (g_env,) = torch.autograd.grad(otreg.sinkhorn(x1, y, a, b, blur=0.3, **TIGHT).cost, x1)
    (g_unr,) = torch.autograd.grad(_unrolled_cost(x2, y, a, b, 0.09, 300), x2)
    assert torch.allclose(g_env, g_unr, rtol=1e-8, atol=1e-11)


def test_gradient_is_plan_weighted_displacement():
    # For C = |x - y|^2 / 2, grad_x OT = a * (x - T(x)) with T the barycentric map.
    x, y, a, b = clouds()
    x = x.clone().requires_grad_()
    res = otreg.sinkhorn(x, y, a, b, blur=0.1, **TIGHT)
    (gx,) = torch.autograd.grad(res.cost, x)
    expected = a[:, None] * (x.detach() - res.plan.barycentric_map())
    assert torch.allclose(gx, expected, atol=1e-12)


def test_batch_equals_separate_problems():
    x, y, a, b = clouds(batch=3)
    res = otreg.sinkhorn(x, y, a, b, blur=0.2, **TIGHT)
    assert res.cost.shape == (3,) and res.f.shape == (3, 30) and res.g.shape == (3, 40)
    for k in range(3):
        one = otreg.sinkhorn(x[k], y[k], a[k], b[k], blur=0.2, **TIGHT)
        assert torch.allclose(res.cost[k], one.cost, rtol=1e-11)
        assert torch.allclose(res.plan.dense()[k], one.plan.dense(), atol=1e-12)


def test_float32_agrees_with_float64():
    x, y, a, b = clouds()
    r64 = otreg.sinkhorn(x, y, a, b, blur=0.1, tol=1e-6)
    r32 = otreg.sinkhorn(x.float(), y.float(), a.float(), b.float(), blur=0.1, tol=1e-5)
    assert r32.cost.dtype == torch.float32
    assert abs(float(r32.cost) - float(r64.cost)) < 1e-5


def test_non_convergence_warns_and_is_reported():
    x, y, a, b = clouds()
    with pytest.warns(otreg.ConvergenceWarning, match="max_iter"):
        res = otreg.sinkhorn(x, y, a, b, blur=0.01, tol=1e-12, max_iter=20)
    assert not res.converged and res.marginal_error > 1e-12 and res.n_iter == 20
    assert res.stopped == "max_iter"


def _spheres(dtype=torch.float64):
    x = noisy_sphere(600, seed=1, dtype=dtype)
    return x, noisy_sphere(700, radius=0.8, center=(0.3, 0.0, 0.0), seed=2, dtype=dtype)


def test_float32_stops_at_its_rounding_floor_and_says_so():
    # blur 0.02 on spheres: float64 reaches tol = 1e-4, float32's marginals hover at about
    # 2e-4 (its rounding of f / eps): the loop stops there instead of running to max_iter
    # (with the over-relaxation: Anderson mixing gets float32 to 1.3e-4 here, slowly)
    x, y = _spheres()
    r64 = otreg.sinkhorn(x, y, blur=0.02, max_iter=1000, tol=1e-4)
    assert r64.converged and r64.stopped == "tol"
    with pytest.warns(otreg.ConvergenceWarning, match="rounding floor of torch.float32"):
        r32 = otreg.sinkhorn(
            x.float(), y.float(), blur=0.02, max_iter=1000, tol=1e-4, relaxation="auto"
        )
    assert r32.stopped == "stalled" and not r32.converged and r32.n_iter < 1000
    assert 1e-4 < r32.marginal_error < 1e-3
    assert float(r32.cost) == pytest.approx(float(r64.cost), rel=1e-5)


def test_a_fixed_iteration_count_does_not_warn():
    x, y, _, _ = clouds()
    steps = len(epsilon_schedule(2, diameter(x[None], y[None]), 0.05, 0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = otreg.sinkhorn(x, y, blur=0.05, tol=0, max_iter=steps + 5)
        assert res.stopped == "max_iter" and res.n_iter == steps + 5
        assert 0 < res.marginal_error < 1 and not res.converged
        # every iteration spent on the eps-scaling: the error was not measured
        res = otreg.sinkhorn(x, y, blur=0.05, tol=0, max_iter=steps)
    assert math.isnan(res.marginal_error)
    with pytest.warns(otreg.ConvergenceWarning, match="not measured; raise max_iter"):
        otreg.sinkhorn(x, y, blur=0.05, max_iter=steps)


def test_a_diverging_fixed_relaxation_stops_and_says_so():
    x, y = _spheres()
    with pytest.warns(otreg.ConvergenceWarning, match="diverged"):
        res = otreg.sinkhorn(x, y, blur=0.02, relaxation=1.9, max_iter=1000)
    assert res.stopped == "diverged" and res.n_iter < 1000  # (the default 'auto' converges)


def test_a_non_finite_error_under_auto_relaxation_does_not_advise_auto(monkeypatch):
    from otreg.ot import solver

    x, y = _spheres()
    monkeypatch.setattr(solver, "residual", lambda *a: torch.tensor([float("nan")]))
    with pytest.warns(otreg.ConvergenceWarning) as caught:
        res = otreg.sinkhorn(x, y, blur=0.1)
    assert res.stopped == "diverged"
    (message,) = [str(w.message) for w in caught]
    assert "relaxation='auto'" not in message and "NaN or infinite" in message


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
    rule = StoppingRule(tol=0.0)  # a fixed iteration count: nothing stops it
    assert not any(rule.stop(e, floor=lambda: 1.0) for e in (1.0, 0.0, float("inf"), 1.0))
    assert rule.reason == "max_iter"


def test_result_reports_its_settings(each_backend):
    x, y, _, _ = clouds()
    res = otreg.sinkhorn(x, y, blur=0.1, tol=1e-6)
    assert res.backend == each_backend and res.form == "log" and res.converged
    assert res.stopped == "tol"
    assert res.eps == pytest.approx(0.01) and res.n_iter > 1
    assert res.f.requires_grad is False and res.cost.shape == ()


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


def test_bad_warm_start_raises_naming_it():
    x, y, a, b = clouds(n=6, m=5)
    f, g = torch.zeros(6, dtype=x.dtype), torch.zeros(5, dtype=x.dtype)
    with pytest.raises(
        ValueError, match="init's g has shape \\(4,\\) but the weights have \\(5,\\)"
    ):
        otreg.sinkhorn(x, y, a, b, init=(f, g[:4]))
    with pytest.raises(TypeError, match="init must be a pair"):
        otreg.sinkhorn(x, y, a, b, init=f)
    with pytest.raises(TypeError, match="init's f is torch.float32"):
        otreg.sinkhorn(x, y, a, b, init=(f.float(), g))
    with pytest.raises(ValueError, match="init's f has NaN"):
        otreg.sinkhorn(x, y, a, b, init=(f / 0 * 0, g))


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
    assert fast.acceleration.startswith("anderson") and plain.acceleration == "none"
    assert fast.n_iter < plain.n_iter / 3
    if reach is None:
        (fp, gp), (ff, gf) = _gauge_fixed(plain, a), _gauge_fixed(fast, a)
    else:
        (fp, gp), (ff, gf) = (plain.f, plain.g), (fast.f, fast.g)
    torch.testing.assert_close(ff, fp, rtol=0, atol=1e-10)
    torch.testing.assert_close(gf, gp, rtol=0, atol=1e-10)
    torch.testing.assert_close(fast.cost, plain.cost, rtol=1e-12, atol=0)


def test_anderson_that_cannot_help_falls_back_and_says_so(monkeypatch):
    from otreg.ot.convergence import Anderson

    # every extrapolated step counted as a failure: the safeguard resets, then gives up
    monkeypatch.setattr(Anderson, "RESET_FACTOR", 0.0)
    x, y, a, b = clouds(n=60, m=50, seed=5)
    res = otreg.sinkhorn(x, y, a, b, blur=0.05, tol=1e-8, max_iter=20000)
    plain = otreg.sinkhorn(x, y, a, b, blur=0.05, tol=1e-8, max_iter=20000, relaxation=1)
    assert res.converged
    assert res.acceleration.startswith(
        f"anderson, then over-relaxation after {Anderson.MAX_RESETS + 1} resets"
    )
    assert float(res.cost) == pytest.approx(float(plain.cost), rel=1e-7)


def test_anderson_history_is_bounded_and_its_step_is_exact_on_a_linear_map():
    from otreg.ot.convergence import Anderson

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
