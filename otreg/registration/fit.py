"""The LDDMM fit behind :func:`otreg.register`: level by level, L-BFGS on the (whitened)
momenta.

At each level the objective is ``regularization * H(q_0, p) + sum_k weight_k * data_k``;
``torch.optim.LBFGS`` (strong Wolfe) runs until ``max_iter`` iterations or a change over an
iteration below ``tol`` times the level's starting objective. With
``LBFGSOptions(precondition=True)`` it optimises ``u = L^T p``
(:meth:`~otreg.registration.LDDMM.whitened`).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
from torch.nn.utils import parametrize

from .._checks import ConvergenceWarning, warn
from ..ot.problem import SinkhornOptions
from ..shapes import Shape
from . import signals
from .lddmm import LDDMM
from .losses import Loss, make_loss
from .options import LBFGSOptions, Level

__all__: list[str] = []


@dataclass
class Fit:
    """What every level of the fit shares."""

    deformation: LDDMM
    regularization: float
    landmarks: tuple[torch.Tensor, torch.Tensor] | None
    optimizer: LBFGSOptions
    sinkhorn: SinkhornOptions
    progress: bool
    history: list[dict]
    start: float
    signal: str | None = None
    signal_weight: float = 1.0
    #: the history's number of this fit's first level (a refinement's follow the first fit's)
    first_level: int = 0
    #: the progress bar's name for this fit ("" or "refine ")
    name: str = ""


def fit_levels(fit: Fit, src: Shape, tgt: Shape, levels: list[Level]) -> None:
    """Fit ``fit.deformation`` to ``tgt`` level by level (coarse to fine), in place; each
    evaluation appended to ``fit.history``."""
    for level, lv in enumerate(levels, start=fit.first_level):
        s_level, t_level = src.decimate(lv.points), tgt.decimate(lv.points)
        s_level = signals.with_level_signal(s_level, src, fit.signal)
        t_level = signals.with_level_signal(t_level, tgt, fit.signal)
        factor = None if fit.signal is None else fit.signal_weight * lv.scale
        terms = {
            name: make_loss(
                name, blur=lv.scale, sinkhorn=fit.sinkhorn, sigma=lv.scale, signal=factor
            )
            for name in lv.loss
            if name != "landmarks"
        }
        number = level - fit.first_level + 1
        label = (
            f"{fit.name}level {number}/{len(levels)} ({s_level.n_points} pts, "
            f"{'+'.join(lv.loss)} at {lv.scale:g} mm)"
        )
        _fit_level(fit, s_level, t_level, terms, lv.loss, level, label)
        unconverged = sum(
            1 for h in fit.history if h["level"] == level and not h.get("sinkhorn_converged", 1)
        )
        if unconverged:
            warn(
                f"register: at {fit.name}level {number}, {unconverged} evaluation(s) of the "
                "Sinkhorn term did not reach its tol even from scratch (their values are not a "
                "divergence); the history marks them (sinkhorn_converged). Raise the level's "
                "scale or sinkhorn max_iter",
                ConvergenceWarning,
            )
        if not all(math.isfinite(h["loss"]) for h in fit.history[-3:]):
            raise FloatingPointError(
                "register: the objective became NaN or infinite; lower "
                "the kernel width or raise regularization"
            )


def _objective(
    fit: Fit,
    s_level: Shape,
    t_level: Shape,
    terms: dict[str, Loss],
    weights: dict[str, float],
    record: dict,
    warped: Shape | None = None,
) -> torch.Tensor:
    """Regularization * energy + the weighted data terms (and landmarks) at the current
    momenta; each term's value and report go into ``record``. ``warped``: the level's source
    already moved by the current momenta (else it is shot here)."""
    deformation = fit.deformation
    if warped is None:
        warped = s_level.with_points(deformation(s_level.points))
    energy = deformation.energy()
    record["energy"] = float(energy.detach())
    total = fit.regularization * energy
    for name, term in terms.items():
        value = term(warped, t_level)
        record[name] = float(value.detach())
        record.update(term.report)
        total = total + weights[name] * value
    if fit.landmarks is not None and "landmarks" in weights:
        moved = deformation(fit.landmarks[0])
        value = ((moved - fit.landmarks[1]) ** 2).sum(1).mean()  # mm^2
        record["landmarks"] = float(value.detach())
        total = total + weights["landmarks"] * value
    return total


def _fit_level(
    fit: Fit,
    s_level: Shape,
    t_level: Shape,
    terms: dict[str, Loss],
    weights: dict[str, float],
    level: int,
    label: str,
) -> None:
    """L-BFGS on the momenta for one level."""
    deformation, opts = fit.deformation, fit.optimizer
    bar = None
    if fit.progress:
        try:
            from tqdm.auto import tqdm

            # L-BFGS evaluates the objective at most max_iter * 5 // 4 times (torch's default)
            bar = tqdm(total=opts.max_iter * 5 // 4, desc=label, leave=False, unit="eval")
        except ImportError:  # pragma: no cover
            bar = None
    with torch.no_grad():
        warped = s_level.with_points(deformation(s_level.points))
        for term in terms.values():
            term.prepare(warped, t_level)
        start_value = _objective(fit, s_level, t_level, terms, weights, {}, warped)
    # torch's tolerance_change is absolute: tol is relative to the level's starting objective
    tolerance = opts.tol * max(abs(float(start_value)), torch.finfo(start_value.dtype).tiny)
    whitened = (
        deformation.whitened() if opts.precondition else contextlib.nullcontext(deformation.momenta)
    )
    with whitened as parameter:
        _lbfgs(fit, s_level, t_level, terms, weights, level, bar, parameter, tolerance)
    if bar is not None:
        bar.close()


def _lbfgs(
    fit: Fit,
    s_level: Shape,
    t_level: Shape,
    terms: dict[str, Loss],
    weights: dict[str, float],
    level: int,
    bar,
    parameter: torch.nn.Parameter,
    tolerance: float,
) -> None:
    """``torch.optim.LBFGS`` on ``parameter``: the momenta, or the whitened momenta that
    :meth:`LDDMM.whitened` maps to them."""
    history, opts = fit.history, fit.optimizer
    optimizer = torch.optim.LBFGS(
        [parameter],
        lr=1.0,
        max_iter=opts.max_iter,
        history_size=opts.history_size,
        line_search_fn="strong_wolfe",
        tolerance_change=tolerance,
        tolerance_grad=0.0,
    )

    def closure():
        optimizer.zero_grad()
        record = {"level": level, "evaluation": len(history)}
        with parametrize.cached():  # the momenta computed once an evaluation
            total = _objective(fit, s_level, t_level, terms, weights, record)
            total.backward()
        record.update(loss=float(total.detach()), seconds=time.perf_counter() - start)
        history.append(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{float(total.detach()):.4g}")
        return total

    start = fit.start
    optimizer.step(closure)
