"""BIDS for ``otreg bids``: the inputs (each subject's surfaces or segmentation,
:func:`find_inputs`), the pairs made from them with their outputs named as BIDS derivatives
(:func:`bids_pairs`), and the derivative dataset's ``dataset_description.json``
(:func:`write_dataset_description`).

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._checks import warn
from ..io import atomic_write
from .job import JobOptions
from .manifest import Pair

__all__ = ["SubjectInput", "find_inputs", "bids_pairs", "write_dataset_description"]

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


def _strings(value, name: str, caller: str = "find_inputs") -> list:
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, (Sequence, set, frozenset)) or not all(
        isinstance(v, str) for v in value
    ):
        raise TypeError(f"{caller}: {name} must be a string or a list of strings, got {value!r}")
    if not value:
        raise ValueError(f"{caller}: {name} is empty")
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


# ------------------------------------------------------------ derivatives


BIDS_VERSION = "1.10.0"


def bids_pairs(
    inputs: Sequence[SubjectInput],
    template: str | os.PathLike | Mapping[str, str | os.PathLike],
    template_id: str,
    *,
    options: Mapping[str, object] | None = None,
    carry: str | Sequence[str] = (),
    template_values: str | os.PathLike | Sequence | Mapping | None = None,
) -> list[Pair]:
    """Each input registered onto the template, with outputs named as BIDS derivatives.

    The surface ``sub-01``, ``ses-1``, ``hemi-L`` gives the pair ``sub-01_ses-1_hemi-L``
    written into ``sub-01/ses-1/anat/`` (``sub-01/anat/`` without a session) as
    ``sub-01_ses-1_hemi-L_space-<template_id>_desc-otreg_<file>``; the segmentation label 17
    gives ``sub-01_ses-1_label-17`` and ``sub-01_ses-1_space-<template_id>_label-17_desc-otreg_``
    ``<file>``. The engine's files: ``warped.vtk``, ``parameters.npz``, ``registration.json``,
    ``metrics.json`` (or ``error.json``), ``log.txt``, ``picture.png``. Subject labels with
    characters other than letters and digits (FreeSurfer folders) lose them in the names,
    with a warning; ``source_subject`` keeps them.

    Args:
        inputs: from :func:`find_inputs`.
        template: the template's file, or for surfaces ``{"L": file, "R": file}``.
        template_id: the ``space-`` label: letters and digits (``fsaverage``, ``fsLR``).
        options: registration options of every pair (fields of
            :class:`~otreg.batch.job.JobOptions`).
        carry: names of each subject's per-vertex files to carry onto the template
            (written as ``..._desc-otreg_to-target_<name>.<ext>``): BIDS
            ``sub-01_hemi-L_<name>.shape.gii`` (or ``.func.gii``, ``.label.gii``) beside the
            surface; FreeSurfer ``surf/lh.<name>`` or ``label/lh.<name>.annot``.
        template_values: files of per-vertex values on the template to carry onto each
            subject (an atlas's labels; written as ``..._to-source_<name>``): a file or a
            list of files for one template, ``{"L": files, "R": files}`` for two.

    Raises:
        FileNotFoundError: a template file does not exist.
        ValueError: no inputs, a bad template_id, a template missing a hemisphere, two inputs
            with the same output names.
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
        >>> from otreg.batch import bids_pairs
        >>> inputs = find_inputs(root, hemispheres="L")
        >>> template = otreg.datasets.fsaverage5_path("pial")
        >>> (pair,) = bids_pairs(inputs, template, "fsaverage5")
        >>> pair.pair_id, pair.folder, pair.prefix
        ('sub-01_hemi-L', 'sub-01/anat', 'sub-01_hemi-L_space-fsaverage5_desc-otreg_')
    """
    caller = "bids_pairs"
    if isinstance(inputs, str) or not isinstance(inputs, Sequence) or not inputs:
        raise TypeError(f"{caller}: inputs must be a non-empty list of SubjectInput")
    for i in inputs:
        if not isinstance(i, SubjectInput):
            raise TypeError(f"{caller}: inputs must be SubjectInput objects, got {i!r}")
        if i.session is not None and not _LABEL.match(i.session):
            raise ValueError(f"{caller}: session {i.session!r} is not a BIDS label")
    if not isinstance(template_id, str):
        raise TypeError(f"{caller}: template_id must be a string, got {template_id!r}")
    if not _LABEL.match(template_id):
        raise ValueError(
            f"{caller}: template_id {template_id!r} is not a BIDS label: use letters and digits "
            "only (e.g. fsaverage, fsLR, MNI152NLin2009cAsym)"
        )
    options = {} if options is None else options
    JobOptions.from_mapping(options, f"{caller}: options")
    templates = _templates(template, {i.hemisphere for i in inputs}, caller)
    carry = tuple(_strings(carry, "carry", caller)) if carry else ()
    if carry and any(i.kind == "dseg" for i in inputs):
        raise ValueError(f"{caller}: carry applies to surfaces, not segmentations")
    on_template = _template_values(template_values, set(templates), caller)
    names = _bids_labels(sorted({i.subject for i in inputs}), caller)
    pairs, seen = [], {}
    for i in inputs:
        ses = f"_ses-{i.session}" if i.session else ""
        entities = f"sub-{names[i.subject]}{ses}"
        if i.kind == "dseg":
            pair_id = f"{entities}_label-{i.label}"
            prefix = f"{entities}_space-{template_id}_label-{i.label}_desc-otreg_"
        else:
            pair_id = f"{entities}_hemi-{i.hemisphere}"
            prefix = f"{pair_id}_space-{template_id}_desc-otreg_"
        if pair_id in seen:
            raise ValueError(f"{caller}: {seen[pair_id]} and {i.path} both give {pair_id}")
        seen[pair_id] = i.path
        folder = f"sub-{names[i.subject]}/" + (f"ses-{i.session}/" if ses else "") + "anat"
        pairs.append(
            Pair(
                pair_id,
                str(i.path.expanduser().absolute()),
                templates[i.hemisphere],
                label=None if i.label is None else float(i.label),
                hemisphere=i.hemisphere,
                source_subject=i.subject,
                target_subject=template_id,
                options=dict(options),
                folder=folder,
                prefix=prefix,
                source_values=tuple(_carried(i, name, caller) for name in carry),
                target_values=on_template.get(i.hemisphere, ()),
            )
        )
    return pairs


def _carried(i: SubjectInput, name: str, caller: str) -> str:
    """The file of ``i``'s subject holding the per-vertex values ``name`` (see
    :func:`bids_pairs`), or FileNotFoundError naming where it looked."""
    if not re.match(r"^[A-Za-z0-9.]+$", name):
        raise ValueError(f"{caller}: carry name {name!r} must be letters, digits and dots")
    if i.path.parent.name == "surf":  # FreeSurfer
        hemi = {"L": "lh", "R": "rh"}[i.hemisphere]
        looked = [
            i.path.parent / f"{hemi}.{name}",
            i.path.parent.parent / "label" / f"{hemi}.{name}.annot",
        ]
    else:
        entities = i.path.name.rsplit("_", 1)[0]
        looked = [
            i.path.parent / f"{entities}_{name}{ext}"
            for ext in (".shape.gii", ".func.gii", ".label.gii")
        ]
    found = [str(p) for p in looked if p.is_file()]
    if not found:
        raise FileNotFoundError(
            f"{caller}: no {name!r} values for {i.path.name}; looked for "
            + ", ".join(str(p) for p in looked)
        )
    return found[0]


def _template_values(given, hemis: set, caller: str) -> dict:
    """Hemisphere -> the template's values files (every hemisphere for one template)."""
    if given is None:
        return {}
    if isinstance(given, Mapping):
        if set(given) - {"L", "R"} or hemis - set(given):
            raise ValueError(
                f"{caller}: template_values has the keys {sorted(given, key=str)}; it needs "
                f"{sorted(hemis, key=str)}"
            )
        per = {h: given[h] for h in hemis}
    else:
        if {"L", "R"} <= hemis:
            raise ValueError(
                f"{caller}: two templates (L and R) take their values as {{'L': files, 'R': files}}"
            )
        per = dict.fromkeys(hemis, given)
    out = {}
    for h, files in per.items():
        files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        paths = [_path(f, "template_values", caller) for f in files]
        for path in paths:
            if not path.is_file():
                raise FileNotFoundError(f"{caller}: template_values {path} does not exist")
        out[h] = tuple(str(p) for p in paths)
    return out


