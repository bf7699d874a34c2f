r"""The debiased Sinkhorn divergence and the ``SinkhornLoss`` module.

.. math::

    S_\varepsilon(a, b) = \mathrm{OT}_\varepsilon(a, b)
        - \tfrac12 \mathrm{OT}_\varepsilon(a, a) - \tfrac12 \mathrm{OT}_\varepsilon(b, b)
        + \tfrac{\varepsilon}{2} (m(a) - m(b))^2

is >= 0, 0 if and only if a = b, and tends to the unregularised OT cost as blur -> 0
(Feydy et al., AISTATS 2019; the mass term is that of Séjourné et al., 2019, for unbalanced
OT; it is 0 in the balanced case). Each term is the dual objective at its detached,
converged potentials, so gradients come from the envelope theorem, with no stored iteration.
Balanced clouds farther apart than their extent (squared Euclidean cost) are solved each
centred on its own mean, which is exact (:func:`_apart`) and keeps float32 costs small.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import reductions
from .._info import sharing_cores
from ..costs import diameter as bounding_diameter
from ._uncompiled import outside_compiled_graphs
from .gradient import differentiate, dual_value, first_order_only
from .large_blur import check_range, closed_form_applies
from .loop import closed_form_solution, solve
from .problem import (
    KEYWORD_DEFAULTS,
    KeywordDefault,
    Problem,
    SinkhornOptions,
    no_autocast,
    resolve_options,
    warn_default_blur,
)
from .result import SinkhornResult, make_result, report_convergence, unbatch

__all__ = ["sinkhorn_divergence", "SinkhornLoss"]

#: A balanced squared-Euclidean problem whose clouds' means lie more than this many times
#: the centred clouds' extent apart is solved on the centred clouds (:func:`_apart`)
APART = 1.0
#: after a warm start that did not converge within the last cold solve's iterations, this
#: many calls solve from scratch before the next try
WARM_BACKOFF = 4


def _fits(t, like) -> bool:
    return (
        t is not None
        and t.shape == like.shape
        and t.dtype == like.dtype
        and t.device == like.device
    )


def divergence(
    caller: str,
    x,
    y,
    a,
    b,
    options: SinkhornOptions,
    *,
    debias: bool = True,
    warm: dict | None = None,
    default_blur: bool = False,
) -> tuple[torch.Tensor, SinkhornResult]:
    """``(value, result)``: the debiased divergence (or the plain OT cost when ``debias`` is
    False), ``()`` or ``(B,)``, and the :class:`~otreg.ot.result.SinkhornResult` of the
    cross term OT(a, b), whose ``converged`` covers every term. Errors name ``caller``.

    ``warm``: a dict of the potentials of a previous call (``f``, ``g``, ``f_aa``, ``g_bb``),
    used as warm starts where their shapes fit (skipping the eps-scaling) and updated.
    ``default_blur``: the caller did not choose the blur (a warning when the data span
    more than :data:`~otreg.ot.problem.DEFAULT_BLUR_SPAN` times it, as brain surfaces in
    mm do). Half precision inputs (an autocast model's) are computed in float32, with
    autocast off, and the value returned in their dtype.
    """
    if options.backward_kind == "unroll":
        raise ValueError(
            f"{caller}: backward is {options.backward!r}; the divergence's gradient is "
            "exact with 'envelope', and 'implicit' also gives its second derivatives. "
            "For unrolled iterations use otreg.sinkhorn(..., backward=otreg.Unroll(...))"
        )
    p = Problem.build(caller, x, y, a, b, options)
    with no_autocast(p.x.device), sharing_cores(p.x.device):
        frame = _apart(caller, p, options)
        q = p if frame is None else frame[0]
        value, result = _divergence(caller, q, options, debias, warm, default_blur, frame)
    return value.to(p.out_dtype), result


def _apart(caller: str, p: Problem, options: SinkhornOptions):
    """``(problem, origin, shift)`` for a balanced squared-Euclidean problem whose clouds'
    means lie more than :data:`APART` times the centred clouds' extent apart, else None:
    the problem on the clouds each centred on its own mean, ``origin`` the problem as given
    and ``shift`` (B, D) the difference of the means, differentiable.

    With C = |x - y|^2 / 2, x = x' + m_x and y = y' + m_y: C = |x' - y'|^2 / 2 +
    <x' - y', shift> + |shift|^2 / 2, and a plan with marginals a and b sums the middle term
    to 0 (each cloud centred on its own weights), so OT(a, b) = OT'(a, b) + m |shift|^2 / 2
    (m the mass) exactly; the self terms do not change. Far apart, the costs themselves are
    large: float32 rounded them by more than eps (clouds of 1,000 Gaussian points 1,000
    units apart, blur 0.05: the gradient less its mean 63% off)."""
    if p.rho is not None or p.cost.name != "sqeuclidean" or closed_form_applies(p):
        return None
    mass = p.a.sum(1, keepdim=True)  # (B, 1), b's too
    mx = (p.a[..., None] * p.x).sum(1) / mass
    my = (p.b[..., None] * p.y).sum(1) / mass
    xc, yc = p.x - mx[:, None], p.y - my[:, None]
    shift = mx - my
    if float(shift.detach().norm(dim=1).max()) <= APART * bounding_diameter(xc, yc):
        return None
    one = (lambda t: t) if p.batched else (lambda t: t[0])
    q = Problem.build(caller, one(xc), one(yc), one(p.a), one(p.b), options)
    if closed_form_applies(q):  # (the expansion in 1 / eps is exact to translations)
        return None
    return dataclasses.replace(q, out_dtype=p.out_dtype), p, shift


def _divergence(
    caller: str,
    p: Problem,
    options: SinkhornOptions,
    debias: bool,
    warm,
    default_blur: bool,
    frame: tuple | None = None,
) -> tuple[torch.Tensor, SinkhornResult]:
    """:func:`divergence` once its problem is built; ``frame`` that of :func:`_apart`."""
    if default_blur:
        warn_default_blur(caller, p)
    xd, yd, ad, bd = p.x.detach(), p.y.detach(), p.a.detach(), p.b.detach()
    check_range(caller, p)
    if closed_form_applies(p):  # blur far above the data (large_blur.py)
        value, xy = closed_form_solution(p, debias)
        result = make_result(p, (xd, yd, ad, bd), xy.f, xy.g, value, xy, True, ([], []))
        return unbatch(value, p.batched), result
    w = {} if warm is None else warm

    def solve_warm(term: str, f_name: str, g_name: str, *clouds):
        """Solve from the potentials of the previous call where they fit, within as many
        iterations as the last solve from scratch took, else (or if that does not converge)
        from scratch, which the next ``WARM_BACKOFF`` calls then do directly: a warm start
        far from the new solution can crawl (a model trained by Adam: 900 to 2,000
        iterations where the annealing needed 260 to 1,300)."""
        f0, g0 = w.get(f_name), w.get(g_name)
        skip = w.get(f"skip_{term}", 0)
        w[f"skip_{term}"] = max(0, skip - 1)
        fits = _fits(f0, clouds[1]) and _fits(g0, clouds[-1])  # the weights a (and b)
        if fits and f"n_{term}" in w and not skip:
            budget = dataclasses.replace(p, max_iter=w[f"n_{term}"])
            sol = solve(budget, *clouds, init=(f0, g0))
            if sol.rule.converged:
                return sol
            w[f"skip_{term}"] = WARM_BACKOFF
        sol = solve(p, *clouds)
        w[f"n_{term}"] = sol.n_iter
        return sol

    with torch.no_grad():
        with reductions.track() as solved:
            xy = solve_warm("xy", "f", "g", xd, ad, yd, bd)
        if debias:
            aa = solve_warm("aa", "f_aa", "f_aa", xd, ad)
            bb = solve_warm("bb", "g_bb", "g_bb", yd, bd)
            w.update(f_aa=aa.f, g_bb=bb.f)
        w.update(g=xy.g)
    implicit = options.backward_kind == "implicit"

    def term(sol, x, y, a, b) -> tuple[torch.Tensor, torch.Tensor]:
        """One OT term, differentiable in (x, y, a, b), and its potential f."""
        if implicit:  # potentials that follow the points (second derivatives too)
            value, f, _, _ = differentiate(caller, p, options, sol, (x, y, a, b))
            return value, f.detach()
        return dual_value(p, x, y, a, b, sol.g, sol.kernel)

    with reductions.track() as differentiated:
        cross, f = term(xy, p.x, p.y, p.a, p.b)
    w["f"] = f
    value = cross
    converged = report_convergence(caller, "OT(a, b)", p, xy.n_iter, xy.rule)
    if debias:
        value = value - 0.5 * (term(aa, p.x, p.x, p.a, p.a)[0] + term(bb, p.y, p.y, p.b, p.b)[0])
        value = value + p.eps / 2 * (p.a.sum(1) - p.b.sum(1)) ** 2
        converged &= report_convergence(caller, "OT(a, a)", p, aa.n_iter, aa.rule)
        converged &= report_convergence(caller, "OT(b, b)", p, bb.n_iter, bb.rule)
    ran = (solved, differentiated)
    if frame is not None:  # back to the clouds as given: the potentials gain linear terms
        _, origin, shift = frame
        lift = origin.a.sum(1) * (shift * shift).sum(1) / 2
        value, cross = value + lift, cross + lift
        s = shift.detach()
        quarter = (s * s).sum(1, keepdim=True) / 4
        f = f + (xd * s[:, None]).sum(-1) + quarter
        g = xy.g - (yd * s[:, None]).sum(-1) + quarter
        p = origin
        xd, yd, ad, bd = p.x.detach(), p.y.detach(), p.a.detach(), p.b.detach()
    else:
        g = xy.g
    if not implicit:
        value = first_order_only(caller, value)
    result = make_result(p, (xd, yd, ad, bd), f, g, cross, xy, converged, ran)
    return unbatch(value, p.batched), result


@outside_compiled_graphs  # (a model compiled around it runs it as it is: see SinkhornLoss)
def sinkhorn_divergence(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    options: SinkhornOptions | None = None,
    **changes,
) -> torch.Tensor:
    """The debiased Sinkhorn divergence S_eps(a, b) >= 0 between two weighted point clouds
    (up to the solves' tolerance and rounding: two identical clouds of 200 Gaussian points
    at blur 0.3 gave -6e-8 at the default ``tol``, in float32 and in float64, and -1e-14 at
    ``tol=1e-9`` in float64).

    Args:
        x: source points, ``(N, D)`` or batched ``(B, N, D)``.
        y: target points, ``(M, D)`` or ``(B, M, D)``.
        a: source weights ``(N,)`` or ``(B, N)``, non-negative; default uniform 1/N.
        b: target weights ``(M,)`` or ``(B, M)``; default uniform 1/M.
        options: a :class:`~otreg.ot.problem.SinkhornOptions` (default: its defaults, those
            of :func:`otreg.sinkhorn`).
        **changes: options to change, by name (blur, reach, diameter, scaling, cost, form,
            backend, tol, max_iter, relaxation, backward, multiscale).

    Returns:
        ``()`` or ``(B,)``, in cost units (mm^2 / 2 for points in mm and the default cost),
        differentiable with respect to the points and the weights.

    Example:
        >>> import torch, otreg
        >>> x = torch.rand(100, 3, requires_grad=True)
        >>> d = otreg.sinkhorn_divergence(x, torch.rand(120, 3) + 1.0, blur=0.05)
        >>> d.backward()   # mm^2 if the points are in mm; zero for identical clouds
        >>> float(d) > 0, tuple(x.grad.shape)
        (True, (100, 3))
    """
    caller = "sinkhorn_divergence"
    default_blur = _blur_left_default(options, changes)
    options = resolve_options(caller, options, **changes)
    return divergence(caller, x, y, a, b, options, default_blur=default_blur)[0]


def _blur_left_default(options, changes: dict) -> bool:
    """Whether the caller left the blur at its default (neither given nor in ``options``)."""
    if "blur" in changes:
        return False
    return options is None or (
        isinstance(options, SinkhornOptions) and options.blur == SinkhornOptions.blur
    )


class SinkhornLoss(nn.Module):
    """OT between point clouds as a differentiable loss.

    ``loss(x, y)`` or ``loss(a, x, b, y)`` returns the debiased Sinkhorn divergence
    (``debias=True``) or the entropic OT cost OT_eps(a, b) (``debias=False``), ``()`` or
    ``(B,)``. The :class:`~otreg.ot.result.SinkhornResult` of the last call's OT(a, b)
    solve (iterations, convergence, backend, plan; with ``debias=True`` not the divergence:
    its ``cost`` is OT_eps(a, b)) is kept in ``loss.last_result``. Note the order of the
    arguments, GeomLoss's: weights before their points (``otreg.sinkhorn(x, y, a, b)``
    takes the points first).

    The gradient is the envelope theorem's, exact at the converged potentials: it is as
    accurate as the solve (``tol``, 1e-3 on the marginals by default). A float64
    ``torch.autograd.gradcheck`` compares it with finite differences of the value, so give
    the loss ``tol=1e-12`` there (on 5 x 6 random points at blur 0.5 the default ``tol``
    leaves the gradient about 1e-5 off, and gradcheck failed on 1 of 20 draws). Balanced
    OT (no ``reach``) is defined for weights of equal sums, so the weights' gradient holds
    along changes that keep each sum (it is known up to a constant): check it through a
    map that keeps the sum (a softmax), not one weight at a time, as gradcheck moves them.
    In a model compiled with ``torch.compile`` the loss runs as it is, outside the graph
    (``torch.compiler.disable``: the graph breaks there, and ``fullgraph=True`` refuses
    it); tracing its converging loop would recompile at each call. Where the
    clouds nearly coincide (late in a fit) the divergence and its gradient are small
    differences of its three terms': their error relative to themselves grows as they
    shrink, while the absolute error stays the terms' (on 200 Gaussian points 1e-3 from
    their target at blur 0.5, float64, the gradient was 60% off at the default ``tol`` and
    0.3% at ``tol=1e-6``); a smaller ``tol`` bounds it.

    Args:
        blur: the final length scale, in the points' units (eps = blur ** p). The default,
            0.05, suits clouds about one unit across (standard normal clouds of thousands
            of points span 10 or more); for brain surfaces in mm give 1 to 5 (mm): a
            default blur below a hundredth of the data's span warns.
        reach: as in :func:`otreg.sinkhorn`.
        debias: subtract the self-transport terms (a divergence: 0 for equal inputs).
        warm_start: start each call's solves from the previous call's potentials (when the
            sizes match), at the final eps without the eps-scaling. In an optimisation loop
            the points move little between calls and fewer iterations reach ``tol`` (86 -> 46
            in the user guide's example). A warm solve not converged within the iterations
            of the last solve from scratch is dropped and solved from scratch, as are the
            next ``WARM_BACKOFF`` (4) calls: where the points move far between calls the
            warm start does not pay, and then costs little. Call :meth:`reset` when the
            problem changes.
        options: a :class:`~otreg.ot.problem.SinkhornOptions`; ``blur`` (unless None),
            ``reach`` and ``**changes`` given here replace its values (``reach=None``
            makes it balanced).
        **changes: the other options of :func:`otreg.sinkhorn`, by name.

    Example:
        >>> import torch, otreg
        >>> loss = otreg.SinkhornLoss(blur=0.05)
        >>> x = torch.rand(100, 3, requires_grad=True)
        >>> loss(x, torch.rand(80, 3)).backward()
        >>> tuple(x.grad.shape)
        (100, 3)
    """

    def __new__(cls, *args, **kwargs):
        """Refuse a loss name where the blur goes (GeomLoss's SamplesLoss("sinkhorn", p=2,
        blur=b)) before Python's bare "got multiple values for argument 'blur'"."""
        if args and isinstance(args[0], str):
            raise TypeError(
                f"SinkhornLoss: got the loss name {args[0]!r} where the blur goes; give no "
                "loss name (GeomLoss's SamplesLoss('sinkhorn', p=2, blur=b) is "
                "otreg.SinkhornLoss(blur=b))"
            )
        return super().__new__(cls)

    def __init__(
        self,
        blur: float | None = None,
        reach: float | None = KEYWORD_DEFAULTS["reach"],
        debias: bool = True,
        warm_start: bool = False,
        options: SinkhornOptions | None = None,
        **changes,
    ) -> None:
        super().__init__()
        caller = "SinkhornLoss"
        if not isinstance(debias, bool):
            raise TypeError(f"{caller}: debias must be True or False, got {debias!r}")
        if not isinstance(warm_start, bool):
            raise TypeError(f"{caller}: warm_start must be True or False, got {warm_start!r}")
        # flagged (once) when the data span far more than the default blur
        self._default_blur = blur is None and _blur_left_default(options, changes)
        if blur is not None:
            changes["blur"] = blur
        if not isinstance(reach, KeywordDefault):  # given, even None: it replaces options'
            changes["reach"] = reach
        self.options = resolve_options(caller, options, **changes)
        self.debias, self.warm_start = debias, warm_start
        self._warm: dict = {}
        self.last_result: SinkhornResult | None = None

    def extra_repr(self) -> str:
        """The options that differ from the defaults (the blur always)."""
        changed = {
            f.name: getattr(self.options, f.name)
            for f in dataclasses.fields(self.options)
            if f.name == "blur" or getattr(self.options, f.name) != f.default
        }
        opts = "".join(f"{k}={v!r}, " for k, v in changed.items())
        return f"{opts}debias={self.debias}, warm_start={self.warm_start}"

    def reset(self) -> None:
        """Forget the potentials kept for warm starts and the last call's result."""
        self._warm = {}
        self.last_result = None

    def __getstate__(self) -> dict:
        """A copy or a pickle leaves out ``last_result``: a diagnostic of the last call,
        whose cost and plan belong to that call's autograd graph (``copy.deepcopy`` of a
        model holding the loss refused them, and pickles carried the clouds)."""
        state = dict(super().__getstate__())
        state["last_result"] = None
        return state

    # torch.compile: a compiled model runs the loss as it is (a graph break), since tracing a
    # converging loop recompiled 54 times and took 113 s for one call of 200 points
    @outside_compiled_graphs
    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        """``loss(x, y)`` or ``loss(a, x, b, y)``: the divergence (or OT cost), ``()`` or
        ``(B,)``."""
        if len(args) == 2:
            (x, y), a, b = args, None, None
        elif len(args) == 4:
            a, x, b, y = args
            if (
                all(isinstance(t, torch.Tensor) for t in args)
                and args[0].dim() == args[1].dim() + 1
            ):
                raise TypeError(
                    f"SinkhornLoss: loss(a, x, b, y) takes each cloud's weights before its "
                    f"points; got shapes {', '.join(str(tuple(t.shape)) for t in args)}, which "
                    "look like loss(x, a, y, b)"
                )
        else:
            raise TypeError(
                f"SinkhornLoss: call it as loss(x, y) or loss(a, x, b, y), got "
                f"{len(args)} arguments"
            )
        warm = self._warm if self.warm_start else None
        value, self.last_result = divergence(
            "SinkhornLoss",
            x,
            y,
            a,
            b,
            self.options,
            debias=self.debias,
            warm=warm,
            default_blur=self._default_blur,
        )
        self._default_blur = False
        return value
