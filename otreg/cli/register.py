"""``otreg register`` (two surfaces or segmentations) and ``otreg demo`` (the main job: two
real brain surfaces): each runs one job (:func:`~otreg.batch.job.run_job`), as a batch
worker does, and prints its metrics. ``otreg transfer`` carries per-vertex values through a
saved registration."""

from __future__ import annotations

import dataclasses
import glob
import resource
from pathlib import Path

import click
import numpy as np

from .. import datasets
from .._checks import check_progress
from ..batch.job import JobOptions, carried_outputs, run_job
from ..batch.manifest import Pair
from ..batch.records import DONE_NAME, FAILED_NAME, read_record
from ..io import (
    kind_of_name,
    load_shape,
    load_values,
    same_file,
    save_shape,
    save_values,
    values_stem,
)
from ..registration import Registration
from ._common import (
    Command,
    check_local_device,
    check_volume_options,
    device_option,
    job_options,
    output_folder,
    progress_option,
    registration_options,
    set_threads,
    threads_option,
    volume_options,
    warnings_as_lines,
)

__all__: list[str] = []


@click.command("register", cls=Command)
@click.argument("source", type=click.Path())
@click.argument("target", type=click.Path())
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder for warped.vtk, parameters.npz, registration.json, pictures and the "
    "carried values (to-target_*, to-source_*): a file of a name this run writes is "
    "replaced (never an input), an earlier otreg run's other files there are removed (as "
    "listed in its .otreg-outputs), any other file is kept.",
)
@click.option(
    "--source-values",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Per-vertex values on SOURCE (a map or labels: .func.gii, .shape.gii, .label.gii, "
    ".annot, a FreeSurfer curv file, .mgh/.mgz, .npy; GIFTI also .gz) to carry onto "
    "TARGET, written as to-target_<name>; repeatable.",
)
@click.option(
    "--target-values",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Per-vertex values on TARGET (an atlas's labels, a template's map) to carry onto "
    "SOURCE, written as to-source_<name>; repeatable.",
)
@registration_options
@volume_options
@threads_option
@device_option
@progress_option
def register_cmd(
    source: str,
    target: str,
    output: str,
    source_values: tuple[str, ...],
    target_values: tuple[str, ...],
    label: float | None,
    level: float | None,
    threads: int | None,
    device: str | None,
    progress: bool | None,
    **registration,
) -> None:
    """Register SOURCE onto TARGET (meshes, or volumes with --label/--level)."""
    check_volume_options(label, level, [source, target])
    check_local_device(device)
    set_threads(threads)
    options = job_options(registration)
    progress = check_progress("otreg register", progress)
    try:  # the checks of a manifest row's values files
        Pair("register", source, target, source_values=source_values, target_values=target_values)
    except ValueError as err:
        raise click.BadParameter(str(err).removeprefix("pair register: ")) from err
    carried = [
        f"to-{to}_{name}"
        for to, files in (("target", source_values), ("source", target_values))
        for f in files
        for name in carried_outputs(f)
    ]
    inputs = [source, target, *source_values, *target_values]
    with output_folder(output, inputs, tuple(carried)) as staging, warnings_as_lines():
        try:
            out = run_job(
                source,
                target,
                staging,
                options,
                label=label,
                level=level,
                progress=progress,
                source_values=source_values,
                target_values=target_values,
                device=device,
            )
        except (ValueError, TypeError, FileNotFoundError) as err:
            raise click.ClickException(str(err)) from err
        written = sorted(p.name for p in staging.iterdir())
    _print_outputs(out.registration.metrics, output, written)


def _print_outputs(m: dict, output: str, written: list[str]) -> None:
    """What a job wrote (the files' names), and its metrics."""
    click.echo(f"wrote {Path(output).expanduser()}/ ({', '.join(written)})")
    aligned = f", {m['prealigned_mean_mm']:.3f} mm pre-aligned" if "prealigned_mean_mm" in m else ""
    click.echo(
        f"  mean surface distance  {m['before_mean_mm']:.3f} mm before{aligned}, "
        f"{m['mean_mm']:.3f} mm after (to the {m.get('distance_to', 'vertices')})"
    )
    click.echo(
        f"    after, both ways     {m['mean_ab_mm']:.3f} mm source to target, "
        f"{m['mean_ba_mm']:.3f} mm target to source"
    )
    click.echo(
        f"  Hausdorff distance     {m['before_hausdorff_mm']:.2f} mm before, "
        f"{m['hausdorff_mm']:.2f} mm after"
    )
    if "curvature_correlation" in m:
        click.echo(
            f"  curvature correlation  {m['before_curvature_correlation']:.3f} before, "
            f"{m['curvature_correlation']:.3f} after"
        )
    for key in sorted(k for k in m if k.endswith("_dice") and f"before_{k}" in m):
        name = f"{key.removesuffix('_dice')} Dice"
        click.echo(f"  {name:<22} {m[f'before_{key}']:.3f} before, {m[key]:.3f} after")
    if "vertex_error_mean_mm" in m:
        click.echo(
            f"  vertex error (truth)   mean {m['vertex_error_mean_mm']:.3f} mm, max "
            f"{m['vertex_error_max_mm']:.2f} mm"
        )
    if "jacobian_min" in m:
        click.echo(
            f"  Jacobian determinant   {m['jacobian_min']:.3f} to {m['jacobian_max']:.3f}"
            f" ({100 * m['jacobian_negative_fraction']:.1f}% negative)"
        )
    read = f"; reading the inputs {m['read_seconds']:.1f} s" if "read_seconds" in m else ""
    click.echo(
        f"  time                   {m['seconds']:.1f} s (pre-alignment "
        f"{m['prealign_seconds']:.1f}, fit {m['fit_seconds']:.1f}, metrics "
        f"{m['metrics_seconds']:.1f}){read}, peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
    )


@click.command(cls=Command)
@click.option(
    "-o",
    "--output",
    default="otreg-demo",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for the results.",
)
@click.option(
    "--pair",
    default="templates",
    show_default=True,
    type=click.Choice(["templates", "hemispheres", "synthetic"]),
    help="templates: fsaverage5 (FreeSurfer, nilearn's wheel) onto Conte69 (fs_LR 32k, the "
    "HCP's, brainspace's wheel), two templates made by different groups; hemispheres: "
    "fsaverage5's left onto its mirrored right; synthetic: fsaverage5 onto a subject made "
    "from it by a known deformation (vertex errors reported).",
)
@click.option(
    "--hemi",
    default="left",
    show_default=True,
    type=click.Choice(["left", "right"]),
    help="Which hemisphere (templates and synthetic pairs).",
)
@click.option(
    "--surface",
    default="midthickness",
    show_default=True,
    type=click.Choice(["midthickness", "pial", "white"]),
    help="Which fsaverage5 surface (Conte69's is its midthickness).",
)
@click.option(
    "--points",
    default=None,
    type=click.IntRange(min=100),
    help="Decimate both surfaces to about this many vertices (a quick run).",
)
@threads_option
@device_option
@progress_option
def demo(
    output: str,
    pair: str,
    hemi: str,
    surface: str,
    points: int | None,
    threads: int | None,
    device: str | None,
    progress: bool | None,
) -> None:
    """Register two real brain surfaces (by default fsaverage5 onto Conte69) and write the
    warped surface, the parameters, the metrics and a picture."""
    check_local_device(device)
    set_threads(threads)
    with output_folder(output, [], ("source.vtk", "target.vtk")) as staging:
        try:
            source, target, truth, what = _demo_pair(pair, hemi, surface, points)
        except (ImportError, FileNotFoundError) as err:
            # otreg's own messages name the command that installs what is missing
            fix = "" if "pip install" in str(err) else "; pip install 'otreg[data,mesh]'"
            raise click.ClickException(f"{err}{fix}") from err
        click.echo(f"{what}: {source.n_points:,} and {target.n_points:,} vertices")
        save_shape(source, staging / "source.vtk")
        save_shape(target, staging / "target.vtk")
        # recorded as the registration's inputs where they will be (otreg transfer reads
        # the target from there)
        final = Path(output).expanduser().resolve()
        source = dataclasses.replace(source, source=str(final / "source.vtk"))
        target = dataclasses.replace(target, source=str(final / "target.vtk"))
        try:
            progress = check_progress("otreg demo", progress)
            out = run_job(source, target, staging, JobOptions(), truth=truth, progress=progress,
                          device=device)  # fmt: skip
        except ValueError as err:  # a device not here (the packaged surfaces are surfaces)
            raise click.ClickException(str(err)) from err
        written = sorted(p.name for p in staging.iterdir())
    _print_outputs(out.registration.metrics, output, written)


def _demo_pair(pair: str, hemi: str, surface: str, points: int | None):
    """``(source, target, truth or None, description)`` of a demo pair, each surface read
    once and decimated to ``points`` vertices when given (a synthetic subject is made from
    the decimated source)."""

    def fit(shape):
        return shape if points is None else shape.decimate(points)

    if pair == "hemispheres":
        source = fit(datasets.fsaverage5(surface, "left"))
        target = fit(datasets.fsaverage5(surface, "right").mirror(0))
        return source, target, None, f"fsaverage5 left {surface} -> mirrored right {surface}"
    source = fit(datasets.fsaverage5(surface, hemi))
    if pair == "templates":
        target = fit(datasets.conte69(hemi))
        return source, target, None, f"fsaverage5 {hemi} {surface} -> Conte69 {hemi} midthickness"
    (subject,) = datasets.synthetic_subjects(source, n=1, seed=0)
    what = f"fsaverage5 {hemi} {surface} -> a synthetic subject (known deformation)"
    return source, subject.shape, subject.shape.points, what


@click.command(cls=Command)
@click.argument("result", type=click.Path(exists=True))
@click.argument("values", type=click.Path())
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False),
    help="The file to write (an earlier file of that name is replaced; never an input); "
    "its folder is made where missing.",
)
@click.option(
    "--to",
    default="target",
    show_default=True,
    type=click.Choice(["target", "source"]),
    help="target: VALUES are at the source's vertices; source: at the target's.",
)
@click.option(
    "--kind",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "map", "labels"]),
    help="map: barycentric interpolation on the nearest triangle; labels: the label whose "
    "corners of the nearest triangle hold the most barycentric weight (summed per label; "
    "whole-number floats count as integers); auto: labels where VALUES hold a label table "
    "(.label.gii, .annot), else what OUTPUT's name asks for (labels for .label.gii and .annot, "
    "a map for .func.gii and .shape.gii), else labels for integer values.",
)
@click.option(
    "--target",
    "target_file",
    default=None,
    type=click.Path(dir_okay=False, exists=True),
    help="The target surface, where its recorded file has moved.",
)
def transfer(
    result: str, values: str, output: str, to: str, kind: str, target_file: str | None
) -> None:
    """Carry per-vertex VALUES (.func.gii, .label.gii, .annot, lh.curv, .mgh, .npy) through the
    registration in RESULT (its folder, or one of its files) onto the other surface, and
    write them as OUTPUT (the format of its name; labels keep their table), with labels'
    confidence (1/3 to 1 a vertex: the winning label's share of its nearest triangle's
    weights) beside it, named as OUTPUT less its extension + _confidence.npy
    (atlas.label.gii: atlas_confidence.npy)."""
    confidence_file = Path(output).with_name(f"{values_stem(Path(output).name)}_confidence.npy")
    with warnings_as_lines():
        try:
            res = Registration.load(result)
            given = load_values(values)
            target = None if target_file is None else load_shape(target_file)
        except (ValueError, TypeError, FileNotFoundError) as err:
            raise click.ClickException(_failed_pair(result) or str(err)) from err
        named = None
        if kind == "auto":  # values with a label table are labels; else OUTPUT's name asks
            # for labels or a map; else the values' dtype decides
            named = None if given.label_table else kind_of_name(output)
            kind = "labels" if given.label_table else named or "auto"
        try:
            out = res.transfer(given, to=to, kind=kind, target=target)
            for written in (output, confidence_file if out.confidence is not None else None):
                if written is not None and (
                    same_file(written, values)
                    or any(same_file(written, p) for p in res.inputs.values() if p)
                ):
                    raise ValueError(f"{written} is an input; otreg never overwrites one")
            if out.confidence is not None and confidence_file.is_file():
                owners = _other_labels(Path(output), confidence_file)
                if owners:
                    raise ValueError(
                        f"{confidence_file.name}, where these labels' confidence goes, is the "
                        f"confidence of {owners[0].name}: name OUTPUT otherwise (its "
                        "confidence is named after it), or remove those files first"
                    )
            _save_transferred(out, Path(output), confidence_file)
        except (ValueError, TypeError, FileNotFoundError) as err:
            message = _in_cli_words(str(err), res, given, to, values)
            if named is not None and f"kind='{named}'" in message:
                message = message.replace(
                    f"kind='{named}'", f"OUTPUT's name ({Path(output).name}) asks for {named}"
                )
                message += " (give --kind, or name OUTPUT for what VALUES hold)"
            raise click.ClickException(message) from err
        except OSError as err:  # a folder where a file goes, no permission, a full disk
            where = err.filename2 or err.filename  # a rename's destination, or the path
            why = f"{where}: {err.strerror}" if where and err.strerror else str(err)
            raise click.ClickException(f"cannot write {output} ({why})") from err
    what = "labels" if out.is_labels else "a map"
    conf = ""
    if out.confidence is not None:
        low = int((out.confidence < 0.5).sum())
        conf = f"; confidence below 0.5 at {low:,} vertices, in {confidence_file.name}"
    click.echo(f"wrote {output}: {what} at {out.n_vertices:,} {to} vertices{conf}")


