r"""Implicit differentiation of a fixed point ``z* = step(z*, *params)``.

Forward iterates without a graph. Backward needs u = (d z*/d params)^T g; differentiating
z* = step(z*, p) gives (I - J) dz* = (d step/d p) dp with J = d step/d z at z*, so

.. math::

    (I - J^T)\, u = g, \qquad \nabla_p = \Big(\frac{\partial\, \mathrm{step}}
        {\partial p}\Big)^T u,

solved matrix-free: J^T u is one vector-Jacobian product through a single taped step. The
solver is scipy's GMRES (``solver="gmres"``, the default) or the fixed-point iteration
u <- g + J^T u (``solver="fixed_point"``, which converges when the forward map contracts).
Memory: one step's graph, whatever the number of iterations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .._checks import ConvergenceWarning, check_choice, check_int, check_positive, warn
from .iterate import iterate
from .tape import Step, as_tuple, refuse_uncounted

__all__ = ["fixed_point"]

BACKWARDS = ("implicit", "unroll")
#: The adjoint solve's tolerance is at least this many units of the dtype's rounding.
ROUNDING_ULPS = 50
SOLVERS = ("gmres", "fixed_point")
#: GMRES's Krylov space: restarted after this many products (a full space on 200 points'
#: potentials, 100 Gaussian points at blur 0.05 in float32, stopped at a residual of 0.15
#: where 50 reached 2e-3: float32 products limit an ill-conditioned system either way)
RESTART = 50


def _flat(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _solve_adjoint(
    apply_jt: Callable, g: torch.Tensor, solver: str, tol: float, max_iter: int
) -> tuple[torch.Tensor, float, int]:
    """Solve (I - J^T) u = g; returns (u, relative residual, iterations)."""
    gnorm = float(g.detach().norm()) or 1.0
    if solver == "fixed_point":
        u, n = g.clone(), 0
        for n in range(1, max_iter + 1):  # noqa: B007
            u_new = g + apply_jt(u)
            done = float((u_new - u).detach().norm()) <= tol * gnorm
            u = u_new
            if done:
                break
    else:
        import numpy as np
        from scipy.sparse.linalg import LinearOperator, gmres

        count = [0]

        def matvec(v):
            count[0] += 1
            t = torch.as_tensor(np.asarray(v).reshape(-1), dtype=g.dtype, device=g.device)
            return (t - apply_jt(t)).detach().cpu().double().numpy()

        op = LinearOperator((g.numel(), g.numel()), matvec=matvec, dtype=np.float64)
        restart = min(RESTART, g.numel())
        sol, _ = gmres(
            op,
            g.detach().cpu().double().numpy(),
            rtol=tol,
            atol=0.0,
            restart=restart,
            maxiter=max(1, -(-max_iter // restart)),  # scipy's count is of restart cycles
        )
        u, n = torch.as_tensor(sol, dtype=g.dtype, device=g.device), count[0]
    residual = float((u - apply_jt(u) - g).detach().norm()) / gnorm
    return u, residual, n


class _Implicit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: Step, opts: dict, report: dict, n_state: int, *tensors):
        z, params = tensors[:n_state], tensors[n_state:]
        ctx.run, ctx.opts, ctx.report, ctx.n_state = run, opts, report, n_state
        ctx.save_for_backward(*z, *params)
        return tuple(t.clone() for t in z)

    @staticmethod
    def backward(ctx, *grad_out):
        saved = ctx.saved_tensors
        z, params = saved[: ctx.n_state], saved[ctx.n_state :]
        g = _flat([go if go is not None else torch.zeros_like(t) for go, t in zip(grad_out, z)])
        if not bool(g.any()):  # nothing flows back through z*: no step to retape, no solve
            ctx.report.update(backward_residual=0.0, backward_iterations=0)
            return (None, None, None, None, *(None for _ in z), *(None for _ in params))
        with torch.enable_grad():
            zz = tuple(t.detach().requires_grad_() for t in z)
            out = ctx.run(zz, params)
            flat_out = _flat(out)

            def apply_jt(u: torch.Tensor) -> torch.Tensor:
                grads = torch.autograd.grad(flat_out, zz, u, retain_graph=True, allow_unused=True)
                return _flat(
                    [gr if gr is not None else torch.zeros_like(t) for gr, t in zip(grads, zz)]
                )

            o = ctx.opts
            # the residual is computed in the state's dtype: below its rounding (float32:
            # 6e-6 relative) no solver can go, and GMRES would spend max_iter restarts
            tol = max(o["tol"], ROUNDING_ULPS * torch.finfo(g.dtype).eps)
            u, residual, n = _solve_adjoint(apply_jt, g, o["solver"], tol, o["max_iter"])
            ctx.report.update(backward_residual=residual, backward_iterations=n)
            if residual > 10 * tol:
                warn(
                    f"fixed_point: the adjoint solve stopped at relative residual "
                    f"{residual:.3g} > {tol:g} after {n} iterations; the "
                    "gradient is approximate",
                    ConvergenceWarning,
                )
            # a tensor given twice (x against itself) gets its whole gradient once: autograd
            # gives every occurrence the total, which would count it twice
            first = {}
            for k, p in enumerate(params):
                if p.requires_grad:
                    first.setdefault(id(p), k)
            wanted = [params[k] for k in first.values()]
            got = torch.autograd.grad(flat_out, wanted, u, allow_unused=True) if wanted else ()
            by_index = dict(zip(first.values(), got))
        gp = tuple(by_index.get(k) for k in range(len(params)))
        return (None, None, None, None, *(None for _ in z), *gp)


def implicit(
    step: Callable,
    z_star,
    params: Sequence[torch.Tensor] = (),
    *,
    solver: str = "gmres",
    tol: float = 1e-8,
    max_iter: int = 1000,
    report: dict | None = None,
):
    """Attach implicit gradients to an already computed fixed point ``z_star`` of ``step``.

    Returns z_star (same values) whose gradients with respect to ``params`` solve the adjoint
    system of the module docstring.
    """
    z, single = as_tuple("implicit", z_star)
    run = Step(step, tuple(params), False, single, z)
    opts = {"solver": solver, "tol": tol, "max_iter": max_iter}
    out = _Implicit.apply(
        run, opts, {} if report is None else report, len(z), *(t.detach() for t in z), *params
    )
    return out[0] if single else tuple(out)


def fixed_point(
    step: Callable,
    x0,
    params: Sequence[torch.Tensor] | nn.Module = (),
    *,
    tol: float = 1e-6,
    max_iter: int = 1000,
    backward: str = "implicit",
    solver: str = "gmres",
    backward_tol: float | None = None,
    backward_max_iter: int = 1000,
    report: dict | None = None,
):
    """Find ``z* = step(z*, *params)`` by iteration, differentiably.

    Args:
        step: ``step(z, *params) -> z`` (a tensor or a tuple of tensors), a contraction near z*.
        x0: the starting point.
        params: tensors that receive gradients (an nn.Module is not supported here: pass
            ``tuple(module.parameters())`` and use them in ``step``).
        tol: stop when ``|z_{k+1} - z_k| <= tol |z_{k+1}|`` (all tensors flattened together).
        max_iter: the most forward iterations; warns ``ConvergenceWarning`` at the cap.
        backward: ``"implicit"`` (solve the adjoint system: memory of one step) or
            ``"unroll"`` (autograd through the same number of iterations, for comparison).
        solver: ``"gmres"`` or ``"fixed_point"`` for the adjoint system. GMRES converges
            in fewer steps but keeps up to 50 Krylov vectors in float64 (memory of up to
            about 100 float32 states); ``"fixed_point"`` keeps two (O(1) states) and needs a
            contraction.
        backward_tol: relative residual of the adjoint solve (default: ``tol``).
        backward_max_iter: the most adjoint iterations (products J^T u; GMRES stops at the
            restart cycle that reaches them).
        report: a dict filled with ``n_iter``, ``converged``, ``residual`` and, after
            backward, ``backward_residual`` and ``backward_iterations``.

    Returns:
        z*, with the structure of x0.

    Example:
        >>> import torch
        >>> from otreg.loops import fixed_point
        >>> c = torch.tensor(2.0, requires_grad=True)
        >>> x = fixed_point(lambda x, c: 0.5 * (x + c / x), torch.tensor(1.0), (c,))  # sqrt(c)
        >>> x.backward()
        >>> round(float(x), 6), round(float(c.grad), 6)          # d sqrt(c)/dc = 1/(2 sqrt(c))
        (1.414214, 0.353553)
    """
    caller = "fixed_point"
    if not callable(step):
        raise TypeError(f"{caller}: step must be callable, got {type(step).__name__}")
    if isinstance(params, nn.Module):
        raise TypeError(f"{caller}: pass tuple(module.parameters()) as params and use them in step")
    z, single = as_tuple(caller, x0)
    tol = check_positive(caller, "tol", tol)
    max_iter = check_int(caller, "max_iter", max_iter, 1)
    check_choice(caller, "backward", backward, BACKWARDS)
    check_choice(caller, "solver", solver, SOLVERS)
    backward_tol = (
        tol if backward_tol is None else check_positive(caller, "backward_tol", backward_tol)
    )
    backward_max_iter = check_int(caller, "backward_max_iter", backward_max_iter, 1)
    params = tuple(params)
    if backward == "implicit":
        why = "the implicit backward differentiates with respect to params only"
        fix = "step(z, *params)), detach it, or use backward='unroll'"
        refuse_uncounted(caller, step, params, why, fix)
    run = Step(step, params, False, single, z)
    report = {} if report is None else report
    with torch.no_grad():
        current, change, n = tuple(t.detach() for t in z), float("inf"), 0
        for n in range(1, max_iter + 1):  # noqa: B007
            nxt = run(current)
            change = float(_flat(nxt).sub(_flat(current)).norm()) / max(
                float(_flat(nxt).norm()), 1e-30
            )
            current = nxt
            if change <= tol:
                break
    report.update(n_iter=n, converged=change <= tol, residual=change)
    if change > tol:
        warn(
            f"{caller}: stopped after {n} iterations with relative change {change:.3g} "
            f"> tol={tol:g}; raise max_iter or check that step contracts",
            ConvergenceWarning,
        )
    if backward == "unroll":
        return iterate(step, x0, n, params, strategy="store")
    return implicit(
        step,
        current[0] if single else current,
        params,
        solver=solver,
        tol=backward_tol,
        max_iter=backward_max_iter,
        report=report,
    )
