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
from tests.conftest import clouds, student_t

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


def test_heavy_tailed_clouds_get_the_gradient_of_pots_converged_plan():
    """The far points of heavy-tailed clouds carry the gradient with little mass: the default
    tol stops only when the marginal error weighed by the gradient is small too (the L1
    marginal error alone stopped at a gradient 1.4e-2 off here). The oracle is POT's
    log-domain Sinkhorn, started from our tight potentials, that confirms them as its fixed
    point (from zero it needs minutes here)."""
    x, y = student_t(300, 1, 0.0), student_t(300, 101, 0.25)
    blur, a = 0.1, np.full(300, 1 / 300)
    xs = x.clone().requires_grad_(True)
    res = otreg.sinkhorn(xs, y, blur=blur)
    (grad,) = torch.autograd.grad(res.cost, xs)
    tight = otreg.sinkhorn(x, y, blur=blur, **TIGHT)
    start = (tight.f / res.eps + np.log(a), tight.g / res.eps + np.log(a))
    P, log = ot.sinkhorn(
        a, a, cost_matrix(x, y, "sqeuclidean"), reg=res.eps, method="sinkhorn_log",
        stopThr=1e-12, numItermax=1000, warmstart=tuple(t.numpy() for t in start), log=True,
    )  # fmt: skip
    assert log["niter"] < 100 and np.abs(P.sum(0) - a).sum() < 1e-10
    oracle = a[:, None] * x.numpy() - P @ y.numpy()
    error = np.linalg.norm(grad.numpy() - oracle) / np.linalg.norm(oracle)
    assert res.converged and error < 5e-3


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


