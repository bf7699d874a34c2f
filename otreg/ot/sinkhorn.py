"""The Sinkhorn loop: log and scaling forms, eps-scaling, balanced and unbalanced.

Entropic OT between measures a = sum_i a_i delta_{x_i} and b = sum_j b_j delta_{y_j}:

.. math::

    \\mathrm{OT}_\\varepsilon(a, b) = \\min_{\\pi \\ge 0} \\langle \\pi, C \\rangle
        + \\varepsilon \\mathrm{KL}(\\pi \\,|\\, a \\otimes b)
        + \\rho \\mathrm{KL}(\\pi 1 \\,|\\, a) + \\rho \\mathrm{KL}(\\pi^T 1 \\,|\\, b)

(the two marginal penalties are constraints when ``reach`` is None). Its dual is

.. math::

    \\max_{f, g}\\; F(f) + G(g) - \\varepsilon \\langle a \\otimes b,
        e^{(f \\oplus g - C)/\\varepsilon} - 1 \\rangle,

with F(f) = <a, f> (balanced) or <a, rho (1 - e^{-f/rho})> (unbalanced, rho = reach ** p).
The optimal plan is pi_ij = a_i b_j exp((f_i + g_j - C_ij)/eps). Coordinate ascent on the dual
is the Sinkhorn iteration, with the damping lambda = 1 / (1 + eps/rho) in the unbalanced case:

.. math::

    f_i \\leftarrow \\lambda\\, \\mathrm{softmin}_j(\\log b_j + g_j/\\varepsilon)
    \\qquad g_j \\leftarrow \\lambda\\, \\mathrm{softmin}_i(\\log a_i + f_i/\\varepsilon)

The loop runs without autograd. eps decreases from ``diameter ** p`` to ``blur ** p``
(one symmetric, averaged update per value, as in GeomLoss), then alternating updates continue
at the final eps until the marginal error is below ``tol``.

Gradients (envelope theorem): with g detached, f = lambda softmin(g) is recomputed by one
differentiable reduction and the dual objective evaluated at (f, g); its gradient is
sum_j pi_ij grad C(x_i, y_j) for the points and the partial derivatives for the weights.
No iteration is stored.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

import torch

from .. import reductions as R
from .._checks import (
    ConvergenceWarning,
    as_points,
    as_weights,
    check_choice,
    check_int,
    check_positive,
    check_same_device_dtype,
)
from ..costs import Cost, epsilon_schedule, get_cost
from ..costs import diameter as _diameter
from .convergence import Relaxation, StoppingRule, rounding_floor
from .multiscale import FIRST_MARGIN, REFRESH, auto_cluster_scale, use_multiscale
from .plan import TransportPlan

__all__ = ["sinkhorn", "SinkhornResult", "Relaxation", "StoppingRule", "FORMS", "BACKWARDS"]

FORMS = ("log", "scaling")
BACKWARDS = ("envelope", "implicit", "unroll")


@dataclass
class SinkhornResult:
    """What :func:`sinkhorn` returns.

    Attributes:
        f, g: dual potentials, ``(N,)`` and ``(M,)`` or ``(B, N)`` and ``(B, M)``, detached,
            in cost units.
        cost: the entropic OT value OT_eps(a, b), ``()`` or ``(B,)``, differentiable with
            respect to the points and weights (envelope theorem).
        n_iter: iterations run, the eps-scaling ones included.
        converged: whether the marginal error fell below ``tol``.
        stopped: why the loop at the final eps stopped
            (:class:`~otreg.ot.convergence.StoppingRule`): ``"tol"`` (converged),
            ``"stalled"`` (the error stopped decreasing: the dtype's rounding floor),
            ``"diverged"`` (a non-finite error) or ``"max_iter"``.
        marginal_error: relative L1 violation of the optimality (marginal) conditions, the
            largest over the batch; NaN when no iteration ran at the final eps (max_iter
            spent on the eps-scaling).
        eps: the final entropic regularisation ``blur ** p``.
        backend: the reduction backend that ran (``"auto"`` resolved), ``"multiscale"``
            when the multiscale solver's truncated reductions did (the plan's own reductions
            then use the dense backend ``auto`` picks).
        form: ``"log"`` or ``"scaling"``.
        plan: the lazy :class:`~otreg.ot.plan.TransportPlan`.
    """

    f: torch.Tensor
    g: torch.Tensor
    cost: torch.Tensor
    n_iter: int
    converged: bool
    marginal_error: float
    eps: float
    backend: str
    form: str
    stopped: str
    plan: TransportPlan = field(repr=False)


# ------------------------------------------------------------------ validated problem
@dataclass
class _Problem:
    """Validated, batched inputs and options shared by sinkhorn and sinkhorn_divergence."""

    x: torch.Tensor  # (B, N, D)
    y: torch.Tensor  # (B, M, D)
    a: torch.Tensor  # (B, N)
    b: torch.Tensor  # (B, M)
    batched: bool
    cost: Cost
    rho: float | None  # reach ** p
    schedule: list[float]
    form: str
    backend: str
    tol: float
    max_iter: int
    relaxation: float | str = "auto"
    multiscale: bool = False
    truncate: float = 5.0
    cluster_scale: float | None = None

    @property
    def eps(self) -> float:
        return self.schedule[-1]

    def damping(self, eps: float) -> float:
        return 1.0 if self.rho is None else 1.0 / (1.0 + eps / self.rho)


def _validate(fn: str, x, y, a, b, *, blur=0.05, reach=None, diameter=None, scaling=0.5,
              cost="sqeuclidean", form="log", backend="auto", tol=1e-4, max_iter=1000,
              backward="envelope", relaxation="auto", multiscale="auto", truncate=5.0,
              cluster_scale=None, **unknown) -> _Problem:
    """Check every input and option (defaults as in :func:`sinkhorn`); batch the inputs."""
    if unknown:
        raise TypeError(f"{fn}: unknown option(s) {', '.join(sorted(unknown))}; the options are "
                        "blur, reach, diameter, scaling, cost, form, backend, tol, max_iter, "
                        "backward, relaxation, multiscale, truncate, cluster_scale")
    x, bx = as_points(fn, "x", x)
    y, by = as_points(fn, "y", y)
    if bx != by:
        raise ValueError(f"{fn}: x has shape {tuple(x.shape[bx ^ 1:])} and y "
                         f"{tuple(y.shape[by ^ 1:])}; give both batched (B, N, D) or neither")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{fn}: x has batch size {x.shape[0]} but y has {y.shape[0]}; "
                         "a batch needs the same number of problems on both sides")
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"{fn}: x has points of dimension {x.shape[-1]} but y of dimension "
                         f"{y.shape[-1]}; both need the same D")
    check_same_device_dtype(fn, {"x": x, "y": y})
    a = as_weights(fn, "a", a, x, "x")
    b = as_weights(fn, "b", b, y, "y")
    cost_ = get_cost(cost, fn)
    blur = check_positive(fn, "blur", blur)
    rho = None
    if reach is not None:
        rho = check_positive(fn, "reach", reach) ** cost_.p
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or \
            not 0 < scaling < 1:
        raise ValueError(f"{fn}: scaling is {scaling}; it must be in (0, 1)")
    diam = _diameter(x, y) if diameter is None else check_positive(fn, "diameter", diameter)
    check_choice(fn, "form", form, FORMS)
    check_choice(fn, "backend", backend, R.BACKENDS)
    check_choice(fn, "backward", backward, BACKWARDS)
    tol = check_positive(fn, "tol", tol, allow_zero=True)
    max_iter = check_int(fn, "max_iter", max_iter, 1)
    if relaxation != "auto" and (isinstance(relaxation, bool) or not isinstance(
            relaxation, (int, float)) or not 1 <= relaxation < 2):
        raise ValueError(f"{fn}: relaxation is {relaxation!r}; it must be 'auto' or in [1, 2) "
                         "(1: plain Sinkhorn updates; 1.5-1.9 over-relaxes them)")
    schedule = epsilon_schedule(cost_.p, max(diam, blur), blur, scaling)
    if len(schedule) > max_iter:
        raise ValueError(f"{fn}: max_iter is {max_iter} but the eps-scaling schedule alone has "
                         f"{len(schedule)} steps (diameter {diam:.3g}, blur {blur:.3g}, scaling "
                         f"{scaling}); raise max_iter or lower scaling")
    if rho is None:
        ma, mb = a.detach().sum(1), b.detach().sum(1)
        rel = ((ma - mb).abs() / torch.maximum(ma, mb)).max()
        if float(rel) > 1e-5:
            raise ValueError(f"{fn}: a has total mass {ma.max().item():.6g} and b "
                             f"{mb.max().item():.6g}; balanced OT (reach=None) needs equal masses:"
                             " normalise the weights or set reach for unbalanced OT")
    truncate = check_positive(fn, "truncate", truncate)
    scale = None if cluster_scale is None else check_positive(fn, "cluster_scale", cluster_scale)
    use_ms = use_multiscale(fn, multiscale, x, y, cost_, form, backward, diam, blur, scale)
    if use_ms and scale is None:
        scale = auto_cluster_scale(diam, max(x.shape[1], y.shape[1]), x.shape[-1])
    return _Problem(x, y, a, b, bx, cost_, rho, schedule, form, backend, tol, max_iter,
                    relaxation if relaxation == "auto" else float(relaxation), use_ms, truncate,
                    scale)


# ------------------------------------------------------------------ the loop
def _softmin(p: _Problem, eps: float, x, y, w_log, pot) -> torch.Tensor:
    """-eps log sum_j w_j exp((pot_j - C(x_i, y_j))/eps) in the problem's form."""
    if p.form == "log":
        return R.softmin(x, y, w_log + pot / eps, eps, p.cost, p.backend)
    v = torch.exp(w_log + pot / eps).unsqueeze(-1)
    kv = R.kernel_product(x, y, v, eps, p.cost, p.backend).squeeze(-1)
    out = -eps * torch.log(kv)
    if not bool(torch.isfinite(out).all()):
        raise FloatingPointError(
            f"sinkhorn: form='scaling' under- or overflowed at eps={eps:.3g} (exp(-C/eps) "
            f"rounds to 0 in {x.dtype} for costs above about {87 * eps:.3g}); use form='log', "
            "which is stable at any eps, or a larger blur")
    return out


