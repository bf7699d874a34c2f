"""Pairs for ``otreg bids``: each input found by :func:`otreg.batch.bids.find_inputs`
registered onto a template, with its outputs named as BIDS derivatives, and the derivative
dataset's ``dataset_description.json``."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from .._checks import warn
from .bids import _LABEL, SubjectInput, _few, _path, _read_json
from .manifest import Pair, check_options

__all__ = ["bids_pairs", "write_dataset_description"]

BIDS_VERSION = "1.10.0"


def bids_pairs(
    inputs: Sequence[SubjectInput],
    template: str | os.PathLike | Mapping[str, str | os.PathLike],
    template_id: str,
    *,
    options: Mapping[str, object] | None = None,
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
        options: registration options of every pair (see ``ROW_OPTIONS``).

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
    options = check_options({} if options is None else options, f"{caller}: options")
    templates = _templates(template, {i.hemisphere for i in inputs}, caller)
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
            )
        )
    return pairs


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

    from ..io import atomic_write

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
