"""Differentiate a loop ``x_{k+1} = step(x_k, *params)`` under a memory budget.

Strategies (the gradient is the same; memory and time differ):

- ``"store"``: plain autograd; every step's saved tensors stay alive until backward.
- ``"checkpoint"``: binomial checkpointing (revolve): at most ``snapshots`` states are stored;
  backward recomputes the others by the optimal schedule of :mod:`otreg.loops.schedules`.
  RNG states are saved with the checkpoints, so random steps recompute identically. Given
  ``memory=``, the number of snapshots comes from the budget minus the fixed cost of
  checkpointing, *measured* once per step function and state shapes on a short
  checkpointed loop, so that the process's measured peak stays
  within the budget; on Linux the allocator is told to give large freed blocks back
  (:mod:`otreg.loops.memory`).
- ``"reversible"``: for steps with an exact ``inverse``: nothing is stored; backward rebuilds
  x_k = inverse(x_{k+1}) from the output. Floating-point inversion drifts: the drift
  ``|rebuilt x_0 - x_0| / |x_0|`` is reported (``report["drift"]``).
- ``"offload"``: plain autograd with saved tensors moved to CPU memory (pinned with a GPU)
  and fetched back in backward (``torch.autograd.graph.save_on_cpu``).

Every strategy takes ``memory=``: checkpointing fits its snapshots to it; the others measure
what they need (one taped step for ``reversible``; that plus every step's saved tensors for
``store``, and for ``offload`` on the CPU) and raise ``ValueError`` naming it when the budget
is smaller.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .._checks import check_choice, check_int
from .budget import (
    STRATEGIES,
    check_budget,
    snapshot_count,
    state_bytes,
    within_budget,
    working_bytes,
)
from .memory import limit_heap_retention
from .tape import Checkpointed, Reversible, Step, as_tuple, refuse_uncounted

__all__ = ["iterate", "STRATEGIES"]


State = torch.Tensor | tuple[torch.Tensor, ...]


def iterate(
    step: Callable,
    x0: State,
    n_steps: int,
    params: Sequence[torch.Tensor] | nn.Module = (),
    *,
    strategy: str = "store",
    memory: int | str | None = None,
    snapshots: int | None = None,
    inverse: Callable | None = None,
    report: dict | None = None,
) -> State:
    """Run ``x_{k+1} = step(x_k, *params)`` ``n_steps`` times, differentiably.

    Args:
        step: ``step(x, *params) -> x`` with x a tensor or a tuple of tensors, keeping
            shapes, dtypes and devices. If ``params`` is an ``nn.Module``, ``step(x)`` is
            called and the module's parameters receive the gradients.
        x0: the initial state.
        n_steps: number of steps, >= 1.
        params: tensors passed to every step (gradients flow to them), or an nn.Module.
        strategy: ``"store"``, ``"checkpoint"``, ``"reversible"`` or ``"offload"``.
        memory: a budget in bytes or as ``"500MB"`` for the loop forward and backward
            (the growth of the process's peak; a GPU's allocated memory for a loop on it).
            ``checkpoint`` fits itself to it: beside x0, ``(memory - working) // state``
            states are stored, ``working`` the measured peak of a short checkpointed loop
            that stores nothing but its input (``report["working_bytes"]``: a step's
            temporaries, a taped step's saved tensors and gradients, the gradient flowing
            back). The other strategies check it: ``reversible`` (and ``offload`` on a GPU)
            need one taped step's peak, measured; ``store`` (and ``offload`` on the CPU,
            where the saved tensors stay in the same memory) that plus every step's saved
            tensors, measured per step (``report["needed_bytes"]``). A budget below what
            the strategy needs raises ``ValueError`` naming it.
        snapshots: checkpoint budget as a number of stored states (instead of ``memory``);
            default ``ceil(sqrt(n_steps))``.
        inverse: ``inverse(x_{k+1}, *params) -> x_k``, for ``strategy="reversible"``.
        report: a dict to fill with what happened: strategy, snapshots, state_bytes,
            step_seconds; after backward, recomputations (the untaped steps the backward
            pass ran to rebuild states: p(n, s) + 1 - n of ``untaped_evaluations``, p(n, s)
            + 1 with the forward pass) and max_stored (checkpoint), or drift (reversible).

    Returns:
        x_n, with the structure of ``x0``.

    Example:
        >>> import torch
        >>> from otreg.loops import iterate
        >>> w = torch.tensor(0.5, requires_grad=True)
        >>> x = iterate(lambda x, w: x + 0.01 * torch.tanh(w * x), torch.ones(1000), 100, (w,),
        ...             strategy="checkpoint", snapshots=10)
        >>> x.sum().backward()
        >>> float(w.grad) > 0
        True
    """
    caller = "iterate"
    if not callable(step):
        raise TypeError(f"{caller}: step must be callable, got {type(step).__name__}")
    state, single = as_tuple(caller, x0)
    n = check_int(caller, "n_steps", n_steps, 1)
    check_choice(caller, "strategy", strategy, STRATEGIES)
    module = isinstance(params, nn.Module)
    if module:
        param_t = tuple(p for p in params.parameters() if p.requires_grad)
    else:
        if isinstance(params, torch.Tensor) or not isinstance(params, (tuple, list)):
            raise TypeError(
                f"{caller}: params must be a tuple of tensors or an nn.Module, got "
                f"{type(params).__name__}"
            )
        for k, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"{caller}: params[{k}] is {type(p).__name__}; params must be tensors "
                    "(a constant can be captured by step instead)"
                )
        param_t = tuple(params)
    if strategy in ("checkpoint", "reversible"):
        why = f"strategy={strategy!r} recomputes steps outside autograd's record"
        refuse_uncounted(caller, step, param_t, why, "step(x, *params)) or detach it")
    run = Step(step, param_t, module, single, state)
    report = {} if report is None else report
    report.update(strategy=strategy, n_steps=n, state_bytes=state_bytes(state))
    if strategy == "reversible" and not callable(inverse):
        raise ValueError(
            f"{caller}: strategy='reversible' needs inverse=, a callable giving x_k from x_{{k+1}}"
        )
    if strategy != "checkpoint" and snapshots is not None:
        raise ValueError(
            f"{caller}: snapshots applies to strategy='checkpoint' only, not {strategy!r}"
        )
    # the budget in bytes, counted from the start of the outermost budgeted call, one-offs
    # it cannot hold avoided (otreg.loops.budget.within_budget)
    with within_budget(caller, memory, state[0].device) as memory:
        return _run_loop(
            caller, run, state, param_t, n, strategy, memory, snapshots, inverse, report
        )


def _run_loop(caller, run, state, param_t, n, strategy, memory, snapshots, inverse, report):
    """:func:`iterate` once its arguments are checked."""
    single = run.single
    if strategy != "checkpoint" and memory is not None:
        limit_heap_retention()
        check_budget(caller, strategy, run, state, param_t, n, memory, inverse, report)

    if strategy in ("store", "offload"):
        ctx = (
            torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
            if strategy == "offload"
            else contextlib.nullcontext()
        )
        start = time.perf_counter()
        current = state
        with ctx:
            for k in range(n):
                current = run(current)
                if k == 0:
                    report["step_seconds"] = time.perf_counter() - start
        return current[0] if single else current

    tensors = (*state, *param_t)
    if strategy == "reversible":
        out = Reversible.apply(run, inverse, n, report, len(state), *tensors)
        return out[0] if single else tuple(out)

    working = None
    if memory is not None and snapshots is None:
        limit_heap_retention()
        working = working_bytes(run, state, param_t, report)
        report["working_bytes"] = working
    s = snapshot_count(caller, n, state, memory, snapshots, working, report)
    report["snapshots"] = s
    if s >= n:  # every state fits: checkpointing would recompute nothing
        report.update(recomputations=0)
    out = Checkpointed.apply(run, n, min(s, n), report, len(state), *tensors)
    return out[0] if single else tuple(out)
