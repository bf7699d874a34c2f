"""``otreg.register``: pre-alignment, then LDDMM, coarse to fine, with L-BFGS.

The objective at each level is

    E(p) = regularization * H(q_0, p) + sum_k weight_k * data_k(phi_p(source), target)

with H the deformation energy (mm^2 per unit of momentum^2) and the data terms of
:mod:`otreg.registration.losses`. Levels go from decimated surfaces and a large blur to
finer ones; the control points (a decimated source) and the kernel stay fixed, so momenta
carry over from level to level. ``torch.optim.LBFGS`` with a strong-Wolfe line search runs
each level until the relative change of E over an iteration is below ``tol`` or ``max_iter``.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .._checks import ConvergenceWarning, check_choice, check_int, check_positive
from ..ot.solver import sinkhorn
from ..shapes import Shape
from . import metrics
from .deformations import INTEGRATORS, LDDMM, Affine, Rigid, Similarity, fit_linear
from .kernels import GaussianKernel
from .losses import LOSSES, SINKHORN_TERM, make_loss

__all__ = ["register", "Registration", "prealign", "MODELS", "PREALIGNS"]

MODELS = ("lddmm", "rigid", "similarity", "affine")
#: Above this many vertices, Jacobians and the varifold metric use a subset/decimation.
METRIC_POINTS = 20_000
PREALIGNS = ("rigid", "similarity", "affine", "none")
_LINEAR = {"rigid": Rigid, "similarity": Similarity, "affine": Affine}


def _check_shape(caller: str, name: str, shape: object) -> Shape:
    if not isinstance(shape, Shape):
        raise TypeError(f"{caller}: {name} must be an otreg Shape (see otreg.load_shape), got "
                        f"{type(shape).__name__}")
    if shape.dim != 3:
        raise ValueError(f"{caller}: {name} has {shape.dim}-D points; registration needs 3-D")
    return shape


def _even_indices(n: int, k: int) -> torch.Tensor | slice:
    """Indices of about k evenly spaced items out of n (all of them when n <= k)."""
    return slice(None) if n <= k else torch.linspace(0, n - 1, k).round().long()


def _coarse_measure(shape: Shape, max_points: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertex measure (positions, normalised weights) of at most about max_points points:
    a decimated surface, or an evenly strided subset of a point cloud."""
    if shape.n_faces > 0:
        shape = shape.decimate(max_points)
    elif shape.n_points > max_points:
        keep = _even_indices(shape.n_points, max_points)
        w = None if shape.weights is None else shape.weights[keep]
        shape = Shape(shape.points[keep], weights=w, unit=shape.unit)
    x, a = shape.measure("points")
    return x.detach().double(), (a.detach() / a.sum()).double()


def prealign(source: Shape, target: Shape, kind: str = "rigid", n_iter: int = 8,
             blur: tuple[float, float] | None = None, max_points: int = 2000):
    """Fit a rigid, similarity or affine map by OT matching (no correspondence needed).

    Each round solves OT between the moved source measure and the target, sends every
    source point to its barycentric target, and refits the map by weighted least squares
    (Kabsch, Umeyama or affine), with a blur shrinking geometrically from ``blur[0]`` to
    ``blur[1]`` mm (default: a quarter of the target's size down to 1/40 of it). Surfaces
    are compared as vertex measures (area weights) decimated to about ``max_points``
    vertices: a linear map has 12 parameters at most, which a few thousand points fix.
    """
    caller = "prealign"
    check_choice(caller, "kind", kind, tuple(_LINEAR))
    n_iter = check_int(caller, "n_iter", n_iter, 1)
    max_points = check_int(caller, "max_points", max_points, 4)
    x, a = _coarse_measure(source, max_points)
    y, b = _coarse_measure(target, max_points)
    size = float((y.max(0).values - y.min(0).values).norm())
    b0, b1 = blur if blur is not None else (size / 4, size / 40)
    center = (a[:, None] * x).sum(0)
    model = _LINEAR[kind](center).double()
    with torch.no_grad():
        model.set_from(torch.eye(3, dtype=torch.float64), (b[:, None] * y).sum(0) - center)
    for k in range(n_iter):
        bl = b0 * (b1 / b0) ** (k / max(1, n_iter - 1))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            moved = model(x)  # OT in float32 (twice as fast), the fit in float64
            res = sinkhorn(moved.float(), y.float(), a.float(), b.float(), blur=bl,
                           scaling=0.7, tol=1e-3, max_iter=60)
            goal = res.plan.barycentric_map().double()
            A, t = fit_linear(kind, x, goal, a, center)
            model.set_from(A, t)
    return model


