"""The divergence when the blur far exceeds the data: precise, non-negative, finite.

Oracles: the expansion in 1 / eps written here from NumPy moments, and float64 solves where
float64 holds (blur up to 100 times the data's size).
"""

import json
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import otreg
from otreg.ot import large_blur

BLURS = [1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4, 1e6]  # times the data's size


def brain_sized(n=300, m=200, seed=0, dtype=torch.float64):
    """Two clouds of about 60 mm, 100 mm from the origin (scanner coordinates)."""
    g = torch.Generator().manual_seed(seed)
    x = 100 + 30 * torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = 102 + 30 * torch.randn(m, 3, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def size(x, y):
    both = torch.cat([x, y]).double()
    return float((both.max(0).values - both.min(0).values).norm())


def expansion(x, y, blur, debias=True, mass=1.0):
    """The divergence (or OT_eps) to first order in 1 / eps, from NumPy moments."""
    x, y = x.double().numpy(), y.double().numpy()
    eps = blur**2
    sa, sb = np.cov(x.T, bias=True), np.cov(y.T, bias=True)
    shift = 0.5 * ((x.mean(0) - y.mean(0)) ** 2).sum()
    if debias:
        return mass * (shift + ((sa - sb) ** 2).sum() / (4 * eps))
    value = shift + 0.5 * (np.trace(sa) + np.trace(sb)) - np.trace(sa @ sb) / (2 * eps)
    return mass * value + eps * (mass**2 - mass - mass * np.log(mass))


@pytest.mark.parametrize("debias", [True, False])
def test_expansion_agrees_with_a_float64_solve_where_both_hold(debias):
    # At 30 times the size, float64 solves are exact to 1e-10 and the expansion's
    # truncation is (1/900)^2 of the size ** 2.
    x, y = brain_sized()
    blur = 30 * size(x, y)
    a = torch.full((300,), 2 / 300, dtype=torch.float64)  # total mass 2
    b = torch.full((200,), 2 / 200, dtype=torch.float64)
    direct = otreg.SinkhornLoss(blur=blur, debias=debias)(a, x, b, y)
    ref = expansion(x, y, blur, debias, mass=2.0)
    assert abs(float(direct) - ref) < 1e-7 * size(x, y) ** 2


@pytest.mark.parametrize("rel", BLURS)
def test_float32_agrees_with_float64_at_every_blur(rel):
    x, y = brain_sized()
    s = size(x, y)
    blur = rel * s
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # converged: no warning
        v64 = otreg.sinkhorn_divergence(x, y, blur=blur)
        v32 = otreg.sinkhorn_divergence(x.float(), y.float(), blur=blur)
    assert float(v32) >= 0 and float(v64) >= 0
    assert abs(float(v32) - float(v64)) < 1e-4 * float(v64) + 1e-7 * s**2
    if rel >= 10:  # the divergence has reached its limit: the expansion
        assert abs(float(v64) - expansion(x, y, blur)) < 1e-6 * float(v64)


def test_issue_case_blur_1e6_mm_on_brain_sized_data():
    # Was -29,802 mm^2 "converged" from the CLI and 0 from the float32 API.
    x, y = brain_sized(seed=1)
    v = otreg.sinkhorn_divergence(x.float(), y.float(), blur=1e6)
    assert float(v) == pytest.approx(expansion(x, y, 1e6), rel=1e-5)
    res = otreg.sinkhorn(x.float(), y.float(), blur=1e6)
    assert res.converged and res.stopped == "closed form" and res.n_iter == 0
    assert float(res.cost) == pytest.approx(expansion(x, y, 1e6, debias=False), rel=1e-5)
    # the plan of a blur far above the data is a x b
    rows, cols = res.plan.marginals()
    assert torch.allclose(rows, torch.full((300,), 1 / 300), rtol=1e-3)
    assert torch.allclose(cols, torch.full((200,), 1 / 200), rtol=1e-3)


def test_cli_distance_at_a_huge_blur(tmp_path):
    from otreg.cli import main

    x, y = brain_sized(seed=2)
    np.save(tmp_path / "a.npy", x.numpy())
    np.save(tmp_path / "b.npy", y.numpy())
    files = [str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]
    out = CliRunner().invoke(main, ["distance", *files, "--blur", "1e6", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["converged"] is True
    values = [v for k, v in doc.items() if isinstance(v, float) and "divergence" in k]
    assert values and all(v >= 0 for v in values)
    assert values[0] == pytest.approx(expansion(x, y, 1e6), rel=1e-4)


@pytest.mark.parametrize("rel", [30.0, 1e3])
def test_gradient_at_large_blur_matches_float64(rel, monkeypatch):
    # 30: the float32 solve with a float64 final evaluation; 1e3: the closed form, against
    # a float64 solve (which holds there) with the closed form turned off.
    x, y = brain_sized(n=80, m=60)
    blur = rel * size(x, y)

    def grad(xx, yy):
        xx = xx.clone().requires_grad_()
        (g,) = torch.autograd.grad(otreg.sinkhorn_divergence(xx, yy, blur=blur), xx)
        return g.double()

    got = grad(x.float(), y.float())
    monkeypatch.setattr(large_blur, "CLOSED_FORM_FROM", float("inf"))
    ref = grad(x, y)
    assert float((got - ref).norm()) < 1e-4 * float(ref.norm())


def test_unbalanced_far_above_the_data_is_refused():
    x, y = brain_sized()
    with pytest.raises(ValueError, match="blur is .* times the data's size"):
        otreg.sinkhorn_divergence(x, y, blur=1e4 * size(x, y), reach=50.0)
    with pytest.raises(ValueError, match="reach=None"):
        otreg.sinkhorn(x, y, blur=1e4 * size(x, y), reach=50.0)


@st.composite
def problems(draw):
    n, m = draw(st.integers(1, 30)), draw(st.integers(1, 30))
    d = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = torch.Generator().manual_seed(seed)
    scale = 10 ** draw(st.floats(-2, 3))
    x = scale * torch.randn(n, d, generator=g, dtype=torch.float64)
    y = scale * (torch.randn(m, d, generator=g, dtype=torch.float64) + draw(st.floats(-2, 2)))
    a = torch.rand(n, generator=g, dtype=torch.float64)
    b = torch.rand(m, generator=g, dtype=torch.float64)
    a[torch.rand(n, generator=g) < draw(st.floats(0, 0.7))] = 0.0  # zero weights
    b[torch.rand(m, generator=g) < draw(st.floats(0, 0.7))] = 0.0
    a[0] += 0.1  # at least one charged point a side
    b[-1] += 0.1
    a, b = a / a.sum(), b / b.sum()
    rel_blur = 10 ** draw(st.floats(-3, 6))
    reach = draw(st.sampled_from([None, 0.5, 5.0]))
    cost = draw(st.sampled_from(["sqeuclidean", "euclidean"]))
    return x.to(dtype), y.to(dtype), a.to(dtype), b.to(dtype), rel_blur, reach, cost


def _unit(w: torch.Tensor) -> torch.Tensor:
    return w / w.sum()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
@example(  # zero target weights at a tiny blur: OT(b, b)'s weight path was 0 * inf = NaN
    (
        torch.tensor([[1.5410]]),
        torch.tensor([-0.2934, -2.1788, 0.5684, -1.0845, -1.3986, 0.4033, 0.838, -0.7193])[:, None],
        torch.tensor([1.0]),
        torch.tensor([0.0994, 0.1997, 0.0, 0.2709, 0.0, 0.0, 0.0, 0.4300]),
        0.001,
        None,
        "sqeuclidean",
    )
)
@example(  # zero target weights at a small blur: Anderson's extrapolated g where b = 0
    # overflowed the marginal error (0 * inf), and its fallback restarted from a bad point
    (
        torch.tensor([1.541, -0.2934, -2.1788, 0.5684, -1.0845, -1.3986, 0.4033, 0.838])[:, None],
        torch.tensor(
            [-0.7193, -0.4033, -0.5966, 0.182, -0.8567, 1.1006, -1.0712, 0.1227, -0.5663, 0.3731]
        )[:, None],
        _unit(torch.tensor([0.1985, 0.2036, 0.0546, 0.1756, 0.0285, 0.1359, 0.0586, 0.1448])),
        _unit(torch.tensor([0.0, 0.2419, 0.2644, 0.0, 0.2873, 0.0, 0.0, 0.0, 0.1708, 0.0355])),
        0.01,
        None,
        "sqeuclidean",
    )
)
@example(  # blur exactly at the unbalanced limit (1,000 times the size): rounding decides
    (
        torch.tensor([[1.5410]]),
        torch.tensor([[-0.2934]]),
        torch.tensor([1.0]),
        torch.tensor([1.0]),
        1000.0,
        0.5,
        "sqeuclidean",
    )
)
def test_divergence_is_finite_non_negative_with_finite_gradients(problem):
    x, y, a, b, rel_blur, reach, cost = problem
    s = max(size(x, y), 1e-12)
    p = 2 if cost == "sqeuclidean" else 1
    blur = rel_blur * s
    x, a, b = x.clone().requires_grad_(), a.clone().requires_grad_(), b.clone().requires_grad_()
    kw = dict(blur=blur, cost=cost, reach=None if reach is None else reach * s)
    # at the limit itself, the blur's rounding decides which side the problem falls on
    assume(abs(rel_blur**p / large_blur.UNBALANCED_LIMIT - 1) > 1e-9)
    if reach is not None and rel_blur**p > large_blur.UNBALANCED_LIMIT:
        with pytest.raises(ValueError, match="times the data's size"):
            otreg.sinkhorn_divergence(x, y, a, b, **kw)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", otreg.ConvergenceWarning)  # tiny blurs: max_iter
        value = otreg.sinkhorn_divergence(x, y, a, b, **kw)
    assert torch.isfinite(value)
    assert float(value.detach()) >= -1e-6 * s**p
    grads = torch.autograd.grad(value, (x, a, b))
    assert all(bool(torch.isfinite(g).all()) for g in grads)