def test_float32_stalled_on_its_rounding_floor_goes_on_in_float64():
    # blur 0.02 on spheres: float64 reaches tol = 1e-4, float32's marginals hover at about
    # 2e-4 (its rounding of f / eps and of the cost's expansion): the updates go on in
    # float64 from the float32 potentials and converge; the result stays float32
    x, y = _spheres()
    r64 = otreg.sinkhorn(x, y, blur=0.02, max_iter=1000, tol=1e-4)
    assert r64.converged and r64.stopped == "tol"
    for relaxation in ("auto", "anderson"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", otreg.ConvergenceWarning)
            r32 = otreg.sinkhorn(
                x.float(), y.float(), blur=0.02, max_iter=1000, tol=1e-4, relaxation=relaxation
            )
        assert r32.converged and r32.stopped == "tol" and r32.marginal_error < 1e-4
        # (Anderson's mixing gets float32 below tol with KeOps' exact differences)
        assert relaxation == "anderson" or "in float64 from iteration" in r32.acceleration
        assert r32.f.dtype == r32.g.dtype == r32.cost.dtype == torch.float32
        assert float(r32.cost) == pytest.approx(float(r64.cost), rel=1e-6)
        # both within tol of the same potentials: a few eps (4e-4) apart at most
        assert float((r32.f.double() - r64.f).abs().max()) < 1e-3


def test_float32_crawling_along_its_rounding_floor_goes_on_in_float64_early(monkeypatch):
    """Where float32's error creeps down its rounding floor by 1% lows (each resets the
    stall's patience), the updates go on in float64 as soon as the rate shows it (here 163
    updates in all against 289 waiting for a stall), to the same solution."""
    from otreg.ot import loop

    x, y = _spheres()
    r64 = otreg.sinkhorn(x, y, blur=0.02, max_iter=1000, tol=1e-4)
    early = otreg.sinkhorn(x.float(), y.float(), blur=0.02, max_iter=1000, tol=1e-4)
    monkeypatch.setattr(loop, "PROMOTE_AHEAD", None)
    late = otreg.sinkhorn(x.float(), y.float(), blur=0.02, max_iter=1000, tol=1e-4)
    assert early.converged and late.converged and early.marginal_error < 1e-4
    assert "in float64 from iteration" in early.acceleration
    assert early.n_iter < late.n_iter, (early.n_iter, late.n_iter)
    if "in float64" in late.acceleration:  # (after a stall: on the blocked path, 289)
        assert early.n_iter < 0.7 * late.n_iter, (early.n_iter, late.n_iter)
    assert float(early.cost) == pytest.approx(float(r64.cost), rel=1e-6)
    assert float((early.f.double() - r64.f).abs().max()) < 1e-3


def test_float32_self_transport_goes_on_in_float64_too():
    # the divergence's OT(a, a) at blur 0.01: float32 hovered at a marginal error of
    # 2.9e-4 for 1,900 iterations (max_iter) against tol 1e-4
    x, y = _spheres()
    with warnings.catch_warnings():
        warnings.simplefilter("error", otreg.ConvergenceWarning)
        d32 = otreg.sinkhorn_divergence(x.float(), y.float(), blur=0.01, tol=1e-4)
    d64 = otreg.sinkhorn_divergence(x, y, blur=0.01, tol=1e-4)
    assert d32.dtype == torch.float32
    assert float(d32) == pytest.approx(float(d64), rel=1e-6)


def test_a_stall_in_float64_after_float32_is_told_as_float64():
    x, y = (z[::2] for z in _spheres())  # (half the points: the same path, half the time)
    with pytest.warns(otreg.ConvergenceWarning, match="rounding floor of torch.float64") as got:
        res = otreg.sinkhorn(x.float(), y.float(), blur=0.02, max_iter=3000, tol=1e-14)
    assert res.stopped == "stalled" and "in float64 from iteration" in res.acceleration
    assert "float64 points" not in str(got[0].message)


def test_the_warnings_advise_only_what_the_call_does_not_do_already():
    """float64 points at their own rounding floor are not told to use float64; a
    log-form float32 solve that overflows is not told to use the log form."""
    x, y = (z[::2] for z in _spheres())  # (1,600 updates to the floor: half the points)
    with pytest.warns(otreg.ConvergenceWarning, match="rounding floor") as got:
        otreg.sinkhorn(x, y, blur=0.02, max_iter=3000, tol=1e-14)
    assert "float64 points" not in str(got[0].message)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.rand(50, 2, generator=gen), torch.rand(40, 2, generator=gen)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        res = otreg.sinkhorn(a, b, blur=1e-5)
    if res.stopped == "diverged":  # float32 overflowed (the tensorized and blocked sums)
        message = str(got[0].message)
        assert "NaN, infinite or absurd" in message
        assert "use float64 points or a larger blur" in message and "form=" not in message
    else:  # KeOps's sums (exact differences) did not, and converge
        assert res.converged and not got


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


def test_result_reports_its_settings(each_backend):
    x, y, _, _ = clouds()
    res = otreg.sinkhorn(x, y, blur=0.1, tol=1e-6)
    assert res.backend == each_backend and res.form == "log" and res.converged
    assert res.stopped == "tol"
    assert res.eps == pytest.approx(0.01) and res.n_iter > 1
    assert res.f.requires_grad is False and res.cost.shape == ()


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


def test_warnings_name_the_callers_line_whatever_the_entry_point():
    """A warning raised deep in otreg is attributed to the user's call, not to otreg's code
    (so warnings filters and 'once per line' act on the user's lines)."""
    x, y, _, _ = clouds(n=40, m=30, d=3, seed=2)
    calls = {
        "sinkhorn": lambda: otreg.sinkhorn(x, y, blur=0.001, max_iter=40),
        "divergence": lambda: otreg.sinkhorn_divergence(x, y, blur=0.001, max_iter=40),
        "loss": lambda: otreg.SinkhornLoss(blur=0.001, max_iter=40)(x, y),
    }
    for name, call in calls.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        found = [w for w in caught if issubclass(w.category, otreg.ConvergenceWarning)]
        assert found, name
        assert {w.filename for w in found} == {__file__}, (name, found[0].filename)
