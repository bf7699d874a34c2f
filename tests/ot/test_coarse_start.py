"""The dense solver's coarse start (DenseKernel.coarse_problem): the same problem solved
first on grid cells' centroids reaches the same potentials as the eps-scaling on the points,
and is skipped where its potentials are not what the loop wants."""

import numpy as np
import ot
import pytest
import torch

import otreg
from otreg.ot import kernels
from otreg.ot.loop import solve
from otreg.ot.problem import Problem, SinkhornOptions
from tests.conftest import student_t


def heavy_tails(n: int = 1000):
    """Two heavy-tailed clouds: every pair is summed (far points), 1e6 pairs at n = 1,000."""
    return student_t(n, 1, 0.0), student_t(n, 101, 0.25)


@pytest.fixture
def without_coarse_start(monkeypatch):
    def off():
        monkeypatch.setattr(kernels, "COARSE_MIN_PAIRS", 1 << 62)

    return off


def test_the_coarse_start_reaches_the_potentials_of_the_points_eps_scaling(
    without_coarse_start,
):
    x, y = heavy_tails()
    tight = dict(blur=0.2, tol=1e-11, max_iter=20000)
    coarse = otreg.sinkhorn(x, y, **tight)
    assert "cells" in coarse.acceleration, coarse.acceleration
    without_coarse_start()
    plain = otreg.sinkhorn(x, y, **tight)
    assert "cells" not in plain.acceleration
    shift = float((coarse.f - plain.f).mean())  # potentials are defined up to a constant
    assert torch.allclose(coarse.f - shift, plain.f, atol=1e-8 * coarse.eps)
    assert torch.allclose(coarse.g + shift, plain.g, atol=1e-8 * coarse.eps)


def test_the_default_call_with_a_coarse_start_gets_the_gradient_of_pots_converged_plan():
    """As tests/ot/test_solver.py's heavy-tailed test, on clouds large enough for the coarse
    start: POT's log-domain Sinkhorn, started from our tight potentials, confirms them as
    its fixed point, and its plan gives the oracle gradient."""
    x, y = heavy_tails()
    blur, n = 0.1, x.shape[0]
    a = np.full(n, 1 / n)
    xs = x.clone().requires_grad_(True)
    res = otreg.sinkhorn(xs, y, blur=blur)
    assert res.converged and "cells" in res.acceleration, res.acceleration
    (grad,) = torch.autograd.grad(res.cost, xs)
    tight = otreg.sinkhorn(x, y, blur=blur, tol=1e-12, max_iter=20000)
    start = (tight.f.numpy() / res.eps + np.log(a), tight.g.numpy() / res.eps + np.log(a))
    C = 0.5 * ot.dist(x.numpy(), y.numpy())
    P, log = ot.sinkhorn(
        a, a, C, reg=res.eps, method="sinkhorn_log", stopThr=1e-11, numItermax=1000,
        warmstart=start, log=True,
    )  # fmt: skip
    assert log["niter"] < 100 and np.abs(P.sum(0) - a).sum() < 1e-10
    oracle = a[:, None] * x.numpy() - P @ y.numpy()
    error = np.linalg.norm(grad.numpy() - oracle) / np.linalg.norm(oracle)
    assert error < 5e-3


def test_a_cloud_against_itself_takes_the_eps_scaling_on_cells(without_coarse_start):
    """OT(a, a) of the divergence: where the final eps's cells are too many, the eps-scaling
    runs on the cells of an earlier eps, and the points' updates go on from there."""
    x = heavy_tails()[0]
    a = torch.full((1, x.shape[0]), 1 / x.shape[0], dtype=x.dtype)
    p = Problem.build("t", x, x, a[0], a[0], SinkhornOptions(blur=0.15, tol=1e-10))
    sol = solve(p, x[None], a)
    assert "the eps-scaling to blur" in sol.acceleration, sol.acceleration
    without_coarse_start()
    plain = solve(p, x[None], a)
    assert "cells" not in plain.acceleration
    assert torch.allclose(sol.f, plain.f, atol=1e-7 * p.eps)


@pytest.mark.parametrize("case", ["unrolled", "batch", "weightless cell", "few pairs"])
def test_the_coarse_start_is_skipped_where_it_does_not_fit(case):
    """An unrolled gradient replays the plain schedule; a batch, a cell of weightless points
    (its centroid would carry no mass) and a small problem take the points' eps-scaling."""
    x, y = heavy_tails()
    a = torch.full((x.shape[0],), 1 / x.shape[0], dtype=x.dtype)
    kwargs = dict(blur=0.1)
    if case == "unrolled":
        kwargs.update(backward="unroll", blur=0.3)
    elif case == "batch":
        x, y = torch.stack([x, x + 0.1]), torch.stack([y, y])
    elif case == "weightless cell":
        far = x[:, 0].argmax()  # alone in its cell, far out in the tail
        a = a.clone()
        a[far] = 0.0
        a /= a.sum()
        kwargs["a"] = a
    else:
        x, y = x[:400], y[:400]
    res = otreg.sinkhorn(x, y, **kwargs)
    assert "cells" not in res.acceleration, res.acceleration
    assert bool(res.converged.all()) if isinstance(res.converged, torch.Tensor) else res.converged


def test_a_coarse_solve_that_fails_leaves_the_points_eps_scaling(monkeypatch):
    """Potentials from the cells that are not finite (a solve that diverged): the points'
    eps-scaling starts from scratch, converges, and the result does not name the cells."""
    x, y = heavy_tails()
    plain = otreg.sinkhorn(x, y, blur=0.2, multiscale=False, tol=1e-9)

    def broken(self, fc, gc):
        nan = torch.full((1, self.x.shape[1]), float("nan"), dtype=self.x.dtype)
        return nan, nan[:, : self.y.shape[1]]

    monkeypatch.setattr(kernels.DenseKernel, "extrapolate", broken)
    res = otreg.sinkhorn(x, y, blur=0.2, multiscale=False, tol=1e-9)
    assert res.converged and "cells" not in res.acceleration, res.acceleration
    shift = float((res.f - plain.f).mean())
    assert torch.allclose(res.f - shift, plain.f, atol=1e-6 * res.eps)
