"""The debiased Sinkhorn divergence and the ``SinkhornLoss`` module.

.. math::

    S_\\varepsilon(a, b) = \\mathrm{OT}_\\varepsilon(a, b)
        - \\tfrac12 \\mathrm{OT}_\\varepsilon(a, a) - \\tfrac12 \\mathrm{OT}_\\varepsilon(b, b)
        + \\tfrac{\\varepsilon}{2} (m(a) - m(b))^2

is >= 0, 0 if and only if a = b, and tends to the unregularised OT cost as blur -> 0
(Feydy et al., AISTATS 2019; the mass term is that of Séjourné et al., 2019, for unbalanced
OT; it is 0 in the balanced case). Each term is the dual objective at its detached,
converged potentials, so gradients come from the envelope theorem, with no stored iteration.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import reductions as R
from .plan import TransportPlan
from .sinkhorn import (
    SinkhornResult,
    _dual_value,
    _solve_pair,
    _solve_self,
    _unbatch,
    _validate,
    _warn_if_unconverged,
)

__all__ = ["sinkhorn_divergence", "SinkhornLoss"]


def _fits(t, like) -> bool:
    return t is not None and t.shape == like.shape and t.dtype == like.dtype and \
        t.device == like.device


def _divergence(fn: str, x, y, a, b, *, debias: bool = True, warm: dict | None = None,
                **options):
    """(value, cross SinkhornResult) for the debiased divergence or the plain OT cost.

    ``warm``: a dict of the potentials of a previous call (``f``, ``g``, ``f_aa``, ``g_bb``),
    used as warm starts where their shapes fit (skipping the eps-scaling) and updated.
    """
    p = _validate(fn, x, y, a, b, **options)
    if options.get("backward", "envelope") != "envelope":
        raise ValueError(f"{fn}: backward is {options['backward']!r}; the divergence's "
                         "gradient is exact with 'envelope'. For differentiable potentials "
                         "use otreg.sinkhorn(..., backward='implicit')")
    xd, yd, ad, bd = p.x.detach(), p.y.detach(), p.a.detach(), p.b.detach()
    w = {} if warm is None else warm
    with torch.no_grad():
        init = (w["f"], w["g"]) if _fits(w.get("f"), ad) and _fits(w.get("g"), bd) else None
        f, g, n_iter, rule, ms = _solve_pair(p, xd, yd, ad, bd, init)
        if debias:
            f_aa, n_aa, rule_aa, ms_aa = _solve_self(p, xd, ad, w["f_aa"] if _fits(
                w.get("f_aa"), ad) else None)
            g_bb, n_bb, rule_bb, ms_bb = _solve_self(p, yd, bd, w["g_bb"] if _fits(
                w.get("g_bb"), bd) else None)
            w.update(f_aa=f_aa, g_bb=g_bb)
        w.update(g=g)
    cross, f = _dual_value(p, p.x, p.y, p.a, p.b, g, ms)
    w["f"] = f
    value = cross
    converged = _warn_if_unconverged(fn, "OT(a, b)", p, n_iter, rule)
    if debias:
        value = value - 0.5 * (_dual_value(p, p.x, p.x, p.a, p.a, f_aa, ms_aa)[0]
                               + _dual_value(p, p.y, p.y, p.b, p.b, g_bb, ms_bb)[0])
        value = value + p.eps / 2 * (p.a.sum(1) - p.b.sum(1)) ** 2
        converged &= _warn_if_unconverged(fn, "OT(a, a)", p, n_aa, rule_aa)
        converged &= _warn_if_unconverged(fn, "OT(b, b)", p, n_bb, rule_bb)
    backend = R.resolve_backend(p.backend, p.x.shape[0] * p.x.shape[1] * p.y.shape[1],
                                p.x.device)
    plan = TransportPlan(xd, yd, ad, bd, f, g, p.eps, p.cost, backend, p.batched)
    result = SinkhornResult(
        f=_unbatch(f, p.batched), g=_unbatch(g, p.batched), cost=_unbatch(cross, p.batched),
        n_iter=n_iter,
        converged=converged, marginal_error=rule.error, eps=p.eps,
        backend="multiscale" if p.multiscale else backend, form=p.form,
        stopped=rule.reason, plan=plan)
    return _unbatch(value, p.batched), result


def sinkhorn_divergence(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    **options,
) -> torch.Tensor:
    """The debiased Sinkhorn divergence S_eps(a, b) >= 0 between two weighted point clouds.

    Args:
        x, y, a, b: as in :func:`otreg.sinkhorn`.
        **options: the keyword options of :func:`otreg.sinkhorn` (blur, reach, diameter,
            scaling, cost, form, backend, tol, max_iter, backward, relaxation, multiscale,
            truncate, cluster_scale).

    Returns:
        ``()`` or ``(B,)``, in cost units (mm^2 / 2 for points in mm and the default cost),
        differentiable with respect to the points and the weights.
    """
    return _divergence("sinkhorn_divergence", x, y, a, b, debias=True, **options)[0]


class SinkhornLoss(nn.Module):
    """OT between point clouds as a differentiable loss.

    ``loss(x, y)`` or ``loss(a, x, b, y)`` returns the debiased Sinkhorn divergence
    (``debias=True``) or the entropic OT cost OT_eps(a, b) (``debias=False``), ``()`` or
    ``(B,)``. The last solve's :class:`~otreg.ot.sinkhorn.SinkhornResult` (iterations,
    convergence, backend, plan) is kept in ``loss.last_result``.

    Args:
        blur, reach: as in :func:`otreg.sinkhorn`.
        debias: subtract the self-transport terms (a divergence: 0 for equal inputs).
        warm_start: start each call's solves from the previous call's potentials (when the
            sizes match), at the final eps without the eps-scaling. In an optimisation loop
            the points move little between calls and fewer iterations reach ``tol`` (86 -> 46
            in the user guide's example). Call :meth:`reset` when the problem changes.
        **options: the other keyword options of :func:`otreg.sinkhorn`.
    """

    def __init__(self, blur: float = 0.05, reach: float | None = None, debias: bool = True,
                 warm_start: bool = False, **options) -> None:
        super().__init__()
        if not isinstance(debias, bool):
            raise TypeError(f"SinkhornLoss: debias must be True or False, got {debias!r}")
        if not isinstance(warm_start, bool):
            raise TypeError(f"SinkhornLoss: warm_start must be True or False, got "
                            f"{warm_start!r}")
        self.warm_start = warm_start
        self._warm: dict = {}
        self.options = dict(blur=blur, reach=reach, **options)
        self.debias = debias
        # Validate the options now, on a tiny problem, rather than at the first call.
        probe = torch.zeros(1, 1)
        _validate("SinkhornLoss", probe, probe, None, None, **self.options)
        self.last_result: SinkhornResult | None = None

    def extra_repr(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{opts}, debias={self.debias}, warm_start={self.warm_start}"

    def reset(self) -> None:
        """Forget the potentials kept for warm starts."""
        self._warm = {}

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if len(args) == 2:
            (x, y), a, b = args, None, None
        elif len(args) == 4:
            a, x, b, y = args
        else:
            raise TypeError(f"SinkhornLoss: call it as loss(x, y) or loss(a, x, b, y), got "
                            f"{len(args)} arguments")
        warm = self._warm if self.warm_start else None
        value, self.last_result = _divergence("SinkhornLoss", x, y, a, b, debias=self.debias,
                                              warm=warm, **self.options)
        return value
