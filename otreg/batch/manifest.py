"""The list of pairs a batch registers: read from and written to a CSV manifest.

A manifest has the columns ``pair_id, source, target`` and, optionally, ``label``, ``level``
(for volumes), ``hemisphere``, ``source_subject``, ``target_subject`` (for the group report's
subject-by-subject views), ``options`` (a JSON object of registration options for that row:
fields of :class:`~otreg.batch.job.JobOptions`, checked when the manifest is read) and
``source_values``, ``target_values`` (per-vertex maps or labels to carry across: files of
:func:`otreg.io.load_values`, separated by ``;``; the source's land on the target, the
target's on the source). Relative paths resolve from the manifest's folder.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._checks import warn
from ..io import MESH_EXTS, VOLUME_EXTS, atomic_write, same_file
from .job import JobOptions, check_carried_names

__all__ = [
    "Pair",
    "read_manifest",
    "write_manifest",
    "pairs_to_template",
    "all_pairs",
]

#: Columns a manifest may have; the first three are required.
COLUMNS = (
    "pair_id",
    "source",
    "target",
    "label",
    "level",
    "hemisphere",
    "source_subject",
    "target_subject",
    "options",
    "source_values",
    "target_values",
)

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


@dataclass(frozen=True)
class Pair:
    """One registration of a batch.

    Attributes:
        pair_id: a name safe as a folder name (letters, digits, ``. _ + -``; no ``..``).
        source, target: absolute paths of the input files.
        label, level: segmentation label / probability threshold (volumes only).
        hemisphere: ``"L"``, ``"R"`` or None (recorded; BIDS queries use it).
        source_subject, target_subject: subject ids for the group report, or None.
        options: registration options of this row (fields of
            :class:`~otreg.batch.job.JobOptions`; checked here, so that a bad row stops a
            batch before it starts).
        folder: the output folder, relative to the batch folder (default ``pairs/<id>``).
        prefix: prepended to every output file name (BIDS derivative names), default "".
        source_values, target_values: files of per-vertex values on the source (carried onto
            the target) and on the target (carried onto the source); see
            :func:`~otreg.batch.job.run_job`.

    Example:
        >>> from otreg.batch import Pair
        >>> Pair("sub-01_to_tpl", "sub-01.vtk", "tpl.vtk").pair_id
        'sub-01_to_tpl'
    """

    pair_id: str
    source: str
    target: str
    label: float | None = None
    level: float | None = None
    hemisphere: str | None = None
    source_subject: str | None = None
    target_subject: str | None = None
    options: Mapping[str, object] = field(default_factory=dict)
    folder: str = ""
    prefix: str = ""
    source_values: tuple[str, ...] = ()
    target_values: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_pair_id(self.pair_id)
        for side in ("source", "target"):  # a path or its string, kept as the string
            path = getattr(self, side)
            if not isinstance(path, (str, os.PathLike)):
                raise TypeError(
                    f"pair {self.pair_id}: {side} must be a file path (str or pathlib.Path), "
                    f"got {type(path).__name__}"
                )
            object.__setattr__(self, side, os.fspath(path))
        for side in ("source", "target"):
            name = f"{side}_values"
            object.__setattr__(self, name, _values_files(getattr(self, name), self.pair_id, name))
        if not self.folder:
            object.__setattr__(self, "folder", f"pairs/{self.pair_id}")
        JobOptions.from_mapping(self.options, f"pair {self.pair_id}: options")
        given = [n for n, v in (("label", self.label), ("level", self.level)) if v is not None]
        if len(given) == 2:
            raise ValueError(
                f"pair {self.pair_id}: give a label (a segmentation value) or a level (a "
                "threshold of a probability map), not both"
            )
        volumes = [p for p in (self.source, self.target) if p.lower().endswith(VOLUME_EXTS)]
        if given and not volumes:
            raise ValueError(
                f"pair {self.pair_id}: {given[0]} applies to volumes "
                f"({', '.join(VOLUME_EXTS)}), and neither its source nor its target is one: "
                f"leave {given[0]} empty for meshes"
            )
        _check_relative_folder(self.folder, self.pair_id)


def check_pair_id(pair_id: object) -> str:
    """A pair id, or ValueError: ids become folder names, so nothing that could leave the
    batch folder (``../x``, ``/abs``) or surprise a shell."""
    if not isinstance(pair_id, str):
        raise TypeError(f"pair_id must be a string, got {type(pair_id).__name__}")
    if not _ID.match(pair_id) or ".." in pair_id:
        raise ValueError(
            f"pair_id {pair_id!r} is not allowed: use 1 to 128 letters, digits, '.', '_', "
            "'+' or '-', starting with a letter or digit, without '..'"
        )
    return pair_id


def _values_files(files: object, pair_id: str, name: str) -> tuple[str, ...]:
    """The files of ``name`` as a tuple of strings: per-vertex values (not a surface or a
    volume), whose outputs do not collide."""
    if isinstance(files, (str, Path)) or not isinstance(files, Sequence):
        raise TypeError(
            f"pair {pair_id}: {name} must be a list of files, got {type(files).__name__}"
        )
    out = []
    for f in files:
        if not isinstance(f, (str, Path)):
            raise TypeError(f"pair {pair_id}: {name} holds {f!r}, not a file name")
        f = str(f)
        lower = f.lower()
        values_ext = lower.endswith((".gii", ".gii.gz", ".npy")) and not lower.endswith(
            (".surf.gii", ".surf.gii.gz")
        )
        if lower.endswith(VOLUME_EXTS) or (lower.endswith(MESH_EXTS) and not values_ext):
            raise ValueError(
                f"pair {pair_id}: {name} {f} is a surface or a volume; it takes per-vertex "
                "values (.func.gii, .shape.gii, .label.gii, .annot, FreeSurfer curv files, .npy)"
            )
        out.append(f)
    check_carried_names(out, f"pair {pair_id}: {name}")
    return tuple(out)


def _check_relative_folder(folder: str, pair_id: str) -> None:
    p = Path(folder)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ValueError(
            f"pair {pair_id}: output folder {folder!r} must be relative and inside the batch folder"
        )


def read_manifest(path: str | Path) -> list[Pair]:
    """The pairs of a CSV manifest (see the module docstring), in file order.

    Raises:
        FileNotFoundError: no such manifest.
        ValueError: not a text file, a missing column, an unknown column, an empty or bad
            field, a pair id that is not allowed or appears twice (the message names the
            line).

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.batch import pairs_to_template, read_manifest, write_manifest
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "pairs.csv"
        >>> pairs = pairs_to_template({"sub-01": "/data/s1.vtk"}, "/data/tpl.vtk")
        >>> write_manifest(pairs, path).name
        'pairs.csv'
        >>> [p.pair_id for p in read_manifest(path)]
        ['sub-01_to_template']
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"manifest {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"manifest {path} is not a text file (byte {err.start} is not UTF-8): give the "
            "CSV of pairs (pair_id, source, target), not a surface"
        ) from err
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    missing = [c for c in COLUMNS[:3] if c not in header]
    if missing:
        raise ValueError(
            f"manifest {path}: missing column(s) {', '.join(missing)}; it needs "
            f"pair_id, source, target (found: {', '.join(header) or 'no header'})"
        )
    unknown = [c for c in header if c not in COLUMNS]
    if unknown:
        raise ValueError(
            f"manifest {path}: unknown column(s) {', '.join(unknown)}; allowed: "
            f"{', '.join(COLUMNS)}"
        )
    base = path.resolve().parent
    pairs, seen = [], {}
    for line, row in enumerate(reader, start=2):
        where = f"manifest {path}, line {line}"
        fields = len(header) + len(row.get(None) or ()) - sum(v is None for v in row.values())
        if fields != len(header) and any(v for k, v in row.items() if k is not None):
            raise ValueError(
                f"{where}: {fields} fields where the header has {len(header)}; a field that "
                "holds commas (options' JSON) must be in double quotes, its own quotes "
                'doubled: "{""model"": ""rigid"", ""points"": 2000}"'
            )
        row = {(k or "").strip(): (v or "").strip() for k, v in row.items() if k is not None}
        if not any(row.values()):
            continue
        try:
            for col in COLUMNS[:3]:
                if not row.get(col):
                    raise ValueError(f"{col} is empty")
            pid = row["pair_id"]
            if pid in seen:
                raise ValueError(f"pair_id {pid!r} appears twice (also on line {seen[pid]})")
            seen[pid] = line
            options = json.loads(row["options"]) if row.get("options") else {}
            pairs.append(
                Pair(
                    pair_id=pid,
                    source=str(_resolve(base, row["source"])),
                    target=str(_resolve(base, row["target"])),
                    label=_number(row.get("label"), "label"),
                    level=_number(row.get("level"), "level"),
                    hemisphere=_hemisphere(row.get("hemisphere")),
                    source_subject=row.get("source_subject") or None,
                    target_subject=row.get("target_subject") or None,
                    options=options,
                    source_values=_files(base, row.get("source_values")),
                    target_values=_files(base, row.get("target_values")),
                )
            )
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{where}: options is not JSON ({err}); in a CSV file it goes in double "
                'quotes, its own quotes doubled: "{""model"": ""rigid""}"'
            ) from err
        except (ValueError, TypeError) as err:
            raise ValueError(f"{where}: {err}") from err
    if not pairs:
        raise ValueError(f"manifest {path} has no pairs")
    return pairs


