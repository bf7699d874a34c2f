"""The Sinkhorn loop against a kernel, without autograd: eps-scaling, then updates at the
final eps until the stopping rule.

A *kernel* computes the two softmins: :class:`~otreg.ot.kernels.DenseKernel` over every
pair, :class:`~otreg.ot.multiscale.TruncatedKernel` over the cluster pairs its truncation
pattern keeps; the latter also describes a coarse problem, which :func:`solve` solves first
(recursively) before the kernel extrapolates its potentials. eps decreases from
``diameter ** p`` to ``blur ** p`` (one symmetric, averaged update per value, as in GeomLoss);
then alternating updates, Anderson-mixed or over-relaxed
(:mod:`~otreg.ot.convergence`), continue at the final eps until the marginal error is below
``tol``. :func:`pair_step` is one such update as a differentiable map, for the implicit and
unrolled gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from . import cells, newton
from .convergence import Accuracy, Anderson, Relaxation, StoppingRule, diverged
from .kernels import DenseKernel, form_softmin, make_kernel
from .large_blur import closed_form
from .multiscale import TruncatedKernel
from .problem import Problem

__all__: list[str] = []


def residual(
    p: Problem, eps: float, w: torch.Tensor, pot: torch.Tensor, smin: torch.Tensor
) -> torch.Tensor:
    """Relative L1 violation of the optimality condition of ``pot``, per batch, (B,).

    The plan's marginal on that side is w * exp((pot - smin)/eps); it must equal w
    (balanced) or w * exp(-pot/rho) (unbalanced).
    """
    target = 1.0 if p.rho is None else torch.exp(-pot / p.rho)
    gap = w * (torch.exp((pot - smin) / eps) - target).abs()
    err = torch.where(w > 0, gap, 0.0).sum(1)  # no mass: no condition (and no 0 * inf)
    return err / w.sum(1)


def semi_dual(p: Problem, a, b, s, g) -> torch.Tensor:
    """The dual objective at g and at the f it determines, f = lambda s with s the softmin
    of log b + g / eps over the other cloud: (B,). Balanced: <a, f> + <b, g> (the
    entropic term vanishes there)."""
    eps = p.eps
    f = p.damping(eps) * s
    mass = (a * torch.exp((f - s) / eps)).sum(1)  # <a x b, exp((f + g - C)/eps)>
    if p.rho is None:
        value = (a * f).sum(1) + (b * g).sum(1)
    else:
        value = p.rho * (
            (a * -torch.expm1(-f / p.rho)).sum(1) + (b * -torch.expm1(-g / p.rho)).sum(1)
        )
    return value - eps * (mass - a.sum(1) * b.sum(1))


def _probe(p: Problem, kernel):
    """For :class:`~otreg.ot.convergence.Accuracy`: g -> (the value (B,), its gradient with
    respect to the points (B, K)) as the caller will get them from the potential g."""

    def probe(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = kernel.softmin_xy(p.eps, g)
        with torch.enable_grad():
            leaf = s.detach().requires_grad_(True)
            value = semi_dual(p, kernel.a, kernel.b, leaf, g)
            (w,) = torch.autograd.grad(value.sum(), leaf)  # d value / d s, elementwise
        grads = kernel.softmin_gradient(p.eps, g, s, w)
        B = value.shape[0]  # the multiscale kernel's gradients are unbatched (N, D)
        return value.detach(), torch.cat([t.reshape(B, -1) for t in grads], 1)

    return probe


def gradient_weighted_error(p: Problem, kernel, transpose: bool):
    """(pot, s, other) -> the violation of the marginals on one side weighed by how far
    each point's mass travels: || delta_i w_i d_i ||_2 / || w_i d_i ||_2, with delta_i the
    relative violation of point i's marginal (as :func:`residual`'s: ``pot`` its potential,
    ``s`` the softmin of the ``other`` potential over the other cloud), w its weights,
    d_i = |x_i - T_i| and T_i the barycentre of its row of the plan (w_i (x_i - T_i) is its
    gradient for the squared distance); the largest over the batch. On the side of y with
    ``transpose``. Far points with little mass count here, not in the L1 marginal error.
    The displacements d (one barycentre reduction) are measured at the first call and
    kept: once the marginal error is below tol, they barely move."""
    w = kernel.b if transpose else kernel.a
    weights: list[torch.Tensor] = []

    def error(pot: torch.Tensor, s: torch.Tensor, other: torch.Tensor) -> float:
        eps = p.eps
        target = 1.0 if p.rho is None else torch.exp(-pot / p.rho)
        delta = torch.exp((pot - s) / eps) - target  # (B, N)
        if not weights:
            weights.append(w * kernel.displacement(eps, other, s, transpose).to(delta.dtype))
        size = weights[0]
        tiny = torch.finfo(size.dtype).tiny
        out = (delta * size).norm(dim=1) / size.norm(dim=1).clamp_min(tiny)
        return float(torch.nan_to_num(out, nan=math.inf).max())

    return error


#: a kernel that can go on in float64 (:func:`_in_float64`) does so after this many
#: updates without a new low near the rounding floor (a stall stops after
#: ``StoppingRule.PATIENCE``, 100). Measured on two noisy spheres at blur 0.01 (every
#: pair, float32, two cores): at N = 1,000 the marginal error fell by about 1% every 40
#: updates from iteration 680 to 1,030, at 1.1e-3 against tol 1e-3 (a stall at 1,032,
#: 3.3 s); at N = 600 it hovered at 1.1e-2 from iteration 700 to 1,050 and at 4.7e-3 from
#: 1,300 to 2,000 (max_iter). From float32 potentials on such a plateau the float64
#: updates reached tol in a few iterations
PROMOTE_PATIENCE = 30
#: ... and at once where, near that floor, the error would need more than this many
#: updates to reach tol at its rate of the last 20 (``StoppingRule.ahead``)
PROMOTE_AHEAD = 60


def _rule(p: Problem, kernel) -> StoppingRule:
    """The stopping rule of the final updates (an Accuracy compares values on the scale
    eps times the total mass)."""
    patience = PROMOTE_PATIENCE if kernel.promotable else StoppingRule.PATIENCE
    ahead = PROMOTE_AHEAD if kernel.promotable else None
    return StoppingRule(p.tol, p.eps * float(kernel.a.sum(1).max()), patience, ahead)


@dataclass
class Solution:
    """Potentials of one solve (caller's order, detached), the iterations, the stopping
    rule (final error and reason), the kernel (its last pattern serves the gradient) and
    what accelerated the final updates."""

    f: torch.Tensor
    g: torch.Tensor
    n_iter: int
    rule: StoppingRule
    kernel: DenseKernel | TruncatedKernel
    acceleration: str = "none"


def closed_form_solution(p: Problem, debias: bool) -> tuple[torch.Tensor, Solution]:
    """``(value, Solution)`` from the expansion in 1 / eps (:mod:`otreg.ot.large_blur`):
    no iteration, converged by construction."""
    value, f, g = closed_form(p, debias)
    rule = StoppingRule(p.tol)
    rule.error, rule.reason = 0.0, "closed form"
    kernel = DenseKernel(p, p.x.detach(), p.a.detach(), p.y.detach(), p.b.detach())
    return value, Solution(f, g, 0, rule, kernel, "closed form")


def solve(
    p: Problem,
    x,
    a,
    y=None,
    b=None,
    init=None,
    continuation: bool = True,
    newton_at: int | None = None,
) -> Solution:
    """Potentials of OT(a, b) between x and y (or of OT(a, a) when y is None), without
    autograd. ``init``: potentials (f, g), (B, N) and (B, M), to start from at the final
    eps, skipping the eps-scaling (a warm start from a nearby problem). Without one, where
    :func:`halfway` gives a problem, its converged potentials are the start
    (``continuation=False``: never; the unrolled gradient replays the plain schedule; nor
    for OT(a, a), whose averaged updates converge fast from the annealing: on five
    heavy-tailed draws of 5,000 points at blur 0.1, every pair, the half-way solves of
    OT(a, a) and OT(b, b) took 14 to 22 of a divergence's 147 to 232 softmins, and without
    them its gradient moved by 1e-5).
    A small problem over every pair whose updates are crawling after
    :func:`~otreg.ot.newton.check_at` iterations (``newton_at``: the final updates stop there,
    'crawling', where :func:`~otreg.ot.newton.crawling` says so) goes on by Newton's
    continuation (:func:`_newton`); updates near ``tol`` there go on undisturbed."""
    if newton_at is None and newton.applies(p, y, init, continuation):
        sol = solve(p, x, a, y, b, newton_at=newton.check_at(p))
        return _newton(p, x, a, y, b, sol) if sol.rule.reason == "crawling" else sol
    n_first, story, resume = 0, "", None
    first_p = halfway(p, newton_at) if continuation and init is None and y is not None else None
    if first_p is not None:
        first = solve(first_p, x, a, y, b, continuation=False)
        n_first, blur = first.n_iter, first_p.eps ** (1 / p.cost.p)
        if first.rule.reason == "diverged":  # the annealing's potentials then
            story = f"; the updates at blur {blur:.3g} diverged: from the annealing"
        else:
            resume = (first.f, first.g, len(first_p.schedule))
            story = f"; from potentials converged at blur {blur:.3g} in {n_first} iterations"
            if first.kernel.coarse_story:
                story += f" ({first.kernel.coarse_story})"
    kernel = make_kernel(p, x, a, y, b)
    f, g, n_iter = _anneal(p, kernel, init, resume)
    if first_p is None and kernel.coarse_story:
        story = f"; {kernel.coarse_story}"
    if kernel.symmetric:
        f, g, n_iter, rule, acceleration = _final_symmetric(p, kernel, f, g, n_iter + n_first)
    else:
        f, g, n_iter, rule, acceleration = _final_pair(p, kernel, f, g, n_iter + n_first, newton_at)
    f, g = f.to(x.dtype), g.to(x.dtype)  # a multiscale kernel's final softmins are float64
    kernel.finish(f, g, p.eps)
    f, g = kernel.to_caller_order(f, g)
    return Solution(f, g, n_iter, rule, kernel, acceleration + story)


def _newton(p: Problem, x, a, y, b, sol: Solution) -> Solution:
    """The solve by Newton's method along halvings of the blur (:mod:`otreg.ot.newton`),
    from potentials converged at ``newton.START`` times the blur by the updates, or at its
    square where they do not converge there (100 Gaussian points against 120 at blur 1e-3:
    the updates at 16 times the blur ran 1,000 iterations unconverged). Where neither
    start or the continuation converges, the updates go on within what is left of
    ``max_iter`` from the nearer of ``sol`` (their result where they stopped, crawling) and
    Newton's last potentials, by their marginal errors: 1,000 Gaussian points against
    1,010 at blur 0.02 stopped Newton's method at 1.3e-3 (tol 1e-3), where the updates
    had stopped at 0.013, and ran 1,567 more updates from there, unconverged (31 s)."""
    spent = sol.n_iter
    for factor in (newton.START, newton.START**2):  # a larger blur where the first fails
        stages = newton.blurs(p, factor)
        start = replace(p, schedule=[e for e in p.schedule if e >= stages[0]])
        room = min(p.max_iter // 2, p.max_iter - spent)
        first = solve(replace(start, max_iter=max(room, 1)), x, a, y, b, continuation=False)
        spent += first.n_iter
        if first.rule.converged or stages[0] == p.schedule[0]:
            break
    init, whence = (sol.f, sol.g), "the updates went on"
    if first.rule.converged and len(stages) > 1:  # (one eps: no blur left to halve)
        f, g, solves, error = newton.continuation(p, x, a, y, b, first.g, factor)
        if error <= p.tol:
            rule = _rule(p, sol.kernel)
            rule.error, rule.reason = error, "tol"
            blur = start.eps ** (1 / p.cost.p)
            story = (
                f"Newton's method ({solves} solves), from potentials converged at blur "
                f"{blur:.3g} in {first.n_iter} iterations, after {sol.n_iter} updates "
                "that had not converged"
            )
            return Solution(f, g, spent + solves, rule, sol.kernel, story)
        if error < sol.rule.error:  # (NaN, inf: not nearer)
            init = (f, g)
            whence = f"the updates went on from its potentials (marginal error {error:.2g})"
    if spent >= p.max_iter:
        sol.rule.reason = "max_iter"  # (not 'crawling': the budget is spent)
        return replace(sol, n_iter=spent)
    rest = solve(replace(p, max_iter=p.max_iter - spent), x, a, y, b, init=init)
    note = f"; Newton's method did not converge: {whence} at iteration {spent}"
    return replace(rest, n_iter=spent + rest.n_iter, acceleration=rest.acceleration + note)


#: :func:`halfway` stops the schedule at its first eps at least this many times the final
#: one (twice the blur for the squared distance)
HALFWAY = 4.0


def halfway(p: Problem, newton_at: int | None = None) -> Problem | None:
    """The problem whose converged potentials start the final eps's updates where every
    pair is summed: the schedule down to its first eps at least ``HALFWAY`` times the
    final one, and updates there until the same ``tol``, in at most half of ``max_iter``
    (of ``newton_at`` where that is smaller: the check for Newton's continuation comes
    after the final updates have had as many).
    From the annealing alone (one update an eps) the final eps's updates crawl where the
    plan is near a permutation; from potentials converged at twice the blur they need a
    few hundred. Measured (divergence with its gradient, every pair, float32, two cores,
    benchmarks/sinkhorn_family.py at N = 1,000, docs/benchmarks.md): the four sphere
    problems took 0.44 to 1.21 s instead of 1.94 to 5.83 s (202 to 430 iterations instead
    of 579 to 1,427) and the clusters against a ball 0.90 s instead of 3.76 s, gradients as
    accurate or more; 200 to 500 points at blur 0.01 used to stop at ``max_iter``. None where
    multiscale (its truncated kernel at twice the blur keeps several times as many pairs a
    point, and converging there cost more than it saved on two brain surfaces:
    docs/guide/ot.md), for a gradient-accuracy ``tol`` (:class:`Accuracy`), for ``tol=0``
    (a fixed count of iterations), for schedules with no such eps and where half of
    ``max_iter`` would not reach past it. Where it diverges, the final eps starts from the
    annealing's potentials."""
    if p.multiscale is not None or isinstance(p.tol, Accuracy) or p.tol <= 0:
        return None
    schedule = [e for e in p.schedule if e >= HALFWAY * p.eps]
    room = min(p.max_iter, newton_at or p.max_iter) // 2
    if len(schedule) < 2 or room <= len(schedule):  # no eps, or no room
        return None
    return replace(p, schedule=schedule, max_iter=room)


def _anneal(p: Problem, kernel, init, resume=None):
    """Potentials at the start of the final eps: a warm start, or the eps-scaling (after
    the kernel's coarse problem, solved by this loop, when it has one); ``resume``:
    ``(f, g, k)``, potentials converged at the schedule's k-th eps, to go on from there
    (its remaining eps one update each: a single jump of 4 to 16 times the eps made the
    symmetric updates' marginals overflow in float32)."""
    if init is not None:
        f, g = kernel.to_kernel_order(*init)
        kernel.refresh(f, g, p.eps, full=True)
        return f, g, 0
    schedule, n_iter = p.schedule, 0
    if resume is not None:
        f, g, done = resume
        f, g = kernel.to_kernel_order(f, g)
        schedule = p.schedule[done:]
    elif (started := _coarse_start(p, kernel)) is not None:
        f, g, schedule, n_iter = started
    else:
        eps, lam = p.schedule[0], p.damping(p.schedule[0])
        f = lam * kernel.softmin_xy(eps, torch.zeros_like(kernel.b))
        g = f if kernel.symmetric else lam * kernel.softmin_yx(eps, torch.zeros_like(kernel.a))
    for k, eps in enumerate(schedule):  # symmetric, averaged updates
        kernel.refresh(f, g, eps, full=k == 0)
        lam = p.damping(eps)
        f_new = lam * kernel.softmin_xy(eps, g)
        if kernel.symmetric:
            f = g = (f + f_new) / 2
        else:
            g_new = lam * kernel.softmin_yx(eps, f)
            f, g = (f + f_new) / 2, (g + g_new) / 2
        n_iter += 1
    return f, g, n_iter


def _coarse_start(p: Problem, kernel):
    """``(f, g, schedule, n_iter)`` after the kernel's coarse problem (solved by this loop,
    its potentials extended to the points): the potentials, the schedule's eps left, the
    iterations spent; None where the kernel has no coarse problem, or where a dense
    kernel's (:meth:`~otreg.ot.kernels.DenseKernel.coarse_problem`) diverged or left
    potentials that are not finite (the points' eps-scaling then starts from scratch, and
    the kernel's ``coarse_story`` is cleared)."""
    coarse = kernel.coarse_problem()
    if coarse is None:
        return None
    coarse_p, X, A, Y, B = coarse
    start = solve(coarse_p, X, A, Y, B)
    f, g = kernel.extrapolate(start.f, start.g)
    finite = bool(torch.isfinite(f).all() & torch.isfinite(g).all())
    if kernel.coarse_story and (start.rule.reason == "diverged" or not finite):
        kernel.coarse_story = ""  # (a dense kernel's cells: the multiscale solver's are its own)
        return None
    return f, g, p.schedule[len(coarse_p.schedule) :], start.n_iter


def _final_pair(p: Problem, kernel, f, g, n_iter: int, newton_at: int | None = None):
    """Alternating updates at the final eps until the rule stops (:func:`_pair_updates`);
    where they stall on float32's rounding floor above ``tol``, again in float64 from
    there (:func:`_in_float64`) or on a pair list made again (:func:`_new_list`). Also
    returns what accelerated them."""
    rule, story = _rule(p, kernel), ""
    while True:
        f, g, n_iter, acceleration = _pair_updates(p, kernel, f, g, n_iter, rule, newton_at)
        if newton_at is not None and n_iter >= newton_at:
            newton_at = None  # (checked: once)
        story += acceleration
        switch = _in_float64(rule, kernel, n_iter) or _new_list(rule, kernel, n_iter)
        if switch is None:
            return f, g, n_iter, rule, story
        story += f"; {switch}: "
        f, g = f.double(), g.double()


def _in_float64(rule: StoppingRule, kernel, n_iter: int) -> str | None:
    """Whether the final updates go on in float64 (they stalled, or crawled, on the
    rounding floor of a float32 kernel that can sum in float64, :meth:`DenseKernel.promote`;
    ``StoppingRule.ahead``): the note for
    ``result.acceleration`` from iteration ``n_iter``, or None. Measured on
    two noisy spheres at blur 0.01 (N = 1,000, every pair, two cores): float32 alone
    stalled at a marginal error of 1.04e-3 after 1,032 iterations (tol 1e-3, 3.3 s); with
    float64 from iteration 632 it converged at 659 (1.9 s; float64 throughout: 510, 2.4 s).
    """
    if rule.reason != "stalled" or not kernel.promotable:
        return None
    kernel.promote()
    rule.resume()
    rule.promoted, rule.patience, rule.ahead = True, StoppingRule.PATIENCE, None
    return f"in float64 from iteration {n_iter} (float32's rounding floor)"


def _new_list(rule: StoppingRule, kernel, n_iter: int) -> str | None:
    """Whether the final updates go on from a pair list made again at the current
    potentials (they stalled above ``tol`` on the list's rounding floor, which grows as the
    potentials move from the list's reference, :meth:`TruncatedKernel.remake_list`): the
    note for ``result.acceleration``, or None. Measured on 400 and 450 points 0.2 apart at
    blur 0.02 (tol 1e-5, float32): stalled at 1.08e-5 after 554 iterations; from a list
    made there, converged 8 iterations later."""
    if rule.reason != "stalled" or not kernel.remake_list():
        return None
    rule.resume()
    return f"its pair list made again at iteration {n_iter} (its rounding floor)"


def _go_on(rule: StoppingRule, kernel, f, g, stop: bool) -> bool:
    """Whether the updates go on after ``rule.stop`` said ``stop`` at the potentials f, g:
    where the rule says they converged, the kernel checks that it holds every pair that
    matters (``kernel.verify``: a multiscale pattern may have lost some); if it did not,
    it has gained them, and the updates go on from here. Checked at stalls and plateaus
    too, on uniform clouds in a square at a blur of a quarter of their spacing, the pairs
    gained had slacks far below zero and the updates then diverged (a marginal error of
    4.8 after 3,000 iterations where the loop had stalled at 3.6e-3)."""
    if stop and rule.reason == "tol" and not kernel.verify(f, g):
        rule.resume()
        return True
    return not stop


def _pair_updates(
    p: Problem, kernel, f, g, n_iter: int, rule: StoppingRule, newton_at: int | None = None
):
    """Alternating updates at the final eps until ``rule`` stops: extrapolated by Anderson
    mixing (``relaxation="anderson"``; over-relaxed adaptively if the mixing fails) or
    over-relaxed when w > 1. An automatic acceleration's update whose marginal error is NaN,
    infinite or above ``convergence.DIVERGED`` (an overflow in float32 far from the
    optimum: one far outlier at a small blur) is undone: the loop goes back to the best
    potentials so far and goes on with the over-relaxation (after Anderson) or half its
    weight (a weight the caller fixed is kept, and such an error stops the loop,
    'diverged'). Every ``cells.EVERY`` updates the kernel
    may take a step on its cells' constants (:meth:`TruncatedKernel.cell_step`) or on its
    far points' potentials (:meth:`DenseKernel.cell_step`), until one declines (the first
    after ``cells.FIRST_AT``; ``cells.NOT_NOW`` declines this time only); after a refresh
    or a check that gave the kernel pairs (a new map), the mixing and the best point start
    again. At iteration ``newton_at`` (None: never) the loop stops, 'crawling', where
    :func:`newton.crawling` says so. Also returns what accelerated them."""
    eps, lam = p.eps, p.damping(p.eps)
    anderson = Anderson(kernel.b, eps) if p.relaxation == "anderson" else None
    relax = Relaxation("auto" if anderson else p.relaxation)
    probe = _probe(p, kernel) if rule.accuracy is not None else None
    tails = gradient_weighted_error(p, kernel, transpose=True)
    first, best, cell_steps, stepping = n_iter, (math.inf, f, g), 0, True
    grown = kernel.patterns_grown
    while n_iter < p.max_iter:
        if n_iter > first and (n_iter - first) % kernel.refresh_every == 0:
            kernel.refresh(f, g, eps)
        if kernel.patterns_grown != grown:  # a new map: the mixing's history and best go
            grown, best = kernel.patterns_grown, (math.inf, f, g)
            if anderson is not None and not anderson.failed:
                anderson = Anderson(kernel.b, eps)
        mixing = anderson is not None and not anderson.failed
        w = 1.0 if mixing else relax.w
        f_new = lam * kernel.softmin_xy(eps, g)
        f = f_new if w == 1 else torch.lerp(f, f_new, w)
        sg = kernel.softmin_yx(eps, f)
        err = float(residual(p, eps, kernel.b, g, sg).max())
        update = lam * sg if w == 1 else torch.lerp(g, lam * sg, w)
        n_iter += 1
        if diverged(err) and (mixing or (relax.auto and w != 1)):  # undo it
            if mixing:
                anderson.failed = True  # over-relaxation from here
            else:
                relax.back_off()  # a smaller weight, or plain updates
            _, f, g = best
            continue
        if err < best[0]:
            best = (err, f.clone(), g.clone())
        stop = rule.stop(
            err,
            lambda f=f, g=update: kernel.rounding_floor(eps, f, g),
            probe and (lambda g=update: probe(g)),
            lambda g=g, sg=sg, f=f: tails(g, sg, f),
        )
        if not _go_on(rule, kernel, f, update, stop):
            g = update
            break
        if newton_at is not None and n_iter >= newton_at:
            newton_at = None
            if newton.crawling(err, p.tol):
                rule.error, rule.reason, g = err, "crawling", update
                break
        done = n_iter - first
        if stepping and (done == cells.FIRST_AT or done % cells.EVERY == 0):
            gain = cells.MIN_GAIN if cell_steps else cells.FIRST_GAIN
            # sg, not an over-relaxed update: exact; f the softmin of g unless over-relaxed
            stepped = kernel.cell_step(f, sg, gain, g if w == 1 else None)
            stepping = stepped is not None
            # a step taken: a new start (the mixing's history and the rule's track go)
            if stepping and stepped is not cells.NOT_NOW:
                (f, g), cell_steps = stepped, cell_steps + 1
                best = (math.inf, f, g)
                if mixing:
                    anderson = Anderson(kernel.b, eps)
                rule.resume()
                continue
        if mixing:
            g = anderson.step(g, update, err)
        else:
            g = update
            relax.observe(err)
    steps = f", after {cell_steps} {kernel.step_kind} step(s)" if cell_steps else ""
    return f, g, n_iter, _acceleration(p, anderson, relax) + steps


def _acceleration(p: Problem, anderson: Anderson | None, relax: Relaxation) -> str:
    """What sped up the final updates, in words, for the result."""
    backed = f", its weight halved after {relax.backed_off} overflow(s)" if relax.backed_off else ""
    if anderson is not None:
        if anderson.failed:
            why = f"{anderson.resets} resets" if anderson.resets else "an overflow"
            return f"anderson, then over-relaxation after {why} (w = {relax.w:.2f}){backed}"
        return "anderson" if not anderson.resets else f"anderson ({anderson.resets} resets)"
    if p.relaxation == "auto":
        return f"over-relaxation (w = {relax.w:.2f}){backed}"
    if relax.w == 1 and not relax.backed_off:
        return "none"
    return f"over-relaxation (w = {relax.w:.2f}, fixed){backed}"


def _final_symmetric(p: Problem, kernel, f, g, n_iter: int):
    """Averaged updates of the symmetric potential f = g at the final eps (in float64
    from a stall on float32's rounding floor, as :func:`_final_pair`)."""
    rule, note = _rule(p, kernel), ""
    while True:
        f, n_iter = _symmetric_updates(p, kernel, f, n_iter, rule)
        switch = _in_float64(rule, kernel, n_iter)
        if switch is None:
            return f, f, n_iter, rule, "averaged" + note
        note = f", {switch}"
        f = f.double()


def _symmetric_updates(p: Problem, kernel, f, n_iter: int, rule: StoppingRule):
    """Averaged updates f <- (f + softmin(f)) / 2 until ``rule`` stops."""
    eps, lam = p.eps, p.damping(p.eps)
    probe = _probe(p, kernel) if rule.accuracy is not None else None
    tails = gradient_weighted_error(p, kernel, transpose=False)
    first = n_iter
    while n_iter < p.max_iter:
        if n_iter > first and (n_iter - first) % kernel.refresh_every == 0:
            kernel.refresh(f, f, eps)
        sf = kernel.softmin_xy(eps, f)
        err = float(residual(p, eps, kernel.a, f, sf).max())
        before, f = f, (f + lam * sf) / 2
        n_iter += 1
        stop = rule.stop(
            err,
            lambda f=f: kernel.rounding_floor(eps, f),
            probe and (lambda f=f: probe(f)),
            lambda f=before, sf=sf: tails(f, sf, f),
        )
        if not _go_on(rule, kernel, f, f, stop):
            break
    return f, n_iter


def symmetric_step(p: Problem):
    """One averaged update of a self term's potential at the final eps, as a map
    f -> (f + lambda softmin(f)) / 2 with softmin over the cloud against itself.

    Its Jacobian (I - lambda P) / 2, P the plan's rows normalised, has its eigenvalues in
    [0, 1/2] (a positive definite kernel): the implicit system stays well conditioned where
    the alternating map's, P Q, has many eigenvalues near 1 (points farther apart than the
    blur: the plan is nearly the identity; 50 Gaussian points at blur 0.1 left a float32
    Hessian-vector product 447 times off).
    """
    eps, lam = p.eps, p.damping(p.eps)

    def step(f, x, a):
        return (f + lam * form_softmin(p, eps, x, x, a.log(), f, (f / lam).detach())) / 2

    return step


def pair_step(p: Problem):
    """One alternating Sinkhorn update at the final eps, as a map (f, g) -> (f, g).

    Balanced potentials are defined up to (f + c, g - c); the map fixes <a, f> = <b, g> so
    that its fixed point is isolated and the implicit system I - J^T is invertible.
    """
    eps, lam = p.eps, p.damping(p.eps)

    def step(state, x, y, a, b):
        f, g = state  # near the fixed point: the inputs estimate the softmins
        f = lam * form_softmin(p, eps, x, y, b.log(), g, (f / lam).detach())
        g = lam * form_softmin(p, eps, y, x, a.log(), f, (g / lam).detach())
        if p.rho is None:
            shift = ((a * f).sum(1) - (b * g).sum(1)) / (2 * a.sum(1))
            f, g = f - shift[:, None], g + shift[:, None]
        return f, g

    return step