_prealign = prealign  # register() has an argument of that name


@dataclass
class Registration:
    """The result of :func:`register`.

    Attributes:
        warped: the source moved by the whole transform (all its vertices).
        linear: the pre-alignment (Rigid/Similarity/Affine module) or None.
        deformation: the fitted :class:`~otreg.registration.deformations.LDDMM` or None.
        history: one dict per objective evaluation: level, evaluation, loss, energy, data
            terms, seconds.
        metrics: surface distances, varifold distance, Jacobian determinants (and vertex
            errors when the truth was given).
        options: the options of the run.
    """

    warped: Shape
    linear: torch.nn.Module | None
    deformation: LDDMM | None
    history: list[dict] = field(default_factory=list, repr=False)
    metrics: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict, repr=False)

    @property
    def momenta(self) -> torch.Tensor | None:
        return None if self.deformation is None else self.deformation.momenta.detach()

    def transform(self, what: torch.Tensor | Shape) -> torch.Tensor | Shape:
        """Carry points ``(N, 3)`` (tensor or NumPy array) or a Shape (of the source's space)
        through the transform."""
        if isinstance(what, Shape):
            return what.with_points(self.transform(what.points))
        if isinstance(what, np.ndarray):
            return self.transform(torch.as_tensor(what)).numpy()
        if not isinstance(what, torch.Tensor):
            raise TypeError(f"Registration.transform: give points (N, 3) as a tensor or array, "
                            f"or a Shape; got {type(what).__name__}")
        if what.dim() != 2 or what.shape[1] != 3:
            raise ValueError(f"Registration.transform: points have shape {tuple(what.shape)}; "
                             "they must be (N, 3)")
        x = what.detach().double()
        with torch.no_grad():
            if self.linear is not None:
                x = self.linear(x)
            if self.deformation is not None:
                x = self.deformation(x)
        return x.to(what.dtype)

    def save(self, folder: str | Path) -> Path:
        """Write warped.vtk, parameters.npz (no pickle) and registration.json."""
        from ..io import save_shape
        from ..io._files import atomic_write

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_shape(self.warped.with_points(self.warped.points.detach()), folder / "warped.vtk")
        params: dict[str, np.ndarray] = {}
        if self.linear is not None:
            params.update(linear_kind=np.array(type(self.linear).__name__.lower()),
                          linear_matrix=self.linear.matrix().detach().numpy(),
                          linear_translation=self.linear.translation.detach().numpy(),
                          linear_center=self.linear.center.numpy())
        if self.deformation is not None:
            d = self.deformation
            params.update(control_points=d.control_points.numpy(),
                          momenta=d.momenta.detach().numpy(),
                          sigma=np.array(d.kernel.sigmas), kernel_weights=np.array(
                              d.kernel.weights), n_steps=np.array(d.n_steps),
                          integrator=np.array(d.integrator))
        atomic_write(folder / "parameters.npz", lambda p: np.savez(p, **params))
        doc = {"options": self.options, "metrics": self.metrics, "history": self.history}
        atomic_write(folder / "registration.json",
                     lambda p: p.write_text(json.dumps(doc, indent=2, default=str)))
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> Registration:
        """Read what :meth:`save` wrote; ``transform`` then works as before."""
        from ..io import load_shape

        folder = Path(folder)
        for name in ("parameters.npz", "registration.json", "warped.vtk"):
            if not (folder / name).exists():
                raise FileNotFoundError(f"Registration.load: {folder / name} is missing")
        p = np.load(folder / "parameters.npz", allow_pickle=False)
        linear = None
        if "linear_kind" in p:
            center = torch.as_tensor(p["linear_center"])
            linear = Affine(center).double()
            linear.set_from(torch.as_tensor(p["linear_matrix"]),
                            torch.as_tensor(p["linear_translation"]))
        deformation = None
        if "momenta" in p:
            deformation = LDDMM(torch.as_tensor(p["control_points"]),
                                sigma=p["sigma"].tolist(), kernel_weights=p[
                                    "kernel_weights"].tolist(), n_steps=int(p["n_steps"]),
                                integrator=str(p["integrator"])).double()
            with torch.no_grad():
                deformation.momenta.copy_(torch.as_tensor(p["momenta"]))
        doc = json.loads((folder / "registration.json").read_text())
        return cls(load_shape(folder / "warped.vtk"), linear, deformation, doc["history"],
                   doc["metrics"], doc["options"])


