"""sinkhorn_divergence and SinkhornLoss against GeomLoss, POT and their defining properties."""

import warnings

import geomloss
import numpy as np
import ot
import pytest
import torch

import otreg
from otreg.costs import get_cost
from tests.conftest import clouds

# each test runs on every reduction backend (tests/ot/conftest.py)
pytestmark = pytest.mark.usefixtures("each_backend")

TIGHT = dict(tol=1e-13, max_iter=50000)


def geomloss_value_and_grad(x, y, a, b, **kw):
    x = x.clone().requires_grad_()
    value = geomloss.SamplesLoss("sinkhorn", p=2, backend="tensorized", **kw)(a, x, b, y)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach(), grad


def value_and_grad(x, y, a, b, **kw):
    x = x.clone().requires_grad_()
    value = otreg.sinkhorn_divergence(x, y, a, b, **kw)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach(), grad


@pytest.mark.parametrize("seed", [0, 1])
def test_balanced_divergence_and_gradient_match_geomloss(seed):
    # GeomLoss has no stopping rule: it converges with a large blur and scaling close to 1.
    x, y, a, b = clouds(n=40, m=30, d=3, seed=seed)
    v_ref, g_ref = geomloss_value_and_grad(x, y, a, b, blur=0.5, scaling=0.9995)
    v, g = value_and_grad(x, y, a, b, blur=0.5, **TIGHT)
    assert abs(float(v - v_ref)) < 1e-4 * float(v_ref)
    assert float((g - g_ref).norm()) < 1e-4 * float(g_ref.norm())


def test_unbalanced_divergence_value_matches_geomloss():
    # Values agree. GeomLoss 0.3's unbalanced *gradient* is not the derivative of its value
    # (it differs from its own finite differences); ours is checked against finite
    # differences in test_sinkhorn.py.
    x, y, a, b = clouds(n=40, m=30, d=3)
    b = 1.5 * b
    v_ref, _ = geomloss_value_and_grad(x, y, a, b, blur=0.5, reach=1.0, scaling=0.9995)
    v, _ = value_and_grad(x, y, a, b, blur=0.5, reach=1.0, **TIGHT)
    assert abs(float(v - v_ref)) < 1e-4 * float(v_ref)


def test_divergence_of_a_measure_with_itself_is_zero():
    x, _, a, _ = clouds()
    assert abs(float(otreg.sinkhorn_divergence(x, x, a, a, blur=0.1, **TIGHT))) < 1e-12
    d = otreg.sinkhorn_divergence(x, x, a, 2 * a, blur=0.1, reach=0.5, **TIGHT)
    assert float(d) > 0  # unbalanced: different masses are far apart


@pytest.mark.parametrize("seed", range(5))
def test_divergence_is_non_negative(seed):
    x, y, a, b = clouds(seed=seed, shift=0.05 * seed)
    for reach in (None, 0.3):
        assert float(otreg.sinkhorn_divergence(x, y, a, b, blur=0.2, reach=reach, **TIGHT)) >= 0


def test_divergence_tends_to_the_ot_cost_as_blur_vanishes():
    x, y, a, b = clouds(n=20, m=20, seed=5, shift=0.5)
    emd = ot.emd2(a.numpy(), b.numpy(), get_cost("sqeuclidean").dense(x[None], y[None])[0].numpy())
    errors = [
        abs(float(otreg.sinkhorn_divergence(x, y, a, b, blur=blur, tol=1e-8, max_iter=50000)) - emd)
        for blur in (0.1, 0.03, 0.01)
    ]
    assert errors[0] > errors[2] and errors[2] < 2e-3 * emd


def test_translation_closed_form():
    # Between a cloud and its translate by t, the debiased divergence is |t|^2 / 2 exactly.
    x, _, a, _ = clouds(n=25, d=3)
    t = torch.tensor([0.3, -0.2, 0.1], dtype=x.dtype)
    d = otreg.sinkhorn_divergence(x, x + t, a, a, blur=0.1, tol=1e-8, max_iter=10000)
    assert float(d) == pytest.approx(float((t**2).sum() / 2), rel=1e-6)


def test_sinkhorn_loss_matches_the_functions(each_backend):
    x, y, a, b = clouds()
    loss = otreg.SinkhornLoss(blur=0.2, tol=1e-10)
    assert torch.allclose(
        loss(a, x, b, y), otreg.sinkhorn_divergence(x, y, a, b, blur=0.2, tol=1e-10)
    )
    assert torch.allclose(loss(x, y), otreg.sinkhorn_divergence(x, y, blur=0.2, tol=1e-10))
    assert loss.last_result.converged and loss.last_result.backend == each_backend
    plain = otreg.SinkhornLoss(blur=0.2, debias=False, tol=1e-10)
    assert torch.allclose(plain(a, x, b, y), otreg.sinkhorn(x, y, a, b, blur=0.2, tol=1e-10).cost)
    assert "blur=0.2" in repr(loss)


