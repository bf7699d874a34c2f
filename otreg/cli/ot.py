"""``otreg distance``: the Sinkhorn divergence between two shapes."""

from __future__ import annotations

import json
import math
import sys
import time
import warnings

import click

from .._checks import ConvergenceWarning
from ..io import load_input
from ..ot.divergence import divergence
from ..ot.problem import SinkhornOptions
from ..registration.prealign import check_scales
from ._common import (
    Command,
    check_volume_options,
    smooth_option,
    stdout_to_stderr,
    volume_options,
    warnings_as_lines,
)

__all__: list[str] = []

#: Exit code of a value printed though the solver did not converge (0: converged, 1: an
#: error).
NOT_CONVERGED = 3


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


@click.command(cls=Command)
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
    default=SinkhornOptions.scaling,
    show_default=True,
    type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
    help="eps-scaling factor per annealing step.",
)
@click.option(
    "--tol",
    default=SinkhornOptions.tol,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Marginal-error tolerance at the final blur; 0: exactly --max-iter iterations "
    "(a fixed count, no convergence test).",
)
@click.option(
    "--max-iter",
    default=SinkhornOptions.max_iter,
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
    default=SinkhornOptions.relaxation,
    show_default=True,
    type=_Relaxation(),
    help="How the Sinkhorn updates are accelerated: 'anderson' (mixing of the last 24), "
    "'auto' (over-relaxation adapted to the measured convergence rate) or a fixed "
    "over-relaxation weight in [1, 2) (1: plain updates).",
)
@volume_options
@smooth_option
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
    smooth: int | None,
    as_json: bool,
) -> None:
    """Sinkhorn divergence between two shapes' measures (area-weighted, normalised).

    SOURCE and TARGET are meshes, point clouds or volumes (with --label or --level). Exit 0:
    converged (or, with --tol 0, ran its --max-iter iterations); 1: an error (a bad option
    or input); 3: the value is printed (and "converged": false in --json) but the solver
    stopped short of --tol, a warning on stderr says why.
    """
    check_volume_options(label, level, [source, target])
    with stdout_to_stderr(as_json), warnings_as_lines():
        try:
            shapes = [load_input(p, label, level, smooth=smooth) for p in (source, target)]
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
    else:
        click.echo(
            f"Sinkhorn divergence {value:.4f} mm^2 (sqrt(2 S) = {out['sqrt_2d_mm']:.3f} mm, "
            f"a W2-like distance), blur {blur} mm, {res.n_iter} iterations, "
            f"{out['seconds']:.1f} s"
        )
    if not res.converged and not (tol == 0 and res.stopped == "max_iter"):  # (0: a count)
        hint = {
            "stalled": "it stopped decreasing (the rounding floor): raise --tol or --blur",
            "diverged": "the iteration diverged: use --relaxation anderson",
        }.get(res.stopped, "raise --max-iter or --blur for a converged value")
        if math.isnan(res.marginal_error) and res.stopped != "diverged":
            what = "the eps-scaling used all of --max-iter, so the marginal error was not measured"
        else:
            what = f"marginal error {res.marginal_error:.2e} >= tol {tol:g}"
        click.echo(f"warning: not converged: {what}: {hint}", err=True)
        sys.exit(NOT_CONVERGED)
