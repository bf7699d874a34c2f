"""``otreg.register``: pre-alignment, then LDDMM, coarse to fine, with L-BFGS.

The objective at each level is

    E(p) = regularization * H(q_0, p) + sum_k weight_k * data_k(phi_p(source), target)

with H the deformation energy (mm^2 per unit of momentum^2) and the data terms of
:mod:`otreg.registration.losses`. Levels go from decimated surfaces and a large blur to
finer ones; the control points (a decimated source) and the kernel stay fixed, so momenta
carry over from level to level. ``torch.optim.LBFGS`` with a strong-Wolfe line search runs
each level until the relative change of E over an iteration is below ``optimizer.tol`` or
``optimizer.max_iter``. The options are the objects of :mod:`otreg.registration.options`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import torch

from .._checks import FoldWarning, check_choice, check_int, check_positive, warn
from .._progress import progress_wanted
from ..ot.problem import SinkhornOptions
from ..shapes import Shape
from . import defaults, metrics, signals
from .deformations import LDDMM
from .fit import Fit, fit_levels
from .kernels import GaussianKernel
from .losses import SINKHORN_TERM
from .options import (
    MODELS,
    PREALIGNS,
    LBFGSOptions,
    LDDMMOptions,
    Level,
    PrealignOptions,
    loss_weights,
)
from .prealign import LINEAR, check_scales
from .prealign import prealign as fit_prealign
from .result import Registration

__all__ = ["register", "METRIC_POINTS"]

#: Above this many vertices, the varifold metric compares decimated copies.
METRIC_POINTS = 20_000

#: The deprecated keywords of register(): which option object now holds each.
_ALIASES = {
    **{
        name: "model"
        for name in (
            "sigma",
            "control_points",
            "n_steps",
            "integrator",
            "regularization",
            "strategy",
            "memory",
        )
    },
    "max_iter": "optimizer",
    "tol": "optimizer",
    "reach": "sinkhorn",
}
_NEW_SPELLING = {
    "model": "model=LDDMMOptions({name}=...)",
    "optimizer": "optimizer=LBFGSOptions({name}=...)",
    "sinkhorn": "sinkhorn=SinkhornOptions({name}=...)",
}


def _check_shape(caller: str, name: str, shape: object) -> Shape:
    if not isinstance(shape, Shape):
        raise TypeError(
            f"{caller}: {name} must be an otreg Shape (see otreg.load_shape), got "
            f"{type(shape).__name__}"
        )
    if shape.dim != 3:
        raise ValueError(f"{caller}: {name} has {shape.dim}-D points; registration needs 3-D")
    return shape


def _levels(levels, loss, caller: str) -> list[Level]:
    """Checked levels, each with its loss weights resolved.

    A level is a :class:`Level`, ``(points, scale)`` or ``(points, scale, loss)``; without
    its own loss it takes ``loss``, or when ``loss`` is None the default: the Sinkhorn
    divergence at every level but the last, the varifold at the last (OT matches globally
    from afar; the varifold is cheaper and sharper once the surfaces are close).
    """
    out = []
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
            terms = {"varifold" if k == len(levels) - 1 and len(levels) > 1 else "sinkhorn": 1.0}
        out.append(
            Level(
                check_int(caller, "level points", n, 4),
                check_positive(caller, "level scale", scale),
                terms,
            )
        )
    return out


def _resolve(caller: str, model, prealign, optimizer, sinkhorn, deprecated: dict):
    """The option objects, with the deprecated keywords folded in (a DeprecationWarning
    each); an alias combined with the object that holds it, or that cannot apply, raises
    ValueError; unknown keywords raise TypeError."""
    unknown = sorted(set(deprecated) - set(_ALIASES))
    if unknown:
        raise TypeError(f"{caller}: unknown keyword argument(s) {', '.join(unknown)}")
    explicit = {
        "model": isinstance(model, LDDMMOptions),
        "optimizer": optimizer is not None,
        "sinkhorn": sinkhorn is not None,
    }
    if isinstance(model, LDDMMOptions):
        lddmm, model = model, "lddmm"
    else:
        check_choice(caller, "model", model, MODELS)
        lddmm = LDDMMOptions() if model == "lddmm" else None
    changes: dict[str, dict] = {"model": {}, "optimizer": {}, "sinkhorn": {}}
    for name, value in deprecated.items():
        holder = _ALIASES[name]
        spelling = _NEW_SPELLING[holder].format(name=name)
        if holder == "model" and model != "lddmm":
            raise ValueError(
                f"{caller}: {name}= applies to model='lddmm' only, not model={model!r}"
            )
        if explicit[holder]:
            raise ValueError(
                f"{caller}: {name}= and {holder}= were both given; write {spelling} only"
            )
        warn(f"{caller}: {name}= is deprecated; write {spelling}", DeprecationWarning)
        changes[holder][name] = value
    if changes["model"]:
        # the strategy follows the budget as in LDDMMOptions(memory=...), unless given too
        strategy = changes["model"].get("strategy")
        lddmm = dataclasses.replace(lddmm, **{**changes["model"], "strategy": strategy})
    if optimizer is None:
        optimizer = LBFGSOptions(**changes["optimizer"])
    elif not isinstance(optimizer, LBFGSOptions):
        raise TypeError(
            f"{caller}: optimizer must be an LBFGSOptions or None, got {type(optimizer).__name__}"
        )
    if sinkhorn is None:
        sinkhorn = SINKHORN_TERM.replace(**changes["sinkhorn"])
    elif not isinstance(sinkhorn, SinkhornOptions):
        raise TypeError(
            f"{caller}: sinkhorn must be a SinkhornOptions or None, got {type(sinkhorn).__name__}"
        )
    if isinstance(prealign, PrealignOptions):
        pre = prealign
    else:
        check_choice(caller, "prealign", prealign, PREALIGNS)
        pre = PrealignOptions(prealign)
    if model in LINEAR:  # a linear model is the pre-alignment of its own kind
        pre = dataclasses.replace(pre, kind=model)
    return model, lddmm, pre, optimizer, sinkhorn


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
    dtype: torch.dtype = torch.float64,
    signal: str | None = None,
    signal_weight: float = 1.0,
    **deprecated,
) -> Registration:
    """Register ``source`` onto ``target``: pre-alignment, then a deformation.

    Args:
        source, target: surfaces (:class:`~otreg.shapes.Shape`, mm); no point-to-point
            correspondence is needed and vertex counts may differ.
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
            float64 (default) or float32.
        signal: match what is on the surfaces too, not only where they are: ``"curvature"``
            (the mean curvature of each level's meshes, :meth:`Shape.mean_curvature`) or
            the name of a per-vertex float array that both shapes carry in ``data`` (e.g.
            ``"sulc"``). Each shape's signal is standardised (z-scores); the data terms
            then compare points ``(x, y, z, signal_weight * scale * z)``, ``scale`` the
            level's: a difference of one standard deviation counts as ``signal_weight``
            level scales.
        signal_weight: see ``signal`` (> 0).
        **deprecated: ``sigma``, ``control_points``, ``n_steps``, ``integrator``,
            ``regularization``, ``strategy``, ``memory`` (now in :class:`LDDMMOptions`),
            ``max_iter``, ``tol`` (:class:`LBFGSOptions`) and ``reach`` (``sinkhorn``) still
            work for one release, with a ``DeprecationWarning``.

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
    caller = "register"
    source, target = _check_shape(caller, "source", source), _check_shape(caller, "target", target)
    for name, s in (("source", source), ("target", target)):
        if s.n_faces == 0:
            raise ValueError(f"{caller}: {name} has no triangles; registration compares surfaces")
    if source.unit != target.unit:
        raise ValueError(f"{caller}: source is in {source.unit} but target in {target.unit}")
    check_scales(caller, source, target)
    model, lddmm, pre, optimizer, sinkhorn = _resolve(
        caller, model, prealign, optimizer, sinkhorn, deprecated
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
    levels_ = _levels(defaults.default_levels(scale) if levels is None else levels, loss, caller)
    if any("landmarks" in lv.loss for lv in levels_) and landmarks is None:
        raise ValueError(f"{caller}: loss has 'landmarks' but landmarks= is None")
    if signal is not None:
        signals.check_signal(caller, signal, source, target)
    signal_weight = check_positive(caller, "signal_weight", signal_weight)
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"{caller}: progress is {progress!r}; it must be True, False or None")
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
    asdict = dataclasses.asdict
    options = {
        "model": model,
        "lddmm": None if lddmm is None else asdict(lddmm),
        "prealign": asdict(pre),
        "levels": [asdict(lv) for lv in levels_],
        "optimizer": asdict(optimizer),
        "sinkhorn": asdict(sinkhorn),
        "loss": loss,
        "varifold_sigma": varifold_sigma,
        "scale": dataclasses.asdict(scale),
        "signal": signal,
        "signal_weight": signal_weight,
        "dtype": str(dtype).removeprefix("torch."),
    }
    start = time.perf_counter()
    src = source.to(dtype)
    tgt = target.to(dtype)
    history: list[dict] = []

    linear = None if pre.kind == "none" else fit_prealign(src, tgt, pre)
    phases = {"prealign_seconds": time.perf_counter() - start}
    moved_src = src
    if linear is not None:  # the linear map is fitted in float64
        moved_src = src.with_points(linear(src.points.double()).detach().to(dtype))
    deformation = None
    if lddmm is not None:
        deformation = LDDMM(
            moved_src.decimate(lddmm.control_points).points,
            sigma=lddmm.sigma,
            n_steps=lddmm.n_steps,
            integrator=lddmm.integrator,
            strategy=lddmm.strategy,
            memory=lddmm.memory,
        ).to(dtype)
        lm = None
        if landmarks is not None:
            lsrc = torch.as_tensor(landmarks[0], dtype=dtype)
            lsrc = lsrc if linear is None else linear(lsrc).detach()
            lm = (lsrc, torch.as_tensor(landmarks[1], dtype=dtype))
        fit = Fit(
            deformation,
            lddmm.regularization,
            lm,
            optimizer,
            sinkhorn,
            progress_wanted(progress),
            history,
            start,
            signal,
            signal_weight,
        )
        fit_levels(fit, moved_src, tgt, levels_)
    phases["fit_seconds"] = time.perf_counter() - start - phases["prealign_seconds"]
    with torch.no_grad():
        warped_pts = moved_src.points if deformation is None else deformation(moved_src.points)
    metrics_start = time.perf_counter()
    warped = source.with_points(warped_pts.to(source.points.dtype))
    inputs = {
        name: None if s.source is None else os.path.abspath(s.source)
        for name, s in (("source", source), ("target", target))
    }
    result = Registration(warped, linear, deformation, history, {}, options, inputs)
    result.metrics = metrics.registration_metrics(
        result,
        source,
        None if linear is None else moved_src,
        tgt,
        truth=truth,
        varifold_sigma=varifold_sigma,
        decimate_above=METRIC_POINTS,
    )
    if result.metrics["jacobian_negative_fraction"] > 0:
        m = result.metrics
        warn(
            f"register: the deformation folds: its Jacobian determinant is <= 0 at "
            f"{100 * m['jacobian_negative_fraction']:.2f}% of the source vertices (min "
            f"{m['jacobian_min']:.3g}); raise the kernel width (model=LDDMMOptions(sigma=...)) "
            "or the regularization",
            FoldWarning,
        )
    if deformation is not None:  # mm^2: sqrt of it is the geodesic distance of the flow
        with torch.no_grad():
            result.metrics["energy"] = float(deformation.energy())
    result.metrics["sinkhorn_unconverged_evaluations"] = sum(
        1 for h in history if not h.get("sinkhorn_converged", True)
    )
    result.metrics.update(phases, metrics_seconds=time.perf_counter() - metrics_start)
    result.metrics["seconds"] = time.perf_counter() - start
    return result
