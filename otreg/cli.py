"""The ``otreg`` command line (click)."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
import warnings

import click

from ._cli_batch import batch, bids, manifest, report
from ._cli_guards import (
    stdout_to_stderr,
    warnings_as_lines,
)
from ._cli_register import check_volume_options, demo, register_cmd
from .reductions import BACKENDS

__all__ = ["main"]


class _Relaxation(click.ParamType):
    """'anderson', 'auto' or a number in [1, 2)."""

    name = "anderson|auto|w"

    def convert(self, value, param, ctx):
        if value in ("anderson", "auto") or isinstance(value, float):
            return value
        try:
            w = float(value)
        except ValueError:
            w = math.nan
        if not 1 <= w < 2:
            self.fail(f"{value!r} is neither 'anderson', 'auto' nor a number in [1, 2)", param, ctx)
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
    default="anderson",
    show_default=True,
    type=_Relaxation(),
    help="How the Sinkhorn updates are accelerated: 'anderson' (mixing of the last 24), "
    "'auto' (over-relaxation adapted to the measured convergence rate) or a fixed "
    "over-relaxation weight in [1, 2) (1: plain updates).",
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

    check_volume_options(label, level, [source, target])
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
            "diverged": "the iteration diverged: use --relaxation anderson",
        }.get(res.stopped, "raise --max-iter or --blur for a converged value")
        if math.isnan(res.marginal_error) and res.stopped != "diverged":
            what = "the eps-scaling used all of --max-iter, so the marginal error was not measured"
        else:
            what = f"marginal error {res.marginal_error:.2e} >= tol {tol:g}"
        click.echo(f"warning: not converged: {what}: {hint}", err=True)


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


main.add_command(register_cmd)
main.add_command(demo)
main.add_command(batch)
main.add_command(bids)
main.add_command(manifest)
main.add_command(report)

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
