"""The result of :func:`otreg.register`: the warped source, the transform, its metrics and
history; saved as ``warped.vtk``, ``parameters.npz`` (no pickle) and ``registration.json``,
which carry one run id so that a folder mixing two runs is refused at load."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .._checks import check_choice, check_positive
from ..io import (
    OUTPUTS_RECORD,
    VertexValues,
    atomic_write_all,
    check_writable_folder,
    gifti_structure,
    load_shape,
    read_pyvista_mesh,
    remove_stale_temps,
    replace_recorded_outputs,
    same_file,
    unlabelled,
)
from ..ot.solver import sinkhorn
from ..shapes import Shape
from . import metrics
from .lddmm import LDDMM, ComposedLDDMM
from .linear import _Linear
from .transfer import carry, checked_values, vertex_values

__all__ = ["Registration"]

#: The files :meth:`Registration.save` writes, by role.
OUTPUTS = {
    "warped": "warped.vtk",
    "parameters": "parameters.npz",
    "registration": "registration.json",
}


@dataclass
class Registration:
    """The result of :func:`register`.

    Attributes:
        warped: the source moved by the whole transform (all its vertices).
        linear: the pre-alignment (Rigid/Similarity/Affine module) or None.
        deformation: the fitted :class:`~otreg.registration.LDDMM`, or with a refinement
            the :class:`~otreg.registration.ComposedLDDMM` of it and the refinement's, or
            None (a linear model).
        history: one dict per objective evaluation: level, evaluation, loss, energy, data
            terms, seconds.
        metrics: surface distances, varifold distance, Jacobian determinants (and vertex
            errors when the truth was given); the time of the whole call (``seconds``) and
            of its parts: ``prealign_seconds``, ``fit_seconds`` (every level),
            ``metrics_seconds`` (every source vertex moved, with its Jacobian, and these
            metrics).
        options: the effective options of the run (the option objects' fields).
        inputs: the files the source and target were read from (``{"source": path or
            None, "target": ...}``, absolute paths); :meth:`save` never writes over them.
        target: the target surface (in memory after :func:`register`; after :meth:`load`,
            read from ``inputs`` when :meth:`transfer` needs it).
        target_summary: the target's vertex count, area (mm^2), centroid (mm) and second
            moments (mm^2), as :meth:`save` recorded them (after :meth:`load`): a target
            given later, or read from a file that changed since, must match them.

    Example:
        >>> import pyvista as pv, torch, otreg, tempfile
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
        >>> res = otreg.register(ball, ball.with_points(ball.points + 2.0), model="rigid",
        ...                      progress=False)
        >>> res.transform(torch.zeros(1, 3)).round(decimals=1)   # the centre moves 2 mm
        tensor([[2., 2., 2.]])
        >>> otreg.Registration.load(res.save(tempfile.mkdtemp())).metrics == res.metrics
        True
    """

    warped: Shape
    linear: torch.nn.Module | None
    deformation: LDDMM | ComposedLDDMM | None
    history: list[dict] = field(default_factory=list, repr=False)
    metrics: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict, repr=False)
    inputs: dict = field(default_factory=dict, repr=False)
    target: Shape | None = field(default=None, repr=False)
    target_summary: dict | None = field(default=None, repr=False)

    @property
    def momenta(self) -> torch.Tensor | None:
        """The fitted momenta ``(K, 3)`` (the first LDDMM's, with a refinement), detached;
        None without a deformation."""
        return None if self.deformation is None else self.deformation.momenta.detach()

    def transform(self, what: torch.Tensor | np.ndarray | Shape) -> torch.Tensor | Shape:
        """Carry points ``(N, 3)`` (tensor or NumPy array) or a Shape (of the source's space)
        through the transform; integer points come back as float64."""
        if isinstance(what, Shape):
            return what.with_points(self.transform(what.points))
        if isinstance(what, np.ndarray):
            return self.transform(torch.as_tensor(what)).numpy()
        dtype = _checked_points("transform", what)
        if len(what) == 0:
            return what.to(dtype)
        with torch.no_grad():
            return self.apply(what.detach().double()).to(dtype)

    @property
    def device(self) -> torch.device:
        """Where the fitted transform lives (its parameters' device)."""
        for part in (self.deformation, self.linear):
            if part is not None:
                return next(iter(part.buffers())).device
        return self.warped.points.device

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The whole transform of points ``(N, 3)``, differentiable in x (for Jacobians),
        computed on the transform's device and returned on x's."""
        where = x.device
        x = x.to(self.device)
        if self.linear is not None:
            x = self.linear(x)
        if self.deformation is not None:
            x = self.deformation(x)
        return x.to(where)

    def inverse_transform(self, what: torch.Tensor | np.ndarray | Shape) -> torch.Tensor | Shape:
        """Carry points ``(N, 3)`` (tensor or NumPy array) or a Shape of the target's space
        back to the source's: the deformation's flow undone step by step
        (:meth:`~otreg.registration.LDDMM.inverse`), then the pre-alignment's inverse.
        ``inverse_transform(transform(x))`` is x to about 1e-6 of its size after a float32
        fit (the default: the forward map's rounding), 1e-10 after ``dtype=torch.float64``.

        Example:
            >>> import pyvista as pv, torch, otreg
            >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
            >>> res = otreg.register(ball, ball.with_points(ball.points * 1.1), progress=False)
            >>> x = ball.points[:5]
            >>> bool((res.inverse_transform(res.transform(x)) - x).abs().max() < 1e-4)
            True
        """
        if isinstance(what, Shape):
            return what.with_points(self.inverse_transform(what.points))
        if isinstance(what, np.ndarray):
            return self.inverse_transform(torch.as_tensor(what)).numpy()
        dtype = _checked_points("inverse_transform", what)
        if len(what) == 0:
            return what.to(dtype)
        x = what.detach().double().to(self.device)
        with torch.no_grad():
            if self.deformation is not None:
                x = self.deformation.inverse(x)
            if self.linear is not None:
                x = self.linear.inverse(x)
        return x.to(what.device, dtype)

    def transfer(
        self,
        values: torch.Tensor | np.ndarray | str | Path | VertexValues,
        to: str = "target",
        kind: str = "auto",
        *,
        target: Shape | None = None,
    ) -> VertexValues:
        """Carry per-vertex values from one surface onto the other's vertices.

        ``to="target"``: values at the source's vertices land on the target's: each target
        vertex takes them from the nearest point of the warped source surface (its
        triangle's three vertices, weighted by the point's barycentric coordinates).
        ``to="source"``: values at the target's vertices land on the source's: each warped
        source vertex takes them from the nearest point of the target surface. Every vertex
        receives a value.

        Args:
            values: ``(N,)`` or ``(N, C)`` values at the vertices of the surface they come
                from, a :class:`~otreg.io.VertexValues` (its label table is kept), the
                name of a per-vertex array that surface carries in ``data``, or a file of
                them as a ``pathlib.Path`` (read with :func:`~otreg.io.load_values`).
            to: ``"target"`` or ``"source"``.
            kind: ``"map"`` (barycentric interpolation: thickness, activation), ``"labels"``
                (the label whose corners of the nearest triangle hold the most barycentric
                weight, summed over the corners that carry it; that sum is returned as the
                vertex's confidence, in [1/3, 1]; floats that are whole numbers are taken
                as integers) or ``"auto"`` (labels for integers; floats that are all whole
                numbers, with few distinct values, are carried as a map with a warning).
            target: the target surface, where the result does not hold it (loaded from
                files whose target file moved).

        Returns:
            :class:`~otreg.io.VertexValues` at the destination's vertices: the values'
            dtype and label table, and for labels a ``confidence`` per vertex.

        Example:
            >>> import pyvista as pv, torch, otreg
            >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
            >>> res = otreg.register(ball, ball.with_points(ball.points + 2.0), model="rigid",
            ...                      progress=False)
            >>> z = ball.points[:, 2]                    # a map on the source: its height
            >>> moved = res.transfer(z, to="target")     # on the target: the same height
            >>> float((moved.values - z).abs().max()) < 0.3
            True
        """
        caller = "Registration.transfer"
        check_choice(caller, "to", to, ("target", "source"))
        check_choice(caller, "kind", kind, ("auto", "map", "labels"))
        goal = self._target(caller, target)
        origin, onto = (self.warped, goal) if to == "target" else (goal, self.warped)
        role = "source" if to == "target" else "target"
        given, labels = checked_values(
            caller, values, origin, role, kind, onto, surface_file=self.inputs.get(role)
        )
        out = carry(given, origin, onto.points, labels)
        return dataclasses.replace(out, structure=gifti_structure(self.inputs.get(to)))

    def label_probabilities(
        self,
        labels: torch.Tensor | np.ndarray | str | VertexValues,
        to: str = "target",
        *,
        blur: float | None = None,
        target: Shape | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Soft labels from a transport plan: each destination vertex's probability of
        each label.

        The entropic optimal transport plan ``pi`` between the two surfaces' area measures
        (the warped source's and the target's, :func:`otreg.sinkhorn` at ``blur``) spreads
        each vertex's mass over the other surface's vertices within about ``blur``; the
        probability of label ``l`` at destination vertex ``j`` is the share of the mass it
        receives from vertices labelled ``l``: ``sum_i pi_ij [label_i = l] / sum_i pi_ij``.
        Where :meth:`transfer` picks one label from the nearest triangle, these say how
        sure that is at the scale of ``blur`` (near a border: shared).

        Args:
            labels: ``(N,)`` integer labels at the vertices of the surface they come from
                (or a :class:`~otreg.io.VertexValues`, or the name of an array in its
                ``data``).
            to: ``"target"`` or ``"source"``.
            blur: mm; default the finest scale the fit used (its last level's).
            target: the target surface, where the result does not hold it.

        Returns:
            ``(probabilities, values)``: ``(M, L)`` float64 rows summing to 1 at the
            destination's ``M`` vertices, and the ``(L,)`` labels of the columns.

        Example:
            >>> import pyvista as pv, torch, otreg
            >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
            >>> res = otreg.register(ball, ball, model="rigid", progress=False)
            >>> halves = (ball.points[:, 2] > 0).long()
            >>> p, values = res.label_probabilities(halves, blur=2.0)
            >>> values.tolist(), bool(torch.allclose(p.sum(1), torch.ones(len(p), dtype=p.dtype)))
            ([0, 1], True)
            >>> float(p[ball.points[:, 2].argmax(), 1]) > 0.99     # the north pole: upper
            True
        """
        caller = "Registration.label_probabilities"
        check_choice(caller, "to", to, ("target", "source"))
        goal = self._target(caller, target)
        origin, onto = (self.warped, goal) if to == "target" else (goal, self.warped)
        given = vertex_values(caller, labels, origin, "source" if to == "target" else "target")
        if not given.is_labels or given.values.dim() != 1:
            raise ValueError(
                f"{caller}: labels are {given.values.dtype} of shape "
                f"{tuple(given.values.shape)}; labels are one integer a vertex"
            )
        if blur is None:
            levels = self.options.get("levels") or []
            if not levels:
                raise ValueError(f"{caller}: this result records no fit's scale: give blur= (mm)")
            blur = float(levels[-1]["scale"])
        blur = check_positive(caller, "blur", blur)
        values, index = torch.unique(given.values, return_inverse=True)
        x, y = (s.points.detach().double().cpu() for s in (origin, onto))
        a, b = (s.point_areas.detach().double().cpu() for s in (origin, onto))
        with torch.no_grad():
            plan = sinkhorn(x, y, a / a.sum(), b / b.sum(), blur=blur).plan
            onehot = torch.nn.functional.one_hot(index, len(values)).double()
            mass = plan.apply_t(onehot)  # (M, L): the mass each vertex gets from each label
        return mass / mass.sum(1, keepdim=True).clamp_min(1e-300), values

    def label_overlap(
        self,
        source_labels: torch.Tensor | np.ndarray | str | VertexValues,
        target_labels: torch.Tensor | np.ndarray | str | VertexValues,
        *,
        source: Shape | None = None,
        target: Shape | None = None,
        ignore: Sequence[int] | set[int] | None = None,
    ) -> dict[str, float]:
        """How well the source's labels land on the target's own, before and after.

        The source's labels are carried onto the target's vertices as :meth:`transfer` does,
        from the warped source (after) and from the source as given (before: ``source``, or
        the warped source brought back by :meth:`inverse_transform`), and compared with the
        target's labels: the Dice overlap ``2|A ∩ B| / (|A| + |B|)`` of each label, averaged
        over every label either side has (a label one side lacks scores 0) but those in
        ``ignore``: by default the "no label" entries, -1 and the keys the label tables name
        ``unknown``, ``???`` or ``medial_wall`` (:func:`otreg.io.unlabelled`), which would
        otherwise count an atlas's background as a region.

        Args:
            source_labels: ``(N,)`` integer labels at the source's vertices (or a
                :class:`~otreg.io.VertexValues`, or the name of an array in the warped
                source's ``data``).
            target_labels: ``(M,)`` integer labels at the target's vertices (or the name of
                an array in the target's ``data``).
            source: the source surface as given (default: recovered by the inverse map).
            target: the target surface, where the result does not hold it.
            ignore: labels left out of the mean, e.g. ``(0,)`` for an atlas's "unknown" or
                medial wall given without a table: their vertices still count against the
                label they should have. None (default): :func:`otreg.io.unlabelled` of the
                two; ``()``: every label.

        Returns:
            ``{"dice": after, "before_dice": before}``, each in [0, 1].

        Example:
            >>> import pyvista as pv, torch, otreg
            >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
            >>> moved = ball.with_points(ball.points + torch.tensor([8.0, 0, 0]))
            >>> res = otreg.register(ball, moved, model="rigid", progress=False)
            >>> halves = (ball.points[:, 0] > 0).long()      # a label per hemisphere
            >>> overlap = res.label_overlap(halves, halves)
            >>> overlap["before_dice"] < 0.9 < overlap["dice"]
            True
        """
        caller = "Registration.label_overlap"
        goal = self._target(caller, target)
        if source is not None and (not isinstance(source, Shape) or source.n_faces == 0):
            raise TypeError(f"{caller}: source must be a surface Shape, got {source!r}")
        if source is not None and source.n_points != self.warped.n_points:
            raise ValueError(
                f"{caller}: source has {source.n_points} vertices; the warped source has "
                f"{self.warped.n_points}: give the surface that was registered"
            )
        given = vertex_values(caller, source_labels, self.warped, "source", name="source_labels")
        own = vertex_values(caller, target_labels, goal, "target", name="target_labels")
        for name, v in (("source_labels", given), ("target_labels", own)):
            if not v.is_labels or v.values.dim() != 1:
                raise ValueError(
                    f"{caller}: {name} are {v.values.dtype} of shape "
                    f"{tuple(v.values.shape)}; labels are one integer a vertex"
                )
        if ignore is None:
            ignore = unlabelled(given, own)
        if not isinstance(ignore, (tuple, list, set, frozenset)) or not all(
            isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in ignore
        ):
            raise TypeError(
                f"{caller}: ignore must be a sequence of integer labels, got {ignore!r}"
            )
        before = source if source is not None else self.inverse_transform(self.warped)
        truth = own.values.numpy()
        every = np.arange(goal.n_points)
        left_out = tuple(int(k) for k in ignore)
        return {
            when: metrics.label_dice(
                carry(given, shape, goal.points, True).values, truth, every, left_out
            )
            for when, shape in (("dice", self.warped), ("before_dice", before))
        }

    def _target(self, caller: str, given: Shape | None) -> Shape:
        """The target surface: given, kept since :func:`register`, or read from its file."""
        if given is not None:
            if not isinstance(given, Shape) or given.n_faces == 0:
                raise TypeError(f"{caller}: target must be a surface Shape, got {given!r}")
            self._check_target(caller, given, "the target given")
            return given
        if self.target is not None:
            return self.target
        path = self.inputs.get("target")
        if path and Path(path).is_file():
            target = load_shape(path)
            self._check_target(caller, target, f"the target file {path}")
            self.target = target
            return self.target
        raise FileNotFoundError(
            f"{caller}: this result does not hold its target surface, and its file "
            f"({path or 'not recorded'}) is not there: give target= (the surface registered "
            "onto)"
        )

    def _check_target(self, caller: str, shape: Shape, what: str) -> None:
        """Refuse a target that is not the surface registered onto (another template,
        hemisphere, resolution or surface of the subject, or the same one moved): its
        vertex count, area, centroid or second moments differ from the registered
        target's (to 0.1% of its size)."""
        if shape is self.target:  # the one registered onto (run_job passes it per file)
            return
        known = _summary(self.target) if self.target is not None else self.target_summary
        if not known:
            return
        have, size = _summary(shape), max(float(known["area_mm2"]) ** 0.5, 1e-12)
        moved = float(np.linalg.norm(np.subtract(have["centroid_mm"], known["centroid_mm"])))
        if have["vertices"] != known["vertices"]:
            differs = f"{have['vertices']} vertices, the registered target {known['vertices']}"
        elif abs(have["area_mm2"] - known["area_mm2"]) > 1e-3 * known["area_mm2"]:
            differs = (
                f"an area of {have['area_mm2']:.6g} mm^2, the registered target "
                f"{known['area_mm2']:.6g}"
            )
        elif moved > 1e-3 * size:
            differs = f"its centroid {moved:.3g} mm from the registered target's"
        elif (
            "moments_mm2" in known
            and float(np.abs(np.subtract(have["moments_mm2"], known["moments_mm2"])).max())
            > 1e-3 * size**2
        ):
            differs = "its orientation (the second moments of its vertices) differs"
        else:
            return
        raise ValueError(
            f"{caller}: {what} is not the surface this registration was fitted onto "
            f"({differs}): give that surface"
        )

    def jacobians(self, points: torch.Tensor) -> torch.Tensor:
        """The Jacobian matrices of the whole transform at ``points`` (N, 3), float64:
        ``(N, 3, 3)``, no gradient (the pre-alignment's matrix times the deformation's,
        :meth:`~otreg.registration.LDDMM.jacobians`)."""
        return transform_jacobians(self.linear, self.deformation, points)

    def save(self, folder: str | Path) -> Path:
        """Write warped.vtk, parameters.npz (no pickle) and registration.json, all or
        nothing: each carries the same run id, which :meth:`load` checks. Refuses
        (ValueError) a folder where one of them would replace an input of the run, and
        (PermissionError or ValueError, naming it) a folder that cannot be written. In a
        folder where an otreg command wrote (its ``.otreg-outputs`` record), the files that
        command wrote and this save does not replace (pictures, carried values) are
        removed, as a command's next run would (:func:`otreg.io.replace_recorded_outputs`):
        the folder never mixes two runs."""
        folder = Path(folder)
        for name in OUTPUTS.values():
            for role, given in self.inputs.items():
                if given is not None and same_file(folder / name, given):
                    raise ValueError(
                        f"Registration.save: {folder / name} is the {role} of this "
                        f"registration ({given}); otreg never overwrites an input: choose "
                        "another folder"
                    )
        check_writable_folder(folder, "Registration.save")  # not a raw OSError from deep inside
        remove_stale_temps(folder, tuple(OUTPUTS.values()))  # left by a save that was killed
        run_id = uuid.uuid4().hex
        mesh = self.warped.with_points(self.warped.points.detach()).to_pyvista()
        mesh.field_data["run_id"] = np.array([run_id])
        params: dict[str, np.ndarray] = {"run_id": np.array(run_id)}
        for part in (self.linear, self.deformation):
            if part is not None:
                params.update(part.to_arrays())
        doc = {
            "run_id": run_id,
            "options": self.options,
            "metrics": self.metrics,
            "history": self.history,
            "inputs": self.inputs,
        }
        summary = _summary(self.target) if self.target is not None else self.target_summary
        if summary:
            doc["target_surface"] = summary
        text = json.dumps(doc, indent=2, default=str)
        atomic_write_all(
            {
                folder / OUTPUTS["warped"]: lambda p: mesh.save(str(p)),
                folder / OUTPUTS["parameters"]: lambda p: np.savez(p, **params),
                folder / OUTPUTS["registration"]: lambda p: p.write_text(text),
            }
        )
        if (folder / OUTPUTS_RECORD).is_file():
            replace_recorded_outputs(folder, OUTPUTS.values(), list(self.inputs.values()))
        return folder

    @classmethod
    def load(cls, path: str | Path) -> Registration:
        """Read what :meth:`save` wrote; ``transform`` then works as before (the linear part
        comes back as an :class:`~otreg.registration.Affine` of the same matrix).

        Args:
            path: the folder :meth:`save` wrote into, or one of its files. Files named with
                a prefix are read too: a batch's BIDS derivatives
                (``sub-01_hemi-L_space-tpl_desc-otreg_parameters.npz`` and its siblings),
                given as one of the files, or as their folder when it holds one such set.

        Raises:
            FileNotFoundError: a file of the set is missing.
            ValueError: the files come from different runs, or the folder holds several
                prefixed sets (the message lists them: give one's file).
        """
        caller = "Registration.load"
        folder, prefix = _locate(caller, Path(path).expanduser())
        paths = {role: folder / f"{prefix}{name}" for role, name in OUTPUTS.items()}
        missing = [p for p in (paths["parameters"], paths["registration"], paths["warped"])
                   if not p.exists()]  # fmt: skip
        if len(missing) == 3:
            raise FileNotFoundError(
                f"{caller}: {path} is not a registration's folder or file (it holds none of "
                f"{', '.join(OUTPUTS.values())})"
            )
        if missing:
            raise FileNotFoundError(f"{caller}: {missing[0]} is missing")
        mesh = read_pyvista_mesh(paths["warped"], caller)
        ids = {"warped": mesh.field_data["run_id"][0] if "run_id" in mesh.field_data else None}
        try:
            with np.load(paths["parameters"], allow_pickle=False) as arrays:
                ids["parameters"] = arrays["run_id"] if "run_id" in arrays.files else None
                linear = _Linear.from_arrays(arrays) if "linear_kind" in arrays else None
                deformation = ComposedLDDMM.from_arrays(arrays) if "momenta" in arrays else None
        except Exception as err:  # a zip, pickle or array error: say which file
            raise ValueError(_unreadable(caller, paths["parameters"], err)) from err
        try:
            doc = json.loads(paths["registration"].read_text())
            if not isinstance(doc, dict) or not {"history", "metrics", "options"} <= set(doc):
                raise ValueError("not an object with history, metrics and options")
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError among them
            raise ValueError(_unreadable(caller, paths["registration"], err)) from err
        ids["registration"] = doc.get("run_id")
        ids = {name: None if v is None else str(v) for name, v in ids.items()}
        if len(set(ids.values())) > 1:  # no run id in all three: saved before they were
            found = ", ".join(f"{OUTPUTS[role]} {v or 'none'}" for role, v in ids.items())
            raise ValueError(
                f"{caller}: {folder} mixes files of two runs (run ids: {found}); a save "
                "was interrupted or a file was copied in: rerun the registration (or "
                "save it again) into this folder"
            )
        warped = Shape.from_pyvista(mesh, source=str(paths["warped"].absolute()))
        return cls(
            warped,
            linear,
            deformation,
            doc["history"],
            doc["metrics"],
            doc["options"],
            doc.get("inputs", {}),  # absent from results saved before it was recorded
            target_summary=doc.get("target_surface"),
        )


def _summary(shape: Shape) -> dict:
    """A surface's vertex count, area (mm^2) and vertex centroid (mm): what a target given
    to a saved registration is checked against."""
    points = shape.points.detach().double().cpu()
    return {
        "vertices": int(shape.n_points),
        "area_mm2": float(shape.area.detach().double().cpu()) if shape.n_faces else 0.0,
        "centroid_mm": [float(c) for c in points.mean(0)],
        # the vertices' covariance: a rotation about the centroid changes it
        "moments_mm2": [float(c) for c in torch.cov(points.T).flatten()],
    }


def _locate(caller: str, path: Path) -> tuple[Path, str]:
    """The folder and the file-name prefix of a saved registration given as a folder or as
    one of its files."""
    for name in OUTPUTS.values():
        if path.name.endswith(name) and not path.is_dir():
            return path.parent, path.name[: -len(name)]
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"{caller}: {path} does not exist")
        raise ValueError(
            f"{caller}: {path} is neither a folder nor a saved registration (give the folder "
            f"Registration.save wrote, or its {OUTPUTS['registration']})"
        )
    if (path / OUTPUTS["parameters"]).exists():
        return path, ""
    prefixes = sorted(
        p.name[: -len(OUTPUTS["parameters"])] for p in path.glob(f"*{OUTPUTS['parameters']}")
    )
    if len(prefixes) == 1:
        return path, prefixes[0]
    if len(prefixes) > 1:
        raise ValueError(
            f"{caller}: {path} holds {len(prefixes)} saved registrations "
            f"({', '.join(p + OUTPUTS['parameters'] for p in prefixes[:4])}...); give the "
            "file of the one to load"
        )
    return path, ""  # nothing there: the missing file is named next


def _checked_points(method: str, what) -> torch.dtype:
    """The dtype that ``Registration.<method>`` returns for the points ``what``, a tensor
    (N, 3) of finite numbers (integers come back as float64, never rounded), else an error
    naming what was given."""
    caller = f"Registration.{method}"
    if not isinstance(what, torch.Tensor):
        raise TypeError(
            f"{caller}: give points (N, 3) as a tensor or array, or a Shape; "
            f"got {type(what).__name__}"
        )
    if what.dim() != 2 or what.shape[1] != 3:
        raise ValueError(f"{caller}: points have shape {tuple(what.shape)}; they must be (N, 3)")
    if what.is_floating_point() and not bool(torch.isfinite(what).all()):
        bad = int((~torch.isfinite(what)).any(1).sum())
        raise ValueError(f"{caller}: {bad} of the {len(what)} points are NaN or infinite")
    return what.dtype if what.is_floating_point() else torch.float64


def transform_jacobians(linear, deformation: LDDMM | ComposedLDDMM | None, points) -> torch.Tensor:
    """The Jacobian matrices ``(N, 3, 3)``, float64, of ``deformation`` after ``linear``
    (either may be None) at ``points`` (N, 3): the linear map's matrix times the
    deformation's Jacobians at the moved points, no gradient."""
    return transform_with_jacobians(linear, deformation, points)[1]


def transform_with_jacobians(
    linear, deformation: LDDMM | ComposedLDDMM | None, points
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(moved points (N, 3), Jacobian matrices (N, 3, 3))``, both float64 on the
    transform's device, of ``deformation`` after ``linear`` at ``points``: one flow for both,
    no gradient."""
    x = torch.as_tensor(points).detach().double()
    for part in (deformation, linear):  # computed where the transform lives
        if part is not None:
            x = x.to(next(iter(part.buffers())).device)
            break
    A = None
    if linear is not None:
        with torch.no_grad():
            A = linear.matrix().detach().double()
            x = linear(x).double()
    if deformation is None:
        J = torch.eye(3, dtype=x.dtype, device=x.device).expand(x.shape[0], 3, 3)
    else:
        with torch.no_grad():
            x, J = deformation.forward_with_jacobians(x)
        x, J = x.double(), J.double()
    return x, (J if A is None else J @ A)


def _unreadable(caller: str, path: Path, err: Exception) -> str:
    return (
        f"{caller}: {path} could not be read ({type(err).__name__}: {err}); it may be "
        "truncated or corrupt: rerun the registration (or save it again)"
    )
