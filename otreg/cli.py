"""The ``otreg`` command line (click)."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
import warnings

import click

__all__ = ["main"]


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
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False),
              help="Folder for warped.vtk, parameters.npz, registration.json and pictures.")
@click.option("--model", default="lddmm", show_default=True,
              type=click.Choice(["lddmm", "rigid", "similarity", "affine"]))
@click.option("--prealign", default="rigid", show_default=True,
              type=click.Choice(["rigid", "similarity", "affine", "none"]))
@click.option("--loss", default="sinkhorn", show_default=True,
              type=click.Choice(["sinkhorn", "varifold", "currents", "chamfer"]))
@click.option("--sigma", default=20.0, show_default=True, type=float,
              help="LDDMM kernel width, mm.")
@click.option("--label", default=None, type=float, help="Segmentation label for volumes.")
@click.option("--level", default=None, type=float, help="Threshold for probability maps.")
@click.option("--picture/--no-picture", default=True, show_default=True)
def register_cmd(source: str, target: str, output: str, model: str, prealign: str, loss: str,
                 sigma: float, label: float | None, level: float | None, picture: bool) -> None:
    """Register SOURCE onto TARGET (meshes, or volumes with --label/--level)."""
    from pathlib import Path

    from . import load_shape, register

    try:
        src, tgt = (load_shape(p, label=label, level=level) for p in (source, target))
        res = register(src, tgt, model=model, prealign=prealign, loss=loss, sigma=sigma)
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise click.ClickException(str(err)) from err
    folder = res.save(output)
    if picture:
        from .viz import plot_history, plot_shapes

        plot_shapes({"source": src, "target": tgt, "warped": res.warped},
                    Path(folder) / "picture.png")
        if res.history:
            plot_history(res.history, Path(folder) / "history.png")
    m = res.metrics
    click.echo(f"wrote {folder}: mean surface distance {m['mean_mm']:.3f} mm, Hausdorff "
               f"{m['hausdorff_mm']:.2f} mm, min Jacobian {m['jacobian_min']:.3f}, "
               f"{m['seconds']:.1f} s")


@main.command()
@click.argument("source", type=click.Path(dir_okay=False))
@click.argument("target", type=click.Path(dir_okay=False))
@click.option("--blur", default=2.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="Blur in mm (eps = blur^2).")
@click.option("--scaling", default=0.7, show_default=True,
              type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
              help="eps-scaling factor per annealing step.")
@click.option("--tol", default=1e-3, show_default=True, type=click.FloatRange(min=0),
              help="Marginal-error tolerance at the final blur.")
@click.option("--max-iter", default=100, show_default=True, type=click.IntRange(min=1),
              help="Most Sinkhorn iterations (the annealing ones included).")
@click.option("--reach", default=None, type=click.FloatRange(min=0, min_open=True),
              help="Unbalanced OT reach in mm (default: balanced).")
@click.option("--label", default=None, type=float, help="Segmentation label for volumes.")
@click.option("--level", default=None, type=float, help="Threshold for probability maps.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON line.")
def distance(source: str, target: str, blur: float, scaling: float, tol: float, max_iter: int,
             reach: float | None, label: float | None, level: float | None,
             as_json: bool) -> None:
    """Sinkhorn divergence between two shapes' measures (area-weighted, normalised).

    SOURCE and TARGET are meshes, point clouds or volumes (with --label or --level).
    """
    from . import ConvergenceWarning, load_shape
    from .ot.divergence import _divergence

    try:
        shapes = [load_shape(p, label=label, level=level) for p in (source, target)]
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise click.ClickException(str(err)) from err
    (x, a), (y, b) = (s.measure() for s in shapes)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # reported below instead
        try:
            value, res = _divergence("otreg distance", x, y, a / a.sum(), b / b.sum(),
                                     blur=blur, reach=reach, scaling=scaling, tol=tol,
                                     max_iter=max_iter)
        except (ValueError, TypeError) as err:
            raise click.ClickException(str(err)) from err
    value = float(value.detach())
    out = {"source": source, "target": target, "divergence_mm2": value,
           "sqrt_2d_mm": math.sqrt(max(0.0, 2 * value)), "blur_mm": blur,
           "iterations": res.n_iter, "converged": res.converged,
           "marginal_error": res.marginal_error, "seconds": time.perf_counter() - start}
    if as_json:
        click.echo(json.dumps(out))
        return
    click.echo(f"Sinkhorn divergence {value:.4f} mm^2 (sqrt(2 S) = {out['sqrt_2d_mm']:.3f} mm, "
               f"a W2-like distance), blur {blur} mm, {res.n_iter} iterations, "
               f"{out['seconds']:.1f} s")
    if not res.converged:
        click.echo(f"warning: marginal error {res.marginal_error:.2e} >= tol {tol:g}: raise "
                   "--max-iter or --blur for a converged value", err=True)


@main.command()
@click.option("--n", "n", default=10_000, show_default=True, type=click.IntRange(min=1),
              help="Points on each circle.")
@click.option("--iters", default=None, type=click.IntRange(min=3),
              help="Run exactly this many Sinkhorn iterations (default: until tol).")
@click.option("--tol", default=1e-6, show_default=True, type=click.FloatRange(min=0),
              help="Marginal-error tolerance when --iters is not given.")
@click.option("--backend", default="auto", show_default=True,
              type=click.Choice(["auto", "keops", "tensorized", "blocked"]))
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON line.")
def demo(n: int, iters: int | None, tol: float, backend: str, as_json: bool) -> None:
    """Two unit circles, the second shifted by 1 along x; kernel exp(-|x-y|^2 / 0.25).

    Solves entropic OT in scaling form (u = a / K v) and prints the OT value, the norm of its
    gradient with respect to the first circle, the time and the peak memory.
    """
    import torch

    from . import sinkhorn
    from .datasets import circles

    x, y = circles(n)
    x.requires_grad_(True)
    blur = math.sqrt(0.125)  # exp(-|x-y|^2/0.25) = exp(-C/eps), C = |x-y|^2/2, eps = 0.125
    start = time.perf_counter()
    with warnings.catch_warnings():
        if iters is not None:  # a fixed count: not converging to tol=0 is the point
            warnings.simplefilter("ignore")
        res = sinkhorn(x, y, blur=blur, diameter=blur, form="scaling", backend=backend,
                       tol=0.0 if iters else tol, max_iter=iters or 10_000)
    (grad,) = torch.autograd.grad(res.cost, x)
    seconds = time.perf_counter() - start
    out = {
        "n": n, "iterations": res.n_iter, "marginal_error": res.marginal_error,
        "ot_value": float(res.cost.detach()), "grad_norm": float(grad.norm()), "seconds": seconds,
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
