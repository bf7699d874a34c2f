"""The batch commands of ``otreg``: ``batch``, ``manifest``, ``report``, and what
``otreg bids`` shares with them (the runner options, :func:`run_engine`). Exit codes: 0 every
pair done, 1 an error before any pair ran, 3 some pairs failed, 130 interrupted."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from .._checks import check_progress
from ..batch import all_pairs, pairs_to_template, read_manifest, write_manifest
from ..batch.engine import check_memory_limit, describe, plan_batch, run_batch
from ..batch.manifest import check_pair_id
from ..batch.records import find_records, unreadable_records
from ..batch.report import build_report
from ..io import same_file
from ._common import (
    Command,
    check_local_device,
    device_option,
    given_registration_options,
    progress_option,
    registration_options,
    warnings_as_lines,
)

__all__: list[str] = []


def _ids(ctx, param, values) -> list[str] | None:
    out = [v.strip() for value in values for v in value.split(",") if v.strip()]
    return out or None


def runner_options(f):
    """The options of every command that runs a batch, the registration flags included."""
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
            "worker above 95% of it is restarted and its pair fails 'out of memory'.",
        ),
        click.option(
            "--dry-run",
            is_flag=True,
            help="Print what would run, and why; run nothing (exit code 3 where a pair "
            "failed before or will fail, as the run's would be).",
        ),
        click.option("--rerun-failed", is_flag=True, help="Run again the pairs that failed."),
        click.option(
            "--only",
            multiple=True,
            callback=_ids,
            help="Pair ids to consider (comma-separated or repeated); others are left as they are.",
        ),
        click.option(
            "--report/--no-report", default=True, show_default=True, help="Write index.html."
        ),
        device_option,
        progress_option,
    ]
    for option in reversed(options):
        f = option(f)
    return registration_options(f)


def run_engine(pairs, output: str | Path, kw: dict, tables: bool = True) -> None:
    """Plan or run a batch from the runner options and exit with its code."""
    options = given_registration_options(kw)
    memory_limit = _memory(kw["memory_limit"])
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise click.BadParameter(f"{output} exists and is not a folder", param_hint="-o")
    above = next((p for p in out.absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():  # the folder could not be made there
        raise click.BadParameter(f"{output} lies under {above}, a file", param_hint="-o")
    _refuse_inputs_in_outputs(pairs, out)
    with warnings_as_lines():
        try:
            if kw["dry_run"]:
                if not (kw["scheduler"] or kw["scheduler_file"]):  # as the run would, first
                    check_local_device(kw["device"])
                planned = plan_batch(
                    pairs, out, options, rerun_failed=kw["rerun_failed"], only=kw["only"]
                )
                for p in planned:
                    click.echo(describe(p))
                counts = {}
                for p in planned:
                    counts[p.state] = counts.get(p.state, 0) + 1
                click.echo(", ".join(f"{n} {state}" for state, n in counts.items()), err=True)
                # as a run would end: 3 where a pair failed before or will fail
                sys.exit(3 if counts.keys() & {"failed", "missing input"} else 0)
            result = run_batch(
                pairs,
                out,
                options,
                workers=kw["workers"],
                threads=kw["threads"],
                scheduler=kw["scheduler"],
                scheduler_file=kw["scheduler_file"],
                timeout=kw["timeout"],
                memory_limit=memory_limit,
                device=kw["device"],
                rerun_failed=kw["rerun_failed"],
                only=kw["only"],
                progress=check_progress("otreg batch", kw["progress"]),
                report=kw["report"] and tables,
                tables=tables,
            )
        except (ValueError, TypeError, FileNotFoundError) as err:
            raise click.UsageError(str(err)) from err
        except (ImportError, OSError) as err:  # not the command line's fault: no usage text
            raise click.ClickException(str(err)) from err
    sys.exit(result.exit_code)


def _memory(value: str) -> str | int:
    """--memory-limit checked before anything runs (a dry run too)."""
    try:
        return check_memory_limit(value)
    except (ValueError, TypeError) as err:
        raise click.BadParameter(
            str(err).removeprefix("memory_limit is ").removeprefix("memory_limit: "),
            param_hint="--memory-limit",
        ) from err


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


@click.command(cls=Command)
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
    failed.csv and the group page index.html. Exit 0: all done, 1: an error (nothing run), 3: some
    pairs failed, 130: interrupted.
    """
    try:
        pairs = read_manifest(pairs_csv)
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise click.UsageError(str(err)) from err
    run_engine(pairs, output, kw)


