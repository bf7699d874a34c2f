"""Memory and time of each loop strategy on one problem: the trade-off table.

Peak memory is measured, not estimated (:func:`otreg.loops.memory.measure_peak`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .iterate import STRATEGIES, iterate
from .memory import measure_peak

__all__ = ["profile", "ProfileResult"]


class ProfileResult(list):
    """Rows (dicts) of :func:`profile`; ``str()`` renders the table.

    Example:
        >>> from otreg.loops import ProfileResult
        >>> rows = ProfileResult([{"strategy": "store", "peak_bytes": 2**20, "seconds": 0.5,
        ...                        "recomputations": 0, "grad_diff": None}])
        >>> print(str(rows).splitlines()[-1])
        store                          1.0 MiB     0.500          0
    """

    def __str__(self) -> str:
        head = (
            f"{'strategy':<12} {'budget':>10} {'peak memory':>12} {'time (s)':>9} "
            f"{'recomputed':>10} {'max |grad - store|':>19}"
        )
        lines = [head, "-" * len(head)]
        for r in self:
            mem = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:,.1f} MiB"
            diff = "" if r["grad_diff"] is None else f"{r['grad_diff']:.2e}"
            rec = "" if r.get("recomputations") is None else str(r["recomputations"])
            budget = "" if r.get("memory") is None else str(r["memory"])
            lines.append(
                f"{r['strategy']:<12} {budget:>10} {mem:>12} {r['seconds']:>9.3f} {rec:>10} "
                f"{diff:>19}"
            )
        return "\n".join(lines)


def profile(
    step: Callable,
    x0,
    n_steps: int,
    params: Sequence[torch.Tensor] = (),
    *,
    strategies: Sequence[str] = ("store", "checkpoint", "offload"),
    loss: Callable | None = None,
    memory: int | str | Sequence[int | str] | None = None,
    snapshots: int | None = None,
    inverse: Callable | None = None,
) -> ProfileResult:
    """Run forward and backward of the loop once per strategy; measure memory and time.

    Args:
        step: ``x_{k+1} = step(x_k, *params)``, as in :func:`otreg.loops.iterate`.
        x0: the initial state (a tensor or a tuple of tensors).
        n_steps: the number of steps.
        params: the tensors the gradient is taken with respect to.
        memory: as in :func:`~otreg.loops.iterate`, or a list of budgets:
            ``"checkpoint"`` then runs once per budget, a row each (the trade-off a user
            picks a budget from).
        snapshots: a fixed number of checkpoints instead of a budget.
        inverse: the step's inverse, needed for ``"reversible"``.
        strategies: which to run; ``"store"`` first gives the reference gradients.
        loss: scalar function of the final state (default: the sum of its entries).

    Returns:
        :class:`ProfileResult`: per strategy ``peak_bytes``, ``seconds`` (forward +
        backward), ``recomputations``, ``drift`` (reversible) and ``grad_diff`` (largest
        absolute difference from the ``"store"`` gradients).

    Example:
        >>> import torch
        >>> from otreg.loops import profile
        >>> w = torch.tensor(0.5, requires_grad=True)
        >>> rows = profile(lambda x, w: x + 0.01 * torch.tanh(w * x), torch.ones(10_000), 50, (w,),
        ...                strategies=("store", "checkpoint"), snapshots=5)
        >>> [r["strategy"] for r in rows], rows[1]["grad_diff"] < 1e-6
        (['store', 'checkpoint'], True)
    """
    for s in strategies:
        if s not in STRATEGIES:
            raise ValueError(f"profile: unknown strategy {s!r}; choose from {STRATEGIES}")
    params = tuple(params)
    state = (x0,) if isinstance(x0, torch.Tensor) else tuple(x0)
    leaves = [t for t in (*state, *params) if t.requires_grad]
    if not leaves:
        raise ValueError("profile: nothing requires grad; set requires_grad on x0 or params")
    loss = loss or (lambda y: sum(t.sum() for t in ((y,) if isinstance(y, torch.Tensor) else y)))
    device = state[0].device
    budgets = list(memory) if isinstance(memory, (list, tuple)) else [memory]
    runs = [(s, b) for s in strategies for b in (budgets if s == "checkpoint" else [None])]
    rows, reference = ProfileResult(), None
    for strategy, budget in runs:
        report: dict = {}
        kwargs = {}
        if strategy == "checkpoint":
            kwargs = {"memory": budget, "snapshots": snapshots}
        if strategy == "reversible":
            kwargs = {"inverse": inverse}

        def run(strategy=strategy, report=report, kwargs=kwargs):
            out = iterate(step, x0, n_steps, params, strategy=strategy, report=report, **kwargs)
            return torch.autograd.grad(loss(out), leaves)

        grads, seconds, peak = measure_peak(run, device)
        if reference is None and strategy == "store":
            reference = grads
        diff = None
        if reference is not None:
            diff = max(float((g - r).abs().max()) for g, r in zip(grads, reference))
        rows.append(
            {
                "strategy": strategy,
                "memory": budget,
                "peak_bytes": peak,
                "seconds": seconds,
                "recomputations": report.get("recomputations"),
                "drift": report.get("drift"),
                "snapshots": report.get("snapshots"),
                "grad_diff": diff,
            }
        )
    return rows
