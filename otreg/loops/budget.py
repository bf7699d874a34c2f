"""What a loop's memory budget buys, measured: ``memory=`` parsed, the peak of short loops
run with each strategy (the cost of one taped step, of checkpointing, of storing a step),
the number of snapshots a budget holds, and the check that raises when a budget is below
what a strategy needs. Used by :func:`~otreg.loops.iterate`.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Sequence

import torch

from .._checks import check_choice, check_int
from .memory import measure_peak, resident_bytes
from .tape import Checkpointed, Reversible, Step

__all__: list[str] = []

#: contexts entered while a budget's planner first runs a short loop, so that one-off costs
#: (compiling the loop's reductions) are paid there, measured and charged to the budget
_ONE_OFF_CONTEXTS: list = []


def charge_one_offs_to_budgets(context) -> None:
    """Register ``context`` (a callable returning a context manager) to be entered while a
    budget's planner first runs the loop: what it makes happen early (e.g. otreg's
    reductions compiling at their first call,
    :func:`otreg.reductions._compiled.compile_now`) then happens before the loop, and what
    it keeps is charged to the budget with the rest of what the call kept."""
    if context not in _ONE_OFF_CONTEXTS:
        _ONE_OFF_CONTEXTS.append(context)


#: contexts entered, with the budget in bytes, around the whole of every call given one
_BUDGET_CONTEXTS: list = []


def fit_one_offs_to_budgets(context) -> None:
    """Register ``context`` (a callable taking a budget in bytes and returning a context
    manager) to be entered around the whole of every call given a memory budget
    (:func:`~otreg.loops.iterate` with ``memory=``, an unrolled Sinkhorn solve with one):
    there a one-off that the budget could not hold is avoided (otreg's reductions stay
    uncompiled when loading torch's compiler would take too much of it,
    :func:`otreg.reductions._compiled.fit_to_budget`)."""
    if context not in _BUDGET_CONTEXTS:
        _BUDGET_CONTEXTS.append(context)


class _Open(threading.local):
    """The budgeted calls in progress in this thread, outermost first: (caller, resident
    bytes at its start). Memory is read for the whole process: budgeted calls running in
    several threads at once see each other's memory."""

    def __init__(self) -> None:
        self.calls: list = []


_OPEN = _Open()


@contextlib.contextmanager
def within_budget(caller: str, memory, device: torch.device):
    """Around a call given ``memory`` (nothing when it is None): yields the budget in
    bytes, entering the :func:`fit_one_offs_to_budgets` contexts. A budget counts from the
    start of the outermost budgeted call in progress: what the process keeps from there to
    a loop's start (:func:`kept_since_call`: a solve before an unrolled loop, a first run's
    one-offs) is charged to the loop past ``ONE_OFF_ALLOWANCE``, and a loop whose call has
    spent its budget before it raises ``ValueError`` at once."""
    if memory is None:
        yield None
        return
    budget = parse_bytes(caller, memory)
    calls = _OPEN.calls
    if calls:
        kept = kept_since_call(device) - ONE_OFF_ALLOWANCE
        if kept >= budget:
            raise ValueError(
                f"{calls[0][0]}: memory budget {_size(budget)} is spent before its "
                f"loop: the call kept {_size(kept)} more than the "
                f"{ONE_OFF_ALLOWANCE / 1e6:,.0f} MB allowed for one-offs before it "
                f"{ONE_OFFS}; raise memory"
            )
    with contextlib.ExitStack() as stack:
        if not calls:
            calls.append((caller, resident_bytes(device)))
            stack.callback(calls.pop)
        for context in _BUDGET_CONTEXTS:
            stack.enter_context(context(budget))
        yield budget


def kept_since_call(device: torch.device) -> int:
    """What the process holds now beyond what it held when the outermost budgeted call in
    progress began (0 outside one, or where memory cannot be read)."""
    calls = _OPEN.calls
    if not calls or calls[0][1] is None:
        return 0
    now = resident_bytes(device)
    return 0 if now is None else max(0, now - calls[0][1])


#: what a call may keep before its loop, for messages
ONE_OFFS = (
    "(what a process's first call keeps: allocator pools and loaded code, and torch's "
    "compiler where otreg's reductions compile, which otreg.reductions.COMPILED = False "
    "prevents; a later call does not pay them again)"
)


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


STRATEGIES = ("store", "checkpoint", "reversible", "offload")


def resolve_strategy(caller: str, strategy: str | None, memory) -> str:
    """``strategy`` checked, or when None the one a budget implies: ``"checkpoint"`` (it
    fits itself to ``memory``) with one, ``"store"`` without; ``memory`` checked too."""
    if strategy is None:
        strategy = "store" if memory is None else "checkpoint"
    check_choice(caller, "strategy", strategy, STRATEGIES)
    if memory is not None:
        parse_bytes(caller, memory)
    return strategy