def _save_transferred(out, output: Path, confidence_file: Path) -> None:
    """Write the carried values and, for labels, their confidence: both or neither (each
    file atomically; the confidence first, removed again if the values cannot be written).
    A map written where labels were before removes their confidence file, which would no
    longer match, unless other labels with the same name less their extension own it
    (:func:`_other_labels`: atlas.func.gii beside atlas.label.gii)."""
    if out.confidence is None:
        save_values(out, output)
        if confidence_file.is_file() and not _other_labels(output, confidence_file):
            confidence_file.unlink()
            click.echo(f"removed {confidence_file}: the confidence of labels written earlier")
        return
    save_values(out.confidence, confidence_file)
    try:
        save_values(out, output)
    except BaseException:
        confidence_file.unlink(missing_ok=True)
        raise


def _other_labels(output: Path, confidence_file: Path) -> list[Path]:
    """Label files other than OUTPUT beside it whose confidence file is the same (the same
    name less the extension: atlas.label.gii and atlas.annot): by their name (.label.gii,
    .annot), or .npy files of integers."""
    stem = values_stem(output.name)
    found = []
    for path in sorted(output.parent.glob(f"{glob.escape(stem)}.*")):
        if path.name in (output.name, confidence_file.name) or values_stem(path.name) != stem:
            continue
        if kind_of_name(path) == "labels" or _integer_npy(path):
            found.append(path)
    return found