def _residual(p: _Problem, eps: float, w: torch.Tensor, pot: torch.Tensor,
              smin: torch.Tensor) -> torch.Tensor:
    """Relative L1 violation of the optimality condition of ``pot``, per batch, (B,).

    The plan's marginal on that side is w * exp((pot - smin)/eps); it must equal w
    (balanced) or w * exp(-pot/rho) (unbalanced).
    """
    target = 1.0 if p.rho is None else torch.exp(-pot / p.rho)
    err = (w * (torch.exp((pot - smin) / eps) - target).abs()).sum(1)
    return err / w.sum(1)


def _solve_pair(p: _Problem, x, y, a, b, init=None):
    """Potentials (f, g) for OT(a, b) between x and y, without autograd.

    ``init``: potentials (f, g) (B, N), (B, M) to start from at the final eps, skipping the
    annealing (a warm start from a nearby problem). Returns ``(f, g, n_iter, error, ms)``
    with ``ms`` the :class:`~otreg.ot.multiscale.MultiscaleProblem` when ``p.multiscale``
    (its final truncation pattern serves the gradient), else None.
    """
    ms = _multiscale(p, x, a, y, b)
    if ms is not None:  # the clouds sorted by cluster; results unsorted at the end
        a, b = ms.a[None], ms.b[None]

        def sm_xy(eps, pot):
            return ms.softmin_xy(b[0].log() + pot[0] / eps, eps)[None]

        def sm_yx(eps, pot):
            return ms.softmin_yx(a[0].log() + pot[0] / eps, eps)[None]
    else:
        a_log, b_log = a.log(), b.log()

        def sm_xy(eps, pot):
            return _softmin(p, eps, x, y, b_log, pot)

        def sm_yx(eps, pot):
            return _softmin(p, eps, y, x, a_log, pot)
    n_iter = 0
    if init is not None:
        f, g = init
        if ms is not None:
            f, g = (t[None] for t in ms.warm_start(f[0], g[0]))
            ms.update_pattern(f[0], g[0], p.eps, full=True)
    else:
        schedule = p.schedule
        if ms is not None:
            f, g, n_iter, n_coarse = ms.coarse_start()
            f, g, schedule = f[None], g[None], p.schedule[n_coarse:]
        else:
            eps0 = p.schedule[0]
            zeros_a, zeros_b = torch.zeros_like(a), torch.zeros_like(b)
            f = p.damping(eps0) * sm_xy(eps0, zeros_b)
            g = p.damping(eps0) * sm_yx(eps0, zeros_a)
        for k, eps in enumerate(schedule):  # annealing: symmetric, averaged updates
            if ms is not None:
                ms.update_pattern(f[0], g[0], eps, margin=FIRST_MARGIN * (k == 0), full=k == 0)
            lam = p.damping(eps)
            ft, gt = lam * sm_xy(eps, g), lam * sm_yx(eps, f)
            f, g = (f + ft) / 2, (g + gt) / 2
            n_iter += 1
    eps, lam = p.eps, p.damping(p.eps)
    relax, rule = Relaxation(p.relaxation), StoppingRule(p.tol)
    first = n_iter
    while n_iter < p.max_iter:  # alternating updates at the final eps (over-relaxed if w > 1)
        if ms is not None and n_iter > first and (n_iter - first) % REFRESH == 0:
            ms.update_pattern(f[0], g[0], eps)
        w = relax.w
        f_new = lam * sm_xy(eps, g)
        f = f_new if w == 1 else torch.lerp(f, f_new, w)
        sg = sm_yx(eps, f)
        err = float(_residual(p, eps, b, g, sg).max())
        g = lam * sg if w == 1 else torch.lerp(g, lam * sg, w)
        n_iter += 1
        if rule.stop(err, lambda f=f, g=g: rounding_floor(eps, f, g)):
            break
        relax.observe(err)
    if ms is not None:
        ms.finish(f[0], g[0], eps)
        f, g = ms.unsort_x(f[0])[None], ms.unsort_y(g[0])[None]
    return f, g, n_iter, rule, ms


