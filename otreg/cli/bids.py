"""``otreg bids``: the BIDS-Apps entry point (participant and group levels)."""

from __future__ import annotations

import re
from pathlib import Path

import click

from ..batch import (
    bids_pairs,
    build_report,
    find_inputs,
    find_records,
    read_manifest,
    write_dataset_description,
    write_manifest,
)
from ..batch.tables import tables_from_records
from ..datasets import fsaverage5_path
from ..io import same_file
from ._common import Command, warnings_as_lines
from .batch import _ids, run_engine, runner_options

__all__: list[str] = []


@click.command(cls=Command)
@click.argument("bids_dir", type=click.Path(file_okay=False))
@click.argument("output_dir", type=click.Path(file_okay=False))
@click.argument("analysis_level", type=click.Choice(["participant", "group"]))
@click.option(
    "--participant-label",
    multiple=True,
    callback=_ids,
    help="Subjects to run (with or without sub-; comma-separated or repeated) [default: all].",
)
@click.option(
    "--surface",
    default="pial",
    show_default=True,
    type=click.Choice(["pial", "white", "midthickness", "inflated"]),
    help="Which of each subject's surfaces to register (and of fsaverage5's, the default "
    "template).",
)
@click.option(
    "--hemi",
    "hemis",
    multiple=True,
    type=click.Choice(["L", "R"]),
    help="Hemispheres [default: both].",
)
@click.option(
    "--label",
    default=None,
    type=int,
    help="Register this label of each subject's aseg segmentation instead of surfaces "
    "(needs --template).",
)
@click.option(
    "--template",
    default=None,
    type=click.Path(dir_okay=False, exists=True),
    help="Template file for every input [default for surfaces: fsaverage5, per hemisphere].",
)
@click.option(
    "--template-left",
    default=None,
    type=click.Path(dir_okay=False, exists=True),
    help="Template surface for the left hemispheres (with --template-right).",
)
@click.option(
    "--template-right",
    default=None,
    type=click.Path(dir_okay=False, exists=True),
    help="Template surface for the right hemispheres (with --template-left).",
)
@click.option(
    "--template-id",
    default=None,
    help="The space- label of the outputs [default: fsaverage5, or the template's name].",
)
@click.option(
    "--bids-database",
    default=None,
    type=click.Path(file_okay=False),
    help="Folder for pybids' index, built once and reused (delete it when the dataset "
    "changes); saves minutes a call on large datasets.",
)
@click.option(
    "--carry",
    multiple=True,
    help="Per-vertex values of each subject to carry onto the template, by name: "
    "sub-XX_hemi-L_NAME.shape.gii (.func.gii, .label.gii) beside the surface, or FreeSurfer's "
    "surf/lh.NAME or label/lh.NAME.annot; written as ..._desc-otreg_to-target_NAME.*; "
    "repeatable.",
)
@click.option(
    "--template-values",
    multiple=True,
    type=click.Path(dir_okay=False, exists=True),
    help="Per-vertex values on the template (an atlas's labels) to carry onto each subject, "
    "written as ..._desc-otreg_to-source_NAME.*; repeatable. With a template per hemisphere, "
    "each file's name says its hemisphere (lh./rh., hemi-L/hemi-R, .L./.R.).",
)
@runner_options
def bids(
    bids_dir: str,
    output_dir: str,
    analysis_level: str,
    participant_label,
    surface: str,
    hemis,
    label,
    template,
    template_left,
    template_right,
    template_id,
    bids_database,
    carry,
    template_values,
    **kw,
) -> None:
    """BIDS-Apps entry point: register each subject's surfaces (fMRIPrep/sMRIPrep
    derivatives, or a FreeSurfer SUBJECTS_DIR) onto a template.

    participant: find the inputs, write each subject's pairs as a manifest
    (OUTPUT_DIR/sub-XX/sub-XX_desc-otreg_pairs.csv) and run them (outputs
    named as BIDS derivatives, sub-XX/anat/sub-XX_hemi-L_space-ID_desc-otreg_*). group: the
    summary tables and the group page from the records of every participant run.
    """
    out = Path(output_dir).expanduser()
    if Path(bids_dir).exists() and out.exists() and same_file(out, bids_dir):
        raise click.BadParameter(
            f"{output_dir} is BIDS_DIR itself: the derivatives would be written among the "
            "inputs. Write them beside it or under BIDS_DIR/derivatives/otreg",
            param_hint="OUTPUT_DIR",
        )
    if analysis_level == "group":
        if not out.is_dir():
            raise click.BadParameter(f"{output_dir} does not exist", param_hint="OUTPUT_DIR")
        if not find_records(out):
            raise click.ClickException(
                f"{output_dir} holds no pair records: run the participant level first"
            )
        # the pairs the participant jobs planned (their manifests): those without a record
        # (a job killed before it wrote one) are listed as not run
        try:
            expected = [
                pair
                for path in sorted(out.glob("sub-*/sub-*_desc-otreg_pairs.csv"))
                for pair in read_manifest(path)
            ]
        except (ValueError, OSError) as err:  # (the message names the file and line)
            raise click.ClickException(f"a participant job's manifest: {err}") from err
        n = tables_from_records(out, expected)
        click.echo(f"wrote {out / 'summary.csv'} ({n} pairs) and {build_report(out)}")
        return
    with warnings_as_lines():
        try:
            inputs = find_inputs(
                bids_dir,
                participant_label,
                surface=surface,
                hemispheres=tuple(hemis) or ("L", "R"),
                label=label,
                database=bids_database,
            )
            templates, tid = _bids_template(
                inputs, surface, template, template_left, template_right, template_id, label
            )
            pairs = bids_pairs(
                inputs,
                templates,
                tid,
                carry=carry,
                template_values=_by_hemisphere(template_values, templates),
            )
        except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
            raise click.UsageError(str(err)) from err
        if not kw["dry_run"]:
            out.mkdir(parents=True, exist_ok=True)
            write_dataset_description(out, bids_dir)
            # a manifest a subject (participant jobs run in parallel: one file for all
            # would hold the last job's subjects only)
            by_subject: dict[str, list] = {}
            for pair in pairs:
                by_subject.setdefault(pair.folder.split("/")[0], []).append(pair)
            for sub, rows in by_subject.items():
                write_manifest(rows, out / sub / f"{sub}_desc-otreg_pairs.csv")
    run_engine(pairs, out, kw, tables=False)


