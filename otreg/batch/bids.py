"""Inputs of ``otreg bids``: each subject's surfaces (or segmentation). The pairs made from
them, with outputs named as BIDS derivatives, are in :mod:`otreg.batch.derivatives`.

Sources (``kind="auto"`` tells them apart by ``dataset_description.json`` or ``SUBJECT/surf/``):

- fMRIPrep/sMRIPrep derivatives, queried with pybids:
  ``sub-01/[ses-1/]anat/sub-01[_ses-1]_hemi-L_pial.surf.gii`` (no ``space-`` or ``desc-``),
  or with ``label=``: ``sub-01/[ses-1/]anat/sub-01[_ses-1]_desc-aseg_dseg.nii.gz``. A raw
  dataset is read through its ``derivatives/fmriprep`` (or ``smriprep``), with a warning.
- a FreeSurfer ``SUBJECTS_DIR``: ``SUBJECT/surf/lh.pial``, ``rh.pial`` or, with ``label=``,
  ``SUBJECT/mri/aseg.mgz``; ``fsaverage*`` folders are skipped.
"""

from __future__ import annotations

import json
import numbers
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .._checks import warn

__all__ = ["SubjectInput", "find_inputs"]

SURFACES = ("pial", "white", "midthickness", "inflated")
KINDS = ("auto", "bids", "freesurfer")
_LABEL = re.compile(r"^[A-Za-z0-9]+$")
_DB_FILE = "layout_index.sqlite"  # the file pybids keeps in its database_path folder
# Index only what otreg reads (anat folders, no sidecar metadata): ~15x faster on fMRIPrep.
_IGNORE = (r"^/(code|models|sourcedata|stimuli)", r"^/sub-[^/]+/(ses-[^/]+/)?(?!anat$|ses-)[^/]+$")
_PIPELINES = ("fmriprep", "smriprep")


@dataclass(frozen=True)
class SubjectInput:
    """One input file of one subject.

    Attributes:
        subject: the subject label, without ``sub-``.
        session: the session label, without ``ses-``, or None.
        hemisphere: ``"L"`` or ``"R"`` for surfaces, None for segmentations.
        path: the file (absolute).
        kind: ``"surface"`` or ``"dseg"``.
        label: for ``"dseg"``, the segmentation value whose boundary is registered.

    Example:
        >>> import pathlib
        >>> from otreg.batch import SubjectInput
        >>> SubjectInput("01", None, "L", pathlib.Path("sub-01_hemi-L_pial.surf.gii")).subject
        '01'
    """

    subject: str
    session: str | None
    hemisphere: str | None
    path: Path
    kind: str = "surface"
    label: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if not self.subject or (self.kind, self.hemisphere is None, self.label is None) not in (
            ("surface", False, True),
            ("dseg", True, False),
        ):
            raise ValueError(f"SubjectInput: a surface needs a hemisphere, a dseg a label: {self}")


