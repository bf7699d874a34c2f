"""The Sinkhorn loop: log and scaling forms, eps-scaling, balanced and unbalanced.

Entropic OT between measures a = sum_i a_i delta_{x_i} and b = sum_j b_j delta_{y_j}:

.. math::

    \\mathrm{OT}_\\varepsilon(a, b) = \\min_{\\pi \\ge 0} \\langle \\pi, C \\rangle
        + \\varepsilon \\mathrm{KL}(\\pi \\,|\\, a \\otimes b)
        + \\rho \\mathrm{KL}(\\pi 1 \\,|\\, a) + \\rho \\mathrm{KL}(\\pi^T 1 \\,|\\, b)

(the two marginal penalties are constraints when ``reach`` is None). Its dual is

.. math::

    \\max_{f, g}\\; F(f) + G(g) - \\varepsilon \\langle a \\otimes b,
        e^{(f \\oplus g - C)/\\varepsilon} - 1 \\rangle,

with F(f) = <a, f> (balanced) or <a, rho (1 - e^{-f/rho})> (unbalanced, rho = reach ** p).
The optimal plan is pi_ij = a_i b_j exp((f_i + g_j - C_ij)/eps). Coordinate ascent on the dual
is the Sinkhorn iteration, with the damping lambda = 1 / (1 + eps/rho) in the unbalanced case:

.. math::

    f_i \\leftarrow \\lambda\\, \\mathrm{softmin}_j(\\log b_j + g_j/\\varepsilon)
    \\qquad g_j \\leftarrow \\lambda\\, \\mathrm{softmin}_i(\\log a_i + f_i/\\varepsilon)

:mod:`~otreg.ot.loop` runs these updates without autograd, against a kernel (every pair, or
the multiscale truncation), with eps-scaling and Anderson mixing. This module is the public
call: it validates the inputs, solves, and attaches the gradient.

Gradients (envelope theorem): with g detached, f = lambda softmin(g) is recomputed by one
differentiable reduction and the dual objective evaluated at (f, g); its gradient is
sum_j pi_ij grad C(x_i, y_j) for the points and the partial derivatives for the weights.
No iteration is stored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .. import reductions
from .._checks import ConvergenceWarning, warn
from ..loops.budget import within_budget
from .convergence import StoppingRule
from .kernels import DenseKernel
from .large_blur import check_range, closed_form_applies, precise_value
from .loop import Solution, closed_form_solution, pair_step, semi_dual, solve
from .multiscale import TruncatedKernel
from .plan import TransportPlan
from .problem import (
    _UNSET,
    RELAXATIONS,
    Accuracy,
    Implicit,
    Multiscale,
    Problem,
    SinkhornOptions,
    Unroll,
    _legacy_options,
    resolve_options,
)

__all__ = [
    "sinkhorn",
    "SinkhornResult",
    "dual_value",
    "report_convergence",
    "check_init",
    "make_result",
    "unbatch",
]


@dataclass
class SinkhornResult:
    """What :func:`sinkhorn` returns.

    Attributes:
        f, g: dual potentials, ``(N,)`` and ``(M,)`` or ``(B, N)`` and ``(B, M)``, detached,
            in cost units.
        cost: the entropic OT value OT_eps(a, b), ``()`` or ``(B,)``, differentiable with
            respect to the points and weights (envelope theorem).
        n_iter: iterations run, the eps-scaling ones included.
        converged: whether the marginal error fell below ``tol``.
        stopped: why the loop at the final eps stopped
            (:class:`~otreg.ot.convergence.StoppingRule`): ``"tol"`` (converged),
            ``"stalled"`` (the error stopped decreasing: the dtype's rounding floor),
            ``"diverged"`` (a non-finite error) or ``"max_iter"``.
        marginal_error: relative L1 violation of the optimality (marginal) conditions, the
            largest over the batch; NaN when no iteration ran at the final eps (max_iter
            spent on the eps-scaling).
        eps: the final entropic regularisation ``blur ** p``.
        backend: the reduction backend that ran (``"auto"`` resolved), ``"multiscale"``
            when the multiscale solver's truncated reductions did (the plan's own reductions
            then use the dense backend ``auto`` picks).
        form: ``"log"`` or ``"scaling"``.
        plan: the lazy :class:`~otreg.ot.plan.TransportPlan`.
        options: the :class:`~otreg.ot.problem.SinkhornOptions` of the solve.
        estimated_error: with ``tol=Accuracy(...)``, the estimated relative errors of the
            value and the gradient at the last check, ``{"value": ..., "gradient": ...}``
            (of OT(a, b) for a divergence); None otherwise.
        acceleration: what sped up the updates at the final eps: ``"anderson"`` (with
            the number of safeguard resets if any), ``"anderson, then over-relaxation
            after N resets"`` (the mixing failed and the loop fell back), ``"over-relaxation
            (w = ...)"``, ``"none"`` or ``"closed form"``.

    Example:
        >>> import torch, otreg
        >>> res = otreg.sinkhorn(torch.rand(50, 2), torch.rand(60, 2), blur=0.1)
        >>> res.stopped, res.marginal_error < res.options.tol
        ('tol', True)
    """

    f: torch.Tensor
    g: torch.Tensor
    cost: torch.Tensor
    n_iter: int
    converged: bool
    marginal_error: float
    eps: float
    backend: str
    form: str
    stopped: str
    plan: TransportPlan = field(repr=False)
    options: SinkhornOptions | None = field(default=None, repr=False)
    acceleration: str = "none"
    estimated_error: dict[str, float] | None = None


def dual_value(p: Problem, x, y, a, b, g, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """The semi-dual objective at a fixed (detached) g: ``(value (B,), f (B, N) detached)``.

    f = lambda softmin(g) is the exact maximiser of the dual over f for this g, computed by one
    differentiable reduction (``kernel.differentiable_softmin``) that carries the dependence
    on x and y. By the envelope theorem the gradient of the value is that of OT_eps at
    convergence: sum_j pi_ij grad C(x_i, y_j) for the points, the potentials for the
    weights. Away from convergence it is the gradient for the plan whose rows have the right
    marginal, which is more accurate than evaluating the dual at both iterates.
    """
    if precise_value(p, x.dtype) and not isinstance(kernel, TruncatedKernel):
        # blur far above the data: float32 rounding would swamp the value (large_blur.py)
        wide = DenseKernel(
            p, *(t.detach().double() for t in (kernel.x, kernel.a, kernel.y, kernel.b))
        )
        value, f = dual_value(p, *(t.double() for t in (x, y, a, b, g)), wide)
        return value.to(x.dtype), f.to(x.dtype)
    s = kernel.differentiable_softmin(x, y, b.detach(), g, p.eps)  # (B, N)
    f = p.damping(p.eps) * s
    value = semi_dual(p, a, b, s, g)
    if b.requires_grad:
        path = weight_path(p, f.detach(), g, kernel, b.detach())
        value = value + (path * (b - b.detach())).sum(1)
    return value, f.detach()


def weight_path(p: Problem, f, g, kernel, b) -> torch.Tensor:
    """sum_i (d value / d s_i)(d s_i / d b_j), (B, M): the weights' share of the gradient that
    runs through the softmin s (which is computed with b detached).

    Autograd would give it as softmax_ij / b_j, 0 * inf = NaN where b_j = 0; the exact value
    is finite there: d s_i / d b_j = -eps exp((g_j - C_ij + s_i) / eps), and weighted by
    d value / d s_i = a_i exp((f_i - s_i) / eps) (balanced: a_i) it sums to
    -eps exp((g_j - t_j) / eps) with t = softmin over x of log a + f / eps, one reduction.
    Where b_j = 0 the solver never fixes g_j (no mass constrains it) and (g_j - t_j) / eps
    can overflow (0 * inf = NaN in the value): there g_j is taken as the update defines it,
    g_j = damping * t_j.
    """
    with torch.no_grad():
        fk, gk = kernel.to_kernel_order(f, g)
        _, t = kernel.to_caller_order(fk, kernel.softmin_yx(p.eps, fk))
        g = torch.where(b > 0, g, p.damping(p.eps) * t)
        return -p.eps * torch.exp((g - t) / p.eps)


def report_convergence(caller: str, what: str, p: Problem, n_iter: int, rule: StoppingRule) -> bool:
    """Whether ``tol`` was reached; if not, a ConvergenceWarning that says why (none for
    ``tol=0``: a fixed iteration count was asked for)."""
    err = rule.error
    if rule.converged or (rule.accuracy is None and err < p.tol):
        return True
    if p.tol == 0:
        return False
    head = f"{caller}: {what} stopped after {n_iter} iterations with marginal error {err:.3g}"
    if rule.accuracy is not None and rule.reason == "max_iter":
        est = rule.estimates or {"value": math.inf, "gradient": math.inf}
        warn(
            f"{caller}: {what} stopped after {n_iter} iterations with estimated errors "
            f"{est['value']:.2g} (value) and {est['gradient']:.2g} (gradient), above "
            f"{p.tol}: raise max_iter, or relax the accuracy (a larger blur converges "
            "faster)",
            ConvergenceWarning,
        )
        return False
    if math.isnan(err) and rule.reason != "diverged":
        head = f"{caller}: {what} stopped after {n_iter} iterations"
        hint = (
            "the eps-scaling used all of max_iter, so the marginal error was not measured; "
            "raise max_iter"
        )
    elif rule.reason == "stalled":
        hint = (
            f"it stopped decreasing {StoppingRule.PATIENCE} iterations before: the "
            f"rounding floor of {p.x.dtype} at eps={p.eps:.3g}. Use float64 points, a "
            f"tol above {err:.2g}, or a larger blur"
        )
    elif rule.reason == "diverged" and p.relaxation not in RELAXATIONS:
        hint = (
            f"the iteration diverged at eps={p.eps:.3g} (relaxation={p.relaxation!r}): "
            "use relaxation='anderson' or a smaller fixed weight"
        )
    elif rule.reason == "diverged":
        hint = (
            f"the marginal error became NaN or infinite at eps={p.eps:.3g} in "
            f"{p.x.dtype}: use float64 points, form='log' or a larger blur"
        )
    else:
        hint = (
            f"above tol={p.tol:g} at eps={p.eps:.3g}: raise max_iter, or relax tol (a "
            "larger blur converges faster)"
        )
    warn(f"{head}; {hint}", ConvergenceWarning)
    return False


def check_init(caller: str, init, p: Problem):
    """Validate warm-start potentials (f, g); return them batched and detached, or None."""
    if init is None:
        return None
    if not (isinstance(init, (tuple, list)) and len(init) == 2):
        raise TypeError(
            f"{caller}: init must be a pair of potentials (f, g), got {type(init).__name__}"
        )
    out = []
    for name, t, like in (("f", init[0], p.a), ("g", init[1], p.b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{caller}: init's {name} must be a tensor, got {type(t).__name__}")
        t = t.detach()
        t = t if p.batched else t.unsqueeze(0)
        if t.shape != like.shape:
            raise ValueError(
                f"{caller}: init's {name} has shape "
                f"{tuple(t.shape[1 - p.batched :])} but the weights have "
                f"{tuple(like.shape[1 - p.batched :])}"
            )
        if t.dtype != like.dtype or t.device != like.device:
            raise TypeError(
                f"{caller}: init's {name} is {t.dtype} on {t.device} but the "
                f"points are {like.dtype} on {like.device}"
            )
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{caller}: init's {name} has NaN or infinite values")
        out.append(t)
    return tuple(out)


def unbatch(t: torch.Tensor, batched: bool) -> torch.Tensor:
    return t if batched else t.squeeze(0)


def backend_used(p: Problem) -> str:
    """The dense backend ``auto`` resolves to for this problem's size and device."""
    pairs = p.x.shape[0] * p.x.shape[1] * p.y.shape[1]
    return reductions.resolve_backend(p.backend, pairs, p.x.device, dtype=p.x.dtype)


