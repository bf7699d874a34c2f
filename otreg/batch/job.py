"""One registration job: the options a command line or a manifest row may set
(:class:`JobOptions`, declared once), and :func:`run_job` (load, register, save, pictures),
which ``otreg register``, ``otreg demo`` and every batch worker call: ``otreg register`` is a
batch of one.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .._checks import check_choice, check_device, check_int, check_positive
from ..io import (
    VOLUME_SMOOTH,
    VertexValues,
    load_input,
    load_values,
    save_values,
    values_stem,
)
from ..registration import LBFGSOptions, LDDMMOptions, PrealignOptions, register
from ..registration.losses import LOSSES, SINKHORN_TERM
from ..registration.options import MODELS, PREALIGNS
from ..registration.result import OUTPUTS
from ..registration.transfer import checked_values
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
        smooth: Taubin smoothing iterations for both inputs as read (>= 0); None:
            :data:`otreg.io.VOLUME_SMOOTH` for a surface made from a volume (its voxels'
            steps), none for a mesh; 0 keeps a volume's steps.
        max_iter: L-BFGS iterations a level; None: :class:`~otreg.LBFGSOptions`' default.
        refine: after the LDDMM fit, fit the narrower refinement
            (:class:`~otreg.RefineOptions`' defaults); false: the first fit alone.
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
    smooth: int | None = None
    max_iter: int | None = None
    refine: bool = True
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
        if self.smooth is not None:
            check_int(what, "smooth", self.smooth, 0)
        if self.max_iter is not None:
            check_int(what, "max_iter", self.max_iter, 1)
        for name in ("refine", "picture"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"{what}: {name} must be true or false, got {getattr(self, name)!r}"
                )

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
            "refine": self.refine,
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
            "volume_smooth": VOLUME_SMOOTH,
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


def carried_name(path: str | Path) -> str:
    """The name of a carried values file in a job's folder, without the ``to-<side>_`` that
    :func:`run_job` puts first: the file's name, less its BIDS entities (``sub-01_hemi-L_
    thickness.shape.gii`` -> ``thickness.shape.gii``). FreeSurfer's files become GIFTI, the
    format that both FreeSurfer and Workbench read, less the source's hemisphere (the values
    now lie on the other surface; a BIDS name takes no ``lh.``): ``lh.sulc`` ->
    ``sulc.shape.gii``, ``lh.aparc.annot`` -> ``aparc.label.gii``.

    Example:
        >>> from otreg.batch.job import carried_name
        >>> carried_name("/d/sub-01_hemi-L_thickness.shape.gii"), carried_name("/d/lh.sulc")
        ('thickness.shape.gii', 'sulc.shape.gii')
    """
    name = Path(path).name
    hemisphere = re.match(r"^[lr]h\.(.+)$", name)
    if hemisphere:  # FreeSurfer's surf/lh.NAME or label/lh.NAME.annot
        rest = hemisphere.group(1)
        if rest.endswith(".annot") and len(rest) > len(".annot"):
            return rest.removesuffix(".annot") + ".label.gii"
        if values_stem(name) == name:  # no extension: a morphometry file
            return rest + ".shape.gii"
    parts = name.split("_")
    suffix = parts[-1].split(".")[0]
    if len(parts) > 1 and "-" not in suffix and all("-" in part for part in parts[:-1]):
        return parts[-1]
    return name


def carried_outputs(path: str | Path) -> tuple[str, str]:
    """The two names a carried values file may be written under in a job's folder (less
    the ``to-<side>_`` before them): :func:`carried_name`, and the labels' confidence,
    ``<stem>_confidence.npy``.

    Example:
        >>> from otreg.batch.job import carried_outputs
        >>> carried_outputs("/d/sub-01_hemi-L_dseg.label.gii")
        ('dseg.label.gii', 'dseg_confidence.npy')
    """
    name = carried_name(path)
    return name, f"{values_stem(name)}_confidence.npy"


def check_carried_names(files: Sequence[str | Path], what: str) -> None:
    """ValueError where two of ``files`` (carried the same way) would be written under one
    name: the same :func:`carried_name`, or one's name the other's labels' confidence
    (``dk.npy`` and ``dk_confidence.npy``; ``dk.label.gii`` and ``dk.npy``, whose
    confidences share a name). Whether a file holds labels is known only once it is read,
    so every file's confidence name is kept free."""
    taken: dict[str, str] = {}
    for f in files:
        for out in carried_outputs(f):
            if out in taken and taken[out] != str(f):
                why = " (a labels file's confidence is written as <name>_confidence.npy)"
                raise ValueError(
                    f"{what} has {taken[out]} and {f}, which would both be written as "
                    f"{out}{why if out.endswith('_confidence.npy') else ''}"
                )
            taken[out] = str(f)


class InputError(ValueError):
    """An input of a job cannot be registered: unreadable, not a surface, a bad label."""