@click.group()
def manifest() -> None:
    """Write a manifest for otreg batch."""


def _subject_ids(files: tuple[str, ...], id_from: str) -> dict[str, str]:
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
            where, other = (
                ("its folder's name", "name")
                if id_from == "parent"
                else ("its name up to the first dot", "parent")
            )
            raise click.BadParameter(
                f"{f}: the subject id is {where} ({sid!r}, --id-from {id_from}), which cannot "
                f"be a pair id: {err}; rename the file or use --id-from {other}",
                param_hint="FILES",
            ) from err
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


_hemisphere = click.option(
    "--hemisphere",
    type=click.Choice(["L", "R"]),
    default=None,
    help="Every pair's hemisphere column (the batch then checks each source's side of the "
    "midline).",
)


def _manifest_out(command):
    """``-o OUTPUT`` and ``--overwrite``: an existing CSV is replaced only when asked."""
    command = click.option(
        "--overwrite", is_flag=True, help="Replace OUTPUT if it exists (else refused)."
    )(command)
    return click.option(
        "-o", "--output", required=True, type=click.Path(dir_okay=False), help="The CSV to write."
    )(command)


def _write_manifest(pairs, output: str, overwrite: bool, inputs) -> None:
    """Write the manifest, refusing to replace an input, or an existing file unasked."""
    if any(same_file(output, given) for given in inputs):
        raise click.BadParameter(f"{output} is one of the inputs", param_hint="-o")
    if Path(output).exists() and not overwrite:
        raise click.BadParameter(
            f"{output} exists; give --overwrite to replace it", param_hint="-o"
        )
    write_manifest(pairs, output)


@manifest.command("to-template", cls=Command)
@click.argument("template", type=click.Path(dir_okay=False, exists=True))
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--template-id", default="template", show_default=True)
@_id_from
@_hemisphere
@_manifest_out
def to_template(
    template: str, files: tuple[str, ...], template_id: str, id_from, hemisphere, output,
    overwrite,
):  # fmt: skip
    """Every subject FILE onto TEMPLATE."""
    try:
        with warnings_as_lines():  # (the template among the files: said in one line)
            pairs = pairs_to_template(
                _subject_ids(files, id_from), template, template_id, hemisphere=hemisphere
            )
        _write_manifest(pairs, output, overwrite, (template, *files))
    except (ValueError, TypeError) as err:
        raise click.UsageError(str(err)) from err
    click.echo(f"wrote {output}: {len(pairs)} pairs")


@manifest.command("all-pairs", cls=Command)
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--symmetric", is_flag=True, help="Both directions of every pair.")
@_id_from
@_hemisphere
@_manifest_out
def all_pairs_cmd(files: tuple[str, ...], symmetric: bool, id_from, hemisphere, output, overwrite):
    """Every pair of subject FILES (a before b in the given order)."""
    try:
        pairs = all_pairs(_subject_ids(files, id_from), symmetric=symmetric, hemisphere=hemisphere)
        _write_manifest(pairs, output, overwrite, files)
    except (ValueError, TypeError) as err:
        raise click.UsageError(str(err)) from err
    click.echo(f"wrote {output}: {len(pairs)} pairs")


@click.command(cls=Command)
@click.argument("folder", type=click.Path(file_okay=False, exists=True))
def report(folder: str) -> None:
    """Rebuild a batch folder's group page (index.html) from its per-pair records."""
    if not find_records(folder) and not unreadable_records(folder):
        raise click.BadParameter(
            f"{folder} holds no batch records (a pair's metrics.json or error.json below "
            "it): give the -o folder of otreg batch, or the OUTPUT_DIR of otreg bids",
            param_hint="FOLDER",
        )
    path = build_report(folder)
    click.echo(f"wrote {path}")
