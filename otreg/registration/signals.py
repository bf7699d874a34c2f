"""Per-vertex signals that the data terms match along with positions (``register(signal=)``):
which signals a pair can use, and each level's standardised signal.

``"curvature"`` is the mean curvature of each level's own mesh (the folds at that level's
resolution); any other name is a float array both shapes carry in ``Shape.data``, taken at a
level's vertices from the nearest full-resolution vertex. Each shape's signal is
standardised (z-scores) and stored in ``data[losses.SIGNAL]``, where the terms read it.
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import warn
from ..shapes import Shape
from . import metrics
from .losses import SIGNAL

__all__: list[str] = []


def check_signal(caller: str, signal: object, source: Shape, target: Shape) -> None:
    """Refuse a signal that is not ``"curvature"`` or a 1-D float array of both shapes'
    ``data``, with a message naming what each shape carries."""
    if not isinstance(signal, str):
        raise TypeError(f"{caller}: signal must be a str or None, got {type(signal).__name__}")
    if signal == "curvature":
        return
    for name, shape in (("source", source), ("target", target)):
        value = shape.data.get(signal)
        if value is None:
            have = ", ".join(map(repr, sorted(shape.data))) or "none"
            raise ValueError(
                f"{caller}: signal is {signal!r} but the {name} has no data[{signal!r}] "
                f"(its data: {have}); give 'curvature' or a name both shapes carry"
            )
        if value.dim() != 1 or not value.is_floating_point():
            raise ValueError(
                f"{caller}: signal {signal!r} of the {name} must be one float per vertex, "
                f"got {value.dtype} of shape {tuple(value.shape)}"
            )


def standardised(values: torch.Tensor) -> torch.Tensor:
    """``(values - mean) / std``: signals of different units and spreads become comparable."""
    return (values - values.mean()) / values.std().clamp_min(1e-12)


def with_level_signal(level: Shape, full: Shape, signal: str | None) -> Shape:
    """The level's shape carrying its standardised signal in ``data[SIGNAL]``: the mean
    curvature of the level's own mesh, or the full shape's array at the nearest vertex."""
    if signal is None:
        return level
    if signal == "curvature":
        values = level.mean_curvature()
    else:
        values = full.data[signal][metrics.nearest_vertices(level.points, full)]
    data = {**level.data, SIGNAL: standardised(values.to(level.points.dtype))}
    return dataclasses.replace(level, data=data)


#: Below this correlation, where the pre-aligned surfaces meet, two signals look like
#: opposite sign conventions (same-sign signals of two brains correlate at 0.3 to 0.9).
OPPOSITE = -0.2

#: Vertices a side for the check (curvature is computed on meshes decimated to this).
CHECK_POINTS = 5000


def check_signs(caller: str, signal: str, source: Shape, target: Shape) -> float:
    """Warn (UserWarning) when the two shapes' signals are anti-correlated where the
    (pre-aligned) source meets the target: each source vertex's value against the target's
    at its nearest vertex. Two labs' maps of one quantity can have opposite signs (the
    HCP's ``sulc`` is FreeSurfer's negated), and a mesh whose triangles wind the other way
    has its curvature negated; matched as they are, folds are pulled onto the wrong folds.
    Returns the correlation."""
    if signal == "curvature":
        pair = [s.decimate(CHECK_POINTS) for s in (source, target)]
        values = [s.mean_curvature() for s in pair]
    else:
        pair, values = [source, target], [source.data[signal], target.data[signal]]
    nearest = metrics.nearest_vertices(pair[0].points, pair[1])
    r = metrics.signal_correlation(values[0], values[1], nearest)
    if r < OPPOSITE:
        cause = (
            "does one mesh wind its triangles the other way (normals inward)?"
            if signal == "curvature"
            else f"do the two maps follow opposite sign conventions (the HCP's sulc is "
            f"FreeSurfer's negated)? If so, negate one: shape.with_data({signal}=-values)"
        )
        warn(
            f"{caller}: signal {signal!r} of the source and the target are anti-correlated "
            f"where the pre-aligned surfaces meet (r = {r:.2f}): {cause}",
            UserWarning,
        )
    return r
