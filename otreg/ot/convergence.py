"""When the Sinkhorn loop at the final eps changes its step and when it stops.

:class:`Accuracy` is the stopping criterion a caller can ask for instead of a marginal
error; :class:`Anderson` extrapolates the updates from the last few (the default);
:class:`Relaxation` adapts the over-relaxation weight of the updates to the measured
convergence rate; :class:`StoppingRule` decides when the loop ends and says why. They see
only the updates and the sequence of marginal errors (and, for a stall, the potentials'
rounding floor).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._checks import check_int, check_positive

__all__ = ["Accuracy"]


@dataclass(frozen=True)
class Accuracy:
    r"""``tol=Accuracy(...)``: stop the updates at the final eps once the OT value and its
    gradient are accurate enough, rather than on the marginal error.

    Every ``every`` iterations the loop evaluates, at its current potential g, what the
    caller will get: the dual value V and the envelope gradient G (with respect to both
    clouds, one differentiable reduction). With d_k the relative change of G between two
    checks and q the largest ratio d_k / d_(k-1) over the last four changes (the
    contraction per check), the error left is estimated by the geometric tail

    .. math::

        e_k = d_k \, q / (1 - q),

    exact for a loop that converges linearly at a steady rate (plain or over-relaxed
    Sinkhorn near its fixed point), and the same for V. The loop stops when both estimates
    are below the tolerances (at the fifth check at the earliest). It is an estimate, not a
    bound: the tests check it against converged float64 solutions, with which the errors
    agreed within a factor of 3. Each check costs about two reductions; the stall,
    divergence and ``max_iter`` rules still apply, and the marginal error is still reported.

    Args:
        value: relative error of the OT value (relative to the larger of its size and
            eps times the total mass: a value near 0 is compared on the entropic scale).
        gradient: relative error of the gradient (its L2 norm over both clouds, relative
            to the gradient's norm) of each OT term. A Sinkhorn divergence subtracts two
            symmetric terms from the cross one: where they nearly cancel (clouds almost
            equal) its own gradient's relative error is larger.
        every: iterations between checks.

    Example:
        >>> import torch, otreg
        >>> x, y = torch.rand(300, 3), torch.rand(300, 3)
        >>> res = otreg.sinkhorn(x, y, blur=0.05, tol=otreg.Accuracy(gradient=1e-3))
        >>> res.converged, res.estimated_error["gradient"] < 1e-3
        (True, True)
    """

    value: float = 1e-4
    gradient: float = 1e-3
    every: int = 10

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", check_positive("Accuracy", "value", self.value))
        object.__setattr__(self, "gradient", check_positive("Accuracy", "gradient", self.gradient))
        object.__setattr__(self, "every", check_int("Accuracy", "every", self.every, 1))


class Anderson:
    """Anderson mixing of the Sinkhorn updates at the final eps (Anderson 1965; Walker and
    Ni 2011): the next potential is the combination of the last ``MEMORY`` (24) updates whose
    residuals (update minus input) cancel best in the least-squares sense, a Krylov-like
    extrapolation of the fixed-point map g -> G(g) (one f- and one g-update). Measured on
    two noisy spheres at blur 0.01 it reaches tol 1e-3 in 2 to 3 times fewer iterations
    than the adaptive over-relaxation (docs/guide/ot.md; 8 updates did as well there but
    converged slowly near a tight tol at blur 0.02 on 2,000 points: 686 iterations against 279
    with 24 and 328 for the over-relaxation). The residuals are weighted by
    sqrt(b) / eps, so that the least-squares norm is the marginal error's to first order,
    and the small (MEMORY x MEMORY) system is solved in float64 with a tiny Tikhonov term.

    Safeguard: when the marginal error after an extrapolated step is more than
    ``RESET_FACTOR`` times the best so far, the history is dropped and the next step is the
    plain update from the best point; after ``MAX_RESETS`` resets the mixing gives up
    (``failed``) and the loop goes on from there with the adaptive over-relaxation, which
    the result's ``acceleration`` then says.
    """

    MEMORY = 24
    #: the history (2 m + 2 float64 vectors of length M a problem) stays within this: fewer
    #: than ``MEMORY`` updates are mixed above about 160,000 points (at least ``MIN_MEMORY``)
    HISTORY_BYTES = 64 * 2**20
    MIN_MEMORY = 4
    RESET_FACTOR = 2.0
    MAX_RESETS = 5
    RIDGE = 1e-10

    def __init__(self, b: torch.Tensor, eps: float) -> None:
        self.scale = b.detach().double().clamp_min(0).sqrt() / eps  # (B, M)
        fits = self.HISTORY_BYTES // (16 * b.numel()) - 1
        self.memory = m = int(max(self.MIN_MEMORY, min(self.MEMORY, fits)))
        B, M = b.shape
        # differences of successive residuals and updates, a ring of m columns, and the
        # residual differences' Gram matrix, updated a column at a time (O(M m) a step)
        self._dr = b.new_zeros((B, M, m), dtype=torch.float64)
        self._du = torch.zeros_like(self._dr)
        self._gram = b.new_zeros((B, m, m), dtype=torch.float64)
        self._eye = torch.eye(m, dtype=torch.float64, device=b.device)
        self.filled, self._pos = 0, 0
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self.best = math.inf
        self._best_update: torch.Tensor | None = None  # the plain update at the best point
        self.resets = 0
        self.failed = False

    def _forget(self) -> None:
        self.filled, self._pos, self._last = 0, 0, None

    def step(self, g: torch.Tensor, update: torch.Tensor, err: float) -> torch.Tensor:
        """The next potential, from the input ``g`` (B, M), its plain update G(g) and the
        marginal error measured at g."""
        if not math.isfinite(err) or err > self.RESET_FACTOR * self.best:
            self._forget()
            self.resets += 1
            self.failed = self.resets > self.MAX_RESETS
            # start again from the best point so far
            return update if self._best_update is None else self._best_update
        if err <= self.best:
            self.best, self._best_update = err, update
        u, r = update.double(), (update - g).double() * self.scale
        last, self._last = self._last, (u, r)
        if last is None:
            return update
        k = self._pos
        self._dr[:, :, k] = r - last[1]
        self._du[:, :, k] = u - last[0]
        row = torch.einsum("bm,bmk->bk", self._dr[:, :, k], self._dr)
        self._gram[:, k, :] = row
        self._gram[:, :, k] = row
        self.filled, self._pos = min(self.filled + 1, self.memory), (k + 1) % self.memory
        n = self.filled
        dr, du, gram = self._dr[:, :, :n], self._du[:, :, :n], self._gram[:, :n, :n]
        ridge = self.RIDGE * gram.diagonal(dim1=1, dim2=2).sum(-1).clamp_min(1e-300)
        gamma, info = torch.linalg.solve_ex(
            gram + ridge[:, None, None] * self._eye[:n, :n],
            torch.einsum("bmk,bm->bk", dr, r)[..., None],
        )
        # points without mass are fixed by no marginal: they keep the plain update (an
        # extrapolated value there would overflow the marginals' exp for nothing)
        out = torch.where(self.scale > 0, u - (du @ gamma)[..., 0], u)
        if bool(info.any() | ~torch.isfinite(out).all()):  # (one wait for a GPU, not two)
            self._forget()
            return update
        return out.to(update.dtype)


class Relaxation:
    """The over-relaxation weight w of the updates at the final eps: fixed, or adapted.

    With ``"auto"``, w starts at 1 (plain Sinkhorn) and follows the observed contraction
    rate of the marginal error, as adaptive SOR does (Hageman and Young, *Applied Iterative
    Methods*, 1981, ch. 9): after ``SETTLE`` iterations at a new w (its transient), the
    error shrinks by a rate r a step over the next ``WINDOW``; the plain iteration's rate
    theta is then (r + w - 1)^2 / (r w^2) (theta = r at w = 1), and the weight that
    minimises the rate is w* = 2 / (1 + sqrt(1 - theta)) (Thibault et al. 2017, Lehmann et
    al. 2021, for Sinkhorn's two alternating half-steps). w only increases, to at most
    ``W_MAX``; at w > w* the rate is w - 1 and the estimate returns w itself, so w settles.
    If the error has not gone below its value at the last change after ``3 * WINDOW``
    iterations, w is pulled halfway back to 1.
    """

    SETTLE = 5
    WINDOW = 10
    W_MAX = 1.95
    MIN_STEP = 0.02

    def __init__(self, setting: float | str) -> None:
        self.auto = setting == "auto"
        self.w = 1.0 if self.auto else float(setting)
        self.w_max = self.W_MAX
        self.backed_off = 0
        self._errors: list[float] = []

    def back_off(self) -> None:
        """After an update that overflowed: w halfway back to 1, and never above that again
        (the loop goes back to its best potentials)."""
        self.backed_off += 1
        self.w_max = 1 + (self.w - 1) / 2 if self.w > 1.02 else 1.0
        self._set(self.w_max)
        self._errors = []

    def _set(self, w: float) -> None:
        self.w, self._errors = w, self._errors[-1:]

    def observe(self, err: float) -> None:
        """Take the marginal error after an update made with the current ``w``."""
        if not self.auto or not math.isfinite(err) or err <= 0:
            return
        e = self._errors
        e.append(err)
        if len(e) > 3 * self.WINDOW and min(e[-self.WINDOW :]) >= e[0] and self.w > 1:
            self._set(1 + (self.w - 1) / 2)  # no progress at this w: back off
            return
        if len(e) <= self.SETTLE + self.WINDOW or e[-1] >= e[-1 - self.WINDOW]:
            return
        r, w = (e[-1] / e[-1 - self.WINDOW]) ** (1 / self.WINDOW), self.w
        theta = min((r + w - 1) ** 2 / (r * w * w), 1.0)
        best = min(self.w_max, 2 / (1 + math.sqrt(1 - theta)))
        if best >= w + self.MIN_STEP:
            self._set(best)


#: a relative marginal error above this stops the loop as a non-finite one does
#: ("diverged"): the plan's mass is then a million times the data's, no step towards a
#: solution. The alternating updates keep the error below 2 (balanced) from any start;
#: errors of 1e34 to 1e83 came from float32 costs at an eps far below their rounding
#: (2,000 Gaussian points, blur 1e-4: eps 1e-8, costs up to 20 rounded by about 1e-6),
#: where the multiscale kernel's marginals, summed in float64, stayed finite and the loop
#: ran all 2,000 iterations (93 s) to warn "raise max_iter" (in float64 its error starts
#: at 0.6)
DIVERGED = 1e6


def diverged(err: float) -> bool:
    """Whether a marginal error says the updates diverged (:data:`DIVERGED`)."""
    return not math.isfinite(err) or err > DIVERGED


class StoppingRule:
    """When the alternating updates at the final eps stop.

    ``"tol"``: converged: the marginal error is below ``tol`` (a number) and, where the loop
    passes ``tails``, the marginal error weighed in the gradient is below ``TAIL_FACTOR``
    times ``tol`` (:func:`otreg.ot.loop.gradient_weighted_error`, checked at most every
    ``TAIL_EVERY`` updates once the marginal error is below ``tol``); or, with
    ``tol=Accuracy(...)``, the value's and the gradient's estimated errors are below its
    tolerances (:class:`Accuracy`; the loop passes a ``probe`` that
    evaluates them). ``"stalled"``: the error is
    within ``FLOOR`` times its rounding floor and has not reached a new low (by 1%) for
    ``patience`` iterations (``PATIENCE``; fewer where the loop then goes on in float64,
    :func:`otreg.ot.loop._in_float64`): further iterations would change nothing. The floor
    is u (max|f, g| + s) / eps (:func:`rounding_floor`, u the dtype's machine epsilon, s the
    size of the terms of the cost's formula): the rounding of the potentials and of the
    scores, seen through exp(f / eps) in the plan's marginals. In float32 at small eps it
    can be above ``tol``: on two noisy spheres at blur 0.02 the error hovers at 1.9e-4,
    where float64 converges to 1e-4 in 284 iterations. The estimate is rough, hence the
    factor and the patience: an error that oscillates while it converges
    (over-relaxed, or with the multiscale solver's changing truncation) sets a new low
    every few dozen iterations. ``"diverged"``: the error is not finite or above
    :data:`DIVERGED` (a fixed relaxation weight too large far from the solution; float32
    at an eps far below the costs' rounding). ``"max_iter"``: the budget ran out.
    With ``tol = 0`` only ``max_iter`` stops the loop (a fixed iteration count).
    """

    PATIENCE = 100
    PROGRESS = 0.99
    RATE_WINDOW = 20
    #: the L1 marginal error weighs each point by its mass, so a few far points that carry
    #: the gradient (heavy tails) can be far from their marginal when it is below tol: the
    #: same error weighed by each point's share of the gradient must be below TAIL_FACTOR
    #: times tol too. Measured (every pair, float64, N = 3,000, ``tol`` 1e-3): on spheres,
    #: Gaussian clouds and clusters it was 1.0 to 1.4 times the marginal error (never
    #: binding); on Student-t clouds (3 degrees of freedom) 17 times, with the gradient 1.4e-2
    #: off; stopping at 2e-3 there gave 1.4e-3. At 5e-3, on float32 Student-t clouds of 300
    #: and 5,000 points, the gradient was 2.6e-3 to 3.2e-3 off (within the 6e-4 to 1e-2 that
    #: tol 1e-3 gives on the other clouds), for 5 to 35% fewer updates than at 2e-3 at 5,000
    #: points (docs/benchmarks.md)
    TAIL_FACTOR = 5.0
    TAIL_EVERY = 5
    FLOOR = 10.0
    #: an Accuracy's estimate uses the ratios of the last WINDOW changes (WINDOW + 1 checks)
    WINDOW = 4
    #: ... or changes below NOISE times the dtype's machine epsilon (relative) are rounding
    NOISE = 100
    NOISE_MARGIN = 1e-3

    def __init__(
        self,
        tol: float | Accuracy,
        value_floor: float = 0.0,
        patience: int = PATIENCE,
        ahead: int | None = None,
    ) -> None:
        self.tol = tol
        #: a stall: ``patience`` updates without a new low, within ``FLOOR`` times the
        #: rounding floor
        self.patience = patience
        #: or, where set, as soon as the error, within ``FLOOR`` times the floor, would
        #: need more than this many updates to reach tol at the rate of its lowest values
        #: over the last ``RATE_WINDOW`` updates (where the loop can go on in float64: a
        #: float32 error that crawls down along its floor gets there in float64 in far
        #: fewer updates)
        self.ahead = ahead
        self._lows: deque[float] = deque(maxlen=self.RATE_WINDOW + 1)
        #: whether the updates went on in float64 after a float32 stall
        self.promoted = False
        self.accuracy = tol if isinstance(tol, Accuracy) else None
        self.error = math.nan  # not measured until an update at the final eps
        self.reason = "max_iter"
        #: with an Accuracy: the estimated relative errors of the value and the gradient
        #: at the last check (infinite until ``WINDOW + 1`` checks have been made)
        self.estimates: dict[str, float] | None = None
        self._best, self._since, self._count = math.inf, 0, 0
        #: the last gradient-weighted error measured (NaN: none) and when
        self.tail_error, self._tail_at = math.nan, -self.TAIL_EVERY
        self._value_floor = value_floor
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._changes: list[tuple[torch.Tensor, torch.Tensor]] = []

    def resume(self) -> None:
        """Go on after a stop (in a finer dtype, or on a kernel that gained pairs): the
        error's history starts again."""
        self.reason = "max_iter"
        self._best, self._since = math.inf, 0
        self._lows.clear()
        self._last, self._changes = None, []
        self._tail_at = self._count - self.TAIL_EVERY

    @property
    def converged(self) -> bool:
        """Whether the loop met its tolerance (or needed none: a closed form)."""
        return self.reason in ("tol", "closed form")

    def stop(
        self,
        err: float,
        floor: Callable[[], float] = lambda: 0.0,
        probe: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
        tails: Callable[[], float] | None = None,
    ) -> bool:
        """Take the marginal error after an update; True to stop. ``floor()`` gives the
        error's rounding floor (computed only when the error has stalled); ``probe()`` the
        value (B,) and gradient (B, K) at the current potentials (called every
        ``Accuracy.every`` iterations, with an :class:`Accuracy` only); ``tails()`` the
        gradient-weighted marginal error there (called once the error is below ``tol``)."""
        self.error = err
        if self.accuracy is None and self.tol <= 0:
            return False
        if diverged(err):
            self.reason = "diverged"
            return True
        self._count += 1
        if self.accuracy is None and err < self.tol and self._tails_within(tails):
            self.reason = "tol"
            return True
        if (
            self.accuracy is not None
            and probe is not None
            and self._count % self.accuracy.every == 0
            and self._accurate(*probe(), lambda: err < self.FLOOR * floor())
        ):
            self.reason = "tol"
            return True
        if err < self.PROGRESS * self._best:
            self._best, self._since = err, 0
        else:
            self._since += 1
        # the floor is in the exponent: rounding by d moves a marginal by up to e^d - 1
        if self._since >= self.patience and err < self.FLOOR * math.expm1(min(floor(), 700.0)):
            self.reason = "stalled"
            return True
        if self.ahead is not None and self._crawling(err, floor):
            self.reason = "stalled"
            return True
        return False

    def _crawling(self, err: float, floor: Callable[[], float]) -> bool:
        """Whether the lowest error so far, at the current rate of its decrease (over the
        last ``RATE_WINDOW`` updates), needs more than ``ahead`` updates to reach tol, the
        error being within ``FLOOR`` times its rounding floor."""
        low = min(err, self._lows[-1]) if self._lows else err
        self._lows.append(low)
        if len(self._lows) <= self.RATE_WINDOW or self.accuracy is not None:
            return False
        if not err < self.FLOOR * math.expm1(min(floor(), 700.0)):
            return False
        rate = (low / self._lows[0]) ** (1 / self.RATE_WINDOW)
        return rate >= 1 or math.log(self.tol / low) / math.log(rate) > self.ahead

    def _tails_within(self, tails: Callable[[], float] | None) -> bool:
        """Whether the gradient-weighted error is within ``TAIL_FACTOR`` times tol (True
        without ``tails``; False between checks, ``TAIL_EVERY`` updates apart)."""
        if tails is None:
            return True
        if self._count - self._tail_at < self.TAIL_EVERY:
            return False
        self._tail_at, self.tail_error = self._count, tails()
        return self.tail_error <= self.TAIL_FACTOR * self.tol

    def _accurate(
        self, value: torch.Tensor, gradient: torch.Tensor, at_floor: Callable[[], bool]
    ) -> bool:
        """Take a check's value (B,) and gradient (B, K); whether both estimated errors
        (the geometric tail of their changes, see :class:`Accuracy`) are within tolerance.

        Changes at rounding level (below ``NOISE`` times the dtype's machine epsilon) for
        two checks in a row are taken as converged as far as the dtype allows (the error
        estimated by those changes), where either the marginal error is at its rounding
        floor (``at_floor()``) or the tolerance is over ``1 / NOISE_MARGIN`` times that
        level: a sequence still converging behind changes that small would need a
        contraction above 1 - NOISE_MARGIN per check to hide an error above the tolerance.
        """
        noise = self.NOISE * torch.finfo(gradient.dtype).eps
        value, gradient = value.double(), gradient.double()
        last, self._last = self._last, (value, gradient)
        if last is None:
            return False
        tiny = torch.finfo(torch.float64).tiny
        dv = (value - last[0]).abs() / value.abs().clamp_min(max(self._value_floor, tiny))
        dg = (gradient - last[1]).norm(dim=1) / gradient.norm(dim=1).clamp_min(tiny)
        self._changes = [*self._changes[-(self.WINDOW - 1) :], (dv, dg)]
        a = self.accuracy
        estimates = {}
        for k, (name, tol) in enumerate((("value", a.value), ("gradient", a.gradient))):
            changes = [c[k] for c in self._changes]
            estimates[name] = _tail(changes, self.WINDOW)
            recent = max(float(c.max()) for c in changes[-2:])
            if (
                len(changes) >= 2
                and recent <= noise
                and (noise <= self.NOISE_MARGIN * tol or at_floor())
            ):
                estimates[name] = min(estimates[name], recent)
        self.estimates = estimates
        return estimates["value"] <= a.value and estimates["gradient"] <= a.gradient


def _tail(changes: list[torch.Tensor], window: int) -> float:
    """The largest over the batch of d_k q / (1 - q): d_k the last change (B,), q the
    largest ratio of successive changes among the last ``window`` changes; infinite while
    fewer are known or where q >= 1."""
    if len(changes) < window:
        return math.inf
    d = changes[-1]
    ratios = [changes[k] / changes[k - 1] for k in range(1, len(changes))]
    q = torch.stack(ratios).amax(0)
    q = torch.where(d == 0, torch.zeros_like(q), q)  # no change left: converged
    tail = torch.where(q < 1, d * q / (1 - q).clamp_min(1e-300), torch.full_like(d, math.inf))
    return float(tail.max())


def rounding_floor(
    eps: float, *potentials: torch.Tensor, dtype=None, cost_scale: float = 0.0
) -> float:
    """U (max |potential| + cost_scale) / eps: the rounding noise of the marginals
    exp((f - s) / eps), U the machine epsilon of ``dtype`` (default: the potentials');
    ``cost_scale`` the size of the terms the cost is computed from (|x|^2 / 2 + |y|^2 / 2
    for the expansion of |x - y|^2 / 2), whose rounding the scores carry too."""
    top = max(float(t.abs().max()) for t in potentials)
    return torch.finfo(dtype or potentials[0].dtype).eps * (top + cost_scale) / eps