def _load(role: str, given: str | Path | Shape, label, level, smooth=None) -> Shape:
    """The ``role`` input as a surface; :class:`InputError` names the file and the fault
    (FileNotFoundError when it is missing)."""
    if isinstance(given, Shape):
        shape, name = given, f"the {role} shape"
        if smooth and shape.n_faces:
            shape = shape.smooth(smooth)
    else:
        name = f"{role} {given}"
        if not Path(given).is_file():
            what = "is a folder, not a file" if Path(given).is_dir() else "does not exist"
            raise FileNotFoundError(f"{name} {what}")
        try:
            shape = load_input(given, label, level, smooth=smooth)
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
    source_values: Sequence[str | Path] = (),
    target_values: Sequence[str | Path] = (),
    device: str | torch.device | None = None,
) -> JobOutput:
    """Register ``source`` onto ``target`` (files, or Shapes) and write the result into
    ``folder`` (the files of :data:`JOB_FILES`).

    ``label``/``level`` select a structure of the inputs that are volumes; with
    ``options.points`` both surfaces are decimated first, and the warped surface written is
    the full source carried through the fitted map.

    ``source_values`` (files of :func:`~otreg.io.load_values` at the source's vertices) are
    carried onto the target's vertices (:meth:`~otreg.Registration.transfer`) and written as
    ``to-target_<name>`` in the same format (FreeSurfer's as GIFTI), ``<name>`` from
    :func:`carried_name`;
    ``target_values`` onto the source's as ``to-source_<name>``. Labels keep their table; their
    confidence goes beside them as ``to-<side>_<name>_confidence.npy``.

    ``device`` (``"cuda"``, ``"cuda:1"``; default the CPU) is where the registration runs:
    the surfaces are read on the CPU and moved there; what is written is the same.

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
    device = check_device("run_job", device)
    for what, files in (("source_values", source_values), ("target_values", target_values)):
        check_carried_names(files, f"run_job: {what}")
    start = time.perf_counter()  # reading (meshing a volume) is no part of register's time
    full, full_target = (
        _load(role, given, label, level, options.smooth)
        for role, given in (("source", source), ("target", target))
    )
    carried = {  # read and checked before the work: (file, values) by the side they go to
        "target": [
            _read_carried("source", path, full, full_target, source) for path in source_values
        ],
        "source": [
            _read_carried("target", path, full_target, full, target) for path in target_values
        ],
    }
    src, tgt = (
        s
        if options.points is None
        else dataclasses.replace(s.decimate(options.points), source=s.source)
        for s in (full, full_target)
    )
    read_seconds = time.perf_counter() - start
    if device is not None:
        src, tgt = src.to(device), tgt.to(device)
        truth = None if truth is None else truth.to(device)
    res = register(src, tgt, truth=truth, progress=progress, **options.register_options())
    if options.points is not None:  # the metrics are the decimated fit's
        res.warped, res.target = res.transform(full), full_target
    folder = Path(folder)
    for name in PICTURES.values():  # an earlier run's, which this one's would not replace
        (folder / name).unlink(missing_ok=True)
    res.metrics.update(_overlaps(res, full, full_target, carried), read_seconds=read_seconds)
    res.save(folder)
    files = dict(OUTPUTS)
    for to, given in carried.items():
        for path, values in given:
            files.update(_carry(res, to, path, values, full_target, folder))
    if options.picture:
        for role, path in plot_registration(res, src, tgt, folder).items():
            files[role] = Path(path).name
    return JobOutput(res, src, tgt, full, files)


def _overlaps(res, source: Shape, target: Shape, carried: dict) -> dict:
    """For each labels file carried both ways under one name (:func:`carried_name`): the
    mean Dice of the source's labels carried onto the target with the target's own, after
    and before the registration (:meth:`~otreg.Registration.label_overlap`), as
    ``<name>_dice`` and ``before_<name>_dice``, ``<name>`` the file's name less its
    extension (``dseg.label.gii`` -> ``dseg``, ``lh.aparc.annot`` -> ``aparc``); the
    tables' "no label" entries (:func:`otreg.io.unlabelled`) are left out of the mean."""
    theirs = {carried_name(path): (path, values) for path, values in carried["source"]}
    out = {}
    for path, mine in carried["target"]:
        name = carried_name(path)
        if name not in theirs or not (mine.is_labels and theirs[name][1].is_labels):
            continue
        other, own = theirs[name]
        try:
            overlap = res.label_overlap(mine, own, source=source, target=target)
        except (ValueError, TypeError) as err:
            raise InputError(f"labels {name} (of {path} and {other}): {err}") from err
        key = re.sub(r"\W+", "_", values_stem(name)).strip("_") or "labels"
        out[f"{key}_dice"], out[f"before_{key}_dice"] = overlap["dice"], overlap["before_dice"]
    return out


def _read_carried(side: str, path: str | Path, surface: Shape, other: Shape, surface_file) -> tuple:
    """``(path, values)``: the values of file ``path`` at the vertices of ``surface`` (the
    ``side``, given as ``surface_file``; ``other`` the other side), checked as the transfer
    will carry them (one a vertex, a map finite, the surface's structure); errors name the
    file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{side} values {path} does not exist")
    try:
        values = load_values(path)
    except (ValueError, TypeError, OSError) as err:
        raise InputError(f"{side} values {path}: {err}") from err
    try:
        checked_values(f"{side} values {path}", values, surface, side, surface_file=surface_file)
    except (ValueError, TypeError) as err:
        name = "target" if side == "source" else "source"
        hint = ""
        if values.n_vertices == other.n_points != surface.n_points:
            hint = f" (it has the {name}'s vertex count: are these {name} values?)"
        raise InputError(f"{err}{hint}") from err
    return path, values


def _carry(
    res, to: str, path: str | Path, values: VertexValues, target: Shape, folder: Path
) -> dict[str, str]:
    """Carry ``values`` (of file ``path``) onto the ``to`` side; write them (and a labels'
    confidence) into ``folder``; their files by role."""
    side = "source" if to == "target" else "target"
    try:
        moved = res.transfer(values, to=to, target=target)
    except (ValueError, TypeError) as err:
        raise InputError(f"{side} values {path}: {err}") from err
    name = f"to-{to}_{carried_name(path)}"
    save_values(moved, folder / name)
    files = {f"to-{to}:{carried_name(path)}": name}
    if moved.confidence is not None:
        confidence = folder / f"to-{to}_{carried_outputs(path)[1]}"
        save_values(moved.confidence, confidence)
        files[f"to-{to}:{carried_name(path)}:confidence"] = confidence.name
    return files
