"""Ground costs C(x, y) for each backend, and the blur -> epsilon rule.

- ``"sqeuclidean"``: C(x, y) = |x - y|^2 / 2 (p = 2). With this halved convention the gradient
  of the OT cost with respect to x_i is a_i (x_i - T(x_i)), and the Sinkhorn divergence tends to
  W2^2 / 2 as blur -> 0 (the convention of GeomLoss).
- ``"euclidean"``: C(x, y) = |x - y| (p = 1). Its square root is smoothed at 0 by adding
  ``1e-20`` under the root, so that the gradient at x = y is 0 rather than NaN. Its squared
  distances are summed from the coordinates' differences, not through a matrix product:
  the product's rounding (u |x|^2) would sit under the root, where it becomes a distance of
  about sqrt(u) |x| between coincident points (3e-4 in float32) and a gradient of noise
  over that distance (measured before: gradients hundreds of times too large in float32).

The entropic regularisation is eps = blur ** p, in the points' units to the power p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__: list[str] = []

SQRT_FLOOR = 1e-20


def _sq_dists(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """|x_i - y_j|^2 for x (B, N, D), y (B, M, D) -> (B, N, M), through a matrix product.

    The expansion |x|^2 + |y|^2 - 2<x, y> is what BLAS does fast; it is clamped at 0 against
    rounding.
    """
    x2 = (x * x).sum(-1, keepdim=True)
    y2 = (y * y).sum(-1).unsqueeze(-2)
    return torch.baddbmm(x2 + y2, x, y.transpose(1, 2), alpha=-2.0).clamp_min_(0.0)


def squared_differences(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None):
    """|x_i - y_j|^2 for x (B, N, D), y (B, M, D) -> (B, N, M), summed coordinate by
    coordinate from the differences (exact to rounding relative to the distance; D passes
    over (B, N, M), against one matrix product for :func:`_sq_dists`); in ``out`` if given
    (no autograd then)."""
    if out is None:
        return sum((x[..., k, None] - y[..., k].unsqueeze(-2)) ** 2 for k in range(x.shape[-1]))
    out.zero_()
    diff = torch.empty_like(out)
    for k in range(x.shape[-1]):
        torch.sub(x[..., k, None], y[..., k].unsqueeze(-2), out=diff)
        out.addcmul_(diff, diff)
    return out


class _Distances(torch.autograd.Function):
    """|x_i - y_j| (smoothed at 0) from the coordinates' differences, its gradient the
    unit vectors (x_i - y_j) / |x_i - y_j| from them too, coordinate by coordinate: autograd
    through the differences would keep D matrices (B, N, M) for the backward, this keeps
    the distances only (the backward's own operations are differentiable, for a second
    derivative)."""

    @staticmethod
    def forward(ctx, x, y):
        with torch.no_grad():
            out = squared_differences(x, y).add_(SQRT_FLOOR).sqrt_()
        ctx.save_for_backward(x, y, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, y, dist = ctx.saved_tensors
        weights = grad / dist
        need_x, need_y = ctx.needs_input_grad[:2]
        gx, gy = [], []
        for k in range(x.shape[-1]):
            term = weights * (x[..., k, None] - y[..., k].unsqueeze(-2))
            if need_x:
                gx.append(term.sum(-1))
            if need_y:
                gy.append(-term.sum(-2))
        return (torch.stack(gx, -1) if need_x else None), (torch.stack(gy, -1) if need_y else None)


@dataclass(frozen=True)
class Cost:
    """A ground cost: its name, its exponent p, and a formula for each backend.

    Example:
        >>> from otreg.costs import get_cost
        >>> c = get_cost("sqeuclidean")
        >>> c.name, c.p
        ('sqeuclidean', 2)
    """

    name: str
    p: int

    def dense(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The cost matrix, ``(B, N, M)``, for x ``(B, N, D)`` and y ``(B, M, D)``."""
        if self.p == 2:
            return _sq_dists(x, y) / 2
        return _Distances.apply(x, y)

    def keops(self, x_i: Any, y_j: Any) -> Any:
        """The same formula on KeOps LazyTensors (symbolic, never stored)."""
        sq = ((x_i - y_j) ** 2).sum(-1)
        if self.p == 2:
            return sq / 2
        return (sq + SQRT_FLOOR).sqrt()


COSTS = {"sqeuclidean": Cost("sqeuclidean", 2), "euclidean": Cost("euclidean", 1)}


def get_cost(name: str | Cost, caller: str = "otreg") -> Cost:
    """The Cost of that name (``"sqeuclidean"`` or ``"euclidean"``).

    Example:
        >>> from otreg.costs import get_cost
        >>> get_cost("euclidean").p
        1
    """
    if isinstance(name, Cost):
        return name
    if name not in COSTS:
        raise ValueError(f"{caller}: cost is {name!r}; choose one of {', '.join(map(repr, COSTS))}")
    return COSTS[name]


def diameter(x: torch.Tensor, y: torch.Tensor) -> float:
    """Diagonal of the bounding box of both clouds ``(B, N, D)``: the largest distance scale.

    Example:
        >>> import torch
        >>> from otreg.costs import diameter
        >>> diameter(torch.zeros(1, 3, 2), torch.tensor([[[3.0, 4.0]]]))
        5.0
    """
    both = torch.cat([x.detach().reshape(-1, x.shape[-1]), y.detach().reshape(-1, y.shape[-1])])
    span = both.max(0).values - both.min(0).values
    return float(span.norm())


def epsilon_schedule(p: int, diameter: float, blur: float, scaling: float) -> list[float]:
    """The eps-scaling list, from ``diameter ** p`` down to ``blur ** p``.

    Each step multiplies eps by ``scaling ** p``; the list starts with ``diameter ** p`` twice
    and ends with ``blur ** p``: GeomLoss's convention, so that an iteration count here means
    the same as there. The solver then iterates at the final eps until convergence.

    Example:
        >>> from otreg.costs import epsilon_schedule
        >>> [round(e, 4) for e in epsilon_schedule(2, 1.0, 0.25, 0.5)]
        [1.0, 1.0, 0.25, 0.0625]
    """
    start, stop, step = p * math.log(diameter), p * math.log(blur), p * math.log(scaling)
    n = max(0, math.ceil((stop - start) / step))
    return [diameter**p] + [math.exp(start + k * step) for k in range(n)] + [blur**p]
