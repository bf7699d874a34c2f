"""Carrying per-vertex values between two surfaces: the checks of what is carried
(one a vertex, labels integers, a map finite, the right hemisphere) and the carrying
itself, from the nearest point of the other surface (libigl's closest points and
barycentric coordinates): maps interpolated on its triangle, labels by a vote of its
corners with a confidence. :class:`~otreg.registration.Registration` carries with them,
and a batch checks its files with :func:`checked_values` before the fit."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from ..io import VertexValues, gifti_structure, load_values, named_structure
from ..shapes import Shape
from . import metrics


def vertex_values(
    caller: str,
    values,
    surface: Shape,
    role: str,
    other: Shape | None = None,
    name: str = "values",
) -> VertexValues:
    """``values`` (the argument ``name``) checked against the surface they come from (its
    vertex count); ``other``, the surface they would go to, for the hint where they have
    its vertex count."""
    if isinstance(values, os.PathLike):  # a file (a str names an array of the surface)
        values = load_values(values)
    if isinstance(values, str):
        if values not in surface.data:
            have = ", ".join(sorted(surface.data)) or "none"
            hint = ""
            if "/" in values or "." in values:  # a file's name, read with load_values
                hint = f"; to carry a file's values, give otreg.io.load_values({values!r})"
            elif role == "target" and not surface.data:
                hint = (
                    "; a registration loaded from its folder reads the target from its file, "
                    "without the arrays added to it in memory: give target= the Shape that "
                    "carries them"
                )
            raise ValueError(
                f"{caller}: the {role} carries no per-vertex array {values!r} (its arrays: "
                f"{have}){hint}"
            )
        values = surface.data[values]
    if isinstance(values, np.ndarray):
        if values.dtype.kind not in "biuf":  # strings, objects: torch's own words name none
            raise TypeError(
                f"{caller}: {name} is an array of {values.dtype}; give numbers (labels as "
                "integers with a table: otreg.io.VertexValues(ids, {id: (name, rgba)}))"
            )
        values = torch.as_tensor(values)
    if isinstance(values, torch.Tensor):
        values = VertexValues(values.detach().cpu())
    if not isinstance(values, VertexValues):
        raise TypeError(
            f"{caller}: {name} must be a tensor, an array, a VertexValues or the name of a "
            f"per-vertex array; got {type(values).__name__}"
        )
    shape = tuple(values.values.shape)
    if len(shape) not in (1, 2) or values.n_vertices != surface.n_points:
        hint = ""
        if len(shape) == 2 and shape[1] == surface.n_points:
            hint = " (transposed? give values.T)"
        elif shape and other is not None and shape[0] == other.n_points != surface.n_points:
            back = "source" if role == "target" else "target"
            hint = (
                f" (they have the {back}'s vertex count: to carry the {back}'s values onto "
                f"the {role}, give to={role!r})"
            )
        raise ValueError(
            f"{caller}: {name} have shape {shape}; the {role} has {surface.n_points} "
            f"vertices: give (N,) or (N, C) with N = {surface.n_points}{hint}"
        )
    return values


#: float values with at most this many distinct whole numbers look like labels: carried as
#: a map, with a warning that says how to carry them as labels
MAX_LABELS_GUESS = 1000


def checked_values(
    caller: str,
    values,
    surface: Shape,
    role: str,
    kind: str = "auto",
    other: Shape | None = None,
    surface_file: str | Path | None = None,
) -> tuple[VertexValues, bool]:
    """``values`` checked as :meth:`~otreg.registration.Registration.transfer` would carry them from
    ``surface`` (the ``role``, read from ``surface_file`` if known) to ``other``: one a
    vertex, labels integers (floats that are whole numbers become integers), a map finite,
    of the surface's structure where both GIFTI files say theirs; with whether they are
    carried as labels. :func:`~otreg.batch.run_job` checks its files with it before the
    fit."""
    given = vertex_values(caller, values, surface, role, other)
    theirs = None
    if given.structure:  # a GIFTI's AnatomicalStructurePrimary, else FreeSurfer's lh./rh.
        theirs = gifti_structure(surface_file) or named_structure(surface_file)
    if theirs is not None and theirs != given.structure:
        raise ValueError(
            f"{caller}: the values' file says they belong to {given.structure} (its "
            f"AnatomicalStructurePrimary, or FreeSurfer's lh./rh. name), the {role} "
            f"surface's ({Path(surface_file).name}) to {theirs}: carry them through a "
            f"registration of {given.structure}"
        )
    labels = given.is_labels if kind == "auto" else kind == "labels"
    data = given.values
    if data.is_complex():
        raise TypeError(f"{caller}: values are {data.dtype}; give real numbers or integers")
    finite = bool(torch.isfinite(data).all()) if data.is_floating_point() else True
    # (inf equals its rounding: not a whole number, and refused below before any guess)
    whole = data.is_floating_point() and finite and bool((data == data.round()).all())
    if labels and data.is_floating_point():
        if not finite:
            bad = int((~torch.isfinite(data)).sum())
            raise ValueError(
                f"{caller}: kind='labels' but {bad} of the values are NaN or infinite; "
                "labels are integers: give each vertex one (e.g. 0 for unlabelled)"
            )
        if not whole:
            bad = int((data != data.round()).sum())
            raise ValueError(
                f"{caller}: kind='labels' but {bad} of the values are not whole numbers "
                f"(they are {data.dtype}); labels are integers"
            )
        given = dataclasses.replace(given, values=data.long())  # labels stored as floats
    elif kind == "auto" and whole and data.dim() == 1:
        distinct = len(data.unique())
        if distinct <= MAX_LABELS_GUESS:
            warnings.warn(
                f"{caller}: the values are {data.dtype} but each is a whole number "
                f"({distinct} distinct): they are carried as a map (interpolated); if they "
                "are labels, give kind='labels'",
                stacklevel=3,
            )
    if labels and given.values.dim() != 1:
        raise ValueError(
            f"{caller}: labels are one integer a vertex, (N,); these have shape "
            f"{tuple(data.shape)}: carry each column alone, or give kind='map'"
        )
    if not labels and not bool(torch.isfinite(data.double()).all()):
        bad = int((~torch.isfinite(data.double())).sum())
        raise ValueError(
            f"{caller}: values hold {bad} NaN or infinite entries; a map is interpolated "
            "and they would spread: fill them first"
        )
    return given, labels


def carry(given: VertexValues, origin: Shape, points: torch.Tensor, labels: bool) -> VertexValues:
    """``given`` at the vertices of surface ``origin``, carried onto ``points`` ``(M, 3)``: maps
    interpolated on the nearest triangle, labels by the largest barycentric weight summed
    per label over its corners (with it as the confidence)."""
    data = given.values
    corners, weights = nearest_triangles(points, origin)
    picked = data[torch.as_tensor(corners)]  # (M, 3) or (M, 3, C)
    w = torch.as_tensor(weights, dtype=torch.float64)
    if not labels:
        w = w.to(picked.dtype) if picked.is_floating_point() else w
        out = (picked.double() * (w[..., None] if picked.dim() == 3 else w)).sum(1)
        # a map has no label table, even where it was interpolated from labels
        return VertexValues(out.to(data.dtype if data.is_floating_point() else torch.float64))
    votes = torch.stack([(w * (picked == picked[:, k : k + 1])).sum(1) for k in range(3)], 1)
    best = votes.argmax(1)
    out = picked.gather(1, best[:, None])[:, 0]
    return VertexValues(out, given.label_table, confidence=votes.max(1).values.float())


def nearest_triangles(points: torch.Tensor, surface: Shape) -> tuple[np.ndarray, np.ndarray]:
    """For each point ``(M, 3)``, the three vertices of the surface's nearest triangle
    ``(M, 3)`` and the barycentric coordinates of the nearest point on it ``(M, 3)`` (libigl's
    closest points; the nearest vertex, weight 1, where libigl does not import)."""
    pts = points.detach().cpu().double().numpy()
    if not metrics._closest_points_available():  # pragma: no cover - libigl missing
        from scipy.spatial import cKDTree

        tree = cKDTree(surface.points.detach().cpu().double().numpy())
        nearest = tree.query(pts)[1]
        return np.repeat(nearest[:, None], 3, 1), np.tile([1.0, 0.0, 0.0], (len(pts), 1))
    import igl

    _, cells, closest = metrics.closest_surface_points(pts, surface)
    faces = surface.faces.cpu().numpy()[cells]
    corners = surface.points.detach().cpu().double().numpy()[faces]  # (M, 3, 3)
    a, b, c = (np.ascontiguousarray(corners[:, k]) for k in range(3))
    w = igl.barycentric_coordinates(closest, a, b, c)
    w = np.where(np.isfinite(w).all(1, keepdims=True), w, [1.0, 0.0, 0.0])  # degenerate: a corner
    w = np.clip(w, 0.0, 1.0)
    w /= np.maximum(w.sum(1, keepdims=True), 1e-30)
    return faces, w
