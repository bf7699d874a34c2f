"""matplotlib pictures: loss curves, a transport plan, the memory/time trade-off.

Each is drawn on a ``matplotlib.figure.Figure`` of its own (no pyplot), so it needs no
display and leaves a notebook's backend alone; each writes a PNG atomically and returns its
path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..io import atomic_write
from ..ot.plan import TransportPlan

__all__ = ["plot_history", "plot_plan", "plot_tradeoff"]

#: history entries that are not values of the objective or its terms
_NOT_VALUES = ("level", "evaluation", "seconds", "sinkhorn_iterations", "sinkhorn_converged")


def _save(fig, path: str | Path, dpi: int = 100) -> Path:
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(str(tmp), dpi=dpi))
    return path


def plot_history(history: list[dict], path: str | Path) -> Path:
    """The objective and its terms per evaluation (log scale), 600 x 400 pixels.

    Args:
        history: :attr:`otreg.registration.Registration.history` (one dict an evaluation).
        path: the PNG to write.

    Example:
        >>> import otreg, tempfile, pathlib
        >>> h = [{"level": 0, "energy": 1.0 + k, "loss": 2.0 / (k + 1)} for k in range(5)]
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> otreg.viz.plot_history(h, folder / "history.png").name
        'history.png'
    """
    from matplotlib.figure import Figure

    if not isinstance(history, (list, tuple)) or not all(isinstance(h, dict) for h in history):
        raise TypeError("plot_history: history must be a list of dicts (Registration.history)")
    keys: list[str] = []
    for h in history:  # levels may have different data terms
        keys += [k for k in h if k not in (*_NOT_VALUES, *keys)]
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for key in keys:
        ax.semilogy([h.get(key, float("nan")) for h in history], label=key)
    for k in range(1, len(history)):
        if history[k].get("level") != history[k - 1].get("level"):
            ax.axvline(k - 0.5, color="grey", linewidth=0.5, linestyle="--")
    ax.set_xlabel("objective evaluation (dashed: next level)")
    ax.set_ylabel("value (energy: mm^2; data terms: their units)")
    if keys:
        ax.legend()
    fig.tight_layout()
    return _save(fig, path)


def _points_2d(name: str, p) -> torch.Tensor:
    p = torch.as_tensor(p).detach().cpu().double()
    if p.dim() == 3 and p.shape[0] == 1:
        p = p[0]
    if p.dim() != 2 or p.shape[1] < 2:
        raise ValueError(
            f"plot_plan: {name} has shape {tuple(p.shape)}; it must be (N, D) with D >= 2 "
            "(the first two coordinates are drawn)"
        )
    return p[:, :2]


def plot_plan(x, y, plan, path: str | Path, max_lines: int = 400) -> Path:
    """Two point clouds and the heaviest entries of a transport plan between them as
    segments (opacity proportional to the mass), in the plane of the first two
    coordinates; 600 x 600 pixels.

    Args:
        x: ``(N, D)`` source points (or ``(1, N, D)``), drawn blue.
        y: ``(M, D)`` target points, drawn orange.
        plan: an ``(N, M)`` tensor or array, or a :class:`otreg.ot.plan.TransportPlan` of one
            problem (made dense: for clouds of a few thousand points).
        path: the PNG to write.
        max_lines: draw at most this many segments, the heaviest.

    Example:
        >>> import torch, otreg, tempfile, pathlib
        >>> x, y = torch.rand(30, 2), torch.rand(40, 2) + 1.0
        >>> plan = otreg.sinkhorn(x, y, blur=0.05).plan
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> otreg.viz.plot_plan(x, y, plan, folder / "plan.png").name
        'plan.png'
    """
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure

    xs, ys = _points_2d("x", x), _points_2d("y", y)
    if isinstance(plan, TransportPlan):
        if plan.batched and plan.shape[0] != 1:
            raise ValueError(f"plot_plan: plan holds {plan.shape[0]} problems; give one")
        plan = plan.dense()[0] if plan.batched else plan.dense()
    pi = torch.as_tensor(plan).detach().cpu().double()
    if tuple(pi.shape) != (xs.shape[0], ys.shape[0]):
        raise ValueError(
            f"plot_plan: plan has shape {tuple(pi.shape)}; it must be (N, M) = "
            f"({xs.shape[0]}, {ys.shape[0]}), one entry per pair of points"
        )
    if max_lines < 1:
        raise ValueError(f"plot_plan: max_lines is {max_lines}; it must be >= 1")
    k = min(max_lines, pi.numel())
    mass, flat = pi.flatten().topk(k)
    i, j = flat // pi.shape[1], flat % pi.shape[1]
    alpha = (mass / mass.max().clamp_min(1e-300)).clamp(0.05, 1.0).numpy()
    segments = torch.stack([xs[i], ys[j]], dim=1).cpu().numpy()
    fig = Figure(figsize=(6, 6))
    ax = fig.subplots()
    colours = [(0.3, 0.3, 0.3, float(a)) for a in alpha]
    ax.add_collection(LineCollection(segments, colors=colours, linewidths=0.8))
    ax.scatter(xs[:, 0], xs[:, 1], s=12, color="tab:blue", label="x", zorder=3)
    ax.scatter(ys[:, 0], ys[:, 1], s=12, color="tab:orange", label="y", zorder=3)
    ax.set_aspect("equal")
    ax.legend(loc="upper left")
    ax.set_title(f"the {k} heaviest entries of the plan (of {pi.numel():,})")
    fig.tight_layout()
    return _save(fig, path)


def plot_tradeoff(rows: Sequence[dict], path: str | Path) -> Path:
    """Peak memory against time for each loop strategy (the rows of
    :func:`otreg.loops.profile`, or dicts with ``strategy``, ``peak_bytes``, ``seconds`` and
    optionally ``memory``, the budget given), 600 x 450 pixels: the picture a user reads
    to choose a strategy and a budget.

    Example:
        >>> import otreg, tempfile, pathlib
        >>> rows = [{"strategy": "store", "peak_bytes": 8e8, "seconds": 1.0},
        ...         {"strategy": "checkpoint", "peak_bytes": 1e8, "seconds": 1.6}]
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> otreg.viz.plot_tradeoff(rows, folder / "tradeoff.png").name
        'tradeoff.png'
    """
    from matplotlib.figure import Figure

    rows = list(rows)
    if not rows:
        raise ValueError("plot_tradeoff: rows is empty; give the rows of otreg.loops.profile")
    for r in rows:
        if not isinstance(r, dict) or not {"strategy", "peak_bytes", "seconds"} <= set(r):
            raise ValueError(
                "plot_tradeoff: each row needs 'strategy', 'peak_bytes' and 'seconds' "
                f"(otreg.loops.profile's rows), got {r!r}"
            )
    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    colours = dict(
        zip(strategies, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"))
    )
    for r in rows:
        mib = float("nan") if r["peak_bytes"] is None else r["peak_bytes"] / 2**20
        colour = colours.get(r["strategy"], "tab:grey")
        ax.scatter([r["seconds"]], [mib], s=60, color=colour, zorder=3)
        label = r["strategy"] if r.get("memory") is None else f"{r['strategy']} ({r['memory']})"
        ax.annotate(label, (r["seconds"], mib), textcoords="offset points", xytext=(6, 4))
    ax.set_xlabel("forward + backward (s)")
    ax.set_ylabel("measured peak memory (MiB)")
    ax.set_title("memory against time, one point a strategy or budget")
    ax.margins(0.25)
    fig.tight_layout()
    return _save(fig, path)
