r"""Newton's method on the semi-dual, followed along halvings of the blur (Sinkhorn-Newton
with eps-continuation), for small balanced problems over every pair whose updates do not
converge.

Where the blur is far below the points' spacing the plan is nearly a permutation and the
alternating updates crawl: 200 Gaussian points against 150 shifted by 2, at blur 0.01,
stopped at ``max_iter`` (2,000 updates, 5.8 s, a marginal error of 0.16, the gradient 9%
off), and converged only after 5,472 (12 s). With f eliminated (f the softmin of g), the
semi-dual

.. math::

    F(g) = \langle a, f(g) \rangle + \langle b, g \rangle

is concave, with the gradient b - c (c = pi^T 1, the plan's column sums) and the Hessian
-(diag(c) - pi^T diag(1/a) pi) / eps, an (M, M) matrix that fits in memory when M is
small (:data:`MAX_SIDE`). A step solves the damped (Levenberg-Marquardt) system
(H + mu diag(c)) d = eps (b - c) in float64, the constant mode fixed by adding
mean(c) 1 1^T (F does not change when g moves by a constant), and is taken where F rises:
mu is then divided by 3, else multiplied by 10 and the step solved again.

From the annealing's potentials at the final eps the quadratic model seldom holds and the
steps crawl as the updates do (docs/guide/ot.md, "Tried on the final iterations"); from
potentials converged at :data:`START` times the blur, each halving of the blur takes a
few steps (the problem above: converged after 24 solves, from potentials converged at
blur 0.107 in 157 updates; the loss with its gradient 1.14 s, docs/guide/ot.md).
Dense linear algebra in float64 is what makes it cheap here; it is written by hand because
no library solves this dual.
"""

from __future__ import annotations

import math

import torch

from .convergence import Accuracy
from .problem import Problem

__all__: list[str] = []

#: Newton's continuation serves problems over every pair with at most this many pairs
MAX_PAIRS = 4_000_000
#: and at most this many points in y (its Hessian is (M, M), in float64)
MAX_SIDE = 2_000
#: the updates run this many iterations (the eps-scaling's included) before it may take over
AFTER = 400
#: ... and it takes over only where the marginal error then is above this many times
#: ``tol``. Updates just above tol there converge within a few dozen more: noisy spheres
#: at N = 1,000 and blur 0.01 (benchmarks/sinkhorn_family.py, two cores) took 6.7 to
#: 9.8 s when Newton's continuation started at any error above tol, 2.8 to 4.4 s with
#: this check (docs/guide/ot.md); the problems it serves are far above (200 against 150
#: points: 0.36 at tol 1e-3)
CRAWLING = 10.0
#: where y has at most ``SMALL_SIDE`` points the check comes after ``EARLY_AT`` iterations
#: instead (:func:`check_at`): there a Newton solve costs little more than an update (each
#: is a few dozen small torch calls), and the updates' final phase, hundreds of them, is
#: what a call costs. On benchmarks/sinkhorn_family.py's problems at blur 0.01 (divergence
#: and gradient, two cores), by y's size, the five problems' times summed: 150 points
#: 2.78 -> 0.70 s, 300 points 3.04 -> 1.63 s, 400 points 4.91 -> 2.75 s (the Gaussian
#: clouds 0.42 -> 0.70 s), 500 points (checked after 100) 6.35 -> 6.43 s, 1,000 points
#: (after 200) the clusters 1.64 -> 4.13 s (docs/guide/ot.md)
EARLY_AT = 30
SMALL_SIDE = 400
#: it starts from potentials converged at this many times the blur
START = 16.0
#: at most this many solves of the damped system a blur
MAX_SOLVES = 60


def applies(p: Problem, y, init, continuation: bool) -> bool:
    """Whether a solve of ``p`` falls back on Newton's continuation when the updates are
    :func:`crawling` after :func:`check_at` iterations: balanced, over every pair, two clouds,
    small (:data:`MAX_PAIRS`, :data:`MAX_SIDE`), a marginal-error ``tol`` above 0, no warm
    start, an acceleration left to otreg (a fixed over-relaxation weight asks for those
    updates), and room in ``max_iter`` (the unrolled gradient, ``continuation=False``,
    replays plain updates)."""
    return (
        y is not None
        and isinstance(p.relaxation, str)
        and init is None
        and continuation
        and p.rho is None
        and p.multiscale is None
        and not isinstance(p.tol, Accuracy)
        and p.tol > 0
        and p.max_iter > check_at(p)
        and p.x.shape[1] * p.y.shape[1] <= MAX_PAIRS
        and p.y.shape[1] <= MAX_SIDE
    )


