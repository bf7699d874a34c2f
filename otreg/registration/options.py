"""The options of :func:`otreg.register`, as frozen dataclasses: strings for the common
case, an object where settings travel together.

- ``model="lddmm" | "rigid" | "similarity" | "affine" | LDDMMOptions(...)``: the LDDMM
  settings exist only inside :class:`LDDMMOptions`;
- ``prealign="rigid" | "similarity" | "affine" | "none" | PrealignOptions(...)``;
- ``refine=True | False | RefineOptions(...)``: a second, finer LDDMM after the first;
- ``optimizer=LBFGSOptions(...)``: L-BFGS at each level;
- ``levels=(Level(points, scale, loss), ...)`` (tuples ``(points, scale)`` and
  ``(points, scale, loss)`` are converted).

Each checks its fields when built (``ValueError`` for bad values, ``TypeError`` for wrong
types, the message naming the class and the field); ``dataclasses.asdict`` of each is what
:attr:`otreg.registration.Registration.options` records.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

from .._checks import check_choice, check_int, check_positive
from ..loops.budget import resolve_strategy
from .kernels import GaussianKernel
from .losses import LOSSES

__all__ = [
    "LDDMMOptions",
    "RefineOptions",
    "PrealignOptions",
    "LBFGSOptions",
    "Level",
    "MODELS",
    "PREALIGNS",
]

MODELS = ("lddmm", "rigid", "similarity", "affine")
INTEGRATORS = ("euler", "rk4", "leapfrog")
PREALIGNS = ("rigid", "similarity", "affine", "none")


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # normalising a frozen dataclass's own field


def _check_flow(options, caller: str) -> None:
    """The fields LDDMMOptions and RefineOptions share: ``sigma`` (normalised to a float or a
    tuple of floats), ``control_points`` and ``n_steps``."""
    if options.sigma is not None:
        sigmas = GaussianKernel(options.sigma, caller=caller).sigmas
        single = isinstance(options.sigma, numbers.Real)
        _set(options, "sigma", sigmas[0] if single else tuple(sigmas))
    if options.control_points is not None:
        _set(
            options,
            "control_points",
            check_int(caller, "control_points", options.control_points, 4),
        )
    _set(options, "n_steps", check_int(caller, "n_steps", options.n_steps, 1))


@dataclass(frozen=True)
class LDDMMOptions:
    """``model=LDDMMOptions(...)``: the LDDMM deformation.

    Args:
        sigma: kernel width(s), mm (a sum of Gaussians if several); None: a tenth and a
            27th of the target's size (:mod:`otreg.registration.defaults`).
        control_points: number of control points (a decimation of the pre-aligned source);
            None: from the target's area and sigma.
        n_steps: geodesic shooting time steps.
        integrator: ``"leapfrog"`` (symplectic; one kernel sum over the surface points a
            step), ``"rk4"`` (four) or ``"euler"`` (one). fsaverage5 onto Conte69 took 30 s
            with leapfrog and 52 s with RK4, 6 steps each, to the same distances (1.04 mm)
            and Jacobians (0.67 to 1.36).
        regularization: weight of the deformation energy in the objective (>= 0).
        strategy, memory: differentiation of the shooting loop (:func:`otreg.loops.iterate`):
            ``memory="2GB"`` bounds the measured peak growth of shooting forward and
            backward; with it, ``strategy`` defaults to ``"checkpoint"``, without it to
            ``"store"``.

    Example:
        >>> import otreg
        >>> opts = otreg.LDDMMOptions(sigma=(20.0, 8.0), control_points=500)
        >>> opts.n_steps, opts.integrator
        (6, 'leapfrog')
    """

    sigma: float | Sequence[float] | None = None
    control_points: int | None = None
    n_steps: int = 6
    integrator: str = "leapfrog"
    regularization: float = 1e-4
    strategy: str | None = None
    memory: int | str | None = None

    def __post_init__(self) -> None:
        caller = "LDDMMOptions"
        _check_flow(self, caller)
        check_choice(caller, "integrator", self.integrator, INTEGRATORS)
        _set(
            self,
            "regularization",
            check_positive(caller, "regularization", self.regularization, allow_zero=True),
        )
        _set(self, "strategy", resolve_strategy(caller, self.strategy, self.memory))


@dataclass(frozen=True)
class RefineOptions:
    """``refine=RefineOptions(...)``: a second LDDMM, fitted after the first from where it
    left the source, with a narrower kernel on more control points and a few time steps;
    the transform is the composition of the two (:class:`~otreg.registration.ComposedLDDMM`),
    a diffeomorphism.

    The first LDDMM's kernel sums two Gaussians, lobes and folds; a third, narrower one in the
    same fit needs control points as dense as its width on every width's kernel sums (six
    times the time). Fitted on its own, on what is left, the narrow kernel costs what it
    needs: a real individual's hemisphere onto a template went from 1.28 to about 1 mm for
    about half the first fit's time (docs/benchmarks.md).

    Args:
        sigma: kernel width(s), mm; None: half the first LDDMM's narrowest default width
            (a 54th of the target's size; a hemisphere: 4 mm), but no narrower than the
            source's mesh can carry (:mod:`otreg.registration.defaults`; ``refine=True``
            fits no refinement on a mesh too coarse for one).
        control_points: None: from the target's area and sigma, as the first LDDMM's, within
            :data:`~otreg.registration.defaults.REFINE_CONTROL_POINTS_RANGE`.
        n_steps: time steps of its geodesic shooting: what is left to move is small against
            the kernel, and 2 steps reached the distances of 6 (the fsaverage5 -> Conte69
            pair) in 55% of the time.
        levels: coarse to fine, as ``register``'s (``Level`` or tuples); None: derived from
            the target (:func:`~otreg.registration.defaults.default_refine_levels`).
        regularization: weight of its deformation energy (>= 0). Measured against 1e-4
            (one thread, one run each): fsaverage5 -> Conte69 left 2.104 mm from the HCP's
            correspondence and a Desikan-Killiany Dice of 0.898 (2.138, 0.895), right 2.238
            and 0.882 (2.26, 0.881); a real individual onto a template 0.74 / 0.78 mm (0.96 /
            0.98), smallest Jacobian 0.20 (0.50); four donor pairs' Dice +0.007 to +0.014.

    Example:
        >>> import otreg
        >>> otreg.RefineOptions(sigma=3.0).n_steps
        2
    """

    sigma: float | Sequence[float] | None = None
    control_points: int | None = None
    n_steps: int = 2
    levels: Sequence[Level | tuple] | None = None
    regularization: float = 3e-5

    def __post_init__(self) -> None:
        caller = "RefineOptions"
        _check_flow(self, caller)
        if self.levels is not None:
            if isinstance(self.levels, (str, bytes)) or not isinstance(self.levels, Sequence):
                raise TypeError(
                    f"{caller}: levels must be None or a sequence of Level or (points, "
                    f"scale_mm) tuples, got {self.levels!r}"
                )
            _set(self, "levels", tuple(self.levels))
        _set(
            self,
            "regularization",
            check_positive(caller, "regularization", self.regularization, allow_zero=True),
        )


@dataclass(frozen=True)
class PrealignOptions:
    """``prealign=PrealignOptions(...)``: the linear map fitted by OT matching.

    Args:
        kind: ``"rigid"``, ``"similarity"``, ``"affine"`` or ``"none"``.
        n_iter: rounds of (OT, barycentric targets, least-squares fit).
        blur: ``(first, last)`` blur in mm, shrinking geometrically; default a quarter of the
            target's size down to 1/40 of it.
        max_points: the surfaces are decimated to about this many vertices (500 aligns
            a hippocampus pair and two hemisphere templates as well as 2,000, in a sixth of
            the time).
        closest_point_iter: rounds of symmetric closest-point fitting (each source point
            pulled towards its nearest target point and each target point pulling its
            nearest source point, onto the target's tangent plane there; far pairs left
            out) after the OT rounds, at most; 0: none. OT matches all of one surface's
            area with all of the other's, so where the two differ in shape (a medial wall,
            a cut) it pulls the map off; the closest points then fit where the surfaces
            agree.

    Example:
        >>> import otreg
        >>> otreg.PrealignOptions("affine", max_points=1000).n_iter
        8
    """

    kind: str = "rigid"
    n_iter: int = 8
    blur: tuple[float, float] | None = None
    max_points: int = 500
    closest_point_iter: int = 100

    def __post_init__(self) -> None:
        caller = "PrealignOptions"
        check_choice(caller, "kind", self.kind, PREALIGNS)
        _set(self, "n_iter", check_int(caller, "n_iter", self.n_iter, 1))
        if self.blur is not None:
            if (
                isinstance(self.blur, (str, bytes))
                or not isinstance(self.blur, Sequence)
                or len(self.blur) != 2
            ):
                raise TypeError(
                    f"{caller}: blur must be None or (first, last) in mm, got {self.blur!r}"
                )
            _set(self, "blur", tuple(check_positive(caller, "blur", b) for b in self.blur))
        _set(self, "max_points", check_int(caller, "max_points", self.max_points, 4))
        _set(
            self,
            "closest_point_iter",
            check_int(caller, "closest_point_iter", self.closest_point_iter, 0),
        )


@dataclass(frozen=True)
class LBFGSOptions:
    """``optimizer=LBFGSOptions(...)``: ``torch.optim.LBFGS`` (strong-Wolfe line search) at
    each level.

    Args:
        max_iter: iterations per level (at most 5/4 as many objective evaluations).
        tol: stop a level when the objective changes over an iteration by less than tol
            times its value at the level's start.
        history_size: number of past updates kept for the Hessian approximation.
        precondition: optimise whitened LDDMM momenta
            (:meth:`~otreg.registration.LDDMM.whitened`): the same objective,
            reached in fewer iterations (fsaverage5 onto Conte69: closer after 15
            iterations a level than without after 30).

    Example:
        >>> import otreg
        >>> otreg.LBFGSOptions(max_iter=30).precondition
        True
    """

    max_iter: int = 15
    tol: float = 1e-5
    history_size: int = 20
    precondition: bool = True

    def __post_init__(self) -> None:
        caller = "LBFGSOptions"
        _set(self, "max_iter", check_int(caller, "max_iter", self.max_iter, 1))
        _set(self, "tol", check_positive(caller, "tol", self.tol, allow_zero=True))
        _set(self, "history_size", check_int(caller, "history_size", self.history_size, 1))
        if not isinstance(self.precondition, bool):
            raise TypeError(
                f"{caller}: precondition must be True or False, got {self.precondition!r}"
            )


def loss_weights(loss: object, caller: str, what: str = "loss") -> dict[str, float]:
    """A data-term name or a dict of weights, checked, as a dict of weights."""
    if isinstance(loss, str):
        loss = {loss: 1.0}
    if not isinstance(loss, dict) or not loss:
        raise ValueError(
            f"{caller}: {what} is {loss!r}; give a data term name or a non-empty "
            "dict of weights, e.g. {'sinkhorn': 1.0}"
        )
    out = {}
    for name, w in loss.items():
        check_choice(caller, "loss", name, LOSSES)
        out[name] = check_positive(caller, f"weight of {name}", w)
    return out


@dataclass(frozen=True)
class Level:
    """One level of the coarse-to-fine fit.

    Args:
        points: both surfaces are decimated to about this many vertices.
        scale: mm; the Sinkhorn blur and the varifold/currents kernel width at this level.
        loss: this level's data term (a name or a dict of weights); None: ``register``'s
            ``loss`` (or its default).

    Example:
        >>> import otreg
        >>> otreg.Level(2000, 4.0, {"sinkhorn": 1.0, "varifold": 0.5}).loss
        {'sinkhorn': 1.0, 'varifold': 0.5}
    """

    points: int
    scale: float
    loss: str | dict[str, float] | None = field(default=None)

    def __post_init__(self) -> None:
        caller = "Level"
        _set(self, "points", check_int(caller, "points", self.points, 4))
        _set(self, "scale", check_positive(caller, "scale", self.scale))
        if self.loss is not None:
            _set(self, "loss", loss_weights(self.loss, caller))
