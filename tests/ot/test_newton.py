"""Newton's continuation: small problems at a blur far below the points' spacing, where the
updates crawl, converge; checked on the optimality conditions, computed here, and against
the exact transport cost."""

import math
import re
import warnings

import numpy as np
import ot
import pytest
import torch

import otreg
from otreg.ot import newton

D = torch.float64
BLUR = 0.01


def gaussians(n=60, m=50, seed=0, batch=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, n, 3, generator=g, dtype=D)
    y = torch.randn(*batch, m, 3, generator=g, dtype=D) + 1.0
    return x, y


def plan_and_value(x, y, f, g, eps):
    """The plan a b exp((f + g - C) / eps) of uniform weights and its entropic cost."""
    a = torch.full((x.shape[0],), 1 / x.shape[0], dtype=D)
    b = torch.full((y.shape[0],), 1 / y.shape[0], dtype=D)
    C = ((x[:, None] - y[None]) ** 2).sum(-1) / 2
    plan = a[:, None] * b[None] * torch.exp((f[:, None] + g[None] - C) / eps)
    kl = torch.special.xlogy(plan, plan / (a[:, None] * b[None])).sum() - plan.sum() + 1
    return plan, a, b, float((plan * C).sum() + eps * kl), C


def test_a_problem_the_updates_do_not_solve_converges_by_newton():
    x, y = gaussians()
    res = otreg.sinkhorn(x, y, blur=BLUR, tol=1e-6)
    assert res.converged and res.acceleration.startswith("Newton's method"), res.acceleration
    assert res.n_iter < 2000
    plan, a, b, value, C = plan_and_value(x, y, res.f, res.g, BLUR**2)
    assert float((plan.sum(1) - a).abs().sum()) < 1e-5  # both marginals hold
    assert float((plan.sum(0) - b).abs().sum()) < 2e-6
    assert float(res.cost) == pytest.approx(value, rel=1e-7)  # (primal and dual, tol 1e-6)
    exact = ot.emd2(a.numpy(), b.numpy(), C.numpy())  # the unregularised cost, below
    assert 0 < value - exact < BLUR**2 * math.log(x.shape[0] * y.shape[0])


def test_the_default_loss_on_small_clouds_converges_without_a_warning():
    """200 points against 150 at blur 0.01 stopped at max_iter (0.16 marginal error)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 3, generator=g).requires_grad_(True)
    y = torch.randn(150, 3, generator=g) + 2.0
    loss = otreg.SinkhornLoss(blur=BLUR)
    with warnings.catch_warnings():
        warnings.simplefilter("error", otreg.ConvergenceWarning)
        loss(x, y).backward()
    assert loss.last_result.converged and torch.isfinite(x.grad).all()
    reference = x.detach().double().requires_grad_(True)
    value = otreg.sinkhorn_divergence(reference, y.double(), blur=BLUR, tol=1e-8)
    (expected,) = torch.autograd.grad(value, reference)
    assert float((x.grad.double() - expected).norm() / expected.norm()) < 2e-2


def test_small_problems_give_way_to_newton_early_and_larger_ones_late():
    """A y of at most ``SMALL_SIDE`` points is checked after ``EARLY_AT`` iterations (a
    Newton solve there costs about an update); 300 points against 310 at blur 0.05,
    float32: Newton's continuation after 30 updates (201 updates before), the gradient
    as near the converged float64 one as the updates' was."""
    assert newton.EARLY_AT < newton.AFTER
    for m, at in ((newton.SMALL_SIDE, newton.EARLY_AT), (newton.SMALL_SIDE + 1, newton.AFTER)):
        x, y = torch.zeros(10, 3), torch.rand(m, 3)
        p = otreg.ot.problem.Problem.build("test", x, y, None, None, otreg.SinkhornOptions())
        assert newton.check_at(p) == at
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 3, generator=g).requires_grad_(True)
    y = torch.randn(310, 3, generator=g) + 0.5
    value = otreg.sinkhorn_divergence(x, y, blur=0.05)
    (grad,) = torch.autograd.grad(value, x)
    res = otreg.sinkhorn(x.detach(), y, blur=0.05)
    assert res.converged and f"after {newton.EARLY_AT} updates" in res.acceleration
    reference = x.detach().double().requires_grad_(True)
    exact = otreg.sinkhorn_divergence(reference, y.double(), blur=0.05, tol=1e-9, max_iter=10**5)
    (expected,) = torch.autograd.grad(exact, reference)
    assert float((grad.double() - expected).norm() / expected.norm()) < 1e-2


def test_where_newton_fails_the_updates_go_on_within_max_iter(monkeypatch):
    x, y = gaussians()
    monkeypatch.setattr(newton, "stage", lambda C, a, b, g, eps, tol: (g, g, 1, math.inf))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", otreg.ConvergenceWarning)
        res = otreg.sinkhorn(x, y, blur=BLUR, tol=1e-6, max_iter=3000)
    assert "did not converge: the updates went on at iteration" in res.acceleration
    assert res.n_iter <= 3000
    direct = otreg.sinkhorn(x, y, blur=BLUR, tol=1e-6, max_iter=3000)  # (Newton's, intact)
    if res.converged:
        assert float(res.cost) == pytest.approx(float(direct.cost), rel=1e-6)