def _weights(loss, caller: str, what: str = "loss") -> dict[str, float]:
    """A data-term name or a dict of weights, checked, as a dict of weights."""
    if isinstance(loss, str):
        loss = {loss: 1.0}
    if not isinstance(loss, dict) or not loss:
        raise ValueError(f"{caller}: {what} is {loss!r}; give a data term name or a non-empty "
                         "dict of weights, e.g. {'sinkhorn': 1.0}")
    for name, w in loss.items():
        check_choice(caller, "loss", name, LOSSES)
        check_positive(caller, f"weight of {name}", w)
    return dict(loss)


def _levels(levels, loss, caller: str) -> list[tuple[int, float, dict[str, float]]]:
    """Checked levels as (points, scale mm, loss weights).

    A level is ``(points, scale)`` or ``(points, scale, loss)``; without its own loss it
    takes ``loss``, or when ``loss`` is None the default: the Sinkhorn divergence at every
    level but the last, the varifold at the last (OT matches globally from afar; the
    varifold is cheaper and sharper once the surfaces are close).
    """
    out = []
    levels = list(levels)
    if not levels:
        raise ValueError(f"{caller}: levels is empty")
    for k, lv in enumerate(levels):
        if not (isinstance(lv, (tuple, list)) and len(lv) in (2, 3)):
            raise ValueError(f"{caller}: each level is (points, scale_mm) or (points, scale_mm, "
                             f"loss), got {lv!r}")
        n, scale = lv[0], lv[1]
        if len(lv) == 3:
            terms = _weights(lv[2], caller, f"the loss of level {k + 1}")
        elif loss is not None:
            terms = _weights(loss, caller)
        else:
            terms = {"varifold" if k == len(levels) - 1 and len(levels) > 1 else "sinkhorn": 1.0}
        out.append((check_int(caller, "level points", n, 4),
                    check_positive(caller, "level scale", scale), terms))
    return out