def find_inputs(
    root: str | os.PathLike,
    participant_label: str | Sequence[str] | None = None,
    *,
    surface: str = "pial",
    hemispheres: str | Sequence[str] = ("L", "R"),
    kind: str = "auto",
    label: int | None = None,
    database: str | os.PathLike | None = None,
) -> list[SubjectInput]:
    """Each subject's (and session's) input files, sorted by subject, session, hemisphere.

    Args:
        root: fMRIPrep/sMRIPrep derivatives, a raw BIDS dataset holding them in
            ``derivatives/``, or a FreeSurfer ``SUBJECTS_DIR``.
        participant_label: subject labels, with or without ``sub-`` (None: every subject).
        surface: one of :data:`SURFACES` (ignored with ``label``).
        hemispheres: ``"L"``, ``"R"`` or both.
        kind: ``"auto"``, ``"bids"`` or ``"freesurfer"``.
        label: a segmentation value: find ``aseg`` segmentations instead of surfaces.
        database: a folder for pybids' index (BIDS only): built once, atomically, then
            loaded as is by later calls; delete it after the dataset changes.

    Warns:
        UserWarning: participant labels without inputs; subjects or hemispheres missing.

    Raises:
        FileNotFoundError: no such root.
        ValueError: a bad value, an unknown kind of folder, a raw dataset without derivatives,
            no inputs at all or for any of the participant labels, two files for one input.
        TypeError: an argument of the wrong type.

    Example:
        >>> import json, pathlib, tempfile, otreg
        >>> from otreg.batch import find_inputs
        >>> root = pathlib.Path(tempfile.mkdtemp()) / "fmriprep"          # a tiny fMRIPrep tree
        >>> anat = root / "sub-01" / "anat"
        >>> anat.mkdir(parents=True)
        >>> surface = otreg.datasets.fsaverage5("pial").decimate(500)
        >>> _ = otreg.save_shape(surface, anat / "sub-01_hemi-L_pial.surf.gii")
        >>> _ = (root / "dataset_description.json").write_text(json.dumps({"Name": "demo",
        ...     "BIDSVersion": "1.8.0", "DatasetType": "derivative",
        ...     "GeneratedBy": [{"Name": "fMRIPrep"}]}))
        >>> [(i.subject, i.hemisphere, i.path.name) for i in find_inputs(root, hemispheres="L")]
        [('01', 'L', 'sub-01_hemi-L_pial.surf.gii')]
    """
    root = _path(root, "root", "find_inputs")
    if not root.is_dir():
        raise (ValueError if root.exists() else FileNotFoundError)(
            f"find_inputs: {root} is not a folder; give a BIDS dataset or a SUBJECTS_DIR"
        )
    labels = None
    if participant_label is not None:
        labels = [
            s.strip().removeprefix("sub-") for s in _strings(participant_label, "participant_label")
        ]
        if "" in labels:
            raise ValueError(
                f"find_inputs: participant_label {participant_label!r} has an empty label"
            )
        labels = list(dict.fromkeys(labels))
    hemis = _strings(hemispheres, "hemispheres")
    for name, value, allowed in (
        ("surface", [surface], SURFACES),
        ("kind", [kind], KINDS),
        ("hemispheres", hemis, ("L", "R")),
    ):
        if not isinstance(value[0], str):
            raise TypeError(f"find_inputs: {name} must be a string, got {value[0]!r}")
        if not set(value) <= set(allowed):
            raise ValueError(f"find_inputs: {name} is {value!r}; allowed: {', '.join(allowed)}")
    hemis = tuple(h for h in ("L", "R") if h in hemis)
    if label is not None:
        if not isinstance(label, numbers.Integral) or isinstance(label, bool):
            raise TypeError(f"find_inputs: label must be an integer, got {label!r}")
        if label <= 0:
            raise ValueError(f"find_inputs: label is {label}; give a structure's value (not 0)")
        label = int(label)
    if database is not None:
        database = _path(database, "database", "find_inputs")
    if kind == "auto":
        kind = _detect(root)
    if kind == "bids":
        root, found, everyone = _from_bids(root, surface, hemis, label, database, labels)
        name = (
            f"*_hemi-{'|'.join(hemis)}_{surface}.surf.gii"
            if label is None
            else "*_desc-aseg_dseg.nii.gz"
        )
        what = f"sub-*/[ses-*/]anat/{name}"
    else:
        found, everyone = _from_freesurfer(root, surface, hemis, label)
        side = "|".join("lh" if h == "L" else "rh" for h in hemis)
        what = f"SUBJECT/surf/{side}.{surface}" if label is None else "SUBJECT/mri/aseg.mgz"
    return _select(found, everyone, labels, hemis, f"{root} (looked for {what})")


def _path(value, name: str, caller: str) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{caller}: {name} must be a path, got {type(value).__name__}")
    return Path(value).expanduser().absolute()


def _strings(value, name: str) -> list:
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, (Sequence, set, frozenset)) or not all(
        isinstance(v, str) for v in value
    ):
        raise TypeError(f"find_inputs: {name} must be a string or a list of strings, got {value!r}")
    if not value:
        raise ValueError(f"find_inputs: {name} is empty")
    return list(value)


def _detect(root: Path) -> str:
    if (root / "dataset_description.json").is_file():
        return "bids"
    if any((d / "surf").is_dir() for d in root.iterdir() if not d.name.startswith(".")):
        return "freesurfer"
    hint = ""
    if (root / "surf").is_dir():
        hint = f"; {root} looks like one FreeSurfer subject: give the folder above it"
    elif found := _pipelines(root):
        hint = f"; did you mean {found[0]}?"
    raise ValueError(
        f"find_inputs: {root} is neither a BIDS dataset (no dataset_description.json) nor a "
        f"FreeSurfer SUBJECTS_DIR (no SUBJECT/surf/ folders){hint}"
    )


def _pipelines(folder: Path) -> list[Path]:
    return [folder / p for p in _PIPELINES if (folder / p / "dataset_description.json").is_file()]


