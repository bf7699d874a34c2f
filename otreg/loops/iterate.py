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
import math
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .._checks import check_choice, check_int
from .memory import limit_heap_retention, measure_peak
from .schedules import binomial_schedule

__all__ = ["iterate", "STRATEGIES", "parse_bytes", "state_bytes"]

STRATEGIES = ("store", "checkpoint", "reversible", "offload")
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}

State = torch.Tensor | tuple[torch.Tensor, ...]


def parse_bytes(caller: str, memory: int | str) -> int:
    """``"500MB"``, ``"2 GiB"`` or an integer number of bytes -> bytes."""
    if isinstance(memory, bool):
        raise TypeError(
            f"{caller}: memory must be bytes (int) or a string like '500MB', got {memory!r}"
        )
    if isinstance(memory, int):
        value = memory
    elif isinstance(memory, str):
        text = memory.strip().upper().replace(" ", "")
        number = text.rstrip("KMGIB")
        unit = text[len(number) :]
        try:
            value = int(float(number) * _UNITS[unit])
        except (ValueError, KeyError):
            raise ValueError(
                f"{caller}: memory is {memory!r}; give bytes or a size like '500MB', "
                "'2GB', '512MiB'"
            ) from None
    else:
        raise TypeError(
            f"{caller}: memory must be bytes (int) or a string like '500MB', "
            f"got {type(memory).__name__}"
        )
    if value <= 0:
        raise ValueError(f"{caller}: memory is {memory!r}; it must be positive")
    return value


def state_bytes(state: Sequence[torch.Tensor]) -> int:
    """Bytes held by one state."""
    return sum(t.numel() * t.element_size() for t in state)


# ----------------------------------------------------------------------- helpers
def _as_tuple(caller: str, x0: object) -> tuple[tuple[torch.Tensor, ...], bool]:
    if isinstance(x0, torch.Tensor):
        return (x0,), True
    if isinstance(x0, (tuple, list)) and x0 and all(isinstance(t, torch.Tensor) for t in x0):
        return tuple(x0), False
    raise TypeError(
        f"{caller}: x0 must be a tensor or a non-empty tuple of tensors, got {type(x0).__name__}"
    )


class _Step:
    """The user's step as a function of tuples, with a shape check and RNG handling."""

    def __init__(
        self,
        step: Callable,
        params: tuple,
        module: bool,
        single: bool,
        like: tuple[torch.Tensor, ...],
    ) -> None:
        self.step, self.params, self.module, self.single = step, params, module, single
        self.signature = [(t.shape, t.dtype, t.device) for t in like]
        self.devices = sorted({t.device.index for t in like if t.device.type == "cuda"})

    def __call__(self, state: tuple, params: tuple | None = None) -> tuple:
        params = self.params if params is None else params
        arg = state[0] if self.single else state
        out = self.step(arg) if self.module else self.step(arg, *params)
        out_t = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        got = [(t.shape, t.dtype, t.device) for t in out_t]
        if got != self.signature:
            raise ValueError(
                f"iterate: step changed the state from {self._fmt(self.signature)} "
                f"to {self._fmt(got)}; a step must keep shapes, dtypes and devices"
            )
        return out_t

    @staticmethod
    def _fmt(sig) -> str:
        return ", ".join(f"{tuple(s)} {str(d).replace('torch.', '')}" for s, d, _ in sig)

    def rng_state(self):
        return (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.devices])

    def set_rng_state(self, rng) -> None:
        torch.set_rng_state(rng[0])
        for d, s in zip(self.devices, rng[1]):
            torch.cuda.set_rng_state(s, d)


def _detached(state: tuple) -> tuple:
    return tuple(t.detach() for t in state)


