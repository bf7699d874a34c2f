"""The loop's step as a function of state tuples, and the autograd functions that re-run it
in backward: :class:`Checkpointed` (revolve's schedule over stored snapshots) and
:class:`Reversible` (states rebuilt by the step's inverse). :func:`~otreg.loops.iterate`
picks one; :mod:`~otreg.loops.budget` runs short ones to measure a loop's memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .._checks import warn
from .memory import MMAP_THRESHOLD
from .schedules import binomial_schedule


def as_tuple(caller: str, x0: object) -> tuple[tuple[torch.Tensor, ...], bool]:
    """``x0`` as a tuple of tensors, and whether it was one tensor."""
    if isinstance(x0, torch.Tensor):
        return (x0,), True
    if isinstance(x0, (tuple, list)) and x0 and all(isinstance(t, torch.Tensor) for t in x0):
        return tuple(x0), False
    raise TypeError(
        f"{caller}: x0 must be a tensor or a non-empty tuple of tensors, got {type(x0).__name__}"
    )


def uncounted_tensors(step: Callable, params: tuple) -> list[str]:
    """The names of what ``step`` uses without receiving it in ``params``, and would need a
    gradient: tensors that require one, and modules with such parameters (also inside a
    list, tuple or dict), found in its closure, its default arguments, the globals its code
    names, a ``functools.partial``'s arguments, a module given as the step, and the
    attributes a bound method or a callable object's ``__call__`` names (parameters,
    modules, plain attributes; not properties). A strategy that recomputes steps outside
    autograd's record cannot give them gradients. Not seen: what a function the step calls
    uses, or an attribute of an object the step receives. Nothing is looked for where
    gradients are off (``torch.no_grad``)."""
    if not torch.is_grad_enabled():
        return []
    given = {id(p) for p in params}

    def needs_grad(value, depth: int = 0) -> bool:
        if isinstance(value, torch.Tensor):
            return value.requires_grad and id(value) not in given
        if isinstance(value, torch.nn.Module):
            return any(p.requires_grad and id(p) not in given for p in value.parameters())
        if depth == 0 and isinstance(value, (list, tuple, dict)):
            items = value.values() if isinstance(value, dict) else value
            return any(needs_grad(v, 1) for v in items)
        return False

    found: dict[str, object] = {}

    def look(fn) -> None:
        if isinstance(fn, functools.partial):
            for k, value in enumerate(fn.args):
                found.setdefault(f"partial argument {k}", value)
            for name, value in fn.keywords.items():
                found.setdefault(name, value)
            look(fn.func)
            return
        if isinstance(fn, torch.nn.Module):
            found.setdefault("the parameters of the module given as step", fn)
            return
        owner = getattr(fn, "__self__", None)
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if code is None and callable(fn):  # a callable object: its __call__, bound to it
            owner, fn = fn, getattr(type(fn).__call__, "__func__", type(fn).__call__)
            code = getattr(fn, "__code__", None)
        if code is None:
            return
        if owner is not None:  # the attributes it names
            attributes = dict(getattr(owner, "__dict__", {}))
            if isinstance(owner, torch.nn.Module):
                attributes.update(owner._parameters, **owner._modules)
            for name in code.co_names:
                if name in attributes:
                    found.setdefault(f"self.{name}", attributes[name])
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                found.setdefault(name, cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        for name in code.co_names:
            if name in fn.__globals__:
                found.setdefault(name, fn.__globals__[name])
        positional = code.co_varnames[: code.co_argcount]
        defaults = fn.__defaults__ or ()
        for name, value in zip(positional[len(positional) - len(defaults) :], defaults):
            found.setdefault(name, value)
        for name, value in (fn.__kwdefaults__ or {}).items():
            found.setdefault(name, value)

    look(step)
    names, seen = [], set()
    for name, value in found.items():
        if needs_grad(value) and id(value) not in seen:
            seen.add(id(value))
            names.append(name)
    return names


def refuse_uncounted(caller: str, step: Callable, params: tuple, why: str, fix: str) -> None:
    """Raise ``ValueError`` naming the tensors :func:`uncounted_tensors` finds; ``why`` says
    why they would get no gradient, ``fix`` what to do besides passing them in params."""
    missed = uncounted_tensors(step, params)
    if missed:
        raise ValueError(
            f"{caller}: step uses {', '.join(missed)}, which requires a gradient, without "
            f"receiving it in params: {why}, so it would get none; pass it in params "
            f"({fix})"
        )


#: a reversible loop's drift warns above this many square roots of its dtype's epsilon
#: (float32: 3.5e-3, float64: 1.5e-7)
DRIFT_WARN_ULPS = 10


class Step:
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
        self._last_rng: tuple | None = None  # what rng_state() returned last

    def __call__(self, state: tuple, params: tuple | None = None) -> tuple:
        """One step of the loop on a state tuple."""
        params = self.params if params is None else params
        arg = state[0] if self.single else state
        out = self.step(arg) if self.module else self.step(arg, *params)
        if isinstance(out, torch.Tensor):
            out_t = (out,)
        elif isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
            out_t = tuple(out)
        else:
            raise TypeError(
                f"iterate: step returned {type(out).__name__}; a step returns the next state, "
                "a tensor or a tuple of tensors like x0"
            )
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
        """The RNG states the next step starts from; the previous call's own object when
        nothing drew since (a step that draws nothing then stores no state per snapshot:
        thousands of small tensors kept among a loop's temporaries fragment the heap)."""
        now = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in self.devices])
        last = self._last_rng
        if last is not None and all(
            torch.equal(a, b) for a, b in zip((now[0], *now[1]), (last[0], *last[1]))
        ):
            return last
        self._last_rng = now
        return now

    def set_rng_state(self, rng) -> None:
        """Restore the random state :meth:`rng_state` returned."""
        torch.set_rng_state(rng[0])
        for d, s in zip(self.devices, rng[1]):
            torch.cuda.set_rng_state(s, d)


