"""The batch commands of ``otreg``: ``batch``, ``manifest``, ``report`` (and their shared
runner options). Exit codes: 0 every pair done, 1 usage error, 3 some pairs failed,
130 interrupted."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from ._cli_guards import progress_option, progress_wanted, warnings_as_lines
from .registration.losses import LOSSES
from .registration.options import MODELS, PREALIGNS

__all__ = ["batch", "bids", "manifest", "report", "runner_options", "run_engine", "BatchCommand"]


class BatchCommand(click.Command):
    """A command whose usage errors exit with 1 (the batch convention: 3 means some pairs
    failed, so 2 is not used)."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as err:
            err.exit_code = 1
            raise

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as err:
            err.exit_code = 1
            raise


def _ids(ctx, param, values) -> list[str] | None:
    out = [v.strip() for value in values for v in value.split(",") if v.strip()]
    return out or None


def runner_options(f):
    """The options of every command that runs a batch."""
    options = [
        click.option(
            "--workers",
            type=click.IntRange(min=1),
            default=None,
            help="Local worker processes [default: one per 2 cores, at least 1].",
        ),
        click.option(
            "--threads",
            type=click.IntRange(min=1),
            default=None,
            help="Torch threads per worker [default: cores / workers].",
        ),
        click.option(
            "--scheduler", default=None, help="Address of a running Dask scheduler to use."
        ),
        click.option(
            "--scheduler-file",
            type=click.Path(dir_okay=False, exists=True),
            default=None,
            help="A Dask scheduler file (dask scheduler --scheduler-file F).",
        ),
        click.option(
            "--timeout",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help="Seconds a pair may run before it fails (its worker is restarted).",
        ),
        click.option(
            "--memory-limit",
            default="auto",
            show_default=True,
            help="Memory of a local worker ('4GB', or auto: the machine's / workers); a "
            "worker above 95%% of it is restarted and its pair fails 'out of memory'.",
        ),
        click.option("--dry-run", is_flag=True, help="Print what would run, and why; run nothing."),
        click.option("--rerun-failed", is_flag=True, help="Run again the pairs that failed."),
        click.option(
            "--only",
            multiple=True,
            callback=_ids,
            help="Pair ids to consider (comma-separated or repeated); others are left as they are.",
        ),
        click.option("--model", default=None, type=click.Choice(MODELS), help="[default: lddmm]"),
        click.option(
            "--prealign", default=None, type=click.Choice(PREALIGNS), help="[default: rigid]"
        ),
        click.option(
            "--loss",
            default=None,
            type=click.Choice([n for n in LOSSES if n != "landmarks"]),
            help="[default: sinkhorn, then varifold at the fine level]",
        ),
        click.option(
            "--sigma",
            default=None,
            type=float,
            help="LDDMM kernel width, mm [a tenth and a 27th of the target's size].",
        ),
        click.option(
            "--points",
            default=None,
            type=click.IntRange(min=100),
            help="Decimate both surfaces to about this many vertices first.",
        ),
        click.option(
            "--max-iter",
            default=None,
            type=click.IntRange(min=1),
            help="L-BFGS iterations a level [default: LBFGSOptions's, 15].",
        ),
        click.option(
            "--picture/--no-picture", default=None, help="Pictures per pair [default: on]."
        ),
        click.option(
            "--report/--no-report", default=True, show_default=True, help="Write index.html."
        ),
        progress_option,
    ]
    for option in reversed(options):
        f = option(f)
    return f


#: runner_options' names that are registration options (rows may override them).
_REGISTRATION = ("model", "prealign", "loss", "sigma", "points", "max_iter", "picture")


def run_engine(pairs, output: str | Path, kw: dict, tables: bool = True) -> None:
    """Plan or run a batch from the runner options and exit with its code."""
    from .batch.engine import describe, plan_batch, run_batch

    options = {k: kw[k] for k in _REGISTRATION if kw.get(k) is not None}
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise click.BadParameter(f"{output} exists and is not a folder", param_hint="-o")
    _refuse_inputs_in_outputs(pairs, out)
    with warnings_as_lines():
        try:
            if kw["dry_run"]:
                planned = plan_batch(
                    pairs, out, options, rerun_failed=kw["rerun_failed"], only=kw["only"]
                )
                for p in planned:
                    click.echo(describe(p))
                counts = {}
                for p in planned:
                    counts[p.state] = counts.get(p.state, 0) + 1
                click.echo(", ".join(f"{n} {state}" for state, n in counts.items()), err=True)
                sys.exit(0)
            result = run_batch(
                pairs,
                out,
                options,
                workers=kw["workers"],
                threads=kw["threads"],
                scheduler=kw["scheduler"],
                scheduler_file=kw["scheduler_file"],
                timeout=kw["timeout"],
                memory_limit=_memory(kw["memory_limit"]),
                rerun_failed=kw["rerun_failed"],
                only=kw["only"],
                progress=progress_wanted(kw["progress"]),
                report=kw["report"] and tables,
                tables=tables,
            )
        except (ValueError, TypeError, FileNotFoundError) as err:
            raise click.UsageError(str(err)) from err
        except (ImportError, OSError) as err:
            raise click.UsageError(str(err)) from err
    sys.exit(result.exit_code)


def _memory(value: str) -> str | float:
    if value == "auto":
        return "auto"
    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*([kKmMgGtT]i?[bB])?\s*", value):
        raise click.BadParameter(
            f"{value!r} is not a memory size such as 4GB, 500MB or auto",
            param_hint="--memory-limit",
        )
    return value


