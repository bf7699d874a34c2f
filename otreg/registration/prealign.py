"""Pre-alignment: a rigid, similarity or affine map fitted by OT matching."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import numpy as np
import torch

from .._checks import ConvergenceWarning, warn
from ..ot.solver import sinkhorn
from ..shapes import Shape
from .linear import LINEAR, _Linear, fit_linear
from .options import PrealignOptions

__all__ = ["prealign"]

_UNSET = object()


#: Sizes further apart than this factor suggest a unit mismatch (metres vs millimetres).
SCALE_RATIO = 20.0


#: Sizes further apart than this factor are more than a rigid pre-alignment and a
#: deformation of the default kernel bridge well (the template pair, fsaverage5's pial
#: surface and Conte69's midthickness, differ by 1.01 and 1.02 in RMS radius)
RIGID_SIZE_RATIO = 1.5


def _radius(shape: Shape) -> float:
    """The RMS distance of a shape's points to their centroid."""
    pts = shape.points.detach().double()
    return float((pts - pts.mean(0)).square().sum(1).mean().sqrt())


def check_scales(
    caller: str,
    source: Shape,
    target: Shape,
    names: tuple[str, str] = ("source", "target"),
    prealign: str | None = None,
    deformable: bool = False,
) -> None:
    """Warn (UserWarning) when the shapes' sizes, RMS distances of their points to their
    centroids, differ by more than :data:`SCALE_RATIO`: probably two units; or, for a
    ``prealign`` kind that keeps sizes (rigid, none), by more than
    :data:`RIGID_SIZE_RATIO`: the deformation alone would have to scale one (a fit of 2.5k
    vertices onto a target a tenth the size left them as far apart as before, 17.9 mm).
    Two units under a pre-alignment that keeps sizes, before a ``deformable`` fit: a
    ValueError instead (that fit's data terms, made at the target's scale, ran for minutes
    on two surfaces of 1,500 vertices 966 times apart without finishing a first level)."""
    radii = [_radius(source), _radius(target)]
    if min(radii) == 0:  # a single point (or all at one place): no size to compare
        return
    big = 0 if radii[0] > radii[1] else 1
    ratio = radii[big] / radii[1 - big]
    keeps_sizes = prealign in ("rigid", "none")
    if ratio > SCALE_RATIO:
        message = (
            f"{caller}: {names[big]} is {ratio:.0f} times larger than {names[1 - big]} (RMS "
            f"radius {radii[big]:.3g} vs {radii[1 - big]:.3g} {source.unit}): are they in "
            "two units, e.g. metres and millimetres? otreg expects both in mm; scale one "
            "(shape.with_points(shape.points * 1000) for metres)"
        )
        if deformable and keeps_sizes:
            raise ValueError(
                f"{message}, or give prealign='similarity' to scale the source first "
                f"(prealign={prealign!r} keeps sizes, and the deformation cannot bridge them)"
            )
        warn(message, UserWarning)
    elif ratio > RIGID_SIZE_RATIO and keeps_sizes:
        warn(
            f"{caller}: the {names[big]} is {ratio:.2g} times the size of the other (RMS "
            f"radii {radii[0]:.3g} and {radii[1]:.3g} {source.unit}), and "
            f"prealign={prealign!r} keeps sizes: give prealign='similarity' (or 'affine') "
            "to scale it first",
            UserWarning,
        )


def even_indices(n: int, k: int) -> torch.Tensor | slice:
    """Indices of about k evenly spaced items out of n (all of them when n <= k)."""
    return slice(None) if n <= k else torch.linspace(0, n - 1, k).round().long()