def vjp(run: Step, state: tuple, params: tuple, grad_state: tuple):
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


def add_grads(total: list, grads: tuple) -> None:
    """Accumulate ``grads`` into ``total`` in place (None: no gradient)."""
    for k, g in enumerate(grads):
        if g is not None:
            total[k] = g if total[k] is None else total[k] + g


# ----------------------------------------------------------------------- checkpoint
class Snapshots(dict):
    """Stored states by step index; small CPU states are copied into rows of one
    preallocated tensor per state tensor (made at the first store, ``rows`` deep): kept one
    by one among a step's temporaries they fragment the heap (a loop storing 29 MB of 48 KB
    states held 52 MB resident, 35 MB once trimmed). Step 0, the loop's input, is kept as
    given."""

    def __init__(self, state: tuple, rng, rows: int) -> None:
        super().__init__({0: (state, rng)})
        # only small CPU states, which glibc serves from its heap: larger ones are mapped
        # and unmapped whole, where a copy would only add a state to the peak
        small = all(t.device.type == "cpu" and t.nbytes < MMAP_THRESHOLD for t in state)
        rows = rows if small else 0
        self.rows, self.pool, self.free = rows, None, list(range(rows - 1, -1, -1))
        self.row_of: dict[int, int] = {}

    def store(self, k: int, state: tuple, rng) -> None:
        """Keep the state (and random state) of step k."""
        if self.pool is None and self.rows > 0:
            self.pool = tuple(t.new_empty((self.rows, *t.shape)) for t in state)
        if not self.free:  # more than planned at once: keep the tensors themselves
            self[k] = (state, rng)
            return
        row = self.row_of[k] = self.free.pop()
        rows = tuple(p[row] for p in self.pool)
        for dst, src in zip(rows, state):
            dst.copy_(src)
        self[k] = (rows, rng)

    def drop(self, k: int) -> None:
        """Forget the state of step k."""
        del self[k]
        if k in self.row_of:
            self.free.append(self.row_of.pop(k))