def register(
    source: Shape,
    target: Shape,
    model: str = "lddmm",
    prealign: str = "rigid",
    loss: str | dict[str, float] | None = None,
    *,
    sigma: float | Sequence[float] = 20.0,
    control_points: int = 500,
    n_steps: int = 6,
    integrator: str = "rk4",
    levels: Sequence[tuple] = ((1000, 6.0), (3000, 4.0)),
    regularization: float = 1e-4,
    reach: float | None = None,
    varifold_sigma: float = 4.0,
    landmarks: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_iter: int = 30,
    tol: float = 1e-5,
    strategy: str = "store",
    memory: int | str | None = None,
    truth: torch.Tensor | None = None,
    progress: bool = True,
) -> Registration:
    """Register ``source`` onto ``target``: pre-alignment, then a deformation.

    Args:
        source, target: surfaces (:class:`~otreg.shapes.Shape`, mm); no point-to-point
            correspondence is needed and vertex counts may differ.
        model: ``"lddmm"`` (diffeomorphic) or a linear model (``"rigid"``, ``"similarity"``,
            ``"affine"``) fitted by OT matching alone.
        prealign: ``"rigid"``, ``"similarity"``, ``"affine"`` or ``"none"`` (before LDDMM).
        loss: a data term name (``"sinkhorn"``, ``"varifold"``, ``"currents"``,
            ``"chamfer"``) or a dict of weights, e.g. ``{"sinkhorn": 1, "varifold": 0.1,
            "landmarks": 0.01}``, used at every level. None (default): the Sinkhorn
            divergence at the coarse levels and the varifold at the finest.
        sigma: LDDMM kernel width(s), mm.
        control_points: number of control points (a decimation of the source).
        n_steps, integrator: geodesic shooting time steps and scheme.
        levels: coarse to fine ``(surface points, scale mm)`` or ``(surface points, scale
            mm, loss)``: the surfaces compared at each level are decimated to that many
            vertices; the scale is the Sinkhorn blur and the varifold/currents kernel width
            at that level; a level's own loss replaces ``loss`` there.
        regularization: weight of the deformation energy.
        reach: unbalanced OT reach (mm) for the sinkhorn term.
        varifold_sigma: kernel width (mm) of the varifold distance reported in the metrics.
        landmarks: ``(source_points (L, 3), target_points (L, 3))`` for the landmarks term.
        max_iter: L-BFGS iterations per level.
        tol: stop a level when E changes by less than tol (relative) over an iteration.
        strategy, memory: differentiation of the shooting loop (:func:`otreg.loops.iterate`).
        truth: ground-truth positions of the source vertices in the target (metrics only).
        progress: show a progress bar (tqdm).

    Returns:
        :class:`Registration`.
    """
    caller = "register"
    source, target = _check_shape(caller, "source", source), _check_shape(caller, "target", target)
    for name, s in (("source", source), ("target", target)):
        if s.n_faces == 0:
            raise ValueError(f"{caller}: {name} has no triangles; registration compares surfaces")
    if source.unit != target.unit:
        raise ValueError(f"{caller}: source is in {source.unit} but target in {target.unit}")
    check_choice(caller, "model", model, MODELS)
    check_choice(caller, "prealign", prealign, PREALIGNS)
    levels_ = _levels(levels, loss, caller)
    if any("landmarks" in w for _, _, w in levels_) and landmarks is None:
        raise ValueError(f"{caller}: loss has 'landmarks' but landmarks= is None")
    varifold_sigma = check_positive(caller, "varifold_sigma", varifold_sigma)
    control_points = check_int(caller, "control_points", control_points, 4)
    GaussianKernel(sigma, caller=caller)  # checks the widths now, before any work
    n_steps = check_int(caller, "n_steps", n_steps, 1)
    check_choice(caller, "integrator", integrator, INTEGRATORS)
    regularization = check_positive(caller, "regularization", regularization, allow_zero=True)
    max_iter = check_int(caller, "max_iter", max_iter, 1)
    if truth is not None:
        truth = torch.as_tensor(truth)
        if tuple(truth.shape) != tuple(source.points.shape):
            raise ValueError(f"{caller}: truth has shape {tuple(truth.shape)}; it must give the "
                             f"target position of every source vertex, "
                             f"{tuple(source.points.shape)}")
    options = dict(model=model, prealign=prealign, loss=loss, sigma=sigma,
                   control_points=control_points, n_steps=n_steps, integrator=integrator,
                   levels=levels_, regularization=regularization, reach=reach,
                   varifold_sigma=varifold_sigma, max_iter=max_iter, tol=tol,
                   strategy=strategy, memory=memory)
    start = time.perf_counter()
    src = source.to(torch.float64)
    tgt = target.to(torch.float64)
    history: list[dict] = []

    kind = model if model in _LINEAR else prealign
    linear = None if kind == "none" else _prealign(src, tgt, kind)
    moved_src = src if linear is None else src.with_points(linear(src.points).detach())
    deformation = None
    if model == "lddmm":
        deformation = LDDMM(moved_src.decimate(control_points).points, sigma=sigma, n_steps=n_steps,
                            integrator=integrator, strategy=strategy, memory=memory).double()
        lm = None
        if landmarks is not None:
            lsrc = torch.as_tensor(landmarks[0], dtype=torch.float64)
            lsrc = lsrc if linear is None else linear(lsrc).detach()
            lm = (lsrc, torch.as_tensor(landmarks[1], dtype=torch.float64))
        _fit(deformation, moved_src, tgt, levels_, regularization, reach, lm, max_iter, tol,
             progress, history, start)
    with torch.no_grad():
        warped_pts = moved_src.points if deformation is None else deformation(moved_src.points)
    warped = source.with_points(warped_pts.to(source.points.dtype))
    result = Registration(warped, linear, deformation, history, {}, options)
    # On very large meshes (a 300,000-vertex surface from a volume) the Jacobians are taken
    # at an even subset of the vertices and the varifold metric on decimated copies: at full
    # size they would take minutes to half an hour.
    jac_points = source.points[_even_indices(source.n_points, METRIC_POINTS)]
    jac = metrics.jacobian_determinants(lambda x: _full(result, x), jac_points)
    w64 = warped.to(torch.float64)
    result.metrics = metrics.summary(w64, tgt, jac=jac, truth=truth, sigma=varifold_sigma,
                               varifold_shapes=(w64.decimate(METRIC_POINTS),
                                                tgt.decimate(METRIC_POINTS)))
    result.metrics["jacobian_points"] = int(jac_points.shape[0])
    result.metrics["seconds"] = time.perf_counter() - start
    return result


