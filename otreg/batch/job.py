"""One registration job: the options a command line or a manifest row may set
(:class:`JobOptions`, declared once), and :func:`run_job` (load, register, save, pictures),
which ``otreg register``, ``otreg demo`` and every batch worker call: ``otreg register`` is a
batch of one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .._checks import check_choice, check_int, check_positive
from ..io import load_input
from ..registration import LBFGSOptions, LDDMMOptions, PrealignOptions, register
from ..registration.losses import LOSSES, SINKHORN_TERM
from ..registration.options import MODELS, PREALIGNS
from ..registration.result import OUTPUTS
from ..shapes import Shape
from ..viz import plot_registration
from ..viz.surfaces import PICTURES

__all__ = ["JobOptions", "run_job"]

#: Data terms a job may name (landmarks need points that a file does not carry).
JOB_LOSSES = tuple(name for name in LOSSES if name != "landmarks")
#: Every file a job writes into its folder, by role.
JOB_FILES = {**OUTPUTS, **PICTURES}


@dataclass(frozen=True)
class JobOptions:
    """The registration options of a job, checked when built: the flags of ``otreg
    register``, ``otreg batch`` and ``otreg bids``, and the keys of a manifest row's
    ``options`` (a JSON object).

    Args:
        model: ``"lddmm"`` or a linear model (``"rigid"``, ``"similarity"``, ``"affine"``).
        prealign: ``"rigid"``, ``"similarity"``, ``"affine"`` or ``"none"``.
        loss: a data term at every level; None: the Sinkhorn divergence at the coarse
            level, the varifold at the fine one.
        sigma: the LDDMM kernel width, mm; None: two widths, a tenth and a 27th of the
            target's size.
        points: decimate both surfaces to about this many vertices before registering
            (>= 100); None: the full surfaces. The saved warped surface is always the
            full source carried through the map.
        max_iter: L-BFGS iterations a level; None: :class:`~otreg.LBFGSOptions`' default.
        picture: draw ``picture.png`` and ``history.png``.

    Example:
        >>> from otreg.batch import JobOptions
        >>> JobOptions.from_mapping({"model": "affine", "max_iter": 5}, "row 2").model
        'affine'
    """

    model: str = "lddmm"
    prealign: str = "rigid"
    loss: str | None = None
    sigma: float | None = None
    points: int | None = None
    max_iter: int | None = None
    picture: bool = True

    def __post_init__(self) -> None:
        self.check("JobOptions")

    def check(self, what: str) -> None:
        """Every field against its choices; errors begin with ``what``."""
        check_choice(what, "model", self.model, MODELS)
        check_choice(what, "prealign", self.prealign, PREALIGNS)
        if self.loss is not None:
            check_choice(what, "loss", self.loss, JOB_LOSSES)
        if self.sigma is not None:
            object.__setattr__(self, "sigma", check_positive(what, "sigma", self.sigma))
        if self.points is not None:
            check_int(what, "points", self.points, 100)
        if self.max_iter is not None:
            check_int(what, "max_iter", self.max_iter, 1)
        if not isinstance(self.picture, bool):
            raise TypeError(f"{what}: picture must be true or false, got {self.picture!r}")

    @classmethod
    def from_mapping(cls, values: object, what: str, base: JobOptions | None = None) -> JobOptions:
        """``base`` (default: the defaults) with the options in ``values`` (a mapping, e.g.
        a row's JSON object); an unknown key, a wrong type or a bad value raises, the
        message beginning with ``what``."""
        if not isinstance(values, Mapping):
            raise TypeError(f"{what} must be a JSON object, got {type(values).__name__}")
        names = JOB_OPTION_NAMES
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(
                f"{what}: unknown option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(repr, unknown))}; allowed: {', '.join(names)}"
            )
        merged = dataclasses.asdict(base or cls()) | dict(values)
        options = cls.__new__(cls)  # checked with the caller's words, not JobOptions'
        for name in names:
            object.__setattr__(options, name, merged[name])
        options.check(what)
        return options

    def register_options(self) -> dict:
        """The keyword arguments of :func:`otreg.register` that these options mean."""
        optimizer = LBFGSOptions() if self.max_iter is None else LBFGSOptions(self.max_iter)
        return {
            "model": LDDMMOptions(sigma=self.sigma) if self.model == "lddmm" else self.model,
            "prealign": self.prealign,
            "loss": self.loss,
            "optimizer": optimizer,
        }

    def record(self) -> dict:
        """The options as results record them, every default filled in, the library's
        option objects included (their defaults change results too)."""
        out = dataclasses.asdict(self)
        kw = self.register_options()
        out["max_iter"] = kw["optimizer"].max_iter
        asdict = dataclasses.asdict
        out["library"] = {
            "lddmm": asdict(LDDMMOptions(sigma=self.sigma)),
            "optimizer": asdict(kw["optimizer"]),
            "prealign": asdict(PrealignOptions(self.prealign)),
            "sinkhorn": asdict(SINKHORN_TERM),
        }
        return out


#: The fields of :class:`JobOptions`.
JOB_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(JobOptions))


@dataclass
class JobOutput:
    """What :func:`run_job` did: the registration, the shapes it registered (decimated to
    ``points``), the full source as read, and the files written by role."""

    registration: object
    source: Shape
    target: Shape
    full_source: Shape
    files: dict[str, str]


class InputError(ValueError):
    """An input of a job cannot be registered: unreadable, not a surface, a bad label."""


def _load(role: str, given: str | Path | Shape, label, level) -> Shape:
    """The ``role`` input as a surface; :class:`InputError` names the file and the fault
    (FileNotFoundError when it is missing)."""
    if isinstance(given, Shape):
        shape, name = given, f"the {role} shape"
    else:
        name = f"{role} {given}"
        if not Path(given).is_file():
            what = "is a folder, not a file" if Path(given).is_dir() else "does not exist"
            raise FileNotFoundError(f"{name} {what}")
        try:
            shape = load_input(given, label, level)
        except (ValueError, TypeError, OSError) as err:
            raise InputError(str(err)) from err
    if shape.n_faces == 0:
        raise InputError(
            f"{name} has no triangles (a point cloud); a registration compares surfaces: "
            "give a mesh, or a volume with a label or level"
        )
    return shape


def run_job(
    source: str | Path | Shape,
    target: str | Path | Shape,
    folder: str | Path,
    options: JobOptions | None = None,
    *,
    label: float | None = None,
    level: float | None = None,
    truth: torch.Tensor | None = None,
    progress: bool | None = False,
) -> JobOutput:
    """Register ``source`` onto ``target`` (files, or Shapes) and write the result into
    ``folder`` (the files of :data:`JOB_FILES`).

    ``label``/``level`` select a structure of the inputs that are volumes; with
    ``options.points`` both surfaces are decimated first, and the warped surface written is
    the full source carried through the fitted map.

    Example:
        >>> import tempfile, pathlib, pyvista as pv, otreg
        >>> from otreg.batch import JobOptions, run_job
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20))
        >>> _ = otreg.save_shape(ball, d / "a.vtk")
        >>> _ = otreg.save_shape(ball.with_points(ball.points + 1.0), d / "b.vtk")
        >>> out = run_job(d / "a.vtk", d / "b.vtk", d / "out", JobOptions("rigid", picture=False))
        >>> sorted(out.files)
        ['parameters', 'registration', 'warped']
    """
    options = options or JobOptions()
    if not isinstance(options, JobOptions):
        raise TypeError(f"run_job: options must be a JobOptions, got {type(options).__name__}")
    full, full_target = _load("source", source, label, level), _load("target", target, label, level)
    src, tgt = (
        s
        if options.points is None
        else dataclasses.replace(s.decimate(options.points), source=s.source)
        for s in (full, full_target)
    )
    res = register(src, tgt, truth=truth, progress=progress, **options.register_options())
    if options.points is not None:  # the metrics are the decimated fit's
        res.warped = res.transform(full)
    folder = Path(folder)
    for name in PICTURES.values():  # an earlier run's, which this one's would not replace
        (folder / name).unlink(missing_ok=True)
    res.save(folder)
    files = dict(OUTPUTS)
    if options.picture:
        for role, path in plot_registration(res, src, tgt, folder).items():
            files[role] = Path(path).name
    return JobOutput(res, src, tgt, full, files)
