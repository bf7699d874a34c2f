"""Registration settings derived from the shapes' size, for the options left unset: one call
registers a 40 mm hippocampus and a 200 mm hemisphere.

With D the diagonal of the target's bounding box (mm) and A the target's area (mm^2):

- the LDDMM kernel: a sum of two Gaussians of widths D / 10 and D / 27 (a hemisphere: 22
  and 8 mm, lobes and folds; a hippocampus: 5 and 2 mm). On fsaverage5 onto Conte69 the
  second width took the mean surface distance from 1.03 to 0.68 mm and the curvature
  correlation from 0.860 to 0.871, for 39 s instead of 27 s;
- control points: ``CONTROL_POINTS_PER_SIGMA2 * A / sigma^2`` with the wider sigma (a
  control point every sigma / 2 or so along the surface), within ``CONTROL_POINTS_RANGE``
  (more, 600 and 1000 on a hemisphere, changed nothing measurable);
- levels at scales ``LEVEL_SCALES * D`` (a hemisphere: 6.5 then 4.4 mm; a hippocampus: 1.6
  then 1.0 mm), each with A / scale^2 vertices (about one per scale-sized patch) within
  ``LEVEL_POINTS_RANGE``;
- the width of the varifold distance in the metrics: D / 50;
- the refinement (:class:`~otreg.registration.RefineOptions`): a Gaussian of width D / 54
  (half the narrower width above; a hemisphere: 4 mm) but at least ``REFINE_EDGE_SIGMAS``
  times the source's mean edge length (a kernel narrower than the spacing of the control
  points folds the surface between them: a 20 mm sphere of 530 vertices folded at 1.5% of
  them), control points by the same rule within ``REFINE_CONTROL_POINTS_RANGE`` and at
  most one for every two source vertices, one level at ``REFINE_LEVEL_SIGMAS`` of that
  width (a hemisphere: 2 mm) with A / scale^2 vertices within
  ``REFINE_LEVEL_POINTS_RANGE``. Where that width would not be below
  ``REFINE_MAX_OF_FINEST`` of the LDDMM's narrowest, a mesh too coarse for anything finer,
  ``refine=True`` fits no refinement.

The values chosen are recorded in the result's ``options`` (``options["scale"]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..shapes import Shape

__all__: list[str] = []

#: kernel widths as fractions of the target's size, widest first
SIGMA_FRACTIONS = (0.1, 1 / 27)
CONTROL_POINTS_PER_SIGMA2 = 4.0
CONTROL_POINTS_RANGE = (100, 1000)
#: coarse to fine, as fractions of the target's size
LEVEL_SCALES = (0.03, 0.02)
LEVEL_POINTS_RANGE = (200, 3000)
METRIC_SIGMA_FRACTION = 0.02
REFINE_SIGMA_FRACTION = 1 / 54
REFINE_EDGE_SIGMAS = 1.3
REFINE_MAX_OF_FINEST = 0.75
REFINE_CONTROL_POINTS_RANGE = (100, 3000)
#: and at most one for every two source vertices: the hippocampus pair (3,001 vertices, a
#: 1.04 mm kernel) with 1,500 control points reached 0.036 mm in 8.5 s, with 3,000 0.037 mm
#: in 12.2 s (more control points than the surface can pin down)
REFINE_MAX_CONTROL_POINTS_PER_VERTEX = 0.5
REFINE_LEVEL_SIGMAS = 0.46
REFINE_LEVEL_POINTS_RANGE = (200, 12000)


@dataclass(frozen=True)
class ShapeScale:
    """How large a shape is: ``size_mm`` (bounding-box diagonal), ``area_mm2``, and its
    vertex count."""

    size_mm: float
    area_mm2: float
    vertices: int


def shape_scale(shape: Shape) -> ShapeScale:
    """The :class:`ShapeScale` of a surface."""
    p = shape.points.detach()
    size = float((p.max(0).values - p.min(0).values).norm())
    return ShapeScale(size, float(shape.area.detach()), shape.n_points)


def _clamp(value: float, bounds: tuple[int, int]) -> int:
    return int(min(max(round(value), bounds[0]), bounds[1]))


def default_sigma(scale: ShapeScale) -> tuple[float, ...]:
    """The LDDMM kernel widths, mm, widest first."""
    return tuple(readable(f * scale.size_mm) for f in SIGMA_FRACTIONS)


def readable(mm: float) -> float:
    """A width in mm as the options record it: to 0.01 mm, or to two significant digits
    below 1 mm (shapes a few mm across, or given in metres, would get widths of 0)."""
    return round(mm, 2) if mm >= 1 else float(f"{mm:.2g}")


def default_control_points(scale: ShapeScale, sigma: float) -> int:
    """The number of control points for a kernel whose widest width is ``sigma`` mm."""
    return _clamp(CONTROL_POINTS_PER_SIGMA2 * scale.area_mm2 / sigma**2, CONTROL_POINTS_RANGE)


def default_levels(
    scale: ShapeScale, fractions=LEVEL_SCALES, points=LEVEL_POINTS_RANGE
) -> list[tuple[int, float]]:
    """Coarse-to-fine ``(points, scale mm)`` levels."""
    out = []
    for fraction in fractions:
        s = readable(fraction * scale.size_mm)
        n = _clamp(scale.area_mm2 / s**2, points)
        out.append((min(n, max(scale.vertices, 4)), s))
    return out


def mean_edge_mm(shape: Shape) -> float:
    """The mean length of a surface's triangle edges, mm (each interior edge counted twice)."""
    p, f = shape.points.detach(), shape.faces
    ends = torch.stack([f, f.roll(-1, dims=1)], -1).reshape(-1, 2)
    return float((p[ends[:, 0]] - p[ends[:, 1]]).norm(dim=1).mean())