def _resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else (base / p)


def _files(base: Path, value: str | None) -> tuple[str, ...]:
    """A ``;``-separated list of files, resolved from the manifest's folder."""
    parts = [v.strip() for v in (value or "").split(";")]
    return tuple(str(_resolve(base, v)) for v in parts if v)


def _number(value: str | None, name: str) -> float | None:
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _hemisphere(value: str | None) -> str | None:
    if not value:
        return None
    h = {"l": "L", "left": "L", "lh": "L", "r": "R", "right": "R", "rh": "R"}.get(value.lower())
    if h is None:
        raise ValueError(f"hemisphere must be L or R (or left/right, lh/rh), got {value!r}")
    return h


def write_manifest(pairs: Sequence[Pair], path: str | Path) -> Path:
    """Write pairs as a CSV manifest (atomically); paths are written as given (absolute).

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.batch import Pair, write_manifest
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "pairs.csv"
        >>> path = write_manifest([Pair("a_to_b", "/data/a.vtk", "/data/b.vtk")], path)
        >>> path.read_text().split()[0].split(",")[:4]
        ['pair_id', 'source', 'target', 'label']
    """
    if not pairs:
        raise ValueError("write_manifest: pairs is empty")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for p in pairs:
        if not isinstance(p, Pair):
            raise TypeError(f"write_manifest: pairs must be Pair objects, got {type(p).__name__}")
        writer.writerow(
            {
                "pair_id": p.pair_id,
                "source": p.source,
                "target": p.target,
                "label": "" if p.label is None else repr(p.label),
                "level": "" if p.level is None else repr(p.level),
                "hemisphere": p.hemisphere or "",
                "source_subject": p.source_subject or "",
                "target_subject": p.target_subject or "",
                "options": json.dumps(dict(p.options), sort_keys=True) if p.options else "",
                "source_values": ";".join(p.source_values),
                "target_values": ";".join(p.target_values),
            }
        )
    path = Path(path)
    text = buf.getvalue()
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path


