"""Cell steps: the cell model against autograd of the semi-dual, and the multiscale
solver's final updates with and without them; far-point steps over every pair."""

import math

import pytest
import torch

import otreg
from otreg.ot import cells, multiscale
from otreg.ot.kernels import make_kernel
from otreg.ot.loop import _anneal
from otreg.ot.problem import Problem, SinkhornOptions
from otreg.reductions.sparse import PairList
from tests.conftest import clusters, student_t

EPS = 0.05


def small_problem(seed=0):
    """Two clouds (40 and 50 points), their weights, f and g, and every pair as a list."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(40, 3, generator=gen, dtype=torch.float64)
    y = torch.rand(50, 3, generator=gen, dtype=torch.float64) + 0.2
    a = torch.rand(40, generator=gen, dtype=torch.float64) + 0.5
    b = torch.rand(50, generator=gen, dtype=torch.float64) + 0.5
    a, b = a / a.sum(), b / b.sum()
    f = torch.randn(40, generator=gen, dtype=torch.float64) * 0.05
    g = torch.randn(50, generator=gen, dtype=torch.float64) * 0.05
    i, j = torch.meshgrid(torch.arange(40), torch.arange(50), indexing="ij")
    pairs = PairList(x, y, i.flatten(), j.flatten(), a.log(), b.log(), f, g, EPS)
    return x, y, a, b, f, g, pairs


def softmin(x, y, log_w, pot):
    """-eps log sum_j w_j exp((pot_j - |x_i - y_j|^2 / 2) / eps), dense."""
    cost = ((x[:, None] - y[None]) ** 2).sum(-1) / 2
    return -EPS * torch.logsumexp(log_w + (pot[None] - cost) / EPS, 1)


def model_and_semi_dual(side: str, seed=0):
    """The cell model of f's cells (g eliminated) or of g's, and the semi-dual it models
    as a function of the cells' constants."""
    x, y, a, b, f, g, pairs = small_problem(seed)
    if side == "f":
        labels = torch.arange(40) // 8  # 5 cells, sorted with the points
        masses = torch.zeros(5, dtype=torch.float64).index_add_(0, labels, a)
        model = cells.cell_model(*pairs.plan(f, b, transpose=True), labels, masses, b)

        def semi_dual(alpha):
            moved = f + alpha[labels]
            return (a * moved).sum() + (b * softmin(y, x, a.log(), moved)).sum()

    else:
        labels = torch.arange(50) // 10
        masses = torch.zeros(5, dtype=torch.float64).index_add_(0, labels, b)
        model = cells.cell_model(*pairs.plan(g, a), labels, masses, a)

        def semi_dual(alpha):
            moved = g + alpha[labels]
            return (b * moved).sum() + (a * softmin(x, y, b.log(), moved)).sum()

    return model, semi_dual, labels


