"""The ``otreg`` command line (click)."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
import warnings
from pathlib import Path

import click

from ._cli_batch import batch, bids, manifest, report
from ._cli_guards import (
    output_folder,
    progress_option,
    progress_wanted,
    stdout_to_stderr,
    warnings_as_lines,
)
from .reductions import BACKENDS
from .registration.losses import LOSSES
from .registration.options import MODELS, PREALIGNS

__all__ = ["main"]


class _Relaxation(click.ParamType):
    """'auto' or a number in [1, 2)."""

    name = "auto|w"

    def convert(self, value, param, ctx):
        if value == "auto" or isinstance(value, float):
            return value
        try:
            w = float(value)
        except ValueError:
            w = math.nan
        if not 1 <= w < 2:
            self.fail(f"{value!r} is neither 'auto' nor a number in [1, 2)", param, ctx)
        return w


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="otreg")
def main() -> None:
    """Optimal transport and registration on PyTorch, within a memory budget."""


@main.command()
@click.option("--no-keops", is_flag=True, help="Do not compile a test formula with KeOps.")
def info(no_keops: bool) -> None:
    """Versions, the backends that work here and the KeOps cache folder."""
    from ._info import info as _info

    _info(check_keops=not no_keops)


@main.command("register")
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
    default=30,
    show_default=True,
    type=click.IntRange(min=1),
    help="L-BFGS iterations a level.",
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
    max_iter: int,
    picture: bool,
    progress: bool | None,
) -> None:
    """Register SOURCE onto TARGET (meshes, or volumes with --label/--level)."""
    from . import LBFGSOptions, LDDMMOptions, register
    from .io import load_input

    _check_volume_options(label, level, [source, target])
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
                optimizer=LBFGSOptions(max_iter=max_iter),
                progress=progress_wanted(progress),
            )
        except (ValueError, TypeError, FileNotFoundError) as err:
            raise click.ClickException(str(err)) from err
        _write_outputs(res, src, tgt, output, picture)


def _check_volume_options(label: float | None, level: float | None, paths: list[str]) -> None:
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
        f"  time                   {m['seconds']:.1f} s, peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
    )


@main.command()
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
    from . import datasets, register, save_shape

    with output_folder(output, [], True, ("source.vtk", "target.vtk")) as folder:
        try:
            source = datasets.fsaverage5(surface, hemi)
            if pair == "templates":
                target = datasets.conte69(hemi)
        except (ImportError, FileNotFoundError) as err:
            raise click.ClickException(
                f"{err}; install the data extra: pip install 'otreg[data,mesh]'"
            ) from err
        if points is not None:
            source = source.decimate(points)
        truth = None
        if pair == "templates":
            what = f"fsaverage5 {hemi} {surface} -> Conte69 {hemi} midthickness"
        elif pair == "hemispheres":
            source = datasets.fsaverage5(surface, "left")
            source = source if points is None else source.decimate(points)
            target = datasets.fsaverage5(surface, "right").mirror(0)
            what = f"fsaverage5 left {surface} -> mirrored right {surface}"
        else:
            (subject,) = datasets.synthetic_subjects(source, n=1, seed=0)
            target, truth = subject.shape, subject.shape.points
            what = f"fsaverage5 {hemi} {surface} -> a synthetic subject (known deformation)"
        if points is not None and truth is None:
            target = target.decimate(points)
        click.echo(f"{what}: {source.n_points:,} and {target.n_points:,} vertices")
        save_shape(source, folder / "source.vtk")
        save_shape(target, folder / "target.vtk")
        res = register(source, target, truth=truth, progress=progress_wanted(progress))
        _write_outputs(res, source, target, output, True)


@main.command()
@click.argument("source", type=click.Path(dir_okay=False))
@click.argument("target", type=click.Path(dir_okay=False))
@click.option(
    "--blur",
    default=2.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Blur in mm (eps = blur^2).",
)
@click.option(
    "--scaling",
    default=0.7,
    show_default=True,
    type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
    help="eps-scaling factor per annealing step.",
)
@click.option(
    "--tol",
    default=1e-3,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Marginal-error tolerance at the final blur.",
)
@click.option(
    "--max-iter",
    default=1000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Most Sinkhorn iterations (the annealing ones included).",
)
@click.option(
    "--reach",
    default=None,
    type=click.FloatRange(min=0, min_open=True),
    help="Unbalanced OT reach in mm (default: balanced).",
)
@click.option(
    "--relaxation",
    default="auto",
    show_default=True,
    type=_Relaxation(),
    help="Over-relaxation of the Sinkhorn updates: 'auto' (adapted to the measured "
    "convergence rate) or a weight in [1, 2) (1: plain updates).",
)
@click.option("--label", default=None, type=float, help="Segmentation label for volumes.")
@click.option("--level", default=None, type=float, help="Threshold for probability maps.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON line.")
def distance(
    source: str,
    target: str,
    blur: float,
    scaling: float,
    tol: float,
    max_iter: int,
    reach: float | None,
    relaxation: float | str,
    label: float | None,
    level: float | None,
    as_json: bool,
) -> None:
    """Sinkhorn divergence between two shapes' measures (area-weighted, normalised).

    SOURCE and TARGET are meshes, point clouds or volumes (with --label or --level).
    """
    from . import ConvergenceWarning
    from .io import load_input
    from .ot.divergence import divergence
    from .ot.problem import SinkhornOptions
    from .registration.prealign import check_scales

    _check_volume_options(label, level, [source, target])
    with stdout_to_stderr(as_json), warnings_as_lines():
        try:
            shapes = [load_input(p, label, level) for p in (source, target)]
        except (ValueError, TypeError, FileNotFoundError) as err:
            raise click.ClickException(str(err)) from err
        check_scales("otreg distance", *shapes, names=(source, target))
        (x, a), (y, b) = (s.measure() for s in shapes)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)  # reported below instead
            try:
                options = SinkhornOptions(
                    blur=blur,
                    reach=reach,
                    scaling=scaling,
                    tol=tol,
                    max_iter=max_iter,
                    relaxation=relaxation,
                )
                value, res = divergence("otreg distance", x, y, a / a.sum(), b / b.sum(), options)
            except (ValueError, TypeError) as err:
                raise click.ClickException(str(err)) from err
    value = float(value.detach())
    out = {
        "source": source,
        "target": target,
        "divergence_mm2": value,
        "sqrt_2d_mm": math.sqrt(max(0.0, 2 * value)),
        "blur_mm": blur,
        "iterations": res.n_iter,
        "converged": res.converged,
        "stopped": res.stopped,
        "marginal_error": res.marginal_error if math.isfinite(res.marginal_error) else None,
        "seconds": time.perf_counter() - start,
    }
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(
        f"Sinkhorn divergence {value:.4f} mm^2 (sqrt(2 S) = {out['sqrt_2d_mm']:.3f} mm, "
        f"a W2-like distance), blur {blur} mm, {res.n_iter} iterations, "
        f"{out['seconds']:.1f} s"
    )
    if not res.converged:
        hint = {
            "stalled": "it stopped decreasing (the rounding floor): raise --tol or --blur",
            "diverged": "the iteration diverged: use --relaxation auto",
        }.get(res.stopped, "raise --max-iter or --blur for a converged value")
        click.echo(
            f"warning: marginal error {res.marginal_error:.2e} >= tol {tol:g}: {hint}", err=True
        )


@main.command()
@click.option(
    "--n",
    "n",
    default=10_000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Points on each circle.",
)
@click.option(
    "--iters",
    default=None,
    type=click.IntRange(min=3),
    help="Run exactly this many Sinkhorn iterations (default: until tol).",
)
@click.option(
    "--tol",
    default=1e-6,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Marginal-error tolerance when --iters is not given.",
)
@click.option("--backend", default="auto", show_default=True, type=click.Choice(BACKENDS))
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON line.")
def circles(n: int, iters: int | None, tol: float, backend: str, as_json: bool) -> None:
    """Two unit circles, the second shifted by 1 along x; Gaussian kernel, eps = 0.125.

    Solves entropic OT in scaling form (u = a / K v) and prints the OT value, the norm of its
    gradient with respect to the first circle, the time and the peak memory.
    """
    import torch

    from . import sinkhorn
    from .datasets import circles

    with stdout_to_stderr(as_json):
        x, y = circles(n)
        x.requires_grad_(True)
        blur = math.sqrt(0.125)  # exp(-|x-y|^2/0.25) = exp(-C/eps), C = |x-y|^2/2, eps = 0.125
        start = time.perf_counter()
        with warnings.catch_warnings():
            if iters is not None:  # a fixed count: not converging to tol=0 is the point
                warnings.simplefilter("ignore")
            res = sinkhorn(
                x,
                y,
                blur=blur,
                diameter=blur,
                form="scaling",
                backend=backend,
                tol=0.0 if iters else tol,
                max_iter=iters or 10_000,
            )
        (grad,) = torch.autograd.grad(res.cost, x)
        seconds = time.perf_counter() - start
    out = {
        "n": n,
        "iterations": res.n_iter,
        "marginal_error": res.marginal_error,
        "ot_value": float(res.cost.detach()),
        "grad_norm": float(grad.norm()),
        "seconds": seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "backend": res.backend,
    }
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"two circles of {n:,} points, eps = 0.125, scaling form, backend {res.backend}")
    click.echo(f"  iterations       {res.n_iter} (marginal error {res.marginal_error:.2e})")
    click.echo(f"  OT value         {out['ot_value']:.8f}")
    click.echo(f"  |grad_x OT|      {out['grad_norm']:.8f}")
    click.echo(f"  time             {seconds:.2f} s")
    click.echo(f"  peak RSS         {out['peak_rss_mb']:.0f} MB")


main.add_command(batch)
main.add_command(bids)
main.add_command(manifest)
main.add_command(report)

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