def _subjects(subjects: Mapping[str, str | Path], caller: str) -> dict[str, str]:
    if not isinstance(subjects, Mapping) or not subjects:
        raise ValueError(f"{caller}: subjects must be a non-empty mapping of id -> file")
    out = {}
    for sid, f in subjects.items():
        check_pair_id(sid)
        out[sid] = str(Path(f).expanduser().absolute())
    return out


def hemisphere_of(path: str | Path) -> str | None:
    """The hemisphere a file's name gives: a BIDS ``hemi-L``/``hemi-R`` entity or a
    FreeSurfer ``lh.``/``rh.`` prefix ("L" or "R"), else None.

    Example:
        >>> from otreg.batch.manifest import hemisphere_of
        >>> hemisphere_of("sub-01_hemi-R_pial.surf.gii"), hemisphere_of("/fs/lh.white")
        ('R', 'L')
    """
    name = Path(path).name
    found = re.search(r"(?:^|_)hemi-([LR])(?:_|\.|$)", name)
    if found:
        return found.group(1)
    return {"lh.": "L", "rh.": "R"}.get(name[:3].lower())


def pairs_to_template(
    subjects: Mapping[str, str | Path],
    template: str | Path,
    template_id: str = "template",
    **columns,
) -> list[Pair]:
    """Every subject onto one template: pairs ``<subject>_to_<template_id>``.

    Args:
        subjects: subject id -> surface or volume file.
        template: the template's file.
        template_id: the template's name in pair ids and the group report.
        **columns: label, level, hemisphere or options, the same for every pair (the
            hemisphere, where not given, from each subject's file name:
            :func:`hemisphere_of`).

    Example:
        >>> from otreg.batch import pairs_to_template
        >>> pairs = pairs_to_template({"s1": "/d/s1.vtk", "s2": "/d/s2.vtk"}, "/d/t.vtk", "fsavg")
        >>> [p.pair_id for p in pairs]
        ['s1_to_fsavg', 's2_to_fsavg']
    """
    subjects = _subjects(subjects, "pairs_to_template")
    template = str(Path(template).expanduser().absolute())
    itself = [sid for sid, f in subjects.items() if f == template or same_file(f, template)]
    if itself:  # a glob of the subjects' files that caught the template too
        warn(
            f"pairs_to_template: {', '.join(itself)} is the template itself ({template}); "
            "left out rather than registered onto itself",
            UserWarning,
        )
        subjects = {sid: f for sid, f in subjects.items() if sid not in itself}
    if not subjects:
        raise ValueError("pairs_to_template: no subject left besides the template")
    return [
        Pair(
            f"{sid}_to_{template_id}",
            f,
            template,
            source_subject=sid,
            target_subject=template_id,
            **({"hemisphere": hemisphere_of(f)} | columns),
        )
        for sid, f in subjects.items()
    ]


def all_pairs(subjects: Mapping[str, str | Path], symmetric: bool = False, **columns) -> list[Pair]:
    """Every pair of subjects: ``a_to_b`` for a before b in the given order, and also
    ``b_to_a`` when ``symmetric`` (a registration is not symmetric in its inputs).

    Example:
        >>> from otreg.batch import all_pairs
        >>> subjects = {"a": "/d/a.vtk", "b": "/d/b.vtk", "c": "/d/c.vtk"}
        >>> [p.pair_id for p in all_pairs(subjects)]
        ['a_to_b', 'a_to_c', 'b_to_c']
    """
    subjects = _subjects(subjects, "all_pairs")
    if len(subjects) < 2:
        raise ValueError(f"all_pairs: need at least 2 subjects, got {len(subjects)}")
    combos = (
        itertools.permutations(subjects, 2) if symmetric else itertools.combinations(subjects, 2)
    )
    return [
        Pair(
            f"{a}_to_{b}",
            subjects[a],
            subjects[b],
            source_subject=a,
            target_subject=b,
            **columns,
        )
        for a, b in combos
    ]