def _templates(template, hemis: set, caller: str) -> dict:
    def file(value, name: str) -> str:
        path = _path(value, name, caller)
        if not path.is_file():
            raise FileNotFoundError(f"{caller}: {name} {path} does not exist")
        return str(path)

    if not isinstance(template, Mapping):
        path = file(template, "template")
        if {"L", "R"} <= hemis:
            warn(
                f"{caller}: one template ({path}) for both hemispheres; give "
                "{'L': file, 'R': file} for a template per hemisphere"
            )
        return dict.fromkeys(hemis, path)
    if None in hemis:
        raise ValueError(
            f"{caller}: a segmentation takes one template file, not one per hemisphere"
        )
    if set(template) - {"L", "R"} or hemis - set(template):
        raise ValueError(
            f"{caller}: template has the keys {sorted(template, key=str)}; it needs "
            f"{sorted(hemis)} (only 'L' and 'R' allowed)"
        )
    return {h: file(template[h], f"template[{h!r}]") for h in hemis}


def _bids_labels(subjects: list[str], caller: str) -> dict[str, str]:
    """Subject -> its BIDS label (letters and digits); a warning names those that change."""
    out: dict[str, str] = {}
    for s in subjects:
        out[s] = re.sub(r"[^A-Za-z0-9]", "", s)
        twin = [t for t in out if t != s and out[t] == out[s]]
        if not out[s] or twin:
            raise ValueError(f"{caller}: subject {s!r} has no BIDS label of its own {twin}")
    renamed = [f"{s} -> sub-{n}" for s, n in out.items() if s != n]
    if renamed:
        warn(f"{caller}: BIDS labels are letters and digits: {_few(renamed)}")
    return out