def test_sinkhorn_loss_drives_gradient_descent_to_the_target():
    x, y, _, _ = clouds(n=50, m=50, d=2, dtype=torch.float32)
    x = x.clone().requires_grad_()
    loss = otreg.SinkhornLoss(blur=0.1)
    opt = torch.optim.SGD([x], lr=1.0)
    first = None
    for _ in range(100):
        opt.zero_grad()
        value = loss(x, y)
        first = first if first is not None else float(value.detach())
        # the gradient of the cost/2 convention is a_i (x_i - T(x_i)): step by N to follow T
        (value * x.shape[0]).backward()
        opt.step()
    assert float(value.detach()) < 1e-3 * first


def test_batched_divergence():
    x, y, a, b = clouds(batch=2)
    d = otreg.sinkhorn_divergence(x, y, a, b, blur=0.2, **TIGHT)
    assert d.shape == (2,)
    for k in range(2):
        one = otreg.sinkhorn_divergence(x[k], y[k], a[k], b[k], blur=0.2, **TIGHT)
        np.testing.assert_allclose(float(d[k]), float(one), rtol=1e-11)


def test_sinkhorn_loss_warm_start_gives_the_same_values_faster():
    x, y, a, b = clouds(n=50, m=40, d=3, seed=4)
    cold = otreg.SinkhornLoss(blur=0.1, tol=1e-9)
    warm = otreg.SinkhornLoss(blur=0.1, tol=1e-9, warm_start=True)
    gen = torch.Generator().manual_seed(1)
    total_cold = total_warm = 0
    for _ in range(3):
        x = x + 0.01 * torch.randn(x.shape, generator=gen, dtype=x.dtype)
        vc, vw = cold(a, x, b, y), warm(a, x, b, y)
        assert float(vw) == pytest.approx(float(vc), rel=1e-7)
        total_cold += cold.last_result.n_iter
        total_warm += warm.last_result.n_iter
    assert total_warm < total_cold
    warm.reset()
    warm(a, x, b, y)
    assert warm.last_result.n_iter == cold.last_result.n_iter  # cold again after reset
    with pytest.raises(TypeError, match="warm_start must be True or False"):
        otreg.SinkhornLoss(warm_start=1)


def test_a_model_holding_the_loss_copies_and_pickles_after_a_call():
    """deepcopy (a best checkpoint, an EMA copy) and pickle of a model holding the loss
    after a forward and backward: last_result (the call's graph) is left out, the warm
    potentials kept; the copy computes what the original does."""
    import copy
    import pickle

    x, y, a, b = clouds(n=60, m=50, d=3, seed=5)
    lin = torch.nn.Linear(3, 3).to(x.dtype)
    loss = otreg.SinkhornLoss(blur=0.2, warm_start=True)
    model = torch.nn.ModuleList([lin, loss])
    loss(lin(x), y).backward()
    assert loss.last_result is not None and loss.last_result.cost.grad_fn is not None
    twin = copy.deepcopy(model)
    assert twin[1].last_result is None and loss.last_result is not None
    assert twin[1]._warm.keys() == loss._warm.keys()
    with torch.no_grad():
        assert float(twin[1](twin[0](x), y)) == pytest.approx(float(loss(lin(x), y)), rel=1e-6)
    blob = pickle.dumps(model)
    assert pickle.loads(blob)[1].last_result is None
    loss.reset()
    assert loss.last_result is None and not loss._warm