def sinkhorn(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    blur: float = 0.05,
    reach: float | None = None,
    diameter: float | None = None,
    scaling: float = 0.5,
    cost: str = "sqeuclidean",
    form: str = "log",
    backend: str = "auto",
    tol: float | Accuracy = 1e-3,
    max_iter: int = 1000,
    relaxation: float | str = "anderson",
    backward: str | Implicit | Unroll = "envelope",
    multiscale: bool | str | Multiscale = "auto",
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
    strategy=_UNSET,
    memory=_UNSET,
    truncate=_UNSET,
    cluster_scale=_UNSET,
) -> SinkhornResult:
    """Entropic optimal transport between two weighted point clouds.

    The keyword options are the fields of :class:`~otreg.ot.problem.SinkhornOptions`, with
    the same defaults.

    Args:
        x: source points, ``(N, D)`` or batched ``(B, N, D)``.
        y: target points, ``(M, D)`` or ``(B, M, D)``.
        a, b: non-negative weights ``(N,)``/``(M,)`` or ``(B, N)``/``(B, M)``; default
            uniform 1/N and 1/M. Balanced OT needs equal total masses.
        blur: the final length scale, in the points' units; eps = blur ** p.
        reach: unbalanced OT with KL marginal penalties of strength rho = reach ** p;
            ``None`` (default) for balanced OT.
        diameter: the largest distance, which starts the eps-scaling; default: the diagonal
            of the bounding box of both clouds.
        scaling: eps is multiplied by ``scaling ** p`` at each annealing step, in (0, 1).
        cost: ``"sqeuclidean"`` (``|x - y|^2 / 2``, p = 2) or ``"euclidean"`` (``|x - y|``, p = 1).
        form: ``"log"`` (log-sum-exp, stable at any eps) or ``"scaling"`` (u = a / K v, faster
            per iteration, but exp(-C/eps) underflows at small eps: it then raises
            ``FloatingPointError`` naming the log form rather than switching silently).
        backend: ``"auto"``, ``"keops"``, ``"tensorized"`` or ``"blocked"`` (see
            :mod:`otreg.reductions`).
        tol: stop when the relative L1 marginal error at the final eps is < tol (tol=0 runs
            exactly max_iter iterations); or :class:`~otreg.ot.problem.Accuracy`
            ``(value, gradient)``: when the value's and the gradient's estimated relative
            errors are below these (``result.estimated_error`` gives them).
        max_iter: the most iterations in all, the eps-scaling ones included.
        relaxation: how the updates at the final eps are accelerated: the same fixed
            point, reached in far fewer iterations when plain updates crawl (balanced OT at
            a blur much smaller than the data). ``"anderson"`` (default): Anderson mixing of
            the last 24 updates, safeguarded, falling back to ``"auto"`` if it fails
            (:class:`~otreg.ot.convergence.Anderson`; 2-3x fewer iterations than
            ``"auto"`` where measured). ``"auto"``: over-relaxation
            f <- (1 - w) f + w softmin(g) (Thibault et al. 2017; Lehmann et al. 2021), w
            starting at 1 and following the measured convergence rate towards the optimal
            weight (:class:`~otreg.ot.convergence.Relaxation`); a number in [1, 2) fixes w
            (1: plain Sinkhorn). ``result.acceleration`` says what ran.
        backward: how gradients are obtained. ``"envelope"`` (default): of ``cost`` only, by
            the envelope theorem, at the memory of one reduction; ``f``, ``g`` and ``plan``
            are detached. ``"implicit"`` or :class:`~otreg.ot.problem.Implicit`: ``f`` and
            ``g`` themselves are differentiable (implicit function theorem at the fixed
            point, solved matrix-free), and so are the plan's products, e.g. for a loss on
            the plan. ``"unroll"`` or :class:`~otreg.ot.problem.Unroll` ``(strategy,
            memory)``: autograd through the iterations at the final eps (the annealing gives
            the warm start), run by :func:`otreg.loops.iterate` with that strategy; these
            are plain updates (``relaxation`` does not apply).
        multiscale: solve coarse-to-fine with truncated kernels
            (:mod:`otreg.ot.multiscale`): the eps-scaling starts on grid clusters, then each
            reduction sums only over the pairs of clusters that can matter. ``"auto"``
            (default) turns it on for one problem (no batch) in 1 to 3 dimensions with the
            squared Euclidean cost, the log form, the envelope backward, N * M >= 4e6 and a
            blur below half the cluster scale; ``True`` or
            :class:`~otreg.ot.problem.Multiscale` ``(truncate, cluster_scale)`` requires it
            (``ValueError`` naming what does not fit), ``False`` sums over every pair.
        init: potentials ``(f, g)`` of a nearby problem (e.g. ``(res.f, res.g)`` of the
            previous step of an optimisation), shaped like a and b: the solver starts from
            them at the final eps, without the eps-scaling (a warm start).
        strategy, memory, truncate, cluster_scale: deprecated spellings of
            ``Unroll(strategy, memory)`` and ``Multiscale(truncate, cluster_scale)``.

    Returns:
        :class:`SinkhornResult`. Warns :class:`~otreg.ConvergenceWarning` when ``tol`` is
        not reached; ``result.converged`` says it too.

    Example:
        >>> import torch, otreg
        >>> x, y = torch.rand(200, 3), torch.rand(300, 3)
        >>> res = otreg.sinkhorn(x, y, blur=0.1)
        >>> res.converged, tuple(res.f.shape), tuple(res.g.shape)
        (True, (200,), (300,))
    """
    caller = "sinkhorn"
    backward, multiscale = _legacy_options(
        caller, backward, multiscale, strategy, memory, truncate, cluster_scale
    )
    options = resolve_options(
        caller,
        blur=blur,
        reach=reach,
        diameter=diameter,
        scaling=scaling,
        cost=cost,
        form=form,
        backend=backend,
        tol=tol,
        max_iter=max_iter,
        relaxation=relaxation,
        backward=backward,
        multiscale=multiscale,
    )
    p = Problem.build(caller, x, y, a, b, options)
    init = check_init(caller, init, p)
    check_range(caller, p)
    budget = options.backward.memory if isinstance(options.backward, Unroll) else None
    # the budget counts from here: what the solve keeps is charged to its loop
    with within_budget(caller, budget, p.x.device):
        return solve_and_differentiate(caller, p, options, init)