def check_at(p: Problem) -> int:
    """The iteration at which the updates give way to Newton's continuation if they are
    :func:`crawling`: :data:`EARLY_AT` for a y of at most :data:`SMALL_SIDE` points, else
    :data:`AFTER`."""
    return EARLY_AT if p.y.shape[1] <= SMALL_SIDE else AFTER


def crawling(error: float, tol: float) -> bool:
    """Whether updates at this marginal ``error`` at :func:`check_at` give way
    to Newton's continuation (:data:`CRAWLING`)."""
    return not error <= CRAWLING * tol  # (NaN: crawling too)


def blurs(p: Problem, start: float = START) -> list[float]:
    """The eps of the start (the first of ``p.schedule`` at most ``start ** p`` times the
    final eps), then of each stage, halving the blur down to the final eps."""
    eps = next(e for e in p.schedule if e <= start**p.cost.p * p.eps)
    out = [eps]
    while eps > p.eps * (1 + 1e-9):
        eps = max(eps / 2**p.cost.p, p.eps)
        out.append(eps)
    return out


def _semi_dual(C, a, b, g, eps):
    """``(F, f, P)``: the semi-dual at g, the f it determines and the plan's rows
    normalised, for one problem: C (N, M), a (N,), b (M,), g (M,)."""
    logits = (g - C) / eps + b.log()
    f = -eps * torch.logsumexp(logits, 1)
    P = torch.exp(logits + f[:, None] / eps)
    return float((a * f).sum() + (b * g).sum()), f, P


def stage(C, a, b, g, eps: float, tol: float) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """Newton's method at one eps from g, until the marginal error sum |c - b| / sum b is
    at most ``tol`` or :data:`MAX_SOLVES` solves: ``(f, g, solves, error)``, float64."""
    m = b.shape[0]
    F, f, P = _semi_dual(C, a, b, g, eps)
    mu, solves = 1e-3, 0
    while True:
        pi = a[:, None] * P
        c = pi.sum(0)
        error = float((c - b).abs().sum() / b.sum())
        if error <= tol or solves >= MAX_SOLVES or not math.isfinite(error):
            return f, g, solves, error
        hessian = torch.diag(c) - (pi.T @ P) + float(c.mean()) * torch.ones(m, m, dtype=C.dtype)
        damping = torch.diag(c + 1e-6 * float(c.max()))
        while solves < MAX_SOLVES:
            solves += 1
            step = torch.linalg.solve(hessian + mu * damping, eps * (b - c))
            F_new, f_new, P_new = _semi_dual(C, a, b, g + step, eps)
            if F_new > F:
                g, F, f, P = g + step, F_new, f_new, P_new
                mu = max(mu / 3, 1e-9)
                break
            mu *= 10


def continuation(
    p: Problem, x, a, y, b, g, start: float = START
) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """From g (B, M), potentials converged at the first eps of :func:`blurs` (from
    ``start``), Newton's method at each of the others: ``(f, g, solves, error)``, f (B, N)
    and g (B, M) in x's dtype, the solves summed over the batch, the largest final error."""
    fs, gs, solves, worst = [], [], 0, 0.0
    wide = [t.detach().double() for t in (x, a, y, b)]
    for k in range(x.shape[0]):
        C = p.cost.dense(wide[0][k : k + 1], wide[2][k : k + 1])[0]
        gk = g[k].double()
        for eps in blurs(p, start)[1:]:
            tol = p.tol if eps == p.eps else max(p.tol, 1e-2)
            fk, gk, n, error = stage(C, wide[1][k], wide[3][k], gk, eps, tol)
            solves += n
        fs.append(fk)
        gs.append(gk)
        worst = max(worst, error) if math.isfinite(error) else math.inf
    return torch.stack(fs).to(x.dtype), torch.stack(gs).to(x.dtype), solves, worst
