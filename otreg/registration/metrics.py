"""Registration metrics: surface distances, vertex errors, Jacobian determinants, varifolds.

Nearest vertices come from scipy's cKDTree, nearest surface points from VTK (pyvista).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..shapes import Shape
from .losses import make_loss, varifold_distance

__all__ = [
    "surface_distances",
    "point_to_surface_distances",
    "vertex_error",
    "jacobian_determinants",
    "varifold_distance",
    "summary",
]


def _nearest(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from scipy.spatial import cKDTree

    return cKDTree(b).query(a)[0]


def point_to_surface_distances(points: np.ndarray, shape: Shape) -> np.ndarray:
    """Distance from each point ``(N, 3)`` to the nearest point of the triangles of ``shape``
    (VTK's closest-cell search; needs pyvista), ``(N,)``."""
    _, closest = shape.to_pyvista().find_closest_cell(points, return_closest_point=True)
    return np.linalg.norm(points - closest, axis=1)


def surface_distances(a: Shape, b: Shape, to: str = "auto") -> dict[str, float]:
    """Distances from the vertices of each shape to the other, both ways (mm): means and
    Hausdorff (the largest).

    ``to="surface"``: to the nearest point of the other's triangles (needs pyvista);
    ``"vertices"``: to its nearest vertex, which adds up to half the vertex spacing;
    ``"auto"``: surface when both have triangles and pyvista is installed. The kind used is
    returned as ``distance_to``.
    """
    if to not in ("auto", "surface", "vertices"):
        raise ValueError(f"surface_distances: to is {to!r}; choose 'auto', 'surface' or 'vertices'")
    pa = a.points.detach().cpu().double().numpy()
    pb = b.points.detach().cpu().double().numpy()
    if to == "auto":
        try:
            import pyvista  # noqa: F401

            to = "surface" if a.n_faces and b.n_faces else "vertices"
        except ImportError:
            to = "vertices"
    if to == "surface":
        ab = point_to_surface_distances(pa, b)
        ba = point_to_surface_distances(pb, a)
    else:
        ab, ba = _nearest(pa, pb), _nearest(pb, pa)
    return {
        "mean_ab_mm": float(ab.mean()),
        "mean_ba_mm": float(ba.mean()),
        "mean_mm": float((ab.mean() + ba.mean()) / 2),
        "hausdorff_mm": float(max(ab.max(), ba.max())),
        "distance_to": to,
    }


def vertex_error(points: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    """|points - truth| per vertex (mm): mean, median, max."""
    d = (points.detach().double() - truth.detach().double().to(points.device)).norm(dim=1)
    return {
        "vertex_error_mean_mm": float(d.mean()),
        "vertex_error_median_mm": float(d.median()),
        "vertex_error_max_mm": float(d.max()),
    }


def jacobian_determinants(
    transform: Callable[[torch.Tensor], torch.Tensor], points: torch.Tensor
) -> torch.Tensor:
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


def summary(
    warped: Shape,
    target: Shape,
    jac: torch.Tensor | None = None,
    truth: torch.Tensor | None = None,
    sigma: float = 10.0,
    varifold_shapes: tuple[Shape, Shape] | None = None,
) -> dict[str, float]:
    """The metrics a registration reports. ``varifold`` is |mu_w - mu_t|^2 / |mu_t|^2 (0: the
    same surface, about 2: nothing in common), with kernel width ``sigma`` mm, computed on
    ``varifold_shapes`` if given (e.g. decimated copies of large meshes)."""
    out = surface_distances(warped, target)
    vw, vt = varifold_shapes or (warped, target)
    if vw.n_faces and vt.n_faces:
        with torch.no_grad():
            v = make_loss("varifold", sigma=sigma, caller="summary")(
                vw.to(torch.float64), vt.to(torch.float64)
            )
        out["varifold"] = float(v)
    if jac is not None:
        out.update(
            jacobian_min=float(jac.min()),
            jacobian_max=float(jac.max()),
            jacobian_negative_fraction=float((jac <= 0).double().mean()),
        )
    if truth is not None:
        out.update(vertex_error(warped.points, truth))
    return out