def default_refine_sigma(
    scale: ShapeScale, source_edge_mm: float, finest_mm: float
) -> float | None:
    """The refinement's kernel width, mm, for a source of mean edge ``source_edge_mm`` after
    an LDDMM whose narrowest width is ``finest_mm``; None where the mesh is too coarse for a
    width below ``REFINE_MAX_OF_FINEST * finest_mm``."""
    sigma = max(REFINE_SIGMA_FRACTION * scale.size_mm, REFINE_EDGE_SIGMAS * source_edge_mm)
    return None if sigma > REFINE_MAX_OF_FINEST * finest_mm else readable(sigma)


def default_refine_control_points(scale: ShapeScale, sigma: float, source_vertices: int) -> int:
    """The refinement's number of control points for a kernel whose widest width is
    ``sigma`` mm, on a source of ``source_vertices`` vertices: at most one for every
    ``1 / REFINE_MAX_CONTROL_POINTS_PER_VERTEX`` vertices."""
    n = CONTROL_POINTS_PER_SIGMA2 * scale.area_mm2 / sigma**2
    most = max(
        REFINE_CONTROL_POINTS_RANGE[0], REFINE_MAX_CONTROL_POINTS_PER_VERTEX * source_vertices
    )
    return min(_clamp(n, REFINE_CONTROL_POINTS_RANGE), int(most))


def default_refine_levels(scale: ShapeScale, sigma: float) -> list[tuple[int, float]]:
    """The refinement's ``(points, scale mm)`` levels for its kernel's narrowest width
    ``sigma`` mm."""
    fraction = REFINE_LEVEL_SIGMAS * sigma / scale.size_mm
    return default_levels(scale, (fraction,), REFINE_LEVEL_POINTS_RANGE)


def default_metric_sigma(scale: ShapeScale) -> float:
    """The varifold metric's kernel width, mm."""
    return readable(METRIC_SIGMA_FRACTION * scale.size_mm)