def _full(result: Registration, x: torch.Tensor) -> torch.Tensor:
    """The whole transform, differentiable in x (for Jacobians)."""
    if result.linear is not None:
        x = result.linear(x)
    if result.deformation is not None:
        x = result.deformation(x)
    return x


def _fit(deformation, src, tgt, levels, regularization, reach, landmarks, max_iter, tol,
         progress, history, start) -> None:
    for level, (n_points, scale, weights) in enumerate(levels):
        s_level, t_level = src.decimate(n_points), tgt.decimate(n_points)
        sinkhorn_options = SINKHORN_TERM.replace(reach=reach)
        terms = {name: make_loss(name, blur=scale, sinkhorn=sinkhorn_options, sigma=scale)
                 for name in weights if name != "landmarks"}
        label = (f"level {level + 1}/{len(levels)} ({s_level.n_points} pts, "
                 f"{'+'.join(weights)} at {scale:g} mm)")
        _fit_level(deformation, s_level, t_level, terms, weights, regularization, landmarks,
                   max_iter, tol, progress, history, start, level, label)
        if not all(math.isfinite(h["loss"]) for h in history[-3:]):
            raise FloatingPointError("register: the objective became NaN or infinite; lower "
                                     "the kernel width or raise regularization")


def _fit_level(deformation, s_level, t_level, terms, weights, regularization, landmarks,
               max_iter, tol, progress, history, start, level, label) -> None:
    """L-BFGS on the momenta for one level."""
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm

            # L-BFGS evaluates the objective at most max_iter * 5 // 4 times (torch's default)
            bar = tqdm(total=max_iter * 5 // 4, desc=label, leave=False, unit="eval")
        except ImportError:  # pragma: no cover
            bar = None
    with torch.no_grad():
        warped = s_level.with_points(deformation(s_level.points))
        for term in terms.values():
            term.prepare(warped, t_level)
    optimizer = torch.optim.LBFGS([deformation.momenta], lr=1.0, max_iter=max_iter,
                                  history_size=20, line_search_fn="strong_wolfe",
                                  tolerance_change=tol, tolerance_grad=1e-12)

    def closure():
        optimizer.zero_grad()
        warped = s_level.with_points(deformation(s_level.points))
        energy = deformation.energy()
        record = {"level": level, "evaluation": len(history), "energy": float(energy.detach())}
        total = regularization * energy
        for name, term in terms.items():
            value = term(warped, t_level)
            record[name] = float(value.detach())
            total = total + weights[name] * value
        if landmarks is not None and "landmarks" in weights:
            value = ((deformation(landmarks[0]) - landmarks[1]) ** 2).sum(1).mean()
            record["landmarks"] = float(value.detach())
            total = total + weights["landmarks"] * value
        total.backward()
        record.update(loss=float(total.detach()), seconds=time.perf_counter() - start)
        history.append(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{float(total.detach()):.4g}")
        return total

    optimizer.step(closure)
    if bar is not None:
        bar.close()