def test_a_warm_start_that_crawls_falls_back_to_the_annealing():
    """Clouds moved far between calls: the previous potentials are a poor start (a model
    trained by Adam took 900 to 2,000 iterations from them, and stopped unconverged, where
    the annealing took 260 to 1,300); the warm attempt stops at half the last cold solve's
    iterations and the call solves from scratch, converged, with the cold call's value."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 3, generator=gen, dtype=torch.float64)
    y = x @ torch.randn(3, 3, generator=gen, dtype=torch.float64) + 0.5
    cold = otreg.SinkhornLoss(blur=0.05)
    warm = otreg.SinkhornLoss(blur=0.05, warm_start=True)
    warm(x, y)
    moved = x @ torch.tensor([[0.0, -1, 0], [1, 0, 0], [0, 0, 1]], dtype=x.dtype) + 2.0
    vc, vw = cold(moved, y), warm(moved, y)
    assert cold.last_result.converged and warm.last_result.converged
    assert float(vw) == pytest.approx(float(vc), rel=1e-3)
    assert warm.last_result.n_iter == cold.last_result.n_iter  # solved from scratch
    assert warm._warm["skip_xy"] == otreg.ot.divergence.WARM_BACKOFF  # after a failed try


@pytest.mark.parametrize("reach", [None, 0.7])
def test_gradient_with_respect_to_zero_weights_is_finite_and_exact(reach):
    # A zero weight is a point the measure does not charge (a zero-area triangle's vertex):
    # d S / d b_j is finite there, and one-sided finite differences give it.
    x, y, a, b = clouds(n=25, m=20, d=2, seed=3)
    b[[2, 7]] = 0.0
    b = b / b.sum()
    kw = dict(blur=0.3, reach=reach, **TIGHT)
    for debias in (True, False):
        bg = b.clone().requires_grad_()
        loss = otreg.SinkhornLoss(debias=debias, **kw)
        (grad,) = torch.autograd.grad(loss(a, x, bg, y), bg)
        assert torch.isfinite(grad).all()
        # along a direction that keeps the total mass (balanced OT needs it)
        d = torch.zeros_like(b)
        d[2], d[0] = 1.0, -1.0
        h = 1e-6
        fd = (loss(a, x, b + h * d, y) - loss(a, x, b, y)) / h
        assert abs(float(fd - (grad * d).sum())) < 1e-4 * (1 + abs(float(fd)))


def test_a_default_blur_far_below_the_data_warns_once():
    g = torch.Generator().manual_seed(0)
    x = 100 + 30 * torch.randn(50, 3, generator=g, dtype=torch.float64)  # mm
    y = x + 2.0
    with pytest.warns(UserWarning, match="blur is the default 0.05.*span"):
        otreg.sinkhorn_divergence(x, y)
    loss = otreg.SinkhornLoss()
    with pytest.warns(UserWarning, match="Set blur"):
        loss(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loss(x, y)  # once per loss
        otreg.sinkhorn_divergence(x, y, blur=2.0)
        otreg.SinkhornLoss(blur=2.0)(x, y)
        otreg.sinkhorn_divergence(x / 100, y / 100)  # data of unit size: the default fits


def test_euclidean_divergence_gradient_in_float32_matches_float64():
    """The self terms' coincident points (and clouds near each other) once gave float32
    gradients hundreds of times too large with cost="euclidean": the squared distances went
    through a matrix product whose rounding sat under the root (each backend: the module's
    fixture points ``auto`` at it)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 3, generator=gen, dtype=torch.float64)
    y = x + 1e-3 * torch.randn(200, 3, generator=gen, dtype=torch.float64) + 0.5
    grads = []
    for dtype in (torch.float64, torch.float32):
        xx = x.to(dtype).requires_grad_(True)
        value = otreg.sinkhorn_divergence(xx, y.to(dtype), blur=0.5, cost="euclidean")
        grads.append(torch.autograd.grad(value, xx)[0].double())
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 1e-4


def far_apart(n=300, offset=300.0):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    y = 0.8 * torch.randn(n - 50, 3, generator=gen, dtype=torch.float64)
    return x, y + offset * torch.tensor([1.0, 0.3, -0.2], dtype=torch.float64)


def test_float32_gradients_of_clouds_far_apart_follow_float64():
    """Costs of 5e4 rounded in float32 by more than eps: the gradient less its mean (the
    shape's share, beside the translation) was 10% off at 300 units apart; the clouds are
    now solved centred, exactly (balanced OT, squared Euclidean cost)."""
    x, y = far_apart()
    grads = []
    for dtype in (torch.float64, torch.float32):
        xx = x.to(dtype).requires_grad_(True)
        value = otreg.sinkhorn_divergence(xx, y.to(dtype), blur=0.05)
        grads.append(torch.autograd.grad(value, xx)[0].double())
    shape = [g - g.mean(0) for g in grads]
    assert float((shape[1] - shape[0]).norm() / shape[0].norm()) < 5e-3


def test_centring_far_apart_clouds_changes_nothing_but_rounding(monkeypatch):
    """Value, gradients (points and weights), the result's potentials and its plan's
    barycentric map match the uncentred solve in float64."""
    from otreg.ot import divergence as module

    x, y = far_apart(n=60, offset=10.0)
    a = torch.softmax(torch.linspace(-1, 1, 60, dtype=torch.float64), 0)
    b = torch.softmax(torch.linspace(1, -1, 10, dtype=torch.float64), 0)
    out = {}
    for apart in (1.0, float("inf")):  # centred, then as given
        monkeypatch.setattr(module, "APART", apart)
        xx, aa = x.clone().requires_grad_(True), a.clone().requires_grad_(True)
        yy = y.clone().requires_grad_(True)
        loss = otreg.SinkhornLoss(blur=0.1, tol=1e-11, max_iter=20000)
        value = loss(aa, xx, b, yy)
        grads = torch.autograd.grad(value, (xx, aa, yy))
        res = loss.last_result
        out[apart] = (value, *grads, res.f, res.g, res.cost, res.plan.barycentric_map())
    centred, given = out[1.0], out[float("inf")]
    names = ("value", "x gradient", "a gradient", "y gradient", "f", "g", "cost", "map")
    for name, c, g in zip(names, centred, given):
        if name in ("a gradient", "f", "g"):  # defined up to a constant (balanced)
            c, g = c - c.mean(), g - g.mean()
        assert torch.allclose(c, g, rtol=1e-7, atol=1e-9 * float(g.abs().max())), name
