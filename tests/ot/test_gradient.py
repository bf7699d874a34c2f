"""Gradients of a solve: second derivatives right (implicit) or refused (envelope), and the
implicit gradients of a cloud against itself counted once."""

import time
import warnings

import pytest
import torch

import otreg

D = torch.float64
SOLVE = dict(blur=0.1, tol=1e-12, max_iter=5000)


def clouds(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(40, 2, generator=g, dtype=D)
    y = torch.rand(50, 2, generator=g, dtype=D) + 0.2
    v = torch.randn(40, 2, generator=g, dtype=D)
    return x, y, v


def hvp_and_finite_difference(fn, x, v, h=1e-5):
    xx = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(xx), xx, create_graph=True)
    (hv,) = torch.autograd.grad((g * v).sum(), xx)
    grads = []
    for sign in (1, -1):
        xs = (x + sign * h * v).requires_grad_(True)
        grads.append(torch.autograd.grad(fn(xs), xs)[0])
    return hv, (grads[0] - grads[1]) / (2 * h)


@pytest.mark.parametrize(
    "name, fn",
    [
        ("sinkhorn", lambda x, y: otreg.sinkhorn(x, y, backward="implicit", **SOLVE).cost),
        ("divergence", lambda x, y: otreg.sinkhorn_divergence(x, y, backward="implicit", **SOLVE)),
        ("loss", lambda x, y: otreg.SinkhornLoss(backward="implicit", **SOLVE)(x, y)),
        ("unrolled", lambda x, y: otreg.sinkhorn(x, y, backward=otreg.Unroll(), **SOLVE).cost),
    ],
)
def test_hessian_vector_products_agree_with_finite_differences(name, fn):
    x, y, v = clouds()
    hv, fd = hvp_and_finite_difference(lambda xx: fn(xx, y), x, v)
    assert float((hv - fd).norm() / fd.norm()) < 1e-6, name


def test_float32_hessian_vector_products_of_the_divergence_follow_float64():
    """Gaussian clouds farther apart than the blur: the self terms' alternating map was
    nearly singular (many eigenvalues near 1), and the float32 product came out 447 times
    off, warning of an adjoint residual of 3e8; the averaged map's system is well
    conditioned. The first gradient's cotangent on the potentials (zero at the solution)
    no longer reaches the adjoint solve, which warned of a meaningless residual."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, generator=g, dtype=D)
    y = torch.randn(40, 3, generator=g, dtype=D) + 0.5
    v = torch.randn(50, 3, generator=g, dtype=D)

    def divergence(xx, tol):
        return otreg.sinkhorn_divergence(
            xx, y.to(xx.dtype), blur=0.1, backward="implicit", tol=tol, max_iter=20000
        )

    _, fd = hvp_and_finite_difference(lambda xx: divergence(xx, 1e-12), x, v)
    for dtype, tol, within in ((D, 1e-10, 1e-5), (torch.float32, 1e-6, 1e-3)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", otreg.ConvergenceWarning)
            hv, _ = hvp_and_finite_difference(
                lambda xx, tol=tol: divergence(xx, tol), x.to(dtype), v.to(dtype)
            )
        assert float((hv.double() - fd).norm() / fd.norm()) < within, dtype


@pytest.mark.parametrize(
    "call",
    [
        lambda x, y: otreg.sinkhorn(x, y, **SOLVE).cost,
        lambda x, y: otreg.sinkhorn_divergence(x, y, **SOLVE),
        lambda x, y: otreg.SinkhornLoss(**SOLVE)(x, y),
        lambda x, y: otreg.sinkhorn_divergence(x, y, blur=0.1, multiscale=False),
    ],
)
def test_second_derivatives_of_the_envelope_gradient_are_refused(call):
    x, y, _ = clouds()
    x.requires_grad_(True)
    (g,) = torch.autograd.grad(call(x, y), x)  # first derivatives as before
    assert torch.isfinite(g).all()
    with pytest.raises(RuntimeError, match="second derivatives .* Use backward='implicit'"):
        torch.autograd.grad(call(x, y), x, create_graph=True)


def test_implicit_potentials_of_a_cloud_against_itself_count_it_once():
    """x given as both clouds: the derivative of the potentials with respect to x is the
    sum of both roles, once (it was counted twice); checked by finite differences."""
    x, _, v = clouds(1)

    def f_loss(xx):
        res = otreg.sinkhorn(xx, xx, backward="implicit", **SOLVE)
        return (res.f * torch.linspace(0, 1, 40, dtype=D)).sum()

    xx = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f_loss(xx), xx)
    h = 1e-6
    fd = (f_loss(x + h * v) - f_loss(x - h * v)) / (2 * h)
    assert float((g * v).sum()) == pytest.approx(float(fd), rel=1e-5)


def test_the_adjoint_solve_stops_at_the_rounding_of_float32():
    """Its residual is computed in float32: a tolerance below that rounding was chased for
    50,000 GMRES steps (a minute) and then warned."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(100, 3, generator=g, requires_grad=True)
    y = torch.rand(120, 3, generator=g)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error", otreg.ConvergenceWarning)
        otreg.sinkhorn(x, y, blur=0.1, backward=otreg.Implicit(tol=1e-10)).cost.backward()
    assert time.perf_counter() - start < 30 and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("M", [6, 7])
def test_the_implicit_divergence_differentiates_its_weights_as_the_envelope_does(M):
    # the self terms OT(a, a), OT(b, b) sum their weights' share over their own clouds: with
    # the cross term's, N != M raised a shape error and N == M gave a gradient 4.5% off
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, generator=g, dtype=D), torch.randn(M, 3, generator=g, dtype=D)
    a, b = (torch.rand(n, generator=g, dtype=D) + 0.5 for n in (6, M))
    a, b = a / a.sum(), b / b.sum()
    grads = {}
    for backward in ("envelope", "implicit"):
        ps = [t.clone().requires_grad_(True) for t in (x, y, a, b)]
        v = otreg.sinkhorn_divergence(*ps, blur=0.5, backward=backward, tol=1e-13)
        grads[backward] = torch.autograd.grad(v, ps)
    for env, imp in zip(grads["envelope"][:2], grads["implicit"][:2]):
        assert torch.allclose(env, imp, atol=1e-10)
    for env, imp in zip(grads["envelope"][2:], grads["implicit"][2:]):
        diff = env - imp  # weights summing to one: their gradient is known up to a constant
        assert float(diff.max() - diff.min()) < 1e-10
    # along weights that keep their sum: a finite difference of the value
    v = torch.zeros(6, dtype=D)
    v[0], v[3] = 1.0, -1.0

    def value(t):
        return float(otreg.sinkhorn_divergence(x, y, a + t * v, b, blur=0.5, tol=1e-13))

    h = 1e-5
    fd = (value(h) - value(-h)) / (2 * h)
    assert abs(float(grads["implicit"][2] @ v) - fd) < 1e-6 * max(1.0, abs(fd))