def _coarse_measure(shape: Shape, max_points: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertex measure (positions, normalised weights) of at most about max_points points:
    a decimated surface, or an evenly strided subset of a point cloud."""
    if shape.n_faces > 0:
        shape = shape.decimate(max_points)
    elif shape.n_points > max_points:
        keep = even_indices(shape.n_points, max_points)
        w = None if shape.weights is None else shape.weights[keep]
        shape = Shape(shape.points[keep], weights=w, unit=shape.unit)
    x, a = shape.measure("points")
    return x.detach().double(), (a.detach() / a.sum()).double()


def prealign(
    source: Shape,
    target: Shape,
    kind: str | PrealignOptions = "rigid",
    n_iter: int = _UNSET,
    blur: tuple[float, float] | None = _UNSET,
    max_points: int = _UNSET,
    closest_point_iter: int = _UNSET,
) -> _Linear:
    """Fit a rigid, similarity or affine map by OT matching (no correspondence needed).

    ``kind`` is a name (``"rigid"``, ``"similarity"``, ``"affine"``) or a
    :class:`PrealignOptions`; ``n_iter``, ``blur``, ``max_points`` and
    ``closest_point_iter``, when given, replace its fields (defaults: those of
    :class:`PrealignOptions`).

    Each round solves OT between the moved source measure and the target, sends every
    source point to its barycentric target, and refits the map by weighted least squares
    (Kabsch, Umeyama or affine), with a blur shrinking geometrically from ``blur[0]`` to
    ``blur[1]`` mm (default: a quarter of the target's size down to 1/40 of it). The
    rounds start from the identity rotation, or from a rotation between the two
    surfaces' principal axes where that fits far better (a surface upside down). Surfaces
    are compared as vertex measures (area weights) decimated to about ``max_points``
    vertices: a linear map has 12 parameters at most, which a few thousand points fix.
    Rounds of symmetric closest points then refine the map (``closest_point_iter``): OT
    needs no starting guess but matches all of each surface's area, the closest points
    only the parts that agree.

    Example:
        >>> import pyvista as pv, torch, otreg
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
        >>> from otreg.registration import prealign
        >>> rigid = prealign(ball, ball.with_points(ball.points + 5.0), "rigid")
        >>> rigid(torch.zeros(1, 3, dtype=torch.float64)).detach().round(decimals=0)
        tensor([[5., 5., 5.]], dtype=torch.float64)
    """
    caller = "prealign"
    changes = {
        name: value
        for name, value in (
            ("n_iter", n_iter),
            ("blur", blur),
            ("max_points", max_points),
            ("closest_point_iter", closest_point_iter),
        )
        if value is not _UNSET
    }
    if isinstance(kind, PrealignOptions):
        options = dataclasses.replace(kind, **changes)
    else:
        options = PrealignOptions(kind, **changes)
    if options.kind not in LINEAR:
        raise ValueError(
            f"{caller}: kind is {options.kind!r}; choose one of {', '.join(map(repr, LINEAR))}"
        )
    x, a = _coarse_measure(source, options.max_points)
    y, b = _coarse_measure(target, options.max_points)
    size = float((y.max(0).values - y.min(0).values).norm())
    b0, b1 = options.blur if options.blur is not None else (size / 4, size / 40)
    center = (a[:, None] * x).sum(0)
    model = LINEAR[options.kind](center).double()
    shift = (b[:, None] * y).sum(0) - center
    start = _best_start(model, options.kind, x, a, y, b, (b0, b1), shift)
    with torch.no_grad():
        model.set_from(start, shift)
    n = options.n_iter
    for k in range(n):
        _ot_round(model, options.kind, x, a, y, b, b0 * (b1 / b0) ** (k / max(1, n - 1)))
    if options.closest_point_iter:
        _fit_closest_points(model, options, source, target, center)
    return model


def _ot_round(model, kind: str, x, a, y, b, blur: float) -> float:
    """One round: OT between the moved source and the target at ``blur``, every source
    point sent to its barycentric target, the map refitted by weighted least squares.
    Returns the round's mean squared move to the targets before the refit (mm^2)."""
    return _ot_rounds([model], kind, x, a, y, b, blur)[0]


def _ot_rounds(models: list, kind: str, x, a, y, b, blur: float) -> list[float]:
    """:func:`_ot_round` for several maps of the same source at once, in one batched
    Sinkhorn solve (the pre-alignment's few hundred points a side leave a solve's time to
    its per-call overhead: five starts together cost about what one does alone)."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        moved = torch.stack([model(x) for model in models])
        k = len(models)
        res = sinkhorn(  # OT in float32 (twice as fast), the fit in float64
            moved.float(), y.float().expand(k, -1, -1), a.float().expand(k, -1),
            b.float().expand(k, -1), blur=blur, scaling=0.7, tol=1e-3, max_iter=60,
        )  # fmt: skip
        goals = res.plan.barycentric_map().double()
        moves = []
        for model, goal, before in zip(models, goals, moved):
            A, t = fit_linear(kind, x, goal, a, model.center)
            model.set_from(A, t)
            moves.append(float((a * (goal - before).square().sum(1)).sum()))
    return moves


#: Rounds at the first blur that each candidate start of the pre-alignment is given before
#: it is scored by one round at the last blur.
START_ROUNDS = 2
#: A start other than the identity is taken where its score (the mean squared move of that
#: last round) is below this fraction of the identity's.
START_GAIN = 0.5


def _axis_rotations(x, a, y, b) -> list[torch.Tensor]:
    """The four rotations (3, 3) that take the source's principal axes (of its weighted
    points x (N, 3), a (N,)) onto the target's, one for each pair of axis signs."""

    def axes(p, w):
        d = p - (w[:, None] * p).sum(0)
        return torch.linalg.eigh((w[:, None] * d).T @ d).eigenvectors

    U, V = axes(x, a), axes(y, b)
    out = []
    for signs in ((1, 1, 1), (1, -1, -1), (-1, 1, -1), (-1, -1, 1)):
        s = torch.tensor(signs, dtype=x.dtype, device=x.device)
        s[2] *= torch.sign(torch.linalg.det(V) * torch.linalg.det(U))  # a proper rotation
        out.append(V @ torch.diag(s) @ U.T)
    return out


def _best_start(model, kind: str, x, a, y, b, blurs: tuple[float, float], shift) -> torch.Tensor:
    """The rotation (3, 3) the pre-alignment's rounds start from: the identity, unless one
    of the rotations taking the source's principal axes onto the target's scores far
    better (:data:`START_GAIN`) after :data:`START_ROUNDS` rounds at the first blur, scored
    by one round at the last (at the first blur every start's targets are smeared alike;
    at the last the right orientation's moves were 20 to 300 times smaller). Measured on
    a copy of fsaverage5's white surface turned about a horizontal axis: from the identity
    alone, 45 and 90 degrees were recovered (0.03 mm), 150 and 180 degrees ended upside
    down (vertices 61 mm off)."""
    eye = torch.eye(3, dtype=x.dtype, device=x.device)
    starts = [eye, *_axis_rotations(x, a, y, b)]
    models = []
    for start in starts:
        models.append(copy.deepcopy(model))
        with torch.no_grad():
            models[-1].set_from(start, shift)
    for _ in range(START_ROUNDS):
        _ot_rounds(models, kind, x, a, y, b, blurs[0])
    scores = _ot_rounds(models, kind, x, a, y, b, blurs[1])
    best = min(range(len(scores)), key=scores.__getitem__)
    return starts[best] if scores[best] < START_GAIN * scores[0] else eye


#: Points a side in the closest-point rounds: finer than the OT rounds' (a nearest neighbour
#: search is cheap; a decimated surface's few hundred vertices are centimetres apart).
CLOSEST_POINTS = 5000

#: Pairs further apart than this many times the median distance are left out of a
#: closest-point round (a part one surface lacks).
TRIM = 3.0


def _vertex_sample(shape: Shape, n: int):
    """About ``n`` of the shape's vertices, evenly strided: positions, normalised weights
    and unit normals (None for a point cloud), float64."""
    x, w = shape.measure("points")
    keep = even_indices(shape.n_points, n)
    normals = shape.point_normals.detach()[keep].double() if shape.n_faces else None
    x, w = x.detach()[keep].double(), w.detach()[keep].double()
    return x, w / w.sum(), normals


def _fit_closest_points(model, options, source: Shape, target: Shape, center) -> None:
    """Refit ``model`` by symmetric closest points, ``options.closest_point_iter`` rounds at
    most: each sampled source vertex paired with its nearest target vertex and each target
    vertex with its nearest moved source vertex, the two halves weighted equally, far pairs
    (:data:`TRIM`) left out. On a surface the goal of a pair is the target vertex's tangent
    plane (the moved source point shifted along the target's normal onto it), so that vertex
    spacing coarser than the gap does not bias the fit; on a point cloud, the vertex itself.
    Stops once the moved points change by under 1e-4 of the target's size."""
    from scipy.spatial import cKDTree

    x, a, _ = _vertex_sample(source, CLOSEST_POINTS)
    y, b, normals = _vertex_sample(target, CLOSEST_POINTS)
    ys = y.cpu().numpy()
    target_tree = cKDTree(ys)
    weights = torch.cat([a, b]) / 2
    source_index = torch.arange(len(x))
    tol = 1e-4 * float((y.max(0).values - y.min(0).values).norm())
    with torch.no_grad():
        moved = model(x)
        for _ in range(options.closest_point_iter):
            d_target, to_target = target_tree.query(moved.cpu().numpy())
            d_source, to_source = cKDTree(moved.cpu().numpy()).query(ys)
            i = torch.cat([source_index, torch.as_tensor(to_source)])  # source vertex
            j = torch.cat([torch.as_tensor(to_target), torch.arange(len(y))])  # target vertex
            goal = y[j]
            if normals is not None:  # onto the target's tangent plane
                n = normals[j]
                goal = moved[i] + n * ((goal - moved[i]) * n).sum(1, keepdim=True)
            d = torch.as_tensor(np.concatenate([d_target, d_source]), device=weights.device)
            kept = weights * (d <= TRIM * d.median())
            A, t = fit_linear(options.kind, x[i], goal, kept / kept.sum(), center)
            model.set_from(A, t)
            before, moved = moved, model(x)
            if float((moved - before).norm(dim=1).max()) < tol:
                break