def solve_and_differentiate(caller: str, p: Problem, options, init) -> SinkhornResult:
    """:func:`sinkhorn` once its problem is built: the solve, and the potentials made
    differentiable as ``options.backward`` says."""
    if options.backward_kind == "envelope" and closed_form_applies(p):
        value, sol = closed_form_solution(p, debias=False)
        params = tuple(t.detach() for t in (p.x, p.y, p.a, p.b))
        return make_result(p, params, sol.f, sol.g, value, sol, True)
    detached = tuple(t.detach() for t in (p.x, p.a, p.y, p.b))
    if options.backward_kind == "unroll":
        # the unrolled gradient replays the solve's iterations with plain updates: the
        # solve runs those same updates (accelerated ones would stop earlier, and the
        # replay would then end short of the potentials returned)
        p = dataclasses.replace(p, relaxation=1.0)
    with torch.no_grad():
        sol = solve(p, *detached, init=init)
    converged = report_convergence(caller, "the solver", p, sol.n_iter, sol.rule)
    params = (p.x, p.y, p.a, p.b)
    kind = options.backward_kind
    if kind == "envelope":
        value, f = dual_value(p, *params, sol.g, sol.kernel)
        g = sol.g
        params = tuple(t.detach() for t in params)
    else:
        from ..loops import iterate
        from ..loops.fixed_point import implicit

        step = pair_step(p)
        if kind == "implicit":
            settings = options.backward if isinstance(options.backward, Implicit) else Implicit()
            f, g = implicit(
                step,
                step((sol.f, sol.g), *params),
                params,
                tol=settings.tol,
                max_iter=settings.max_iter,
            )
        else:  # unroll the iterations at the final eps, from the annealed warm start
            settings = options.backward if isinstance(options.backward, Unroll) else Unroll()
            with torch.no_grad():
                warm = solve(dataclasses.replace(p, max_iter=len(p.schedule), tol=0.0), *detached)
            f, g = iterate(
                step,
                (warm.f, warm.g),
                max(1, sol.n_iter - len(p.schedule)),
                params,
                strategy=settings.strategy,
                memory=settings.memory,
            )
        value, _ = dual_value(p, *params, g, DenseKernel(p, p.x, p.a, p.y, p.b))
    return make_result(p, params, f, g, value, sol, converged)


def make_result(p: Problem, params, f, g, value, sol: Solution, converged: bool):
    """The :class:`SinkhornResult` of a solve: ``params`` the (x, y, a, b) the plan is built
    on, f, g, value batched; unbatched here as the inputs were."""
    backend = backend_used(p)
    plan = TransportPlan(*params, f, g, p.eps, p.cost, backend, p.batched)
    return SinkhornResult(
        f=unbatch(f, p.batched),
        g=unbatch(g, p.batched),
        cost=unbatch(value, p.batched),
        n_iter=sol.n_iter,
        converged=converged,
        marginal_error=sol.rule.error,
        eps=p.eps,
        backend="multiscale" if p.multiscale else backend,
        form=p.form,
        stopped=sol.rule.reason,
        plan=plan,
        options=p.options,
        acceleration=sol.acceleration,
        estimated_error=sol.rule.estimates,
    )
