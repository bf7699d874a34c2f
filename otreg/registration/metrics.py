"""Registration metrics: surface distances, vertex errors, Jacobian determinants, varifolds.

Nearest neighbours come from scipy's cKDTree.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..shapes import Shape
from .attachments import varifold_distance

__all__ = ["surface_distances", "vertex_error", "jacobian_determinants", "varifold_distance",
           "summary"]


def _nearest(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from scipy.spatial import cKDTree

    return cKDTree(b).query(a)[0]


def surface_distances(a: Shape, b: Shape) -> dict[str, float]:
    """Vertex-to-nearest-vertex distances both ways (mm): means and Hausdorff."""
    pa = a.points.detach().cpu().double().numpy()
    pb = b.points.detach().cpu().double().numpy()
    ab, ba = _nearest(pa, pb), _nearest(pb, pa)
    return {"mean_ab_mm": float(ab.mean()), "mean_ba_mm": float(ba.mean()),
            "mean_mm": float((ab.mean() + ba.mean()) / 2),
            "hausdorff_mm": float(max(ab.max(), ba.max()))}


def vertex_error(points: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    """|points - truth| per vertex (mm): mean, median, max."""
    d = (points.detach().double() - truth.detach().double().to(points.device)).norm(dim=1)
    return {"vertex_error_mean_mm": float(d.mean()), "vertex_error_median_mm": float(d.median()),
            "vertex_error_max_mm": float(d.max())}


def jacobian_determinants(transform: Callable[[torch.Tensor], torch.Tensor],
                          points: torch.Tensor) -> torch.Tensor:
    """det of the Jacobian of ``transform`` at each point ``(N,)`` (3 backward passes).

    ``transform`` must act on each point independently (as deformations do).
    """
    x = points.detach().double().clone().requires_grad_(True)
    y = transform(x)
    rows = []
    for k in range(y.shape[1]):
        (g,) = torch.autograd.grad(y[:, k].sum(), x, retain_graph=k < y.shape[1] - 1)
        rows.append(g)
    J = torch.stack(rows, dim=1)  # (N, out, in)
    return torch.linalg.det(J)


def summary(warped: Shape, target: Shape, jac: torch.Tensor | None = None,
            truth: torch.Tensor | None = None, sigma: float = 10.0) -> dict[str, float]:
    """The metrics a registration reports."""
    out = surface_distances(warped, target)
    if warped.n_faces and target.n_faces:
        with torch.no_grad():
            v = varifold_distance(warped.to(torch.float64), target.to(torch.float64), sigma)
        out["varifold"] = float(v)
    if jac is not None:
        out.update(jacobian_min=float(jac.min()), jacobian_max=float(jac.max()),
                   jacobian_negative_fraction=float((jac <= 0).double().mean()))
    if truth is not None:
        out.update(vertex_error(warped.points, truth))
    return out
