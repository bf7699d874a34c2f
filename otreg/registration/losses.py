"""Data terms comparing a deformed surface with a target: each maps (Shape, Shape) -> scalar.

- ``"sinkhorn"``: the debiased Sinkhorn divergence between the area measures (mm^2 units for
  normalised masses; solver options a :class:`~otreg.ot.problem.SinkhornOptions`, its
  ``reach`` for unbalanced OT).
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
from ..ot.divergence import divergence
from ..ot.problem import SinkhornOptions
from ..shapes import Shape
from .kernels import GaussianKernel

__all__ = ["Loss", "make_loss", "LOSSES", "SINKHORN_TERM", "varifold_distance"]

LOSSES = ("sinkhorn", "varifold", "currents", "chamfer", "landmarks")
#: The Sinkhorn term's solver options (its blur is each level's scale): each evaluation
#: starts from the potentials ``prepare`` found and iterates, with Anderson mixing, to a
#: marginal error of 1e-3 (on the hippocampus pair's first level this took 1.7 s where the
#: adaptive over-relaxation took 2.3-2.8 s, and ended 0.070 mm away instead of 0.074).
#: ``register(sinkhorn=...)`` replaces it. A fixed w = 1.9 with at most 30 iterations was
#: faster on small moves but stalled on large ones, where its values were no divergence.
SINKHORN_TERM = SinkhornOptions(scaling=0.5, tol=1e-3, max_iter=300, relaxation="anderson")
#: The key of ``Shape.data`` holding the standardised per-vertex signal that the data terms
#: match along with the positions, when built with ``signal=`` (see :func:`make_loss`).
SIGNAL = "otreg_signal"


def _with_signal(points: torch.Tensor, shape: Shape, factor: float | None) -> torch.Tensor:
    """Points ``(N, 3)`` with the shape's signal as a 4th coordinate, times ``factor`` mm."""
    if factor is None:
        return points
    if SIGNAL not in shape.data:
        raise ValueError(f"a data term matching a signal needs data[{SIGNAL!r}] on both shapes")
    s = shape.data[SIGNAL].to(points.dtype).reshape(-1, 1)
    return torch.cat([points, factor * s], dim=1)


class Loss:
    """A named data term: ``term(warped, target) -> scalar tensor``.

    ``prepare(warped, target)`` (optional, no gradient) is called by the fitting loop at the
    start of each level: an iterative term fixes there the
    state its evaluations start from, so that the term stays a deterministic function of
    the points, as a line search requires.

    Example:
        >>> import pyvista as pv, torch, otreg
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
        >>> from otreg.registration import Loss
        >>> shift = Loss("shift", lambda a, b: (a.points.mean(0) - b.points.mean(0)).norm())
        >>> round(float(shift(ball, ball.with_points(ball.points + 1.0))) ** 2, 6)   # mm^2
        3.0
    """

    def __init__(
        self,
        name: str,
        evaluate: Callable[[Shape, Shape], torch.Tensor],
        prepare: Callable[[Shape, Shape], None] | None = None,
        **options,
    ):
        self.name, self.evaluate, self.options = name, evaluate, options
        self._prepare = prepare
        #: what the last evaluation reports besides its value (an iterative term: its
        #: iterations and whether it converged), added to the fit's history
        self.report: dict = {}

    def __call__(self, warped: Shape, target: Shape) -> torch.Tensor:
        """The data term between the warped source and the target, ``()``."""
        return self.evaluate(warped, target)

    def prepare(self, warped: Shape, target: Shape) -> None:
        """Precompute what the target alone determines (once a level)."""
        if self._prepare is not None:
            self._prepare(warped, target)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.name}({opts})"


def _normalised_measure(shape: Shape, kind: str = "points"):
    """Vertices weighted by their areas (half as many Diracs as triangles: 4x fewer pairs)."""
    x, a = shape.measure(kind)
    return x, a / a.sum()