def write_dataset_description(out_dir: str | os.PathLike, source_root: str | os.PathLike) -> Path:
    """Write (atomically) the ``dataset_description.json`` of a BIDS derivative dataset.

    A description otreg wrote before is updated (this version, one more source dataset, its
    other fields kept) and rewritten only when that changes it.

    Args:
        out_dir: the output folder (created if missing).
        source_root: the dataset the inputs came from, recorded in ``SourceDatasets``.

    Returns:
        The description's path.

    Raises:
        ValueError: a description exists that otreg did not write (or that is not JSON).

    Example:
        >>> import json, pathlib, tempfile
        >>> from otreg.batch import write_dataset_description
        >>> out = pathlib.Path(tempfile.mkdtemp())
        >>> path = write_dataset_description(out, "/data/fmriprep")
        >>> json.loads(path.read_text())["DatasetType"]
        'derivative'
    """
    from importlib.metadata import PackageNotFoundError, version

    path = _path(out_dir, "out_dir", "write_dataset_description") / "dataset_description.json"
    source = _path(source_root, "source_root", "write_dataset_description")
    try:
        otreg_version = version("otreg")
    except PackageNotFoundError:
        otreg_version = "unknown"
    new = {
        "Name": "otreg registrations",
        "BIDSVersion": BIDS_VERSION,
        "DatasetType": "derivative",
        "GeneratedBy": [
            {
                "Name": "otreg",
                "Version": otreg_version,
                "Description": "Optimal transport and diffeomorphic registration of surfaces",
            }
        ],
        "SourceDatasets": [{"URL": source.as_uri()}],
    }
    old = _read_json(path)
    if old is not None:
        made_by = [g.get("Name") for g in old.get("GeneratedBy") or [] if isinstance(g, dict)]
        if "otreg" not in made_by:
            raise ValueError(
                f"{path} was not written by otreg (GeneratedBy: {made_by or 'none'}); otreg "
                "does not overwrite another dataset's description: choose another output folder"
            )
        sources = old.get("SourceDatasets") if isinstance(old.get("SourceDatasets"), list) else []
        sources = sources + [s for s in new["SourceDatasets"] if s not in sources]
        new = {**old, **new, "SourceDatasets": sources}
        if new == old:
            return path
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(new, indent=2) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path
