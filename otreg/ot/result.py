"""What a Sinkhorn solve returns: :class:`SinkhornResult`, assembled from a solve by
:func:`make_result`, and the convergence report (:func:`report_convergence`: whether ``tol``
was reached, and a :class:`~otreg.ConvergenceWarning` that says why not)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .._checks import ConvergenceWarning, warn
from .convergence import StoppingRule
from .loop import Solution
from .plan import TransportPlan
from .problem import RELAXATIONS, Problem, SinkhornOptions

__all__ = ["SinkhornResult"]


@dataclass
class SinkhornResult:
    """What :func:`sinkhorn` returns.

    Attributes:
        f, g: dual potentials, ``(N,)`` and ``(M,)`` or ``(B, N)`` and ``(B, M)``, detached,
            in cost units.
        cost: the entropic OT value OT_eps(a, b), ``()`` or ``(B,)``, differentiable with
            respect to the points and weights (envelope theorem); its entropic term
            included (POT's ``ot.solve(C, a, b, reg=eps).value``, not ``ot.sinkhorn2``'s
            linear part ``<pi, C>``).
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
        backend: the reduction backend that ran the solve's iterations at the final eps,
            as the reductions recorded it (``"tensorized"``, ``"blocked"``, ``"keops"``, or
            ``"multiscale"`` for the multiscale solver's truncated reductions);
            ``"closed form"`` when no reduction ran (a blur far above the data).
        gradient_backend: the backend of the one differentiable reduction that carries the
            gradient (its backward pass runs on the same backend). It can differ from
            ``backend``: a reduction that autograd records keeps its matrices for the
            backward pass, so ``auto`` switches from the dense path to the blocked one at
            fewer pairs (:data:`otreg.reductions.TENSORIZED_MAX_PAIRS_RECORDED`).
        form: ``"log"`` or ``"scaling"``.
        plan: the lazy :class:`~otreg.ot.plan.TransportPlan`.
        options: the :class:`~otreg.ot.problem.SinkhornOptions` of the solve.
        estimated_error: with ``tol=Accuracy(...)``, the estimated relative errors of the
            value and the gradient at the last check, ``{"value": ..., "gradient": ...}``
            (of OT(a, b) for a divergence); None otherwise.
        acceleration: what sped up the updates at the final eps: ``"anderson"`` (with
            the number of safeguard resets if any), ``"anderson, then over-relaxation
            after N resets"`` (the mixing failed and the loop fell back), ``"over-relaxation
            (w = ...)"``, ``"none"`` or ``"closed form"``; followed by ``"; in float64
            from iteration k (...): "`` and what accelerated the updates from there, where
            float32's rounding floor stopped them above ``tol`` and they went on in float64;
            and by ``"; from potentials converged at blur b in k iterations"`` where the
            final eps started there (every pair summed: :func:`otreg.ot.loop.halfway`).

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
    gradient_backend: str
    form: str
    stopped: str
    plan: TransportPlan = field(repr=False)
    options: SinkhornOptions | None = field(default=None, repr=False)
    acceleration: str = "none"
    estimated_error: dict[str, float] | None = None


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
        remedies = [f"a tol above {err:.2g}", "a larger blur"]
        dtype = torch.float64 if rule.promoted else p.x.dtype
        if dtype != torch.float64:
            remedies.insert(0, "float64 points")
        hint = (
            f"it stopped decreasing {rule.patience} iterations before: the "
            f"rounding floor of {dtype} at eps={p.eps:.3g}. Use "
            f"{_either(remedies)}"
        )
    elif rule.reason == "diverged" and p.relaxation not in RELAXATIONS:
        hint = (
            f"the iteration diverged at eps={p.eps:.3g} (relaxation={p.relaxation!r}): "
            "use relaxation='anderson' or a smaller fixed weight"
        )
    elif rule.reason == "diverged":
        remedies = ["a larger blur"]
        if p.form != "log":
            remedies.insert(0, "form='log'")
        if p.x.dtype != torch.float64:
            remedies.insert(0, "float64 points")
        hint = (
            f"the marginal error became NaN, infinite or absurd at eps={p.eps:.3g} in "
            f"{p.x.dtype}: use {_either(remedies)}"
        )
    else:
        hint = (
            f"above tol={p.tol:g} at eps={p.eps:.3g}: raise max_iter, or relax tol (a "
            "larger blur converges faster)"
        )
    warn(f"{head}; {hint}", ConvergenceWarning)
    return False


def _either(options: list[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return options[0] if len(options) == 1 else f"{', '.join(options[:-1])} or {options[-1]}"


def unbatch(t: torch.Tensor, batched: bool) -> torch.Tensor:
    return t if batched else t.squeeze(0)


def make_result(
    p: Problem, params, f, g, value, sol: Solution, converged: bool, ran: tuple[list, list]
):
    """The :class:`SinkhornResult` of a solve: ``params`` the (x, y, a, b) the plan is built
    on, f, g, value batched (unbatched here as the inputs were); ``ran`` the backends that
    :func:`otreg.reductions.track` recorded during the solve and during the differentiable
    step."""
    solved, differentiated = ran
    backend = solved[-1] if solved else "closed form"
    plan = TransportPlan(*params, f, g, p.eps, p.cost, p.backend, p.batched)
    return SinkhornResult(
        f=unbatch(f, p.batched).to(p.out_dtype),
        g=unbatch(g, p.batched).to(p.out_dtype),
        cost=unbatch(value, p.batched).to(p.out_dtype),
        n_iter=sol.n_iter,
        converged=converged,
        marginal_error=sol.rule.error,
        eps=p.eps,
        backend=backend,
        gradient_backend=differentiated[-1] if differentiated else backend,
        form=p.form,
        stopped=sol.rule.reason,
        plan=plan,
        options=p.options,
        acceleration=sol.acceleration,
        estimated_error=sol.rule.estimates,
    )
