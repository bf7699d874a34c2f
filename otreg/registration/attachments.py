"""Data terms comparing a deformed surface with a target: each maps (Shape, Shape) -> scalar.

- ``"sinkhorn"``: the debiased Sinkhorn divergence between the area measures (mm^2 units for
  normalised masses; ``reach`` for unbalanced OT).
- ``"varifold"`` (unoriented) and ``"currents"`` (oriented): kernel norms of the difference
  of the surfaces seen as measures on positions and normals (Charon and Trouvé 2013; Glaunès
  and Vaillant 2005), with a Gaussian kernel of width ``sigma`` (mm) on positions.
- ``"chamfer"``: mean squared distance to the nearest point, both ways (mm^2).
- ``"landmarks"``: mean squared distance between corresponding landmarks (mm^2); given to
  :func:`otreg.register` as ``landmarks=(source_points, target_points)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

from .._checks import ConvergenceWarning, check_positive
from ..ot.divergence import sinkhorn_divergence
from ..shapes import Shape
from .kernels import GaussianKernel

__all__ = ["Attachment", "make_attachment", "ATTACHMENTS", "varifold_distance"]

ATTACHMENTS = ("sinkhorn", "varifold", "currents", "chamfer", "landmarks")


class Attachment:
    """A named data term: ``term(warped, target) -> scalar tensor``."""

    def __init__(self, name: str, fn: Callable[[Shape, Shape], torch.Tensor], **options):
        self.name, self.fn, self.options = name, fn, options

    def __call__(self, warped: Shape, target: Shape) -> torch.Tensor:
        return self.fn(warped, target)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.name}({opts})"


def _normalised_measure(shape: Shape, kind: str = "points"):
    """Vertices weighted by their areas (half as many Diracs as triangles: 4x fewer pairs)."""
    x, a = shape.measure(kind)
    return x, a / a.sum()


def _sinkhorn(blur: float, reach: float | None, scaling: float, tol: float, max_iter: int):
    def term(warped: Shape, target: Shape) -> torch.Tensor:
        x, a = _normalised_measure(warped)
        y, b = _normalised_measure(target)
        with warnings.catch_warnings():  # an early stop is fine inside an optimiser
            warnings.simplefilter("ignore", ConvergenceWarning)
            return sinkhorn_divergence(x, y, a, b.to(x.dtype), blur=blur, reach=reach,
                                       scaling=scaling, tol=tol, max_iter=max_iter)
    return term


def _kernel_norm_terms(shape: Shape, oriented: bool):
    """Positions (F, 3) and features (F, E): area-weighted normals (currents) or
    area-weighted vec(n n^T) (varifolds)."""
    c = shape.face_centers
    nvec = shape.face_normals  # area x unit normal
    if oriented:
        return c, nvec
    area = nvec.norm(dim=1, keepdim=True).clamp_min(1e-30)
    unit = nvec / area
    return c, area * (unit[:, :, None] * unit[:, None, :]).reshape(-1, 9)


def varifold_distance(a: Shape, b: Shape, sigma: float, oriented: bool = False,
                      kernel: GaussianKernel | None = None) -> torch.Tensor:
    """|mu_a - mu_b|^2 in the varifold (or currents) kernel space, mm^4 (areas squared)."""
    kernel = kernel or GaussianKernel(sigma)
    ca, fa = _kernel_norm_terms(a, oriented)
    cb, fb = _kernel_norm_terms(b, oriented)
    cb, fb = cb.to(ca.dtype), fb.to(fa.dtype)
    aa = (fa * kernel(ca, ca, fa)).sum()
    ab = (fa * kernel(ca, cb, fb)).sum()
    bb = (fb * kernel(cb, cb, fb)).sum()
    return aa - 2 * ab + bb


def _varifold(sigma: float, oriented: bool):
    kernel = GaussianKernel(sigma)

    def term(warped: Shape, target: Shape) -> torch.Tensor:
        # divided by the target's own squared norm: comparable across data sets and levels
        cb, fb = _kernel_norm_terms(target, oriented)
        norm = (fb * kernel(cb, cb, fb)).sum().detach()
        return varifold_distance(warped, target, sigma, oriented, kernel) / norm
    return term


def _chamfer(warped: Shape, target: Shape) -> torch.Tensor:
    from scipy.spatial import cKDTree

    x, y = warped.points, target.points.to(warped.points.dtype)
    xn, yn = x.detach().cpu().numpy(), y.detach().cpu().numpy()
    _, i_xy = cKDTree(yn).query(xn)
    _, i_yx = cKDTree(xn).query(yn)
    i_xy = torch.as_tensor(np.asarray(i_xy), device=x.device)
    i_yx = torch.as_tensor(np.asarray(i_yx), device=x.device)
    return ((x - y[i_xy]) ** 2).sum(1).mean() + ((y - x[i_yx]) ** 2).sum(1).mean()


def make_attachment(name: str, *, blur: float = 2.0, reach: float | None = None,
                    scaling: float = 0.5, sinkhorn_tol: float = 1e-3, sinkhorn_max_iter: int = 30,
                    sigma: float = 10.0, fn: str = "register") -> Attachment:
    """Build a data term by name (see the module docstring for the meanings and units)."""
    if name == "sinkhorn":
        blur = check_positive(fn, "blur", blur)
        return Attachment(name, _sinkhorn(blur, reach, scaling, sinkhorn_tol, sinkhorn_max_iter),
                          blur=blur, reach=reach)
    if name in ("varifold", "currents"):
        sigma = check_positive(fn, f"{name} sigma", sigma)
        return Attachment(name, _varifold(sigma, name == "currents"), sigma=sigma)
    if name == "chamfer":
        return Attachment(name, _chamfer)
    if name == "landmarks":
        raise ValueError(f"{fn}: give landmarks as landmarks=(source_points, target_points); "
                         "the term is added with weight 'landmarks' in loss")
    raise ValueError(f"{fn}: unknown loss {name!r}; choose from {', '.join(ATTACHMENTS)}")