def _sinkhorn(options: SinkhornOptions, dtype: torch.dtype | None, signal: float | None = None):
    """The divergence term: ``(term, prepare, report)``.

    ``prepare`` solves the problem at hand (at most ten times ``options.max_iter``
    iterations) and keeps its potentials; every evaluation starts from these (not from the
    previous evaluation's: the value would depend on the order of the evaluations). An
    evaluation that does not reach ``options.tol`` from there (a line search's trial far
    from the level's start) is solved again from scratch, with the eps-scaling and ten times
    the iterations; ``report`` says how many iterations the last one took and whether it
    converged: a value that is not converged is no divergence (it can be negative)."""
    reference: dict = {}
    report: dict = {}
    retry_options = options.replace(max_iter=10 * options.max_iter)

    def solve(warped: Shape, target: Shape, warm: dict | None, opts: SinkhornOptions):
        x, a = _normalised_measure(warped)
        y, b = _normalised_measure(target)
        x, y = _with_signal(x, warped, signal), _with_signal(y, target, signal)
        dt = dtype or x.dtype
        with warnings.catch_warnings():  # reported through ``report`` and the history
            warnings.simplefilter("ignore", ConvergenceWarning)
            value, result = divergence(
                "register", x.to(dt), y.to(dt), a.to(dt), b.to(dt), opts, warm=warm
            )
        return value.to(x.dtype), result

    def term(warped: Shape, target: Shape) -> torch.Tensor:
        value, result = solve(warped, target, dict(reference), options)
        n_iter = result.n_iter
        if not result.converged:
            value, result = solve(warped, target, None, retry_options)
            n_iter += result.n_iter
        report.update(sinkhorn_iterations=n_iter, sinkhorn_converged=result.converged)
        return value

    def prepare(warped: Shape, target: Shape) -> None:
        reference.clear()
        with torch.no_grad():
            solve(warped, target, reference, retry_options)

    return term, prepare, report


def _kernel_norm_terms(shape: Shape, oriented: bool, at: str = "faces"):
    """Positions (F, 3) and features (F, E): area-weighted normals (currents) or
    area-weighted vec(n n^T) (varifolds), at the triangles or (``at="points"``) at the
    vertices, with vertex normals and a third of the adjacent triangles' area: half as
    many Diracs, a quarter of the kernel's pairs."""
    if at == "points":
        c, unit = shape.points, shape.point_normals
        area = shape.point_areas[:, None]
    else:
        c, nvec = shape.face_centers, shape.face_normals  # area x unit normal
        area = nvec.norm(dim=1, keepdim=True).clamp_min(1e-30)
        unit = nvec / area
    if oriented:
        return c, area * unit
    return c, area * (unit[:, :, None] * unit[:, None, :]).reshape(-1, 9)


def varifold_distance(
    a: Shape, b: Shape, sigma: float, oriented: bool = False, kernel: GaussianKernel | None = None
) -> torch.Tensor:
    """``|mu_a - mu_b|^2`` in the varifold (or currents) kernel space, mm^4 (areas squared).

    Example:
        >>> import pyvista as pv, torch, otreg
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
        >>> from otreg.registration import varifold_distance
        >>> float(varifold_distance(ball, ball, sigma=4.0))
        0.0
    """
    kernel = kernel or GaussianKernel(sigma)
    ca, fa = _kernel_norm_terms(a, oriented)
    cb, fb = _kernel_norm_terms(b, oriented)
    cb, fb = cb.to(ca.dtype), fb.to(fa.dtype)
    aa = (fa * kernel(ca, ca, fa)).sum()
    ab = (fa * kernel(ca, cb, fb)).sum()
    bb = (fb * kernel(cb, cb, fb)).sum()
    return aa - 2 * ab + bb


def _varifold(
    sigma: float, oriented: bool, signal: float | None = None, dtype: torch.dtype | None = None
):
    """``|mu_warped - mu_target|^2 / |mu_target|^2``: comparable across data sets and levels,
    with the surfaces' vertices as Diracs (4x fewer kernel pairs than their triangles; the
    metric :func:`varifold_distance` uses the triangles). ``prepare`` computes the target's
    terms once (two kernel sums per evaluation, not four). The kernel sums run in ``dtype``
    (None: the points')."""
    kernel = GaussianKernel(sigma)
    cache: dict = {}

    def target_terms(target: Shape):
        if cache.get("target") is not target:
            cb, fb = _kernel_norm_terms(target, oriented, "points")
            cb, fb = _with_signal(cb, target, signal).detach(), fb.detach()
            cache.update(target=target, cb=cb, fb=fb, bb=(fb * kernel(cb, cb, fb)).sum())
        return cache["cb"], cache["fb"], cache["bb"]

    def term(warped: Shape, target: Shape) -> torch.Tensor:
        cb, fb, bb = target_terms(target)
        ca, fa = _kernel_norm_terms(warped, oriented, "points")
        ca = _with_signal(ca, warped, signal)
        out, dt = ca.dtype, dtype or ca.dtype
        ca, fa, cb, fb, bb = (t.to(dt) for t in (ca, fa, cb, fb, bb))
        aa = (fa * kernel(ca, ca, fa)).sum()
        ab = (fa * kernel(ca, cb, fb)).sum()
        return ((aa - 2 * ab) / bb + 1).to(out)

    def prepare(warped: Shape, target: Shape) -> None:
        with torch.no_grad():
            target_terms(target)

    return term, prepare