def _solve_self(p: _Problem, x, a, init=None):
    """The symmetric potential f = f_aa of OT(a, a), without autograd (``init``: a warm
    start at the final eps, as in :func:`_solve_pair`). Returns ``(f, n_iter, rule, ms)``
    (``rule``: the :class:`~otreg.ot.convergence.StoppingRule` with the final error and why
    the loop stopped)."""
    ms = _multiscale(p, x, a)
    if ms is not None:
        a = ms.a[None]

        def sm(eps, pot):
            return ms.softmin_xy(a[0].log() + pot[0] / eps, eps)[None]
    else:
        a_log = a.log()

        def sm(eps, pot):
            return _softmin(p, eps, x, x, a_log, pot)
    n_iter = 0
    if init is not None:
        f = init
        if ms is not None:
            f = ms.warm_start(f[0], f[0])[0][None]
            ms.update_pattern(f[0], f[0], p.eps, full=True)
    else:
        schedule = p.schedule
        if ms is not None:
            f, _, n_iter, n_coarse = ms.coarse_start()
            f, schedule = f[None], p.schedule[n_coarse:]
        else:
            eps0 = p.schedule[0]
            f = p.damping(eps0) * sm(eps0, torch.zeros_like(a))
        for k, eps in enumerate(schedule):
            if ms is not None:
                ms.update_pattern(f[0], f[0], eps, margin=FIRST_MARGIN * (k == 0), full=k == 0)
            f = (f + p.damping(eps) * sm(eps, f)) / 2
            n_iter += 1
    eps, lam = p.eps, p.damping(p.eps)
    rule = StoppingRule(p.tol)
    first = n_iter
    while n_iter < p.max_iter:
        if ms is not None and n_iter > first and (n_iter - first) % REFRESH == 0:
            ms.update_pattern(f[0], f[0], eps)
        sf = sm(eps, f)
        err = float(_residual(p, eps, a, f, sf).max())
        f = (f + lam * sf) / 2
        n_iter += 1
        if rule.stop(err, lambda f=f: rounding_floor(eps, f)):
            break
    if ms is not None:
        ms.finish(f[0], f[0], eps)
        f = ms.unsort_x(f[0])[None]
    return f, n_iter, rule, ms