def _refuse_inputs_in_outputs(pairs, out: Path) -> None:
    """An input file inside a pair's output folder could be replaced: refuse before work."""
    for p in pairs:
        folder = (out / p.folder).resolve()
        for role in ("source", "target"):
            path = Path(getattr(p, role)).resolve()
            if folder == path.parent and path.name.startswith(p.prefix):
                raise click.BadParameter(
                    f"pair {p.pair_id}: its {role} {path} lies in its output folder {folder}, "
                    "where it could be replaced; choose another -o",
                    param_hint="-o",
                )


@click.command(cls=BatchCommand)
@click.argument("pairs_csv", metavar="PAIRS.csv", type=click.Path(dir_okay=False))
@click.option(
    "-o", "--output", required=True, type=click.Path(file_okay=False), help="Batch folder."
)
@runner_options
def batch(pairs_csv: str, output: str, **kw) -> None:
    """Register every pair of a manifest (columns pair_id, source, target; optional label,
    level, hemisphere, source_subject, target_subject, options as JSON), in worker processes.

    Reruns nothing that is done (same inputs' content, options and output format); a pair
    that fails leaves the others running. Writes DIR/pairs/<id>/ per pair, summary.csv,
    failed.csv and the group page index.html. Exit 0: all done, 1: usage error, 3: some
    pairs failed, 130: interrupted.
    """
    from .batch import read_manifest

    try:
        pairs = read_manifest(pairs_csv)
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise click.UsageError(str(err)) from err
    run_engine(pairs, output, kw)


@click.group()
def manifest() -> None:
    """Write a manifest for otreg batch."""


def _subject_ids(files: tuple[str, ...], id_from: str) -> dict[str, str]:
    from .batch.manifest import check_pair_id

    if not files:
        raise click.UsageError("give the subjects' files")
    out: dict[str, str] = {}
    for f in files:
        p = Path(f)
        if not p.exists():
            raise click.BadParameter(f"{f} does not exist", param_hint="FILES")
        sid = p.parent.name if id_from == "parent" else re.split(r"\.", p.name)[0]
        try:
            check_pair_id(sid)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--id-from") from err
        if sid in out:
            raise click.BadParameter(
                f"two files give the subject id {sid!r} ({out[sid]}, {f}); use --id-from parent "
                "or rename them",
                param_hint="--id-from",
            )
        out[sid] = f
    return out


_id_from = click.option(
    "--id-from",
    type=click.Choice(["name", "parent"]),
    default="name",
    show_default=True,
    help="Subject id: the file name up to its first dot, or its folder's name.",
)
_manifest_out = click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False), help="The CSV to write."
)


@manifest.command("to-template", cls=BatchCommand)
@click.argument("template", type=click.Path(dir_okay=False, exists=True))
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--template-id", default="template", show_default=True)
@_id_from
@_manifest_out
def to_template(template: str, files: tuple[str, ...], template_id: str, id_from, output):
    """Every subject FILE onto TEMPLATE."""
    from .batch import pairs_to_template, write_manifest

    try:
        pairs = pairs_to_template(_subject_ids(files, id_from), template, template_id)
        write_manifest(pairs, output)
    except (ValueError, TypeError) as err:
        raise click.UsageError(str(err)) from err
    click.echo(f"wrote {output}: {len(pairs)} pairs")


@manifest.command("all-pairs", cls=BatchCommand)
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--symmetric", is_flag=True, help="Both directions of every pair.")
@_id_from
@_manifest_out
def all_pairs_cmd(files: tuple[str, ...], symmetric: bool, id_from, output):
    """Every pair of subject FILES (a before b in the given order)."""
    from .batch import all_pairs, write_manifest

    try:
        pairs = all_pairs(_subject_ids(files, id_from), symmetric=symmetric)
        write_manifest(pairs, output)
    except (ValueError, TypeError) as err:
        raise click.UsageError(str(err)) from err
    click.echo(f"wrote {output}: {len(pairs)} pairs")


@click.command(cls=BatchCommand)
@click.argument("folder", type=click.Path(file_okay=False, exists=True))
def report(folder: str) -> None:
    """Rebuild a batch folder's group page (index.html) from its per-pair records."""
    from .batch.report import build_report

    path = build_report(folder)
    click.echo(f"wrote {path}")


@click.command(cls=BatchCommand)
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
@click.option("--template-left", default=None, type=click.Path(dir_okay=False, exists=True))
@click.option("--template-right", default=None, type=click.Path(dir_okay=False, exists=True))
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
    **kw,
) -> None:
    """BIDS-Apps entry point: register each subject's surfaces (fMRIPrep/sMRIPrep
    derivatives, or a FreeSurfer SUBJECTS_DIR) onto a template.

    participant: find the inputs, write OUTPUT_DIR/otreg_pairs.csv and run them (outputs
    named as BIDS derivatives, sub-XX/anat/sub-XX_hemi-L_space-ID_desc-otreg_*). group: the
    summary tables and the group page from the records of every participant run.
    """
    from .batch import bids_pairs, find_inputs, write_dataset_description, write_manifest
    from .batch.tables import tables_from_records

    out = Path(output_dir)
    if analysis_level == "group":
        if not out.is_dir():
            raise click.BadParameter(f"{output_dir} does not exist", param_hint="OUTPUT_DIR")
        from .batch.report import build_report

        n = tables_from_records(out)
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
            pairs = bids_pairs(inputs, templates, tid)
        except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
            raise click.UsageError(str(err)) from err
        if not kw["dry_run"]:
            out.mkdir(parents=True, exist_ok=True)
            write_dataset_description(out, bids_dir)
            write_manifest(pairs, out / "otreg_pairs.csv")
    run_engine(pairs, out, kw, tables=False)


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
    from .datasets import fsaverage5_path

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
