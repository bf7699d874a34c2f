"""``otreg.register``: pre-alignment, then LDDMM, coarse to fine, with L-BFGS, then a finer
LDDMM on what is left (the refinement).

The objective at each level is

    E(p) = regularization * H(q_0, p) + sum_k weight_k * data_k(phi_p(source), target)

with H the deformation energy (mm^2 per unit of momentum^2) and the data terms of
:mod:`otreg.registration.losses`. Levels go from decimated surfaces and a large blur to
finer ones; the control points (a decimated source) and the kernel stay fixed, so momenta
carry over from level to level. ``torch.optim.LBFGS`` with a strong-Wolfe line search runs
each level until the relative change of E over an iteration is below ``optimizer.tol`` or
``optimizer.max_iter``. The refinement then fits a second LDDMM (narrower kernel, more
control points, two time steps) the same way, from where the first left the source; the
deformation is their composition. The options are the objects of
:mod:`otreg.registration.options`.

:func:`register` is a short front over named steps: :func:`_plan` (the options checked and
resolved for this pair), the pre-alignment, :func:`_fit_deformation`, :func:`_metrics`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .._checks import FoldWarning, check_choice, check_int, check_positive, check_progress, warn
from .._info import sharing_cores
from ..ot.problem import SinkhornOptions
from ..shapes import Shape
from . import defaults, metrics, signals
from .fit import Fit, fit_levels
from .kernels import GaussianKernel
from .lddmm import LDDMM, ComposedLDDMM
from .linear import LINEAR
from .losses import SINKHORN_TERM
from .options import (
    MODELS,
    PREALIGNS,
    LBFGSOptions,
    LDDMMOptions,
    Level,
    PrealignOptions,
    RefineOptions,
    loss_weights,
)
from .prealign import check_scales
from .prealign import prealign as fit_prealign
from .result import Registration, transform_with_jacobians

__all__ = ["register"]

#: Above this many vertices, the varifold metric compares decimated copies.
METRIC_POINTS = 20_000


def _check_shape(caller: str, name: str, shape: object) -> Shape:
    if not isinstance(shape, Shape):
        raise TypeError(
            f"{caller}: {name} must be an otreg Shape (see otreg.load_shape), got "
            f"{type(shape).__name__}"
        )
    if shape.dim != 3:
        raise ValueError(f"{caller}: {name} has {shape.dim}-D points; registration needs 3-D")
    return shape


def _levels(levels, loss, caller: str, refine: bool = False) -> list[Level]:
    """Checked levels, each with its loss weights resolved.

    A level is a :class:`Level`, ``(points, scale)`` or ``(points, scale, loss)``; without
    its own loss it takes ``loss``, or when ``loss`` is None the default: the Sinkhorn
    divergence at every level but the last, the varifold at the last (OT matches globally
    from afar; the varifold is cheaper and sharper once the surfaces are close); the
    varifold at every level of the refinement (``refine``).
    """
    out = []
    if isinstance(levels, (str, bytes)) or not isinstance(levels, Iterable):
        raise TypeError(
            f"{caller}: levels must be a sequence of levels, each (points, scale_mm), "
            f"(points, scale_mm, loss) or a Level; got {levels!r}"
        )
    levels = list(levels)
    if not levels:
        raise ValueError(f"{caller}: levels is empty")
    for k, lv in enumerate(levels):
        if isinstance(lv, Level):
            n, scale, own = lv.points, lv.scale, lv.loss
        elif isinstance(lv, (tuple, list)) and len(lv) in (2, 3):
            n, scale = lv[0], lv[1]
            own = (
                loss_weights(lv[2], caller, f"the loss of level {k + 1}") if len(lv) == 3 else None
            )
        else:
            raise ValueError(
                f"{caller}: each level is (points, scale_mm), (points, scale_mm, "
                f"loss) or a Level, got {lv!r}"
            )
        if own is not None:
            terms = own
        elif loss is not None:
            terms = loss_weights(loss, caller)
        else:
            last = k == len(levels) - 1 and len(levels) > 1
            terms = {"varifold" if refine or last else "sinkhorn": 1.0}
        out.append(
            Level(
                check_int(caller, "level points", n, 4),
                check_positive(caller, "level scale", scale),
                terms,
            )
        )
    return out


@dataclass(frozen=True)
class _Plan:
    """What one registration will do: the option objects resolved for this pair (derived
    values filled in) and what :attr:`Registration.options` records of them."""

    model: str
    lddmm: LDDMMOptions | None
    refine: RefineOptions | None
    refine_levels: list[Level]
    prealign: PrealignOptions
    optimizer: LBFGSOptions
    sinkhorn: SinkhornOptions
    levels: list[Level]
    loss: str | dict | None
    varifold_sigma: float
    landmarks: tuple[torch.Tensor, torch.Tensor] | None
    truth: torch.Tensor | None
    signal: str | None
    signal_weight: float
    progress: bool
    dtype: torch.dtype
    scale: defaults.ShapeScale

    def record(self) -> dict:
        asdict = dataclasses.asdict
        return {
            "model": self.model,
            "lddmm": None if self.lddmm is None else asdict(self.lddmm),
            "refine": None if self.refine is None else asdict(self.refine),
            "prealign": asdict(self.prealign),
            "levels": [asdict(lv) for lv in self.levels],
            "optimizer": asdict(self.optimizer),
            "sinkhorn": asdict(self.sinkhorn),
            "loss": self.loss,
            "varifold_sigma": self.varifold_sigma,
            "scale": asdict(self.scale),
            "signal": self.signal,
            "signal_weight": self.signal_weight,
            "dtype": str(self.dtype).removeprefix("torch."),
        }


def _plan(
    caller, source, target, model, prealign, loss, levels, optimizer, sinkhorn,
    varifold_sigma, landmarks, truth, progress, dtype, signal, signal_weight, refine,
) -> _Plan:  # fmt: skip
    """Check every input of :func:`register` and resolve the options for this pair: the
    LDDMM kernel width, control points and levels derived from the target where not
    given."""
    for name, s in (("source", source), ("target", target)):
        _check_shape(caller, name, s)
        if s.n_faces == 0:
            raise ValueError(
                f"{caller}: {name} has no triangles ({s.n_points} points); register fits "
                "surfaces, whatever the loss (its levels decimate meshes, its metrics measure "
                "distances to surfaces): mesh a point cloud first (pyvista's "
                "reconstruct_surface), or fit clouds with otreg.SinkhornLoss in a model of "
                "your own"
            )
    if source.unit != target.unit:
        raise ValueError(f"{caller}: source is in {source.unit} but target in {target.unit}")
    if isinstance(model, LDDMMOptions):
        lddmm, model = model, "lddmm"
    else:
        check_choice(caller, "model", model, MODELS)
        lddmm = LDDMMOptions() if model == "lddmm" else None
    if isinstance(prealign, PrealignOptions):
        pre = prealign
    else:
        check_choice(caller, "prealign", prealign, PREALIGNS)
        pre = PrealignOptions(prealign)
    if model in LINEAR:  # a linear model is the pre-alignment of its own kind
        pre = dataclasses.replace(pre, kind=model)
    check_scales(caller, source, target, prealign=pre.kind, deformable=lddmm is not None)
    if optimizer is None:
        optimizer = LBFGSOptions()
    elif not isinstance(optimizer, LBFGSOptions):
        raise TypeError(
            f"{caller}: optimizer must be an LBFGSOptions or None, got {type(optimizer).__name__}"
        )
    if sinkhorn is None:
        sinkhorn = SINKHORN_TERM
    elif not isinstance(sinkhorn, SinkhornOptions):
        raise TypeError(
            f"{caller}: sinkhorn must be a SinkhornOptions or None, got {type(sinkhorn).__name__}"
        )
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{caller}: dtype is {dtype}; choose torch.float32 or torch.float64")
    scale = defaults.shape_scale(target)
    if lddmm is not None:
        sigma = defaults.default_sigma(scale) if lddmm.sigma is None else lddmm.sigma
        n_cp = lddmm.control_points
        if n_cp is None:
            widest = max(GaussianKernel(sigma, caller=caller).sigmas)
            n_cp = defaults.default_control_points(scale, widest)
        lddmm = dataclasses.replace(lddmm, sigma=sigma, control_points=n_cp)
    levels = _levels(defaults.default_levels(scale) if levels is None else levels, loss, caller)
    refine, refine_levels = _refinement(caller, refine, lddmm, loss, scale, source)
    if any("landmarks" in lv.loss for lv in levels + refine_levels) and landmarks is None:
        raise ValueError(f"{caller}: loss has 'landmarks' but landmarks= is None")
    if any("currents" in lv.loss for lv in levels + refine_levels):
        sides = (source.orientation, target.orientation)
        if None not in sides and sides[0] != sides[1]:
            warn(
                f"{caller}: the source's triangles face {sides[0]} and the target's "
                f"{sides[1]}: loss='currents' compares oriented normals and would pull the "
                "source inside out; flip one (shape.flipped())",
                UserWarning,
            )
    if signal is not None:
        signals.check_signal(caller, signal, source, target)
    signal_weight = check_positive(caller, "signal_weight", signal_weight)
    if varifold_sigma is None:
        varifold_sigma = defaults.default_metric_sigma(scale)
    varifold_sigma = check_positive(caller, "varifold_sigma", varifold_sigma)
    if truth is not None:
        truth = torch.as_tensor(truth)
        if tuple(truth.shape) != tuple(source.points.shape):
            raise ValueError(
                f"{caller}: truth has shape {tuple(truth.shape)}; it must give the "
                f"target position of every source vertex, "
                f"{tuple(source.points.shape)}"
            )
    return _Plan(
        model, lddmm, refine, refine_levels, pre, optimizer, sinkhorn, levels, loss,
        varifold_sigma, landmarks, truth, signal, signal_weight,
        check_progress(caller, progress), dtype, scale,
    )  # fmt: skip


def _refinement(
    caller: str, refine, lddmm: LDDMMOptions | None, loss, scale: defaults.ShapeScale, source
) -> tuple[RefineOptions | None, list[Level]]:
    """The refinement's options with its kernel, control points and levels resolved for
    this pair (None and no levels for ``refine=False``, a linear model, or ``refine=True``
    on a source too coarse for a narrower kernel)."""
    if isinstance(refine, RefineOptions):
        if lddmm is None:
            raise ValueError(
                f"{caller}: refine is a RefineOptions but model is linear; a refinement "
                "refines an LDDMM (model='lddmm')"
            )
    elif isinstance(refine, bool):
        if not refine or lddmm is None:
            return None, []
        refine = RefineOptions()
    else:
        raise TypeError(f"{caller}: refine must be True, False or a RefineOptions, got {refine!r}")
    sigma = refine.sigma
    if sigma is None:
        finest = min(GaussianKernel(lddmm.sigma, caller=caller).sigmas)
        sigma = defaults.default_refine_sigma(scale, defaults.mean_edge_mm(source), finest)
        if sigma is None:
            return None, []
    sigmas = GaussianKernel(sigma, caller=caller).sigmas
    n_cp = refine.control_points
    if n_cp is None:
        n_cp = defaults.default_refine_control_points(scale, max(sigmas), source.n_points)
    levels = refine.levels
    if levels is None:
        levels = defaults.default_refine_levels(scale, min(sigmas))
    levels = _levels(levels, loss, caller, refine=True)
    refine = dataclasses.replace(refine, sigma=sigma, control_points=n_cp, levels=tuple(levels))
    return refine, levels


def register(
    source: Shape,
    target: Shape,
    model: str | LDDMMOptions = "lddmm",
    prealign: str | PrealignOptions = "rigid",
    loss: str | dict[str, float] | None = None,
    *,
    levels: Sequence[Level | tuple] | None = None,
    optimizer: LBFGSOptions | None = None,
    sinkhorn: SinkhornOptions | None = None,
    varifold_sigma: float | None = None,
    landmarks: tuple[torch.Tensor, torch.Tensor] | None = None,
    truth: torch.Tensor | None = None,
    progress: bool | None = None,
    dtype: torch.dtype = torch.float32,
    signal: str | None = None,
    signal_weight: float = 1.0,
    refine: bool | RefineOptions = True,
) -> Registration:
    """Register ``source`` onto ``target``: pre-alignment, then a deformation.

    Args:
        source: the surface to move (:class:`~otreg.shapes.Shape`, mm).
        target: the surface to reach; no point-to-point correspondence is needed and
            vertex counts may differ.
        model: ``"lddmm"`` (diffeomorphic, default :class:`LDDMMOptions`), an
            :class:`LDDMMOptions` (its kernel width, control points, time steps,
            regularization...), or a linear model (``"rigid"``, ``"similarity"``,
            ``"affine"``) fitted by OT matching alone.
        prealign: ``"rigid"``, ``"similarity"``, ``"affine"``, ``"none"`` or a
            :class:`PrealignOptions` (before LDDMM; with a linear model, its settings fit
            that model).
        loss: a data term name (``"sinkhorn"``, ``"varifold"``, ``"currents"``,
            ``"chamfer"``) or a dict of weights, e.g. ``{"sinkhorn": 1, "varifold": 0.1,
            "landmarks": 0.01}``, used at every level. None (default): the Sinkhorn
            divergence at the coarse levels and the varifold at the finest.
        levels: coarse to fine :class:`Level` s or tuples ``(surface points, scale mm)`` /
            ``(surface points, scale mm, loss)``: the surfaces compared at each level are
            decimated to that many vertices; the scale is the Sinkhorn blur and the
            varifold/currents kernel width at that level; a level's own loss replaces
            ``loss`` there. None: two levels sized from the target
            (:func:`otreg.registration.defaults.default_levels`).
        optimizer: :class:`LBFGSOptions` (iterations, tolerance, history) for every level.
        sinkhorn: the Sinkhorn term's solver options (:class:`otreg.ot.problem.SinkhornOptions`;
            its blur is each level's scale, its ``reach`` makes it unbalanced); default
            :data:`otreg.registration.losses.SINKHORN_TERM`.
        varifold_sigma: kernel width (mm) of the varifold distance reported in the metrics;
            None: a fiftieth of the target's size.
        landmarks: ``(source_points (L, 3), target_points (L, 3))`` for the landmarks term.
        truth: ground-truth positions of the source vertices in the target (metrics only).
        progress: show a progress bar (tqdm); None: on a terminal or in Jupyter only
            (a log file would keep every redraw).
        dtype: the floating type of the fit (the deformation's momenta and the shapes):
            float32 (default) or float64. On two real hemisphere pairs float32 took 0.7
            times as long, to the same distances (0.001 mm) and label overlaps (0.001);
            the pre-alignment is fitted in float64 either way.
        signal: match what is on the surfaces too, not only where they are: ``"curvature"``
            (the mean curvature of each level's meshes, :meth:`Shape.mean_curvature`) or
            the name of a per-vertex float array that both shapes carry in ``data`` (e.g.
            ``"sulc"``). Each shape's signal is standardised (z-scores); the data terms
            then compare points ``(x, y, z, signal_weight * scale * z)``, ``scale`` the
            level's: a difference of one standard deviation counts as ``signal_weight``
            level scales.
        signal_weight: see ``signal`` (> 0).
        refine: after the LDDMM fit, fit a second LDDMM with a narrower kernel on what is
            left (:class:`RefineOptions`; True: its defaults, derived from the target);
            the deformation is then their composition. False: the first fit alone.

    Options left None are derived from the target's size and area
    (:mod:`otreg.registration.defaults`), so that a hippocampus and a hemisphere register
    with the same call.

    Returns:
        :class:`Registration`; its ``options`` record the option objects' fields, with the
        derived values filled in, and ``options["scale"]`` the target's size and area.

    Example:
        >>> import pyvista as pv, torch, otreg
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
        >>> egg = ball.with_points(ball.points * torch.tensor([1.2, 0.9, 1.0], dtype=torch.float64))
        >>> res = otreg.register(ball, egg, progress=False)
        >>> res.metrics["mean_mm"] < 0.3 * res.metrics["before_mean_mm"]
        True
    """
    plan = _plan(
        "register", source, target, model, prealign, loss, levels, optimizer, sinkhorn,
        varifold_sigma, landmarks, truth, progress, dtype, signal, signal_weight, refine,
    )  # fmt: skip
    with sharing_cores(source.points.device):  # (fewer threads beside busy processes)
        return _register(plan, source, target)


def _register(plan: _Plan, source: Shape, target: Shape) -> Registration:
    """:func:`register` once its inputs are checked."""
    start = time.perf_counter()
    src, tgt = source.to(plan.dtype), target.to(plan.dtype)
    same = _same_surface(src, tgt)
    if same:  # a sanity check, or one file given twice: a fit would chase rounding noise
        warn(
            f"register: source and target are the same surface ({src.n_points} vertices, "
            "the same triangles and points): the map is the identity, and no fit runs"
        )
    skip = plan.prealign.kind == "none" or same
    linear = None if skip else fit_prealign(src, tgt, plan.prealign)
    seconds = {"prealign_seconds": time.perf_counter() - start}
    moved = src
    if linear is not None:  # the linear map is fitted in float64
        moved = src.mapped(lambda p: linear(p.double()).detach().to(plan.dtype))
    if plan.signal is not None:
        signals.check_signs("register", plan.signal, moved, tgt)
    history: list[dict] = []
    deformation = _fit_deformation(plan, linear, moved, tgt, history, start, fit=not same)
    seconds["fit_seconds"] = time.perf_counter() - start - seconds["prealign_seconds"]
    # the warped vertices and the Jacobians there: one flow of the whole source
    metrics_start = time.perf_counter()
    warped_points, jacobians = transform_with_jacobians(linear, deformation, src.points)
    warped = source.with_points(warped_points.to(source.points))
    found = _metrics(plan, source, None if linear is None else moved, tgt, warped, jacobians,
                     deformation, history)  # fmt: skip
    seconds["metrics_seconds"] = time.perf_counter() - metrics_start
    found.update(seconds, seconds=time.perf_counter() - start)
    inputs = {
        name: None if s.source is None else os.path.abspath(s.source)
        for name, s in (("source", source), ("target", target))
    }
    return Registration(warped, linear, deformation, history, found, plan.record(), inputs, target)


def _same_surface(source: Shape, target: Shape) -> bool:
    """Whether two shapes are one surface: the same triangles, and vertices within 1e-6
    of its size of each other."""
    if source.n_points != target.n_points or source.n_faces != target.n_faces:
        return False
    if source.n_faces and not torch.equal(source.faces, target.faces.to(source.faces)):
        return False
    x, y = source.points.detach(), target.points.detach().to(source.points)
    size = float((y.max(0).values - y.min(0).values).norm())
    return float((x - y).abs().max()) <= 1e-6 * size


def _fit_deformation(
    plan: _Plan,
    linear,
    moved: Shape,
    target: Shape,
    history: list[dict],
    start: float,
    fit: bool = True,
) -> LDDMM | ComposedLDDMM | None:
    """The LDDMM deformation of the pre-aligned source ``moved`` onto ``target``, fitted
    level by level, then its refinement (None for a linear model); every evaluation
    appended to ``history``. ``fit=False``: the same deformations, not fitted (the
    identity: zero momenta)."""
    if plan.lddmm is None:
        return None
    fit_levels_of = fit_levels if fit else (lambda *args: None)
    control_points = moved.decimate(plan.lddmm.control_points).points
    deformation = LDDMM.from_options(control_points, plan.lddmm).to(plan.dtype)
    landmarks = None
    if plan.landmarks is not None:
        source_marks = torch.as_tensor(plan.landmarks[0], dtype=plan.dtype)
        if linear is not None:
            source_marks = linear(source_marks).detach()
        landmarks = (source_marks, torch.as_tensor(plan.landmarks[1], dtype=plan.dtype))
    fit = Fit(
        deformation,
        plan.lddmm.regularization,
        landmarks,
        plan.optimizer,
        plan.sinkhorn,
        plan.progress,
        history,
        start,
        plan.signal,
        plan.signal_weight,
    )
    fit_levels_of(fit, moved, target, plan.levels)
    if plan.refine is None:
        return deformation
    refine = plan.refine
    # the refinement's surfaces: a decimation as large as its finest level or control points,
    # moved by the first fit (not every vertex), and that one's own decimations
    sizes = [lv.points for lv in plan.refine_levels]
    base = moved.decimate(max(sizes + [refine.control_points]))
    for n in [*sizes, refine.control_points]:  # decimated once here, moved with the shape
        base.decimate(n)
    with torch.no_grad():
        base = base.mapped(lambda p: deformation(p).detach())
        if landmarks is not None:
            landmarks = (deformation(landmarks[0]).detach(), landmarks[1])
    options = LDDMMOptions(
        sigma=refine.sigma,
        control_points=refine.control_points,
        n_steps=refine.n_steps,
        integrator=plan.lddmm.integrator,
        regularization=refine.regularization,
        strategy=plan.lddmm.strategy,
        memory=plan.lddmm.memory,
    )
    control_points = base.decimate(refine.control_points).points  # already moved
    second = LDDMM.from_options(control_points, options).to(plan.dtype)
    fit = dataclasses.replace(
        fit,
        deformation=second,
        regularization=refine.regularization,
        landmarks=landmarks,
        first_level=len(plan.levels),
        name="refine ",
    )
    fit_levels_of(fit, base, target, plan.refine_levels)
    return ComposedLDDMM([deformation, second])


def _metrics(plan: _Plan, source, prealigned, target, warped, jacobians, deformation, history):
    """What the registration reports (:func:`metrics.registration_metrics`, the energy,
    the unconverged Sinkhorn evaluations) given the Jacobian matrices at the source's
    vertices; a fold warns."""
    moved = source if prealigned is None else prealigned
    varifold_shapes = None
    if moved.n_faces and moved.n_points > METRIC_POINTS and target.n_points > METRIC_POINTS:
        with torch.no_grad():  # the warped copy: the pre-aligned one's, deformed
            coarse = moved.decimate(METRIC_POINTS)
            coarse = coarse if deformation is None else coarse.mapped(deformation)
        varifold_shapes = (coarse, target.decimate(METRIC_POINTS))
    found = metrics.registration_metrics(
        warped,
        jacobians,
        source,
        prealigned,
        target,
        truth=plan.truth,
        varifold_sigma=plan.varifold_sigma,
        decimate_above=METRIC_POINTS,
        varifold_shapes=varifold_shapes,
    )
    if found["jacobian_negative_fraction"] > 0:
        warn(
            f"register: the deformation folds: its Jacobian determinant is <= 0 at "
            f"{100 * found['jacobian_negative_fraction']:.2f}% of the source vertices (min "
            f"{found['jacobian_min']:.3g}); raise the kernel width (model=LDDMMOptions(sigma=...)) "
            "or the regularization",
            FoldWarning,
        )
    if deformation is not None:  # mm^2: sqrt of it is the geodesic distance of the flow
        with torch.no_grad():
            found["energy"] = float(deformation.energy())
    found["sinkhorn_unconverged_evaluations"] = sum(
        1 for h in history if not h.get("sinkhorn_converged", True)
    )
    return found