def _integer_npy(path: Path) -> bool:
    """Whether ``path`` is a .npy file of integers (read from its header only)."""
    if path.suffix.lower() != ".npy" or not path.is_file():
        return False
    try:
        return np.load(path, mmap_mode="r").dtype.kind in "iu"
    except (OSError, ValueError):
        return False


def _failed_pair(result: str) -> str | None:
    """Why RESULT holds no registration where it is a failed batch pair's folder (its
    error.json), or None."""
    folder = Path(result) if Path(result).is_dir() else Path(result).parent
    failures = sorted(folder.glob(f"*{FAILED_NAME}"))
    if not failures or any(folder.glob(f"*{DONE_NAME}")):
        return None
    record = read_record(failures[0]) or {}
    reason = (record.get("error") or {}).get("reason", "see the record")
    return (
        f"{result} holds no registration: its pair failed ({failures[0].name}: {reason}); "
        "fix the cause and run the batch again"
    )


def _in_cli_words(message: str, res: Registration, given, to: str, values: str) -> str:
    """A transfer's error in the command's words: its options and VALUES' file, not the
    API's arguments, and the other direction where the values have the other surface's
    vertex count."""
    message = message.replace("give target= (", "give --target (")
    message = message.replace("give to='source'", "give --to source")
    message = message.replace("give to='target'", "give --to target")
    message = message.removeprefix("Registration.transfer: ")
    message = message.removeprefix("save_values: ")
    if message.startswith("values "):
        message = f"{values}: {message}"
    if "values have shape" in message:
        counts = {"source": res.warped.n_points}
        if res.target_summary or res.target is not None:
            counts["target"] = (res.target_summary or {}).get("vertices") or res.target.n_points
        # values for --to target belong on the source; these look like the target's
        belong, look = ("source", "target") if to == "target" else ("target", "source")
        if counts.get(look) == given.n_vertices != counts.get(belong) and "--to" not in message:
            message += f" (they have the {look}'s vertex count: --to {belong}?)"
    return message
