r"""The Sinkhorn loop: log and scaling forms, eps-scaling, balanced and unbalanced.

Entropic OT between measures a = sum_i a_i delta_{x_i} and b = sum_j b_j delta_{y_j}:

.. math::

    \mathrm{OT}_\varepsilon(a, b) = \min_{\pi \ge 0} \langle \pi, C \rangle
        + \varepsilon \mathrm{KL}(\pi \,|\, a \otimes b)
        + \rho \mathrm{KL}(\pi 1 \,|\, a) + \rho \mathrm{KL}(\pi^T 1 \,|\, b)

(the two marginal penalties are constraints when ``reach`` is None). Its dual is

.. math::

    \max_{f, g}\; F(f) + G(g) - \varepsilon \langle a \otimes b,
        e^{(f \oplus g - C)/\varepsilon} - 1 \rangle,

with F(f) = <a, f> (balanced) or <a, rho (1 - e^{-f/rho})> (unbalanced, rho = reach ** p).
The optimal plan is pi_ij = a_i b_j exp((f_i + g_j - C_ij)/eps). Coordinate ascent on the dual
is the Sinkhorn iteration, with the damping lambda = 1 / (1 + eps/rho) in the unbalanced case:

.. math::

    f_i \leftarrow \lambda\, \mathrm{softmin}_j(\log b_j + g_j/\varepsilon)
    \qquad g_j \leftarrow \lambda\, \mathrm{softmin}_i(\log a_i + f_i/\varepsilon)

:mod:`~otreg.ot.loop` runs these updates without autograd, against a kernel (every pair, or
the multiscale truncation), with eps-scaling and Anderson mixing. This module is the public
call: it validates the inputs, solves, attaches the gradient (:mod:`~otreg.ot.gradient`)
and assembles the result (:mod:`~otreg.ot.result`).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import reductions
from .._info import sharing_cores
from ..loops.budget import within_budget
from ._uncompiled import outside_compiled_graphs
from .convergence import Accuracy
from .gradient import differentiate
from .large_blur import check_range, closed_form_applies
from .loop import closed_form_solution, solve
from .problem import (
    KEYWORD_DEFAULTS,
    Implicit,
    KeywordDefault,
    Multiscale,
    Problem,
    SinkhornOptions,
    Unroll,
    no_autocast,
    resolve_options,
    warn_default_blur,
)
from .result import SinkhornResult, make_result, report_convergence

__all__ = ["sinkhorn"]


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
        if t.dtype == p.out_dtype != like.dtype:  # half potentials of an earlier result
            t = t.to(like.dtype)
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


@outside_compiled_graphs  # (a model compiled around it runs it as it is: see SinkhornLoss)
def sinkhorn(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    blur: float = KEYWORD_DEFAULTS["blur"],
    reach: float | None = KEYWORD_DEFAULTS["reach"],
    diameter: float | None = KEYWORD_DEFAULTS["diameter"],
    scaling: float = KEYWORD_DEFAULTS["scaling"],
    cost: str = KEYWORD_DEFAULTS["cost"],
    form: str = KEYWORD_DEFAULTS["form"],
    backend: str = KEYWORD_DEFAULTS["backend"],
    tol: float | Accuracy = KEYWORD_DEFAULTS["tol"],
    max_iter: int = KEYWORD_DEFAULTS["max_iter"],
    relaxation: float | str = KEYWORD_DEFAULTS["relaxation"],
    backward: str | Implicit | Unroll = KEYWORD_DEFAULTS["backward"],
    multiscale: bool | str | Multiscale = KEYWORD_DEFAULTS["multiscale"],
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
    options: SinkhornOptions | None = None,
) -> SinkhornResult:
    """Entropic optimal transport between two weighted point clouds.

    The keyword options are the fields of :class:`~otreg.ot.problem.SinkhornOptions`, with
    the same defaults; ``options=SinkhornOptions(...)`` gives them all at once (as for
    :func:`sinkhorn_divergence` and :class:`SinkhornLoss`), a keyword given replacing that
    field (even with its default value: ``reach=None`` makes it balanced).

    Args:
        x: source points, ``(N, D)`` or batched ``(B, N, D)``.
        y: target points, ``(M, D)`` or ``(B, M, D)``.
        a: non-negative source weights ``(N,)`` or ``(B, N)``; default uniform 1/N.
        b: non-negative target weights ``(M,)`` or ``(B, M)``; default uniform 1/M.
            Balanced OT needs equal total masses.
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
        tol: stop when the relative L1 marginal error at the final eps is < tol and the
            same error weighed by how far each point's mass travels is < 5 tol (far points
            with little mass: docs/guide/ot.md); tol=0 runs exactly max_iter iterations;
            or :class:`~otreg.ot.convergence.Accuracy` ``(value, gradient)``: when the
            value's and the gradient's estimated relative errors are below these
            (``result.estimated_error`` gives them).
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
        options: all the options at once, as a :class:`~otreg.ot.problem.SinkhornOptions`;
            a keyword above that is given replaces its field.

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
    keywords = dict(
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
    given = {k: v for k, v in keywords.items() if not isinstance(v, KeywordDefault)}
    base, options = options, resolve_options(caller, options, **given)  # (checks options)
    p = Problem.build(caller, x, y, a, b, options)
    if "blur" not in given and (base is None or base.blur == KEYWORD_DEFAULTS["blur"].value):
        warn_default_blur(caller, p)  # the blur neither given nor in options
    init = check_init(caller, init, p)
    check_range(caller, p)
    budget = options.backward.memory if isinstance(options.backward, Unroll) else None
    # the budget counts from here: what the solve keeps is charged to its loop; autocast
    # (a model's mixed precision) would round the scores to half: off, the inputs are float32
    with (
        within_budget(caller, budget, p.x.device),
        no_autocast(p.x.device),
        sharing_cores(p.x.device),
    ):
        return _solve_and_differentiate(caller, p, options, init)


def _solve_and_differentiate(
    caller: str, p: Problem, options: SinkhornOptions, init
) -> SinkhornResult:
    """:func:`sinkhorn` once its problem is built: the solve, and the potentials made
    differentiable as ``options.backward`` says; each part's reductions recorded."""
    with reductions.track() as solved:
        if options.backward_kind == "envelope" and closed_form_applies(p):
            value, sol = closed_form_solution(p, debias=False)
            params = tuple(t.detach() for t in (p.x, p.y, p.a, p.b))
            return make_result(p, params, sol.f, sol.g, value, sol, True, (solved, []))
        if options.backward_kind == "unroll":
            # the unrolled gradient replays the solve's iterations with plain updates: the
            # solve runs those same updates (accelerated ones would stop earlier, and the
            # replay would then end short of the potentials returned)
            p = dataclasses.replace(p, relaxation=1.0)
        with torch.no_grad():
            sol = solve(
                p,
                *(t.detach() for t in (p.x, p.a, p.y, p.b)),
                init=init,
                continuation=options.backward_kind != "unroll",
            )
    converged = report_convergence(caller, "the solver", p, sol.n_iter, sol.rule)
    with reductions.track() as differentiated:
        value, f, g, params = differentiate(caller, p, options, sol, (p.x, p.y, p.a, p.b))
    return make_result(p, params, f, g, value, sol, converged, (solved, differentiated))