def state_bytes(state: Sequence[torch.Tensor]) -> int:
    """Bytes held by one state."""
    return sum(t.numel() * t.element_size() for t in state)


def stores_on_host(strategy: str, state: tuple) -> bool:
    """Whether the strategy keeps every step's saved tensors in the memory the budget is
    for: ``store`` always, ``offload`` when the loop runs on the CPU (its host memory)."""
    return strategy == "store" or (strategy == "offload" and state[0].device.type == "cpu")


def check_budget(
    caller: str, strategy: str, run, state: tuple, params: tuple, n: int, memory, inverse, report
) -> None:
    """``memory=`` for the strategies that do not tune themselves to it: measure what the
    loop will need and raise ``ValueError`` naming it (and the strategy that fits) when the
    budget is smaller. ``reversible`` (and ``offload`` on a GPU, for the device's memory)
    needs the fixed cost of one taped step, whatever ``n``; ``store`` (and ``offload`` on
    the CPU) that plus every step's saved tensors, measured per step on short loops."""
    budget = parse_bytes(caller, memory)
    if stores_on_host(strategy, state):
        two = probe_peak(run, state, params, "store", 2, None, report)
        four = probe_peak(run, state, params, "store", 4, None, report)
        per_step = max(0, four - two) / 2
        need = int(max(two - 2 * per_step, 0) + n * per_step)
        report.update(working_bytes=int(two - 2 * per_step), step_bytes=int(per_step))
        fits = "strategy='checkpoint' holds it within a budget"
        detail = f"every step's saved tensors, {_size(per_step)} a step, for {n} steps"
    else:
        need = probe_peak(run, state, params, strategy, PROBE_STEPS, inverse, report)
        report.update(working_bytes=need)
        fits = "no strategy needs less than one taped step"
        detail = "one taped step forward and backward (the loop's length does not matter)"
    need = charged(need, report, state[0].device)
    report["needed_bytes"] = need
    if budget < need:
        raise ValueError(
            f"{caller}: memory budget {_size(budget)} is below what "
            f"strategy={strategy!r} needs for this loop: {_size(need)} ({detail}, "
            f"measured{one_off_note(report)}); raise memory to at least "
            f"{_size(least_budget(need, report))} (with {BUDGET_MARGIN:.0%} for the "
            f"measurement's spread; {fits})"
        )
    check_first_run(caller, budget, report)


#: what a budget leaves uncharged of the memory a call keeps before its loop (the
#: allocator pools of a first backward, 30 to 45 MB measured): the stated constant of the
#: bound, measured peak growth <= 1.25 x budget + 30 MB
ONE_OFF_ALLOWANCE = 30_000_000


def charged(need: int, report: dict, device: torch.device) -> int:
    """What a loop needing ``need`` bytes costs this call: plus what the call kept before
    the loop, read now (after the planner's first runs) from the start of the outermost
    budgeted call (:func:`kept_since_call`, into ``report["kept_bytes"]``), beyond
    ``ONE_OFF_ALLOWANCE``."""
    report["kept_bytes"] = kept_since_call(device)
    return need + max(0, report["kept_bytes"] - ONE_OFF_ALLOWANCE)


def _size(nbytes: float) -> str:
    """Bytes for a message: '61.8 MB', '4.1 kB' or '512 bytes'."""
    if nbytes >= 1e5:
        return f"{nbytes / 1e6:,.1f} MB"
    if nbytes >= 1e3:
        return f"{nbytes / 1e3:,.1f} kB"
    return f"{int(nbytes)} bytes"


def least_budget(need: int, report: dict) -> int:
    """The budget an error asks for: one that both ``need`` and the first short run's peak
    (past the one-off allowance, :func:`check_first_run`) fit, plus ``BUDGET_MARGIN`` for
    the measurement's noise from run to run, rounded up to the digits a message shows, so
    that the next try passes both checks."""
    least = max(need, report.get("first_probe_bytes", 0) - ONE_OFF_ALLOWANCE)
    unit = 100_000 if least >= 1e5 else 100
    return int(math.ceil(least * (1 + BUDGET_MARGIN) / unit) * unit)


#: what a suggested budget adds to the measured need (peaks measured in separate processes
#: for one loop spread by up to 10%)
BUDGET_MARGIN = 0.1


def check_first_run(caller: str, budget: int, report: dict) -> None:
    """Raise when the planner's first run peaked over the budget, counted from the start
    of the call, past ``ONE_OFF_ALLOWANCE``."""
    first = report.get("first_probe_bytes", 0) - ONE_OFF_ALLOWANCE
    if first > budget:
        raise ValueError(
            f"{caller}: memory budget {_size(budget)} is below the peak of this loop's "
            f"first short run, {_size(first)} past the "
            f"{ONE_OFF_ALLOWANCE / 1e6:,.0f} MB allowed for one-offs {ONE_OFFS}; raise memory "
            f"to at least {_size(least_budget(0, report))}"
        )