def _multiscale(p: _Problem, x, a, y=None, b=None):
    """A MultiscaleProblem for (x, a) against (y, b) (or itself), or None if not multiscale."""
    if not p.multiscale:
        return None
    from .multiscale import MultiscaleProblem

    return MultiscaleProblem(p, x[0], a[0], None if y is None else y[0],
                             None if b is None else b[0], p.cluster_scale, p.truncate)


def _dual_value(p: _Problem, x, y, a, b, g, ms=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The semi-dual objective at a fixed (detached) g: ``(value (B,), f (B, N) detached)``.

    f = lambda softmin(g) is the exact maximiser of the dual over f for this g, computed by one
    differentiable reduction that carries the dependence on x, y and b. By the envelope theorem
    the gradient of the value is that of OT_eps at convergence: sum_j pi_ij grad C(x_i, y_j)
    for the points, the potentials for the weights. Away from convergence it is the gradient
    for the plan whose rows have the right marginal, which is more accurate than evaluating
    the dual at both iterates. ``ms``: the multiscale problem whose final truncation pattern
    computes that reduction (the points are then sorted by cluster; the value is the same).
    """
    eps = p.eps
    if ms is not None:
        x, a, y, b = x[:, ms.cx.order], a[:, ms.cx.order], y[:, ms.cy.order], b[:, ms.cy.order]
        g = g[:, ms.cy.order]
        s = ms.softmin_xy(b[0].log() + g[0] / eps, eps, x[0], y[0])[None]
    else:
        s = _softmin(p, eps, x, y, b.log(), g)  # (B, N), carries the x, y and b dependence
    f = p.damping(eps) * s
    mass = (a * torch.exp((f - s) / eps)).sum(1)  # <a x b, exp((f + g - C)/eps)>
    if p.rho is None:
        value = (a * f).sum(1) + (b * g).sum(1)
    else:
        value = p.rho * ((a * -torch.expm1(-f / p.rho)).sum(1)
                         + (b * -torch.expm1(-g / p.rho)).sum(1))
    f = f.detach()
    if ms is not None:
        f = ms.unsort_x(f[0])[None]
    return value - eps * (mass - a.sum(1) * b.sum(1)), f


def _pair_step(p: _Problem):
    """One alternating Sinkhorn update at the final eps, as a map (f, g) -> (f, g).

    Balanced potentials are defined up to (f + c, g - c); the map fixes <a, f> = <b, g> so
    that its fixed point is isolated and the implicit system I - J^T is invertible.
    """
    eps, lam = p.eps, p.damping(p.eps)

    def step(state, x, y, a, b):
        f, g = state
        f = lam * _softmin(p, eps, x, y, b.log(), g)
        g = lam * _softmin(p, eps, y, x, a.log(), f)
        if p.rho is None:
            shift = ((a * f).sum(1) - (b * g).sum(1)) / (2 * a.sum(1))
            f, g = f - shift[:, None], g + shift[:, None]
        return f, g

    return step


def _warn_if_unconverged(fn: str, what: str, p: _Problem, n_iter: int,
                         rule: StoppingRule) -> bool:
    """Whether ``tol`` was reached; if not, a ConvergenceWarning that says why (none for
    ``tol=0``: a fixed iteration count was asked for)."""
    err = rule.error
    if err < p.tol:
        return True
    if p.tol == 0:
        return False
    head = f"{fn}: {what} stopped after {n_iter} iterations with marginal error {err:.3g}"
    if math.isnan(err):
        head = f"{fn}: {what} stopped after {n_iter} iterations"
        hint = ("the eps-scaling used all of max_iter, so the marginal error was not measured; "
                "raise max_iter")
    elif rule.reason == "stalled":
        hint = (f"it stopped decreasing {StoppingRule.PATIENCE} iterations before: the "
                f"rounding floor of {p.x.dtype} at eps={p.eps:.3g}. Use float64 points, a "
                f"tol above {err:.2g}, or a larger blur")
    elif rule.reason == "diverged":
        hint = (f"the iteration diverged at eps={p.eps:.3g} (relaxation={p.relaxation!r}): "
                "use relaxation='auto' or a smaller fixed weight")
    else:
        hint = (f"above tol={p.tol:g} at eps={p.eps:.3g}: raise max_iter, or relax tol (a "
                "larger blur converges faster)")
    warnings.warn(f"{head}; {hint}", ConvergenceWarning, stacklevel=3)
    return False


def _check_init(fn: str, init, p: _Problem):
    """Validate warm-start potentials (f, g); return them batched and detached, or None."""
    if init is None:
        return None
    if not (isinstance(init, (tuple, list)) and len(init) == 2):
        raise TypeError(f"{fn}: init must be a pair of potentials (f, g), got "
                        f"{type(init).__name__}")
    out = []
    for name, t, like in (("f", init[0], p.a), ("g", init[1], p.b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: init's {name} must be a tensor, got {type(t).__name__}")
        t = t.detach()
        t = t if p.batched else t.unsqueeze(0)
        if t.shape != like.shape:
            raise ValueError(f"{fn}: init's {name} has shape {tuple(t.shape[1 - p.batched:])}"
                             f" but the weights have {tuple(like.shape[1 - p.batched:])}")
        if t.dtype != like.dtype or t.device != like.device:
            raise TypeError(f"{fn}: init's {name} is {t.dtype} on {t.device} but the points "
                            f"are {like.dtype} on {like.device}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{fn}: init's {name} has NaN or infinite values")
        out.append(t)
    return tuple(out)


def _unbatch(t: torch.Tensor, batched: bool) -> torch.Tensor:
    return t if batched else t.squeeze(0)


def sinkhorn(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    blur: float = 0.05,
    reach: float | None = None,
    diameter: float | None = None,
    scaling: float = 0.5,
    cost: str = "sqeuclidean",
    form: str = "log",
    backend: str = "auto",
    tol: float = 1e-4,
    max_iter: int = 1000,
    backward: str = "envelope",
    strategy: str = "store",
    memory: int | str | None = None,
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
    relaxation: float | str = "auto",
    multiscale: bool | str = "auto",
    truncate: float = 5.0,
    cluster_scale: float | None = None,
) -> SinkhornResult:
    """Entropic optimal transport between two weighted point clouds.

    Args:
        x: source points, ``(N, D)`` or batched ``(B, N, D)``.
        y: target points, ``(M, D)`` or ``(B, M, D)``.
        a, b: non-negative weights ``(N,)``/``(M,)`` or ``(B, N)``/``(B, M)``; default
            uniform 1/N and 1/M. Balanced OT needs equal total masses.
        blur: the final length scale, in the points' units; eps = blur ** p.
        reach: unbalanced OT with KL marginal penalties of strength rho = reach ** p;
            ``None`` (default) for balanced OT.
        diameter: the largest distance, which starts the eps-scaling; default: the diagonal
            of the bounding box of both clouds.
        scaling: eps is multiplied by ``scaling ** p`` at each annealing step, in (0, 1).
        cost: ``"sqeuclidean"`` (|x - y|^2 / 2, p = 2) or ``"euclidean"`` (|x - y|, p = 1).
        form: ``"log"`` (log-sum-exp, stable at any eps) or ``"scaling"`` (u = a / K v, faster
            per iteration, but exp(-C/eps) underflows at small eps: it then raises
            ``FloatingPointError`` naming the log form rather than switching silently).
        backend: ``"auto"``, ``"keops"``, ``"tensorized"`` or ``"blocked"`` (see
            :mod:`otreg.reductions`).
        tol: stop when the relative L1 marginal error at the final eps is < tol (tol=0 runs
            exactly max_iter iterations).
        max_iter: the most iterations in all, the eps-scaling ones included.
        backward: how gradients are obtained. ``"envelope"`` (default): of ``cost`` only, by
            the envelope theorem, at the memory of one reduction; ``f``, ``g`` and ``plan``
            are detached. ``"implicit"``: ``f`` and ``g`` themselves are differentiable
            (implicit function theorem at the fixed point, solved matrix-free), and so are
            the plan's products, e.g. for a loss on the plan. ``"unroll"``: autograd through
            the iterations at the final eps (the annealing gives the warm start), run by
            :func:`otreg.loops.iterate` with ``strategy`` and ``memory``.
        strategy, memory: for ``backward="unroll"``: see :func:`otreg.loops.iterate`.
        init: potentials ``(f, g)`` of a nearby problem (e.g. ``(res.f, res.g)`` of the
            previous step of an optimisation), shaped like a and b: the solver starts from
            them at the final eps, without the eps-scaling (a warm start).
        relaxation: over-relaxation of the updates at the final eps,
            f <- (1 - w) f + w softmin(g) (Thibault et al. 2017; Lehmann et al. 2021): the
            same fixed point, reached in far fewer iterations when plain updates crawl
            (balanced OT at a blur much smaller than the data). ``"auto"`` (default): w
            starts at 1 and follows the measured convergence rate towards the optimal weight
            (:class:`~otreg.ot.convergence.Relaxation`); a number in [1, 2) fixes w (1: plain
            Sinkhorn).
        multiscale: solve coarse-to-fine with truncated kernels
            (:mod:`otreg.ot.multiscale`): the eps-scaling starts on grid clusters of side
            ``cluster_scale``, then each reduction sums only over the pairs of clusters
            that can matter. ``"auto"`` (default) turns it on for one problem (no batch)
            in 1 to 3 dimensions with the squared Euclidean cost, the log form, the
            envelope backward, N * M >= 1e8 and a blur below half the cluster scale;
            ``True`` requires it (``ValueError`` naming what does not fit), ``False``
            sums over every pair.
        truncate: the accuracy of the truncation: dropped terms change each softmin by at
            most eps * exp(-truncate), relative mass (default 5).
        cluster_scale: the side of the clusters, in the points' units; default
            ``diameter * max(N, M) ** (-1/3)``.

    Returns:
        :class:`SinkhornResult`. Warns :class:`~otreg.ConvergenceWarning` when ``tol`` is
        not reached; ``result.converged`` says it too.
    """
    p = _validate("sinkhorn", x, y, a, b, blur=blur, reach=reach, diameter=diameter,
                  scaling=scaling, cost=cost, form=form, backend=backend, tol=tol,
                  max_iter=max_iter, backward=backward, relaxation=relaxation,
                  multiscale=multiscale, truncate=truncate, cluster_scale=cluster_scale)
    if backward != "unroll" and (strategy != "store" or memory is not None):
        raise ValueError("sinkhorn: strategy and memory apply to backward='unroll' only, not "
                         f"backward={backward!r}")
    init = _check_init("sinkhorn", init, p)
    with torch.no_grad():
        f, g, n_iter, rule, ms = _solve_pair(p, p.x.detach(), p.y.detach(), p.a.detach(),
                                             p.b.detach(), init)
    converged = _warn_if_unconverged("sinkhorn", "the solver", p, n_iter, rule)
    params = (p.x, p.y, p.a, p.b)
    if backward == "envelope":
        value, f = _dual_value(p, *params, g, ms)
        params = tuple(t.detach() for t in params)
    else:
        from ..loops import iterate
        from ..loops.fixed_point import implicit

        step = _pair_step(p)
        if backward == "implicit":
            f, g = implicit(step, step((f, g), *params), params, tol=1e-10, max_iter=1000)
        else:  # unroll the iterations at the final eps, from the annealed warm start
            with torch.no_grad():
                warm = _solve_pair(dataclasses.replace(p, max_iter=len(p.schedule), tol=0.0),
                                   *(t.detach() for t in params))
            f, g = iterate(step, warm[:2], max(1, n_iter - len(p.schedule)), params,
                           strategy=strategy, memory=memory)
        value, _ = _dual_value(p, *params, g)
    backend_used = R.resolve_backend(p.backend, p.x.shape[0] * p.x.shape[1] * p.y.shape[1],
                                     p.x.device)
    plan = TransportPlan(*params, f, g, p.eps, p.cost, backend_used, p.batched)
    return SinkhornResult(
        f=_unbatch(f, p.batched), g=_unbatch(g, p.batched), cost=_unbatch(value, p.batched),
        n_iter=n_iter, converged=converged, marginal_error=rule.error, eps=p.eps,
        backend="multiscale" if p.multiscale else backend_used, form=p.form,
        stopped=rule.reason, plan=plan)
