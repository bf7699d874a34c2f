"""Gradients of a Sinkhorn solve: the envelope theorem (the default), the implicit function
theorem, or autograd through unrolled iterations.

- **Envelope** (:func:`dual_value`): at the converged, detached g, f = lambda softmin(g) is
  recomputed by one differentiable reduction and the dual objective evaluated at (f, g);
  its gradient is that of OT_eps: sum_j pi_ij grad C(x_i, y_j) for the points, the
  potentials for the weights. No iteration is stored.
- **Implicit**: f and g themselves become differentiable, through the fixed point of one
  alternating update (:func:`otreg.ot.loop.pair_step`; a self term's averaged update,
  :func:`otreg.ot.loop.symmetric_step`), its adjoint system solved matrix-free
  (:func:`otreg.loops.fixed_point.implicit`); the value's gradient is the envelope's at
  those potentials, built on their graph (``_EnvelopeValue``).
- **Unrolled**: autograd through the iterations at the final eps, from the annealed warm
  start, run by :func:`otreg.loops.iterate` with the chosen strategy and memory budget.

Second derivatives: the envelope gradient holds the potentials fixed, so differentiating it
again (``create_graph=True``, a Hessian-vector product) would miss how they move with the
points: on a 40-point problem that product came out 64% off a finite difference of
gradients. :func:`first_order_only` refuses it, naming the way out: the implicit (and the
unrolled, stored) gradients differentiate the potentials too, and their Hessian-vector
products agree with finite differences to 2e-8 (``tests/ot/test_gradient.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from ..loops import iterate
from ..loops.fixed_point import implicit
from .kernels import DenseKernel
from .large_blur import precise_value
from .loop import Solution, pair_step, semi_dual, solve, symmetric_step
from .multiscale import TruncatedKernel
from .problem import Implicit, Problem, SinkhornOptions, Unroll

__all__: list[str] = []


class _FirstOrderOnly(torch.autograd.Function):
    """The value unchanged; its backward refuses to run under ``create_graph``."""

    @staticmethod
    def forward(ctx, caller: str, value: torch.Tensor) -> torch.Tensor:
        ctx.caller = caller
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if torch.is_grad_enabled():  # create_graph=True: a second derivative is coming
            raise RuntimeError(
                f"{ctx.caller}: second derivatives (create_graph=True) of a value whose "
                "gradient comes from the envelope theorem would be wrong: it holds the "
                "potentials fixed. Use backward='implicit' (otreg.sinkhorn, "
                "otreg.sinkhorn_divergence, SinkhornLoss), whose potentials follow the "
                "points, or finite differences of gradients"
            )
        return None, grad


class _EnvelopeValue(torch.autograd.Function):
    """The dual value V(g, x, y, a, b) at the implicit potentials g: its gradient is the
    envelope's partial dV/d(x, y, a, b) at g, built on g's implicit graph, so that a second
    derivative sees how the potentials move. dV/dg is zero at the solution: handed to the
    adjoint solve, its rounding-size remainder (3e-17 in float64, 2e-8 in float32) came
    back as noise (|u| 0.02 and 1.8) with a warning of a residual that meant nothing."""

    @staticmethod
    def forward(ctx, value_of, g: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.value_of = value_of
        ctx.save_for_backward(g, *params)
        return value_of(g, *params)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, *params = ctx.saved_tensors
        wanted = [k for k, need in enumerate(ctx.needs_input_grad[2:]) if need]
        with torch.enable_grad():
            # views: new nodes, so that the gradient is the partial one along params (not
            # through g, which depends on them), while it stays differentiable in both
            views = [t.view_as(t) if k in wanted else t for k, t in enumerate(params)]
            value = ctx.value_of(g, *views)
            got = torch.autograd.grad(
                value, [views[k] for k in wanted], grad, create_graph=torch.is_grad_enabled()
            )
        out = dict(zip(wanted, got))
        return (None, None, *(out.get(k) for k in range(len(params))))


def first_order_only(caller: str, value: torch.Tensor) -> torch.Tensor:
    """``value``, whose gradient may be taken once but not differentiated again."""
    return _FirstOrderOnly.apply(caller, value) if value.requires_grad else value


def dual_value(p: Problem, x, y, a, b, g, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """The semi-dual objective at a fixed (detached) g: ``(value (B,), f (B, N) detached)``.

    f = lambda softmin(g) is the exact maximiser of the dual over f for this g, computed by one
    differentiable reduction (``kernel.differentiable_softmin``) that carries the dependence
    on x and y. By the envelope theorem the gradient of the value is that of OT_eps at
    convergence: sum_j pi_ij grad C(x_i, y_j) for the points, the potentials for the
    weights. Away from convergence it is the gradient for the plan whose rows have the right
    marginal, which is more accurate than evaluating the dual at both iterates.
    """
    if precise_value(p, x.dtype) and not isinstance(kernel, TruncatedKernel):
        # blur far above the data: float32 rounding would swamp the value (large_blur.py)
        wide = DenseKernel(
            p, *(t.detach().double() for t in (kernel.x, kernel.a, kernel.y, kernel.b))
        )
        value, f = dual_value(p, *(t.double() for t in (x, y, a, b, g)), wide)
        return value.to(x.dtype), f.to(x.dtype)
    s = kernel.differentiable_softmin(x, y, b.detach(), g, p.eps)  # (B, N)
    f = p.damping(p.eps) * s
    value = semi_dual(p, a, b, s, g)
    if b.requires_grad:
        path = weight_path(p, f.detach(), g, kernel, b.detach())
        value = value + (path * (b - b.detach())).sum(1)
    return value, f.detach()


def weight_path(p: Problem, f, g, kernel, b) -> torch.Tensor:
    """sum_i (d value / d s_i)(d s_i / d b_j), (B, M): the weights' share of the gradient that
    runs through the softmin s (which is computed with b detached).

    Autograd would give it as softmax_ij / b_j, 0 * inf = NaN where b_j = 0; the exact value
    is finite there: d s_i / d b_j = -eps exp((g_j - C_ij + s_i) / eps), and weighted by
    d value / d s_i = a_i exp((f_i - s_i) / eps) (balanced: a_i) it sums to
    -eps exp((g_j - t_j) / eps) with t = softmin over x of log a + f / eps, one reduction.
    Where b_j = 0 the solver never fixes g_j (no mass constrains it) and (g_j - t_j) / eps
    can overflow (0 * inf = NaN in the value): there g_j is taken as the update defines it,
    g_j = damping * t_j.
    """
    with torch.no_grad():
        fk, gk = kernel.to_kernel_order(f, g)
        _, t = kernel.to_caller_order(fk, kernel.softmin_yx(p.eps, fk))
        g = torch.where(b > 0, g, p.damping(p.eps) * t)
        return -p.eps * torch.exp((g - t) / p.eps)


def differentiate(
    caller: str, p: Problem, options: SinkhornOptions, sol: Solution, params: tuple
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """``(value, f, g, params)`` of a solve as ``options.backward`` says: the value (B,)
    differentiable in ``params`` = (x, y, a, b); f and g differentiable too for the
    implicit and unrolled gradients (detached for the envelope, whose ``params`` come back
    detached for the plan, and whose value refuses second derivatives)."""
    kind = options.backward_kind
    if kind == "envelope":
        value, f = dual_value(p, *params, sol.g, sol.kernel)
        return first_order_only(caller, value), f, sol.g, tuple(t.detach() for t in params)
    step = pair_step(p)
    if kind == "implicit":
        settings = options.backward if isinstance(options.backward, Implicit) else Implicit()
        x, y, a, b = params
        if x is y and a is b:  # a self term (a divergence's OT(a, a)): f = g
            step = symmetric_step(p)
            f = implicit(
                step, step(sol.f, x, a), (x, a), tol=settings.tol, max_iter=settings.max_iter
            )
            g = f
        else:
            f, g = implicit(
                step,
                step((sol.f, sol.g), *params),
                params,
                tol=settings.tol,
                max_iter=settings.max_iter,
            )
    else:  # unroll the iterations at the final eps, from the annealed warm start
        settings = options.backward if isinstance(options.backward, Unroll) else Unroll()
        x, y, a, b = (t.detach() for t in params)
        with torch.no_grad():
            warm = solve(dataclasses.replace(p, max_iter=len(p.schedule), tol=0.0), x, a, y, b)
        f, g = iterate(
            step,
            (warm.f, warm.g),
            max(1, sol.n_iter - len(p.schedule)),
            params,
            strategy=settings.strategy,
            memory=settings.memory,
        )
    # the kernel over this term's own clouds: a divergence's self terms OT(a, a), OT(b, b)
    # pass theirs (its weights' share of the gradient sums over them)
    x, y, a, b = (t.detach() for t in params)
    kernel = DenseKernel(p, x, a, y, b)
    if kind == "implicit":
        value = _EnvelopeValue.apply(lambda g, *ps: dual_value(p, *ps, g, kernel)[0], g, *params)
    else:
        value, _ = dual_value(p, *params, g, kernel)
    return value, f, g, params