def one_off_note(report: dict) -> str:
    """The one-off part of a need, for error messages."""
    kept = report.get("kept_bytes", 0) - ONE_OFF_ALLOWANCE
    if kept < 1e6:
        return ""
    return f"; {_size(kept)} of it is what the call kept before its loop {ONE_OFFS}"


def probe_peak(
    run: Step,
    state: tuple,
    params: tuple,
    strategy: str,
    steps: int,
    inverse=None,
    report: dict | None = None,
) -> int:
    """The measured peak (bytes) of ``steps`` steps of the loop run with ``strategy``,
    forward and backward, from a detached copy of its input; ``checkpoint`` stores nothing
    but that input (``PROBE_SNAPSHOTS`` slots). Once per step function, shapes, strategy and
    length (64 kept); at least the output and its gradient (a small step may reuse resident
    memory and read 0; without a reading, off Linux, that is all there is). The first run
    pays the one-offs (under the contexts registered with :func:`charge_one_offs_to_budgets`)
    and the second is the measure; the first's peak counted from the start of the budgeted
    call goes to ``report["first_probe_bytes"]``."""
    step = getattr(run.step, "__func__", run.step)  # a bound method: its function
    params_sig = tuple((p.shape, p.dtype, p.device) for p in params)
    key = (step, tuple(run.signature), params_sig, strategy, steps)
    if key not in _PEAKS:

        def probe():
            x = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in state)
            if strategy == "checkpoint":
                report = {"n_steps": steps}
                out = Checkpointed.apply(run, steps, PROBE_SNAPSHOTS, report, len(x), *x, *params)
            elif strategy == "reversible":
                out = Reversible.apply(run, inverse, steps, {}, len(x), *x, *params)
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

        device = state[0].device
        with torch.random.fork_rng(devices=run.devices):  # the loop's draws stay its own
            start = kept_since_call(device)
            with contextlib.ExitStack() as stack:
                for context in _ONE_OFF_CONTEXTS:
                    stack.enter_context(context())
                _, _, first = measure_peak(probe, device)  # first calls' one-offs
            _, _, peak = measure_peak(probe, device)
        if len(_PEAKS) >= 64:
            _PEAKS.clear()
        _PEAKS[key] = max(peak or 0, 2 * state_bytes(state))
        if report is not None:  # the first run's peak, counted from the call's start
            first = start + (first or 0)
            report["first_probe_bytes"] = max(report.get("first_probe_bytes", 0), first)
    return _PEAKS[key]


#: measured peaks of short loops, by step function, shapes, strategy and length
_PEAKS: dict = {}
#: steps and snapshots (the input included) of the loop that measures checkpointing's cost
PROBE_STEPS, PROBE_SNAPSHOTS = 4, 2


def working_bytes(run: Step, state: tuple, params: tuple, report: dict | None = None) -> int:
    """What checkpointing the loop needs besides its snapshots (a step's temporaries, a
    taped step's saved tensors and gradients, the state being advanced, the gradient flowing
    back, the output): the peak of a ``PROBE_STEPS``-step checkpointed loop that stores
    only its input, less the probe's own snapshots."""
    size = state_bytes(state)
    peak = probe_peak(run, state, params, "checkpoint", PROBE_STEPS, None, report)
    return max(peak - (PROBE_SNAPSHOTS - 1) * size, 2 * size)


def snapshot_count(
    caller: str,
    n: int,
    state: tuple,
    memory,
    snapshots,
    working: int | None,
    report: dict | None = None,
) -> int:
    """The number of stored states: ``snapshots``, or from the ``memory`` budget and the
    measured ``working`` cost (given with ``memory``; with the one-offs in ``report``
    charged, :func:`charged`), or sqrt(n)."""
    if memory is not None and snapshots is not None:
        raise ValueError(f"{caller}: give memory or snapshots, not both")
    if snapshots is not None:
        return check_int(caller, "snapshots", snapshots, 1)
    if memory is None:
        return max(1, math.ceil(math.sqrt(n)))
    budget, size = parse_bytes(caller, memory), max(1, state_bytes(state))
    report = {} if report is None else report
    working = charged(working, report, state[0].device)
    if budget < working:
        raise ValueError(
            f"{caller}: memory budget {_size(budget)} is below what checkpointing this "
            f"loop needs: {_size(working)} (measured on a {PROBE_STEPS}-step loop that "
            f"stores only its input; a state is {_size(size)}{one_off_note(report)}); "
            f"raise memory to at least {_size(least_budget(working, report))}, or use "
            "strategy='store'"
        )
    check_first_run(caller, budget, report)
    return 1 + (budget - working) // size  # the input, and what the rest of the budget holds