def _vjp(run: _Step, state: tuple, params: tuple, grad_state: tuple):
    """One taped step from ``state``: gradients with respect to the state and the params."""
    with torch.enable_grad():
        x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in state)
        out = run(x, params)
        inputs = [t for t in x if t.requires_grad] + [p for p in params if p.requires_grad]
        pairs = [(o, g) for o, g in zip(out, grad_state) if g is not None and o.requires_grad]
        if not pairs:
            return tuple(None for _ in x), tuple(None for _ in params)
        grads = torch.autograd.grad(
            [o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True
        )
    it = iter(grads)
    gx = tuple(next(it) if t.requires_grad else None for t in x)
    gp = tuple(next(it) if p.requires_grad else None for p in params)
    return gx, gp


def _add(total: list, grads: tuple) -> None:
    for k, g in enumerate(grads):
        if g is not None:
            total[k] = g if total[k] is None else total[k] + g


# ----------------------------------------------------------------------- checkpoint
class _Checkpointed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _Step, n: int, snapshots: int, report: dict, n_state: int, *tensors):
        state, params = tuple(tensors[:n_state]), tuple(tensors[n_state:])
        actions = binomial_schedule(n, snapshots)
        first_taped = next(k for k, a in enumerate(actions) if a.kind == "taped")
        slots = {0: (state, run.rng_state())}
        current, evaluations = state, 0
        for action in actions[:first_taped]:
            if action.kind == "advance":
                for _ in range(action.start, action.stop):
                    current = run(current, params)
                    evaluations += 1
            elif action.kind == "store":
                slots[action.start] = (current, run.rng_state())
        report["max_stored"] = len(slots)
        working = (current, run.rng_state())  # x_{n-1}
        out = run(current, params)
        ctx.run, ctx.n_state, ctx.report = run, n_state, report
        ctx.actions, ctx.first_taped = actions, first_taped
        ctx.slots, ctx.working, ctx.evaluations = slots, working, evaluations + 1
        ctx.save_for_backward(*params)
        return out

    @staticmethod
    def backward(ctx, *grad_out):
        run, params = ctx.run, ctx.saved_tensors
        slots, evaluations = ctx.slots, ctx.evaluations
        current, rng = ctx.working
        grad_state = grad_out
        grad_params: list = [None] * len(params)
        max_stored = len(slots)
        with torch.random.fork_rng(devices=run.devices):
            for action in ctx.actions[ctx.first_taped :]:
                if action.kind == "taped":
                    run.set_rng_state(rng)
                    grad_state, gp = _vjp(run, current, params, grad_state)
                    _add(grad_params, gp)
                elif action.kind == "restore":
                    current, rng = slots[action.start]
                elif action.kind == "advance":
                    run.set_rng_state(rng)
                    with torch.no_grad():
                        for _ in range(action.start, action.stop):
                            current = run(current, params)
                            evaluations += 1
                    rng = run.rng_state()
                elif action.kind == "store":
                    slots[action.start] = (current, rng)
                    max_stored = max(max_stored, len(slots))
                elif action.kind == "free":
                    del slots[action.start]
        ctx.report.update(
            max_stored=max_stored,
            untaped_evaluations=evaluations,
            recomputations=evaluations - int(ctx.report["n_steps"]),
        )
        ctx.slots = ctx.working = None
        return (None, None, None, None, None, *grad_state, *grad_params)


# ----------------------------------------------------------------------- reversible
class _Reversible(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _Step, inverse: Callable, n: int, report: dict, n_state: int, *tensors):
        state, params = tuple(tensors[:n_state]), tuple(tensors[n_state:])
        current = state
        for _ in range(n):
            current = run(current, params)
        ctx.run, ctx.inverse, ctx.n, ctx.report, ctx.n_state = run, inverse, n, report, n_state
        ctx.save_for_backward(*state, *current, *params)
        return current

    @staticmethod
    def backward(ctx, *grad_out):
        saved, k = ctx.saved_tensors, ctx.n_state
        x0, current, params = saved[:k], saved[k : 2 * k], saved[2 * k :]
        run = ctx.run
        grad_state, grad_params = grad_out, [None] * len(params)
        for _ in range(ctx.n):
            with torch.no_grad():
                arg = current[0] if run.single else current
                prev = ctx.inverse(arg) if run.module else ctx.inverse(arg, *params)
                current = (prev,) if isinstance(prev, torch.Tensor) else tuple(prev)
            grad_state, gp = _vjp(run, current, params, grad_state)
            _add(grad_params, gp)
        num = max(float((a - b).abs().max()) for a, b in zip(current, x0))
        den = max(float(b.abs().max()) for b in x0) or 1.0
        ctx.report["drift"] = num / den
        return (None, None, None, None, None, *grad_state, *grad_params)