def _by_hemisphere(files: tuple[str, ...], templates) -> object:
    """The template's values files as :func:`~otreg.batch.bids_pairs` takes them: as given
    for one template, by the hemisphere their names say for two."""
    if not files:
        return None
    if not isinstance(templates, dict) or len(templates) < 2:
        return list(files)
    by: dict[str, list[str]] = {"L": [], "R": []}
    for f in files:
        name = Path(f).name
        hemi = [
            h
            for h, pattern in (
                ("L", r"(^lh\.|hemi-L|\.L\.|left)"),
                ("R", r"(^rh\.|hemi-R|\.R\.|right)"),
            )
            if re.search(pattern, name)
        ]
        if len(hemi) != 1:
            raise click.BadParameter(
                f"{f}: with a template per hemisphere, a values file's name must say which "
                "(lh./rh., hemi-L/hemi-R, .L./.R.)",
                param_hint="--template-values",
            )
        by[hemi[0]].append(f)
    return by


def _bids_template(inputs, surface, template, left, right, template_id, label):
    """The template file(s) and the space- label."""
    if template and (left or right):
        raise click.UsageError("give --template or --template-left/--template-right, not both")
    if template:
        stem = Path(template).name.split(".")[0]
        return template, template_id or re.sub(r"[^A-Za-z0-9]", "", stem) or "template"
    if left or right:
        hemis = {i.hemisphere for i in inputs}
        given = {"L": left, "R": right}
        missing = [h for h in sorted(hemis) if not given[h]]
        if missing:
            raise click.UsageError(
                f"inputs of hemisphere {', '.join(missing)} need --template-"
                + " and --template-".join({"L": "left", "R": "right"}[h] for h in missing)
            )
        return {h: given[h] for h in hemis}, template_id or "template"
    if label is not None:
        raise click.UsageError("--label registers segmentations: give their --template")
    kind = surface if surface in ("pial", "white", "inflated") else "pial"
    try:
        files = {
            h: str(fsaverage5_path(kind, {"L": "left", "R": "right"}[h]))
            for h in {i.hemisphere for i in inputs}
        }
    except (ImportError, FileNotFoundError) as err:
        raise click.UsageError(
            f"the default template, fsaverage5, needs nilearn ({err}): pip install "
            "'otreg[data]', or give --template"
        ) from err
    return files, template_id or "fsaverage5"
