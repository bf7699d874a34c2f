"""Implicit gradients of fixed points against unrolled ones."""

import pytest
import torch

import otreg
from otreg.loops import fixed_point
from tests.conftest import clouds


def contraction():
    g = torch.Generator().manual_seed(0)
    A = (0.3 * torch.randn(8, 8, generator=g, dtype=torch.float64)).requires_grad_()
    b = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    return A, b


@pytest.mark.parametrize("solver", ["gmres", "fixed_point"])
def test_implicit_matches_unrolled_on_a_contraction(solver):
    A, b = contraction()

    def step(z, A, b):
        return torch.tanh(A @ z) / 2 + b

    out = {}
    for backward in ("implicit", "unroll"):
        report = {}
        z = fixed_point(
            step,
            torch.zeros(8, dtype=torch.float64),
            (A, b),
            tol=1e-13,
            backward=backward,
            solver=solver,
            report=report,
        )
        out[backward] = torch.autograd.grad((z**3).sum(), (A, b))
        assert report["converged"]
    for g_imp, g_unr in zip(out["implicit"], out["unroll"]):
        assert torch.allclose(g_imp, g_unr, rtol=1e-6, atol=1e-9)
    assert report["n_iter"] > 5


def test_implicit_reports_its_residual():
    A, b = contraction()
    report = {}
    z = fixed_point(
        lambda z, A, b: torch.tanh(A @ z) / 2 + b,
        torch.zeros(8, dtype=A.dtype),
        (A, b),
        tol=1e-12,
        report=report,
    )
    z.sum().backward()
    assert report["backward_residual"] < 1e-10 and report["backward_iterations"] >= 1


@pytest.mark.parametrize("solver", ["gmres", "fixed_point"])
def test_the_adjoint_solve_stops_at_backward_max_iter_products(solver):
    """An adjoint system too ill-conditioned for 60 products (I - J with eigenvalues from
    1e-6 to 0.1): it stops within a restart cycle of them and warns. GMRES counted scipy's
    restart cycles, 50 products each: a sinkhorn_divergence with backward='implicit' on
    100 Gaussian points ran 51,000 products (74 s) for max_iter=1000."""
    from otreg.loops.fixed_point import RESTART

    rate = 1 - torch.logspace(-6, -1, 400, dtype=torch.float64)
    p = torch.randn(400, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    p.requires_grad_()
    report = {}
    z = fixed_point(
        lambda z, p: rate * z + p,
        p.detach() / (1 - rate),  # the fixed point itself: no forward iterations to speak of
        (p,),
        tol=1e-12,
        solver=solver,
        backward_max_iter=60,
        report=report,
    )
    with pytest.warns(otreg.ConvergenceWarning, match="the adjoint solve stopped"):
        z.sum().backward()
    assert 1 <= report["backward_iterations"] <= 60 + (RESTART if solver == "gmres" else 0)


def test_non_convergence_warns():
    A, b = contraction()
    with pytest.warns(otreg.ConvergenceWarning, match="fixed_point: stopped after 3"):
        fixed_point(
            lambda z, A, b: torch.tanh(A @ z) / 2 + b,
            torch.zeros(8, dtype=A.dtype),
            (A, b),
            tol=1e-12,
            max_iter=3,
        )


@pytest.mark.parametrize("reach", [None, 0.5])
def test_sinkhorn_implicit_potentials_match_unrolled(reach):
    x, y, a, b = clouds(n=12, m=10)
    out = {}
    for backward in ("implicit", "unroll"):
        xx, bb = x.clone().requires_grad_(), b.clone().requires_grad_()
        res = otreg.sinkhorn(
            xx, y, a, bb, blur=0.3, reach=reach, tol=1e-13, max_iter=5000, backward=backward
        )
        # a loss on the plan (gauge invariant) and on the potentials
        loss = (res.plan.barycentric_map() ** 2).sum() + (res.f * a).sum() + (res.g * bb).sum()
        out[backward] = torch.autograd.grad(loss, (xx, bb))
    for g_imp, g_unr in zip(out["implicit"], out["unroll"]):
        assert torch.allclose(g_imp, g_unr, rtol=1e-6, atol=1e-9)


def test_sinkhorn_unroll_with_checkpointing_equals_store():
    x, y, a, b = clouds(n=12, m=10)
    out = {}
    for strategy, memory in (("store", None), ("checkpoint", "1MB")):
        xx = x.clone().requires_grad_()
        res = otreg.sinkhorn(
            xx, y, a, b, blur=0.3, tol=1e-10, backward=otreg.Unroll(strategy, memory)
        )
        out[strategy] = torch.autograd.grad(res.f.square().sum(), xx)[0]
    assert torch.allclose(out["store"], out["checkpoint"], rtol=1e-10)


def test_sinkhorn_backward_options_are_checked():
    x, y, _, _ = clouds(n=5, m=6)
    with pytest.raises(ValueError, match="Unroll: strategy is 'sometimes'"):
        otreg.sinkhorn(x, y, backward=otreg.Unroll("sometimes"))
    with pytest.raises(ValueError, match="sinkhorn_divergence: backward is 'unroll'; the"):
        otreg.sinkhorn_divergence(x, y, backward="unroll")
    with pytest.raises(ValueError, match="backward is 'sometimes'; choose one of 'envelope'"):
        otreg.sinkhorn_divergence(x, y, backward="sometimes")


def test_the_implicit_backward_refuses_a_tensor_the_step_captures():
    """A captured A got no gradient from the implicit backward (the unrolled one gave it
    one); passed in params both agree."""
    gen = torch.Generator().manual_seed(0)
    A = (0.1 * torch.randn(10, 10, generator=gen, dtype=torch.float64)).requires_grad_()
    b = torch.randn(10, generator=gen, dtype=torch.float64, requires_grad=True)
    z0 = torch.zeros(10, dtype=torch.float64)
    with pytest.raises(ValueError, match="step uses A, which requires a gradient"):
        fixed_point(lambda z, b: torch.tanh(A @ z + b), z0, (b,))
    grads = []
    for backward in ("implicit", "unroll"):
        z = fixed_point(
            lambda z, b, A: torch.tanh(A @ z + b), z0, (b, A), tol=1e-12, backward=backward
        )
        (gA,) = torch.autograd.grad(z.sum(), A)
        grads.append(gA)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-8, atol=1e-10)