@pytest.mark.parametrize("side", ["f", "g"])
def test_the_cell_model_is_the_semi_duals_gradient_and_hessian(side):
    model, semi_dual, _ = model_and_semi_dual(side)
    zero = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    (gradient,) = torch.autograd.grad(semi_dual(zero), zero)
    hessian = torch.autograd.functional.hessian(semi_dual, zero.detach())
    torch.testing.assert_close(model.gradient, gradient, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(model.hessian, -EPS * hessian, rtol=1e-9, atol=1e-12)
    assert model.gradient.abs().max() > 1e-3  # not a trivial point


@pytest.mark.parametrize("side", ["f", "g"])
def test_the_step_solves_the_newton_system_and_its_gain_is_second_order(side):
    model, semi_dual, _ = model_and_semi_dual(side)
    alpha = model.step(EPS, damping=0.0)
    torch.testing.assert_close(model.hessian @ alpha, EPS * model.gradient, rtol=0, atol=1e-12)
    assert abs(float((alpha * model.masses).sum())) < 1e-15  # the constant mode fixed
    zero = torch.zeros(5, dtype=torch.float64)
    for t in (1e-2, 1e-3):
        actual = float(semi_dual(t * alpha) - semi_dual(zero)) / EPS
        predicted = model.gain(t * alpha, EPS)
        assert predicted > 0
        assert abs(actual - predicted) < 10 * t**3 * abs(model.gain(alpha, EPS)) + 1e-12


def test_the_step_is_damped_and_held_within_the_trust_region():
    model, _, _ = model_and_semi_dual("f")
    free = model.step(EPS, damping=0.0)
    damped = model.step(EPS, damping=10.0)
    assert damped.abs().max() < free.abs().max()
    held = model.step(EPS, damping=0.0, trust=0.5 * float(free.abs().max()) / EPS)
    assert float(held.abs().max()) == pytest.approx(0.5 * float(free.abs().max()))
    torch.testing.assert_close(held, 0.5 * free)


@pytest.mark.parametrize("side", ["f", "g"])
def test_the_diagonal_and_its_gain_are_the_hessians(side):
    model, _, _ = model_and_semi_dual(side)
    d = model.hessian.diagonal()
    torch.testing.assert_close(model.diagonal, d, rtol=1e-12, atol=1e-15)
    expected = float((model.gradient**2 / d).sum()) / 2
    assert model.diagonal_gain() == pytest.approx(expected, rel=1e-12)


def _kernel_with_a_list():
    """1,000 clustered points against a ball at blur 0.01 (multiscale) after the annealing
    and 20 updates, its pair list made at the last potentials: ``(problem, kernel, f, g)``,
    g the softmin of f."""
    x, y = clusters(1000)
    p = Problem.build("t", x, y, None, None, SinkhornOptions(blur=0.01, multiscale=True))
    kernel = make_kernel(p, p.x, p.a, p.y, p.b)
    f, g, _ = _anneal(p, kernel, None)
    for _ in range(20):
        f = kernel.softmin_xy(p.eps, g)
        g = kernel.softmin_yx(p.eps, f)
    assert isinstance(kernel._list, PairList)
    f, g = f[0].double(), g[0].double()
    kernel._build_list(f, g)  # (a list made earlier may hold while f moved since)
    return p, kernel, f, g


def dense_g(p, kernel, f):
    """The softmin over x of log a + f / eps for each y, over every pair in float64 (the
    kernel's sorted clouds)."""
    x, y = kernel.cx.points.double(), kernel.cy.points.double()
    cost = ((y[:, None] - x[None]) ** 2).sum(-1) / 2
    log_a = kernel.a[0].double().log()
    return -p.eps * torch.logsumexp(log_a + (f[None] - cost) / p.eps, 1)


def _f_model(p, kernel, f):
    b = kernel.b[0].double()
    entries = kernel._list.plan(f, b, transpose=True)
    return cells.cell_model(*entries, kernel.cx.labels, kernel.cx.masses.double(), b)


def test_a_step_within_the_lists_margin_keeps_the_list():
    """A step of a few eps a cell: g after it is the pair list's softmin, as the cells'
    pattern gives it, and no list or pattern is made."""
    p, kernel, f, g = _kernel_with_a_list()
    model = _f_model(p, kernel, f)
    alpha = model.step(p.eps, 0.01, trust=5.0)
    builds, patterns = kernel.list_builds, len(kernel.n_pairs)
    moved = f + alpha[kernel.cx.labels]
    new_f, new_g = kernel._stepped("f", f, g, model, alpha)
    assert kernel.list_builds == builds and len(kernel.n_pairs) == patterns
    assert torch.equal(new_f, moved)
    truncation = math.exp(-p.multiscale.truncate)  # the kernel's bound, relative to eps
    assert (new_g - dense_g(p, kernel, moved)).abs().max() < truncation * p.eps


def test_a_far_step_searches_every_cell_pair_and_sums_its_blocks():
    """A step of hundreds of eps a cell leaves the list's margin: the pattern is searched
    again over every cell pair, no list is made by the step itself, and g after
    the step is the softmin over the cell pairs that a search of all of them keeps (the
    list is made by :meth:`cell_step` once the step is taken)."""
    p, kernel, f, g = _kernel_with_a_list()
    model = _f_model(p, kernel, f)
    alpha = 300 * p.eps * torch.linspace(-1, 1, len(model.gradient), dtype=torch.float64)
    builds, patterns = kernel.list_builds, len(kernel.n_pairs)
    moved = f + alpha[kernel.cx.labels]
    new_f, new_g = kernel._stepped("f", f, g, model, alpha)
    assert kernel.list_builds == builds and kernel._list is None
    assert len(kernel.n_pairs) > patterns and torch.equal(new_f, moved)
    assert kernel.verify(new_f[None], new_g[None])  # the pattern holds every pair needed
    truncation = math.exp(-p.multiscale.truncate)  # the kernel's bound, relative to eps
    assert (new_g - dense_g(p, kernel, moved)).abs().max() < truncation * p.eps


def test_a_far_step_that_is_taken_makes_its_list_where_it_led():
    """f's cells pushed hundreds of eps apart: the step that takes them back leaves the
    list's margin, and once taken a pair list is made at the potentials it returns (the
    other one summed over the blocks), so that the next update sums a list."""
    p, kernel, f, g = _kernel_with_a_list()
    cells_of_f = kernel.cx.labels
    push = 300 * p.eps * torch.linspace(-1, 1, kernel.cx.n_clusters, dtype=torch.float64)
    f = f + push[cells_of_f]
    g = kernel.softmin_yx(p.eps, f[None])[0].double()
    builds = kernel.list_builds
    stepped = kernel.cell_step(f[None], g[None], cells.MIN_GAIN)
    assert stepped is not None and kernel.list_builds == builds + 1
    assert isinstance(kernel._list, PairList)
    assert torch.equal(kernel._list.f0, stepped[0][0])
    assert torch.equal(kernel._list.g0, stepped[1][0])


def test_the_eliminated_potential_moves_as_predicted_to_first_order():
    x, y, a, b, f, g, pairs = small_problem()
    model, _, labels = model_and_semi_dual("f")
    alpha = model.step(EPS, damping=0.0)
    before = softmin(y, x, a.log(), f)
    for t in (1e-3, 1e-4):
        moved = softmin(y, x, a.log(), f + t * alpha[labels]) - before
        error = (moved - t * model.eliminated_change(alpha)).abs().max()
        assert error < 50 * t**2 * float(alpha.abs().max()) ** 2 / EPS + 1e-13


@pytest.fixture(scope="module")
def clusters_reference():
    """OT between 1,000-point clusters and a ball at blur 0.01, converged in float64 over
    every pair."""
    x, y = clusters(1000)
    return otreg.sinkhorn(x.double(), y.double(), blur=0.01, tol=1e-7, max_iter=20_000).cost


def test_cell_steps_cut_the_updates_and_converge_to_the_same_plan(monkeypatch, clusters_reference):
    x, y = clusters(1000)
    with_steps = otreg.sinkhorn(x, y, blur=0.01, multiscale=True)
    monkeypatch.setattr(cells, "FIRST_GAIN", float("inf"))
    without = otreg.sinkhorn(x, y, blur=0.01, multiscale=True)
    assert "cell step" in with_steps.acceleration and "cell step" not in without.acceleration
    assert with_steps.converged and without.converged
    assert with_steps.n_iter < without.n_iter / 2
    for res in (with_steps, without):
        assert float(res.cost) == pytest.approx(float(clusters_reference), rel=1e-5)


def test_a_step_that_lowers_the_dual_is_not_taken(monkeypatch, clusters_reference):
    """Every damping's step made downhill (its sign flipped, its model's gain said to be
    large): none is taken, the pattern goes back to the potentials' own, and the updates
    converge as without steps."""
    step = cells.CellModel.step
    monkeypatch.setattr(cells.CellModel, "step", lambda self, *args: -step(self, *args))
    monkeypatch.setattr(cells.CellModel, "gain", lambda self, alpha, eps: 100.0)
    x, y = clusters(1000)
    res = otreg.sinkhorn(x, y, blur=0.01, multiscale=True)
    assert res.converged and "cell step" not in res.acceleration
    assert float(res.cost) == pytest.approx(float(clusters_reference), rel=1e-5)


def test_a_step_declined_on_a_pattern_that_lacked_pairs_is_tried_again(monkeypatch):
    """A draw of the clusters (5,000 points) whose pattern, three updates into the final
    eps, lacked the pairs of some points of the ball: no damping raised the dual there.
    The pattern gains those pairs and the step is tried again at the next interval; the
    steps then go on. Without the retry the updates went on without steps, 1,770 of
    them."""
    x, y = clusters(5000, seed=11)
    answers = []
    step = multiscale.TruncatedKernel.cell_step
    monkeypatch.setattr(
        multiscale.TruncatedKernel,
        "cell_step",
        lambda self, *args: answers.append(step(self, *args)) or answers[-1],
    )
    res = otreg.sinkhorn(x, y, blur=0.01)
    assert answers[0] is cells.NOT_NOW  # the first try: the pattern lacked pairs
    assert res.converged and "cell step" in res.acceleration and res.n_iter < 400


def test_the_default_call_converges_after_its_steps(monkeypatch):
    """2,000 clustered points (multiscale by default): after a step the updates go on
    from the step's own f and g (a refresh of the pattern at the f before the step, some
    cells hundreds of eps away, dropped pairs that mattered and the updates stalled at a
    marginal error of 0.24 for 2,000 iterations)."""
    x, y = clusters(2000)
    res = otreg.sinkhorn(x, y, blur=0.01)
    assert res.backend == "multiscale" and "cell step" in res.acceleration
    assert res.converged and res.n_iter < 600
    monkeypatch.setattr(cells, "FIRST_GAIN", float("inf"))
    without = otreg.sinkhorn(x, y, blur=0.01)
    assert without.converged and without.n_iter > 2 * res.n_iter
    assert float(res.cost) == pytest.approx(float(without.cost), rel=1e-5)


def test_steps_under_over_relaxation_reach_the_same_plan(monkeypatch, clusters_reference):
    """With over-relaxed updates (w > 1, no Anderson mixing; a step tried whatever its
    model's gain) a step is measured from the exact softmin, not from the over-relaxed g:
    here the first is tried and not taken (the dual does not rise), and the solve
    converges as without steps."""
    monkeypatch.setattr(cells, "FIRST_GAIN", 0.0)
    tried, step = [], multiscale.TruncatedKernel.cell_step

    def counted(self, f, g, min_gain, previous=None):
        tried.append(1)
        return step(self, f, g, min_gain, previous)

    monkeypatch.setattr(multiscale.TruncatedKernel, "cell_step", counted)
    x, y = clusters(1000)
    # (over-relaxed updates crawl here once their weight is halved: 865 updates on two
    # threads, 2,492 on one, where a busy machine leaves one; the default stops at 2,000)
    res = otreg.sinkhorn(x, y, blur=0.01, multiscale=True, relaxation="auto", max_iter=5000)
    assert tried and res.converged and res.acceleration.startswith("over-relaxation")
    assert float(res.cost) == pytest.approx(float(clusters_reference), rel=1e-5)


def test_far_point_shifts_give_each_point_its_mass():
    """Each shift solves its point's equation ``sum_i a_i sigma(z_ij + u_j) = b_j``, also
    where the mass received is flat over hundreds of eps (one row sends the point all it
    has, too little; the other rows are 300 eps away), and whether the point must gain or
    lose mass."""
    gen = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(60, 5, generator=gen, dtype=torch.float64)
    z[:, 4], z[0, 4] = -300.0, 5.0
    a = torch.full((60,), 1 / 60, dtype=torch.float64)
    b = torch.tensor([1e-3, 0.01, 0.05, 0.2, 0.3], dtype=torch.float64)
    u = cells.far_point_shifts(z, a.log(), b.log())
    received = (a[:, None] * torch.sigmoid(z + u)).sum(0)
    assert torch.allclose(received, b, rtol=1e-8, atol=0)
    assert u[4] > 290  # (the plateau crossed)


def _heavy_tails_after_updates(n_updates=5):
    """Heavy-tailed clouds (300 points, blur 0.1, every pair, float64) after the annealing
    and a few updates: ``(problem, kernel, f, s, g)``, f the softmin of g and s that of f."""
    x, y = student_t(300, 1, 0.0), student_t(300, 101, 0.25)
    p = Problem.build("t", x, y, None, None, SinkhornOptions(blur=0.1, multiscale=False))
    kernel = make_kernel(p, p.x, p.a, p.y, p.b)
    f, g, _ = _anneal(p, kernel, None)
    for _ in range(n_updates):
        f = kernel.softmin_xy(p.eps, g)
        g = kernel.softmin_yx(p.eps, f)
    f = kernel.softmin_xy(p.eps, g)
    return p, kernel, f, kernel.softmin_yx(p.eps, f), g


def test_a_far_point_step_gives_the_point_its_mass_with_f_eliminated(monkeypatch):
    """A step on the one point whose column holds the mass furthest from its own: after
    it, f is the softmin of g, that column of the plan (summed over every pair in float64)
    holds the point's mass, the other points' potentials did not move, and the dual rose."""
    monkeypatch.setattr(cells, "FAR_POINTS", 1)
    monkeypatch.setattr(cells, "FAR_CONCENTRATION", 0.0)
    p, kernel, f, s, g = _heavy_tails_after_updates()
    a, b, eps = kernel.a[0], kernel.b[0], p.eps
    received = b * torch.exp((g[0] - s[0]) / eps)
    j = int((received - b).abs().argmax())
    stepped = kernel.cell_step(f, s, 0.0, g)
    assert stepped is not None
    f_new, g_new = stepped
    x, y = kernel.x[0], kernel.y[0]
    cost = ((x[:, None] - y[None]) ** 2).sum(-1) / 2
    assert torch.allclose(f_new[0], -eps * torch.logsumexp(b.log() + (g_new[0] - cost) / eps, 1))
    plan = a[:, None] * b * torch.exp((f_new[0][:, None] + g_new[0] - cost) / eps)
    assert float(plan[:, j].sum()) == pytest.approx(float(b[j]), rel=1e-8)
    others = torch.arange(len(b)) != j
    assert torch.equal(g_new[0][others], g[0][others])
    assert float((a * f_new[0]).sum() + (b * g_new[0]).sum()) > float(
        (a * f[0]).sum() + (b * g[0]).sum()
    )


def test_a_far_point_step_that_lowers_the_dual_is_not_taken(monkeypatch):
    """Shifts of 1,000 eps on every chosen point lower the dual at each scale tried: no
    step; and none is tried without the g that f is the softmin of (an over-relaxed f)."""
    p, kernel, f, s, g = _heavy_tails_after_updates()
    monkeypatch.setattr(cells, "FAR_CONCENTRATION", 0.0)
    assert kernel.cell_step(f, s, 0.0, None) is None
    monkeypatch.setattr(cells, "far_point_shifts", lambda z, log_a, log_b: 1000 + 0 * log_b)
    assert kernel.cell_step(f, s, 0.0, g) is None


def test_far_point_steps_converge_to_the_plan_without_them(monkeypatch):
    """The default call on heavy-tailed clouds (float32) takes far-point steps and reaches
    the cost of a tight float64 solve, as it does without them."""
    x, y = student_t(300, 1, 0.0), student_t(300, 101, 0.25)
    res = otreg.sinkhorn(x.float(), y.float(), blur=0.1)
    tight = otreg.sinkhorn(x, y, blur=0.1, tol=1e-10, max_iter=20_000)
    assert res.converged and "far-point step" in res.acceleration
    assert float(res.cost) == pytest.approx(float(tight.cost), rel=1e-5)
    monkeypatch.setattr(otreg.ot.kernels.DenseKernel, "cell_step", lambda self, *args: None)
    without = otreg.sinkhorn(x.float(), y.float(), blur=0.1)
    assert without.converged and "step" not in without.acceleration
    assert float(without.cost) == pytest.approx(float(tight.cost), rel=1e-5)


def test_no_far_point_step_where_the_error_is_the_bulks(monkeypatch):
    """Where the chosen points hold less than ``FAR_CONCENTRATION`` of the marginal's error
    (here: all of it required), the kernel takes no step now and says it may later; the
    solve then goes as without steps."""
    p, kernel, f, s, g = _heavy_tails_after_updates()
    monkeypatch.setattr(cells, "FAR_CONCENTRATION", 1.0)
    assert kernel.cell_step(f, s, 0.0, g) is cells.NOT_NOW
    x, y = student_t(300, 1, 0.0), student_t(300, 101, 0.25)
    res = otreg.sinkhorn(x.float(), y.float(), blur=0.1)
    assert res.converged and "step" not in res.acceleration