def _chamfer(warped: Shape, target: Shape) -> torch.Tensor:
    from scipy.spatial import cKDTree

    x, y = warped.points, target.points.to(warped.points.dtype)
    xn, yn = x.detach().cpu().numpy(), y.detach().cpu().numpy()
    _, i_xy = cKDTree(yn).query(xn)
    _, i_yx = cKDTree(xn).query(yn)
    i_xy = torch.as_tensor(np.asarray(i_xy), device=x.device)
    i_yx = torch.as_tensor(np.asarray(i_yx), device=x.device)
    return ((x - y[i_xy]) ** 2).sum(1).mean() + ((y - x[i_yx]) ** 2).sum(1).mean()


def make_loss(
    name: str,
    *,
    blur: float = 2.0,
    sinkhorn: SinkhornOptions | None = None,
    dtype: torch.dtype | None = torch.float32,
    sigma: float = 10.0,
    signal: float | None = None,
    caller: str = "register",
) -> Loss:
    """Build a data term by name (see the module docstring for the meanings and units).

    The Sinkhorn term solves with ``sinkhorn`` (default :data:`SINKHORN_TERM`) at ``blur``
    mm: each solve starts from the potentials found by ``prepare`` (the surfaces move
    little between an optimiser's evaluations) and runs to ``sinkhorn.tol`` (an evaluation
    that does not get there within ``sinkhorn.max_iter`` iterations is solved again from
    scratch); the term's ``report`` says whether the last evaluation converged. ``sigma``
    is the varifold/currents kernel width (mm).

    ``dtype``: the kernel sums of the Sinkhorn, varifold and currents terms run in it
    (float32 by default: about twice as fast; the value and gradient are returned in the
    points' dtype, and the deformation itself is shot in the points' dtype; None keeps the
    points' dtype).

    ``signal`` (mm per standard deviation): the Sinkhorn, varifold and currents terms also
    match the per-vertex signal in ``data[SIGNAL]`` of both shapes (standardised), each
    vertex then a point ``(x, y, z, signal * s)``: a signal differing by one standard
    deviation counts as ``signal`` mm apart.

    Example:
        >>> import pyvista as pv, torch, otreg
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
        >>> from otreg.registration import make_loss
        >>> term = make_loss("varifold", sigma=4.0)
        >>> same = float(term(ball, ball))  # 0 up to float32 rounding
        >>> abs(same) < 1e-6, float(term(ball, ball.with_points(ball.points * 1.1))) > 0
        (True, True)
    """
    if signal is not None:
        signal = check_positive(caller, "signal", signal)
    if dtype not in (None, torch.float32, torch.float64):
        raise TypeError(
            f"{caller}: dtype is {dtype!r}; choose torch.float32, torch.float64 or None"
        )
    if name == "sinkhorn":
        blur = check_positive(caller, "blur", blur)
        if sinkhorn is not None and not isinstance(sinkhorn, SinkhornOptions):
            raise TypeError(
                f"{caller}: sinkhorn must be an otreg SinkhornOptions or None, got "
                f"{type(sinkhorn).__name__}"
            )
        options = (sinkhorn or SINKHORN_TERM).replace(blur=blur)
        term, prepare, report = _sinkhorn(options, dtype, signal)
        loss = Loss(name, term, prepare, blur=blur, reach=options.reach, signal=signal)
        loss.report = report
        return loss
    if name in ("varifold", "currents"):
        sigma = check_positive(caller, f"{name} sigma", sigma)
        term, prepare = _varifold(sigma, name == "currents", signal, dtype)
        return Loss(name, term, prepare, sigma=sigma, signal=signal)
    if name == "chamfer":
        return Loss(name, _chamfer)
    if name == "landmarks":
        raise ValueError(
            f"{caller}: give landmarks as landmarks=(source_points, target_points); "
            "the term is added with weight 'landmarks' in loss"
        )
    raise ValueError(f"{caller}: unknown loss {name!r}; choose from {', '.join(LOSSES)}")