# ----------------------------------------------------------------------- public
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
            step_seconds; after backward, recomputations and max_stored (checkpoint) or drift
            (reversible).

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
    state, single = _as_tuple(caller, x0)
    n = check_int(caller, "n_steps", n_steps, 1)
    check_choice(caller, "strategy", strategy, STRATEGIES)
    module = isinstance(params, nn.Module)
    if module:
        param_t = tuple(p for p in params.parameters() if p.requires_grad)
    else:
        if isinstance(params, torch.Tensor) or not all(isinstance(p, torch.Tensor) for p in params):
            raise TypeError(f"{caller}: params must be a tuple of tensors or an nn.Module")
        param_t = tuple(params)
    run = _Step(step, param_t, module, single, state)
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
    if strategy != "checkpoint" and memory is not None:
        limit_heap_retention()
        _check_budget(caller, strategy, run, state, param_t, n, memory, inverse, report)

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
        out = _Reversible.apply(run, inverse, n, report, len(state), *tensors)
        return out[0] if single else tuple(out)

    working = None
    if memory is not None and snapshots is None:
        limit_heap_retention()
        working = _working_bytes(run, state, param_t)
        report["working_bytes"] = working
    s = _snapshots(caller, n, state, memory, snapshots, working)
    report["snapshots"] = s
    if s >= n:  # every state fits: checkpointing would recompute nothing
        report.update(recomputations=0)
    out = _Checkpointed.apply(run, n, min(s, n), report, len(state), *tensors)
    return out[0] if single else tuple(out)


def _stores_on_host(strategy: str, state: tuple) -> bool:
    """Whether the strategy keeps every step's saved tensors in the memory the budget is
    for: ``store`` always, ``offload`` when the loop runs on the CPU (its host memory)."""
    return strategy == "store" or (strategy == "offload" and state[0].device.type == "cpu")


def _check_budget(
    caller: str, strategy: str, run, state: tuple, params: tuple, n: int, memory, inverse, report
) -> None:
    """``memory=`` for the strategies that do not tune themselves to it: measure what the
    loop will need and raise ``ValueError`` naming it (and the strategy that fits) when the
    budget is smaller. ``reversible`` (and ``offload`` on a GPU, for the device's memory)
    needs the fixed cost of one taped step, whatever ``n``; ``store`` (and ``offload`` on
    the CPU) that plus every step's saved tensors, measured per step on short loops."""
    budget = parse_bytes(caller, memory)
    if _stores_on_host(strategy, state):
        two = _probe_peak(run, state, params, "store", 2, None)
        four = _probe_peak(run, state, params, "store", 4, None)
        per_step = max(0, four - two) / 2
        need = int(max(two - 2 * per_step, 0) + n * per_step)
        report.update(working_bytes=int(two - 2 * per_step), step_bytes=int(per_step))
        fits = "strategy='checkpoint' holds it within a budget"
        detail = f"every step's saved tensors, {per_step / 1e6:,.1f} MB a step, for {n} steps"
    else:
        need = _probe_peak(run, state, params, strategy, _PROBE_STEPS, inverse)
        report.update(working_bytes=need)
        fits = "no strategy needs less than one taped step"
        detail = "one taped step forward and backward (the loop's length does not matter)"
    report["needed_bytes"] = need
    if budget < need:
        raise ValueError(
            f"{caller}: memory budget {budget / 1e6:,.1f} MB is below what "
            f"strategy={strategy!r} needs for this loop: {need / 1e6:,.1f} MB ({detail}, "
            f"measured); raise memory ({fits})"
        )