class Checkpointed(torch.autograd.Function):
    """The loop run by the binomial schedule: snapshots in forward, re-runs in backward."""

    @staticmethod
    def forward(ctx, run: Step, n: int, snapshots: int, report: dict, n_state: int, *tensors):
        """The final state after n steps, keeping ``snapshots`` states for backward."""
        state, params = tuple(tensors[:n_state]), tuple(tensors[n_state:])
        actions = binomial_schedule(n, snapshots)
        first_taped = next(k for k, a in enumerate(actions) if a.kind == "taped")
        slots = Snapshots(state, run.rng_state(), min(snapshots, n) - 1)  # 1: the input
        current, evaluations = state, 0
        for action in actions[:first_taped]:
            if action.kind == "advance":
                for _ in range(action.start, action.stop):
                    current = run(current, params)
                    evaluations += 1
            elif action.kind == "store":
                slots.store(action.start, current, run.rng_state())
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
        """The gradients of the input state and the parameters, segment by segment."""
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
                    grad_state, gp = vjp(run, current, params, grad_state)
                    add_grads(grad_params, gp)
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
                    slots.store(action.start, current, rng)
                    max_stored = max(max_stored, len(slots))
                elif action.kind == "free":
                    slots.drop(action.start)
        ctx.report.update(
            max_stored=max_stored,
            untaped_evaluations=evaluations,
            recomputations=evaluations - int(ctx.report["n_steps"]),
        )
        ctx.slots = ctx.working = None
        return (None, None, None, None, None, *grad_state, *grad_params)


# ----------------------------------------------------------------------- reversible
class Reversible(torch.autograd.Function):
    """The loop run forward keeping only its last state; backward rebuilds each state by
    the step's inverse."""

    @staticmethod
    def forward(ctx, run: Step, inverse: Callable, n: int, report: dict, n_state: int, *tensors):
        """The final state after n steps; nothing else is kept."""
        state, params = tuple(tensors[:n_state]), tuple(tensors[n_state:])
        current = state
        for _ in range(n):
            current = run(current, params)
        ctx.run, ctx.inverse, ctx.n, ctx.report, ctx.n_state = run, inverse, n, report, n_state
        ctx.save_for_backward(*state, *current, *params)
        return current

    @staticmethod
    def backward(ctx, *grad_out):
        """The gradients, each state rebuilt from the next by the inverse step."""
        saved, k = ctx.saved_tensors, ctx.n_state
        x0, current, params = saved[:k], saved[k : 2 * k], saved[2 * k :]
        run = ctx.run
        grad_state, grad_params = grad_out, [None] * len(params)
        for _ in range(ctx.n):
            with torch.no_grad():
                arg = current[0] if run.single else current
                prev = ctx.inverse(arg) if run.module else ctx.inverse(arg, *params)
                current = (prev,) if isinstance(prev, torch.Tensor) else tuple(prev)
            grad_state, gp = vjp(run, current, params, grad_state)
            add_grads(grad_params, gp)
        num = max(float((a - b).abs().max()) for a, b in zip(current, x0))
        den = max(float(b.abs().max()) for b in x0) or 1.0
        ctx.report["drift"] = drift = num / den
        limit = DRIFT_WARN_ULPS * torch.finfo(x0[0].dtype).eps ** 0.5
        if not drift <= limit:
            warn(
                f"iterate: strategy='reversible' rebuilt x_0 from the output with a relative "
                f"error of {drift:.3g} (report['drift']; above {limit:.2g}), so the gradients "
                "were taken at states that far off: check that inverse undoes step, or use "
                "strategy='checkpoint'",
                UserWarning,
            )
        return (None, None, None, None, None, *grad_state, *grad_params)
