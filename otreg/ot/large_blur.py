r"""Entropic values when the blur far exceeds the data.

At eps = blur ** p much larger than the costs, the softmins' arguments (g - C) / eps fall
below the floating-point resolution of the log-weights they are added to, and each entropic
term is off by about eps * ulp * log(N): the debiased divergence, a difference of such
terms, came out wrong and even negative (blur 1e6 mm between brain surfaces: -3e4 mm^2 in
float32). Two remedies, each chosen by the ratio of eps to the data's size ** p:

- above :data:`PRECISE_FROM`, the final evaluation of each term (one reduction, the one
  that carries the gradient) runs in float64 for float32 data: the rounding of the
  float32 potentials enters that value to second order only;
- above :data:`CLOSED_FORM_FROM`, for balanced OT with the squared Euclidean cost, the
  expansion in 1 / eps (the plan tends to a x b; C~ the doubly centred cost,
  ``|C~|^2 = tr(Sa Sb)`` for the weighted means m and covariances S):

  .. math::

      \mathrm{OT}_\varepsilon(a, b) = m \big(\tfrac12 |m_a - m_b|^2
          + \tfrac12 \mathrm{tr}\,\Sigma_a + \tfrac12 \mathrm{tr}\,\Sigma_b
          - \mathrm{tr}(\Sigma_a \Sigma_b) / (2\varepsilon)\big)
          + \varepsilon (m^2 - m - m \log m) + O(\varepsilon^{-2}),

      S_\varepsilon(a, b) = m \big(\tfrac12 |m_a - m_b|^2
          + |\Sigma_a - \Sigma_b|_F^2 / (4\varepsilon)\big) + O(\varepsilon^{-2}),

  for the total mass m; its truncation error, about size ** (3p) / eps ** 2, is then below
  1e-8 size ** p, and the value is >= 0 by construction.

Unbalanced OT has no such closed form here (its limit involves fourth moments and the mass
term grows with eps); above :data:`UNBALANCED_LIMIT` it is refused with a ``ValueError``
rather than returned wrong.
"""

from __future__ import annotations

import torch

from .problem import Problem

__all__: list[str] = []

#: eps / size ** p above which float32 terms are evaluated in float64 (their rounding,
#: eps * 6e-8 * log N, would pass 1e-7 size ** p).
PRECISE_FROM = 0.1
#: eps / size ** p above which balanced squared-Euclidean values take the closed form.
CLOSED_FORM_FROM = 1e4
#: eps / size ** p above which unbalanced values are lost to rounding (blur 1000 times the
#: data's size for the squared Euclidean cost): refused.
UNBALANCED_LIMIT = 1e6


def _ratio(p: Problem) -> float:
    scale = p.size**p.cost.p
    return 0.0 if scale == 0 else p.eps / scale  # all points equal: every cost is 0, exact


def precise_value(p: Problem, dtype: torch.dtype) -> bool:
    """Whether the final evaluation of a term should run in float64."""
    return dtype != torch.float64 and _ratio(p) > PRECISE_FROM


def check_range(caller: str, p: Problem) -> None:
    """Refuse unbalanced problems whose blur is so far above the data that no floating-point
    evaluation holds (:data:`UNBALANCED_LIMIT`)."""
    if p.rho is not None and _ratio(p) > UNBALANCED_LIMIT:
        blur = p.eps ** (1 / p.cost.p)
        raise ValueError(
            f"{caller}: blur is {blur:.3g}, {blur / p.size:.3g} times the data's size "
            f"({p.size:.3g}); unbalanced entropic OT (reach={p.rho ** (1 / p.cost.p):.3g}) "
            "is lost to rounding that far above the data. Use a blur at most "
            f"{UNBALANCED_LIMIT ** (1 / p.cost.p):.3g} times the size, or reach=None "
            "(balanced OT has a closed form there)"
        )


def closed_form_applies(p: Problem) -> bool:
    """Whether the values are those of the expansion in 1 / eps (balanced, squared
    Euclidean cost, eps above :data:`CLOSED_FORM_FROM` size ** 2)."""
    return p.rho is None and p.cost.name == "sqeuclidean" and _ratio(p) > CLOSED_FORM_FROM


def _moments(x: torch.Tensor, a: torch.Tensor):
    """Total mass (B,), weighted mean (B, D) and covariance (B, D, D) of (x, a)."""
    mass = a.sum(1)
    w = a / mass[:, None]
    mean = (w[:, :, None] * x).sum(1)
    c = x - mean[:, None, :]
    cov = torch.einsum("bn,bni,bnj->bij", w, c, c)
    return mass, mean, cov


def _trace(s: torch.Tensor) -> torch.Tensor:
    return torch.diagonal(s, dim1=1, dim2=2).sum(1)


def closed_form(p: Problem, debias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(value (B,), f (B, N), g (B, M))``: the divergence (or OT_eps(a, b) when not
    ``debias``), differentiable in the points and weights, and the potentials of
    OT_eps(a, b) to first order in 1 / eps (detached)."""
    eps = p.eps
    mass, ma, sa = _moments(p.x, p.a)
    _, mb, sb = _moments(p.y, p.b)
    shift = 0.5 * ((ma - mb) ** 2).sum(1)
    ta, tb = _trace(sa), _trace(sb)
    if debias:
        value = mass * (shift + ((sa - sb) ** 2).sum((1, 2)) / (4 * eps))
    else:
        cross = (sa * sb).sum((1, 2))
        value = mass * (shift + 0.5 * (ta + tb) - cross / (2 * eps))
        value = value + eps * (mass**2 - mass - mass * torch.log(mass))
    with torch.no_grad():  # f_i = sum_j b_j C_ij - <a x b, C> / 2, and g alike (normalised)
        ta, tb, shift = ta.detach(), tb.detach(), shift.detach()
        half = 0.5 * (shift + 0.5 * (ta + tb))
        f = 0.5 * (((p.x - mb[:, None]) ** 2).sum(2) + tb[:, None]) - half[:, None]
        g = 0.5 * (((p.y - ma[:, None]) ** 2).sum(2) + ta[:, None]) - half[:, None]
    return value, f.detach(), g.detach()