def _probe_peak(
    run: _Step, state: tuple, params: tuple, strategy: str, steps: int, inverse=None
) -> int:
    """The measured peak (bytes) of ``steps`` steps of the loop run with ``strategy``,
    forward and backward, from a detached copy of its input; ``checkpoint`` stores nothing
    but that input (``_PROBE_SNAPSHOTS`` slots). Once per step function, shapes, strategy and
    length (64 kept); at least the output and its gradient (a small step may reuse resident
    memory and read 0; without a reading, off Linux, that is all there is)."""
    step = getattr(run.step, "__func__", run.step)  # a bound method: its function
    params_sig = tuple((p.shape, p.dtype, p.device) for p in params)
    key = (step, tuple(run.signature), params_sig, strategy, steps)
    if key not in _PEAKS:

        def probe():
            x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in state)
            if strategy == "checkpoint":
                report = {"n_steps": steps}
                out = _Checkpointed.apply(run, steps, _PROBE_SNAPSHOTS, report, len(x), *x, *params)
            elif strategy == "reversible":
                out = _Reversible.apply(run, inverse, steps, {}, len(x), *x, *params)
            else:
                ctx = (
                    torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
                    if strategy == "offload"
                    else contextlib.nullcontext()
                )
                out = x
                with ctx:
                    for _ in range(steps):
                        out = run(out)
            leaves = [t for t in (*x, *params) if t.requires_grad]
            outs = [o for o in out if o.requires_grad]
            if outs and leaves:
                torch.autograd.grad(
                    outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True
                )

        with torch.random.fork_rng(devices=run.devices):  # the loop's draws stay its own
            probe()  # first calls' one-off allocations, unmeasured
            _, _, peak = measure_peak(probe, state[0].device)
        if len(_PEAKS) >= 64:
            _PEAKS.clear()
        _PEAKS[key] = max(peak or 0, 2 * state_bytes(state))
    return _PEAKS[key]


#: measured peaks of short loops, by step function, shapes, strategy and length
_PEAKS: dict = {}
#: steps and snapshots (the input included) of the loop that measures checkpointing's cost
_PROBE_STEPS, _PROBE_SNAPSHOTS = 4, 2


def _working_bytes(run: _Step, state: tuple, params: tuple) -> int:
    """What checkpointing the loop needs besides its snapshots (a step's temporaries, a
    taped step's saved tensors and gradients, the state being advanced, the gradient flowing
    back, the output): the peak of a ``_PROBE_STEPS``-step checkpointed loop that stores
    only its input, less the probe's own snapshots."""
    size = state_bytes(state)
    peak = _probe_peak(run, state, params, "checkpoint", _PROBE_STEPS)
    return max(peak - (_PROBE_SNAPSHOTS - 1) * size, 2 * size)


def _snapshots(caller: str, n: int, state: tuple, memory, snapshots, working: int | None) -> int:
    """The number of stored states: ``snapshots``, or from the ``memory`` budget and the
    measured ``working`` cost (given with ``memory``), or sqrt(n)."""
    if memory is not None and snapshots is not None:
        raise ValueError(f"{caller}: give memory or snapshots, not both")
    if snapshots is not None:
        return check_int(caller, "snapshots", snapshots, 1)
    if memory is None:
        return max(1, math.ceil(math.sqrt(n)))
    budget, size = parse_bytes(caller, memory), max(1, state_bytes(state))
    if budget < working:
        raise ValueError(
            f"{caller}: memory budget {budget / 1e6:,.1f} MB is below what checkpointing this "
            f"loop needs: {working / 1e6:,.1f} MB (measured on a {_PROBE_STEPS}-step loop that "
            f"stores only its input; a state is {size / 1e6:,.1f} MB); raise memory, or use "
            "strategy='store'"
        )
    return 1 + (budget - working) // size  # the input, and what the rest of the budget holds