def _from_bids(root: Path, surface: str, hemis, label, database, labels):
    try:
        import bids
        from bids.layout import BIDSLayoutIndexer, Query
    except ImportError as err:
        raise ImportError("reading BIDS datasets needs pybids: pip install 'otreg[batch]'") from err
    info = _read_json(root / "dataset_description.json") or {"GeneratedBy": []}
    if info.get("DatasetType", "derivative" if "GeneratedBy" in info else "raw") != "derivative":
        found = _pipelines(root / "derivatives")
        if not found:
            raise ValueError(
                f"find_inputs: {root} is a raw BIDS dataset; point at fMRIPrep or sMRIPrep "
                f"derivatives (sub-*/anat/*_hemi-L_pial.surf.gii), e.g. {root}/derivatives/fmriprep"
            )
        warn(f"{root} is a raw BIDS dataset: reading {found[0]}", UserWarning)
        root = found[0]

    def layout(db):
        ignore = list(_IGNORE)
        if db is None and labels:  # a one-off index: only the subjects asked for
            ignore.append(rf"^/sub-(?!({'|'.join(map(re.escape, labels))})$)[^/]+$")
        indexer = BIDSLayoutIndexer(ignore=[re.compile(p) for p in ignore], index_metadata=False)
        return bids.BIDSLayout(
            root, validate=False, is_derivative=True, database_path=db, indexer=indexer
        )

    if database is None:
        index = layout(None)
    else:  # built in a temporary folder, then renamed into place: never a partial index
        if database.exists() and not database.is_dir():
            raise ValueError(f"find_inputs: database {database} must be a folder")
        if not (database / _DB_FILE).is_file():
            database.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{database.name}-", dir=database.parent))
            try:
                layout(tmp).connection_manager.session.close()
                database.mkdir(exist_ok=True)
                os.replace(tmp / _DB_FILE, database / _DB_FILE)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        index = layout(database)  # pybids loads an existing index without indexing again
        if Path(index.root).resolve() != root.resolve():
            raise ValueError(f"find_inputs: database {database} indexes {index.root}, not {root}")
    if label is None:
        query = dict(suffix=surface, extension=".surf.gii", hemi=list(hemis), desc=Query.NONE)
    else:
        query = dict(suffix="dseg", extension=[".nii.gz", ".nii"], desc="aseg")
    by_key: dict[tuple, list[str]] = {}  # (entities read from the names: pybids' are slow)
    for path in index.get(datatype="anat", space=Query.NONE, return_type="file", **query):
        e = dict(re.findall(r"(?:^|_)(sub|ses|hemi)-([^_]+)", Path(path).name))
        by_key.setdefault((e["sub"], e.get("ses"), e.get("hemi")), []).append(path)
    twice = [p for paths in by_key.values() if len(paths) > 1 for p in sorted(paths)]
    if twice:
        raise ValueError(f"find_inputs: several files for one input: {', '.join(twice[:6])}")
    kind = "surface" if label is None else "dseg"
    found = [SubjectInput(s, ses, h, Path(p[0]), kind, label) for (s, ses, h), p in by_key.items()]
    return root, found, sorted(d.name[4:] for d in root.glob("sub-*") if d.is_dir())


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _from_freesurfer(root: Path, surface: str, hemis, label):
    folders = [
        d
        for d in sorted(root.iterdir())
        if not d.name.startswith((".", "fsaverage")) and d.name != "sub-" and (d / "surf").is_dir()
    ]
    if not folders:
        raise ValueError(f"find_inputs: {root} has no FreeSurfer subjects (SUBJECT/surf/ folders)")
    found = []
    for d in folders:
        subject, aseg = d.name.removeprefix("sub-"), d / "mri" / "aseg.mgz"
        if label is not None and aseg.is_file():
            found.append(SubjectInput(subject, None, None, aseg, "dseg", label))
        for h in hemis if label is None else ():
            path = d / "surf" / f"{'lh' if h == 'L' else 'rh'}.{surface}"
            if path.is_file():
                found.append(SubjectInput(subject, None, h, path))
    return found, [d.name.removeprefix("sub-") for d in folders]


def _select(found, everyone, labels, hemis, where: str) -> list[SubjectInput]:
    found = sorted(found, key=lambda i: (i.subject, i.session or "", i.hemisphere or ""))
    have = sorted({i.subject for i in found})
    if labels is not None:
        missing = [s for s in labels if s not in have]
        if len(missing) == len(labels):
            raise ValueError(
                f"find_inputs: no inputs for participant label(s) {_few(missing)} in {where}; "
                f"subjects there: {_few(everyone) or 'none'}"
            )
        if missing:
            warn(f"no inputs for participant label(s) {_few(missing)} in {where}")
        found, everyone = [i for i in found if i.subject in labels], []
    elif not found:
        raise ValueError(f"find_inputs: no inputs in {where}")
    keys: dict[tuple, set] = {}
    for i in found:
        keys.setdefault((i.subject, i.session), set()).add(i.hemisphere)
    gaps = [f"sub-{s}" for s in everyone if s not in have]
    for (s, ses), hs in keys.items():
        name = f"sub-{s}" + (f"_ses-{ses}" if ses else "")
        gaps += [f"{name}_hemi-{h}" for h in hemis if None not in hs and h not in hs]
    if gaps:
        warn(f"{len(gaps)} input(s) missing in {where}: {_few(gaps)}")
    return found


def _few(items: Sequence[str], n: int = 6) -> str:
    more = f", ... ({len(items)} in all)" if len(items) > n else ""
    return ", ".join(items[:n]) + more
