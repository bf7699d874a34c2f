"""The registration commands of ``otreg``: ``register`` (two surfaces or segmentations) and
``demo`` (the main job: two real brain surfaces), with their shared output step."""

from __future__ import annotations

import resource
from pathlib import Path

import click

from ._cli_guards import output_folder, progress_option, progress_wanted, warnings_as_lines
from .registration.losses import LOSSES
from .registration.options import MODELS, PREALIGNS

__all__ = ["register_cmd", "demo", "check_volume_options"]


@click.command("register")
@click.argument("source", type=click.Path(dir_okay=False))
@click.argument("target", type=click.Path(dir_okay=False))
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder for warped.vtk, parameters.npz, registration.json and pictures.",
)
@click.option("--model", default="lddmm", show_default=True, type=click.Choice(MODELS))
@click.option("--prealign", default="rigid", show_default=True, type=click.Choice(PREALIGNS))
@click.option(
    "--loss",
    default=None,
    type=click.Choice([name for name in LOSSES if name != "landmarks"]),
    help="Data term at every level [default: sinkhorn at the coarse level, varifold "
    "at the fine one].",
)
@click.option(
    "--sigma",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="LDDMM kernel width, mm [default: two widths, a tenth and a 27th of the target's size].",
)
@click.option(
    "--label",
    default=None,
    type=float,
    help="Segmentation label (for the inputs that are volumes).",
)
@click.option(
    "--level",
    default=None,
    type=float,
    help="Threshold of probability maps, in the map's own units (volumes only).",
)
@click.option(
    "--points",
    default=None,
    type=click.IntRange(min=100),
    help="Decimate both surfaces to about this many vertices first.",
)
@click.option(
    "--max-iter",
    default=None,
    type=click.IntRange(min=1),
    help="L-BFGS iterations a level [default: LBFGSOptions's, 15].",
)
@click.option("--picture/--no-picture", default=True, show_default=True)
@progress_option
def register_cmd(
    source: str,
    target: str,
    output: str,
    model: str,
    prealign: str,
    loss: str,
    sigma: float | None,
    label: float | None,
    level: float | None,
    points: int | None,
    max_iter: int | None,
    picture: bool,
    progress: bool | None,
) -> None:
    """Register SOURCE onto TARGET (meshes, or volumes with --label/--level)."""
    from . import LBFGSOptions, LDDMMOptions, register
    from .io import load_input

    check_volume_options(label, level, [source, target])
    with output_folder(output, [source, target], picture), warnings_as_lines():
        try:
            src, tgt = (load_input(p, label, level, points) for p in (source, target))
            for path, shape in ((source, src), (target, tgt)):
                if shape.n_faces == 0:
                    raise ValueError(
                        f"{path} has no triangles (a point cloud); otreg register "
                        "compares surfaces: give a mesh, or a volume with --label/--level"
                    )
            res = register(
                src,
                tgt,
                model=LDDMMOptions(sigma=sigma) if model == "lddmm" else model,
                prealign=prealign,
                loss=loss,
                optimizer=LBFGSOptions() if max_iter is None else LBFGSOptions(max_iter=max_iter),
                progress=progress_wanted(progress),
            )
        except (ValueError, TypeError, FileNotFoundError) as err:
            raise click.ClickException(str(err)) from err
        _write_outputs(res, src, tgt, output, picture)


def check_volume_options(label: float | None, level: float | None, paths: list[str]) -> None:
    """--label and --level apply to volumes: refuse them when no input is one, and
    refuse both at once."""
    from .io import VOLUME_EXTS

    given = [name for name, value in (("--label", label), ("--level", level)) if value is not None]
    if len(given) == 2:
        raise click.UsageError(
            "give --label (a segmentation value) or --level (a threshold of a probability "
            "map), not both"
        )
    if given and not any(Path(p).name.lower().endswith(VOLUME_EXTS) for p in paths):
        raise click.UsageError(
            f"{given[0]} applies to volumes ({', '.join(VOLUME_EXTS)}); "
            f"{' and '.join(paths)} {'is not one' if len(paths) == 1 else 'are not'}: "
            f"leave {given[0]} out for meshes and point clouds"
        )


def _write_outputs(res, src, tgt, output: str, picture: bool) -> None:
    """Save a registration, draw its pictures and print its metrics."""
    folder = res.save(output)
    if picture:
        from .viz import plot_registration

        plot_registration(res, src, tgt, folder)
    m = res.metrics
    written = sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith("."))
    click.echo(f"wrote {folder}/ ({', '.join(written)})")
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
    click.echo(
        f"  time                   {m['seconds']:.1f} s (pre-alignment "
        f"{m['prealign_seconds']:.1f}, fit {m['fit_seconds']:.1f}, metrics "
        f"{m['metrics_seconds']:.1f}), peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
    )


@click.command()
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
@progress_option
def demo(
    output: str, pair: str, hemi: str, surface: str, points: int | None, progress: bool | None
) -> None:
    """Register two real brain surfaces (by default fsaverage5 onto Conte69) and write the
    warped surface, the parameters, the metrics and a picture."""
    from . import register, save_shape

    with output_folder(output, [], True, ("source.vtk", "target.vtk")) as folder:
        try:
            source, target, truth, what = _demo_pair(pair, hemi, surface, points)
        except (ImportError, FileNotFoundError) as err:
            # otreg's own messages name the command that installs what is missing
            fix = "" if "pip install" in str(err) else "; pip install 'otreg[data,mesh]'"
            raise click.ClickException(f"{err}{fix}") from err
        click.echo(f"{what}: {source.n_points:,} and {target.n_points:,} vertices")
        save_shape(source, folder / "source.vtk")
        save_shape(target, folder / "target.vtk")
        res = register(source, target, truth=truth, progress=progress_wanted(progress))
        _write_outputs(res, source, target, output, True)


def _demo_pair(pair: str, hemi: str, surface: str, points: int | None):
    """``(source, target, truth or None, description)`` of a demo pair, each surface read
    once and decimated to ``points`` vertices when given (a synthetic subject is made from
    the decimated source)."""
    from . import datasets

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