def test_where_newton_stops_nearer_than_the_updates_they_go_on_from_its_potentials(
    monkeypatch,
):
    """Newton's method cut short (its last stage stopped at 100 times tol) ends
    unconverged but nearer than the crawling updates: the updates go on from its
    potentials and converge."""
    x, y = gaussians()
    stage = newton.stage

    def cut_short(C, a, b, g, eps, tol):
        f, g, solves, error = stage(C, a, b, g, eps, 100 * tol if eps == BLUR**2 else tol)
        assert eps != BLUR**2 or error > tol  # (unconverged)
        return f, g, solves, error

    monkeypatch.setattr(newton, "stage", cut_short)
    res = otreg.sinkhorn(x, y, blur=BLUR, tol=1e-6, max_iter=5000)
    assert "the updates went on from its potentials (marginal error" in res.acceleration
    assert res.converged
    direct = otreg.sinkhorn(x, y, blur=BLUR, tol=1e-6)
    assert float(res.cost) == pytest.approx(float(direct.cost), rel=1e-6)


def test_where_the_updates_do_not_converge_at_the_start_blur_a_larger_one_starts():
    """100 Gaussian points against 120 at blur 1e-3 (eps 1e-6 against costs up to 20): the
    updates at 16 times the blur did not converge either, and the call returned 0.224 for
    a transport cost of 0.279, with a warning. From 256 times the blur, Newton's stages
    converge, to the exact (unregularised) cost, POT's emd2."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(100, 3, generator=g, dtype=D), torch.randn(120, 3, generator=g, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("error", otreg.ConvergenceWarning)
        res = otreg.sinkhorn(x, y, blur=1e-3)
    assert res.converged and res.acceleration.startswith("Newton's method"), res.acceleration
    start = float(re.search(r"converged at blur (\S+) in", res.acceleration).group(1))
    assert start > newton.START * 1e-3
    C = (((x[:, None] - y[None]) ** 2).sum(-1) / 2).numpy()
    exact = ot.emd2(np.full(100, 1 / 100), np.full(120, 1 / 120), C)
    assert float(otreg.sinkhorn_divergence(x, y, blur=1e-3)) == pytest.approx(exact, rel=1e-4)


def test_a_batch_is_solved_problem_by_problem():
    x, y = gaussians(batch=(2,))
    res = otreg.sinkhorn(x, y, blur=BLUR, tol=1e-6)
    assert res.converged and res.acceleration.startswith("Newton's method")
    for k in range(2):
        alone = otreg.sinkhorn(x[k], y[k], blur=BLUR, tol=1e-6)
        assert float(res.cost[k]) == pytest.approx(float(alone.cost), rel=1e-7)


def test_the_stages_halve_the_blur_down_to_the_final_one():
    x, y = gaussians()
    p = otreg.ot.problem.Problem.build(
        "test", x, y, None, None, otreg.SinkhornOptions(blur=BLUR, scaling=0.9)
    )
    eps = newton.blurs(p)
    assert eps[0] <= newton.START**2 * p.eps and eps[0] in p.schedule
    assert eps[-1] == p.eps
    assert np.allclose(np.array(eps[1:-1]) / np.array(eps[:-2]), 0.25)


def test_updates_near_tol_at_the_check_go_on_undisturbed(monkeypatch):
    """Updates whose marginal error at the check is within ``CRAWLING`` times tol are not
    handed to Newton's method: the solve is the plain updates', iteration for iteration."""
    x, y = gaussians()
    options = dict(blur=0.05, tol=1e-12, max_iter=1500)  # (past the check, then converged)
    monkeypatch.setattr(newton, "CRAWLING", 1e30)  # every error is 'near tol'
    monkeypatch.setattr(newton, "EARLY_AT", 400)  # (the halfway solve's room as without)
    near = otreg.sinkhorn(x, y, **options)
    monkeypatch.setattr(newton, "applies", lambda *args: False)
    plain = otreg.sinkhorn(x, y, **options)
    assert near.converged and near.n_iter > newton.EARLY_AT and "Newton" not in near.acceleration
    assert near.n_iter == plain.n_iter and near.acceleration == plain.acceleration
    assert torch.equal(near.f, plain.f) and torch.equal(near.g, plain.g)


def test_updates_far_from_tol_at_the_check_give_way(monkeypatch):
    x, y = gaussians()
    monkeypatch.setattr(newton, "EARLY_AT", 50)
    res = otreg.sinkhorn(x, y, blur=BLUR, tol=1e-6)
    assert res.converged and res.acceleration.startswith("Newton's method"), res.acceleration
    assert "after 50 updates" in res.acceleration
    assert newton.crawling(float("nan"), 1e-3) and not newton.crawling(5e-3, 1e-3)
