"""The dense kernel the Sinkhorn loop runs against: softmins over every pair (i, j), in the
problem's form, through :mod:`otreg.reductions`. :func:`make_kernel` picks it or the
multiscale :class:`~otreg.ot.multiscale.TruncatedKernel`, which has the same interface."""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import reductions
from ..reductions.sparse import grid_clusters
from . import cells
from .convergence import Accuracy, rounding_floor
from .multiscale import TruncatedKernel
from .problem import Problem

__all__: list[str] = []

#: a share of a row below this counts as this (log1p(-1) is -inf)
_TINY = 1e-300

#: a dense solve over at least this many pairs may first solve the same problem on the
#: centroids of grid cells (:meth:`DenseKernel.coarse_problem`; at 4 million, the cells'
#: problem of the heavy-tailed clouds' half-way solve, 3.5 million pairs, took 0.81 s
#: through the points' eps-scaling, 0.41 s through its own cells)
COARSE_MIN_PAIRS = 1_000_000
#: ... of side this many times the blur (the potentials vary little within a cell)
COARSE_CELL = 0.3
#: ... where the cells' pairs are at most this fraction of the points' (at 0.25 of a
#: blur and 0.25 of the pairs, one heavy-tailed draw's half-way solve found no eps whose
#: cells paid, and its divergence took 10.5 s against 5.3 s)
COARSE_MAX_FRACTION = 0.4
#: ... tried at this many eps of the schedule at most, from the final one up
COARSE_TRIES = 3


def form_softmin(p: Problem, eps: float, x, y, w_log, pot, estimate=None) -> torch.Tensor:
    """-eps log sum_j w_j exp((pot_j - C(x_i, y_j))/eps) in the problem's form; ``estimate``
    (B, N): a likely result, such as the previous iterate (:func:`otreg.reductions.softmin`)."""
    if p.form == "log":
        h = w_log + pot / eps
        return reductions.softmin(x, y, h, eps, p.cost, p.backend, estimate=estimate)
    v = torch.exp(w_log + pot / eps).unsqueeze(-1)
    kv = reductions.kernel_product(x, y, v, eps, p.cost, p.backend).squeeze(-1)
    out = -eps * torch.log(kv)
    if not bool(torch.isfinite(out).all()):
        raise FloatingPointError(
            f"sinkhorn: form='scaling' under- or overflowed at eps={eps:.3g} (exp(-C/eps) "
            f"rounds to 0 in {x.dtype} for costs above about {87 * eps:.3g}); use form='log', "
            "which is stable at any eps, or a larger blur"
        )
    return out


class DenseKernel:
    """Softmins over every pair (i, j), through :mod:`otreg.reductions`.

    The interface the loop uses (shared with
    :class:`~otreg.ot.multiscale.TruncatedKernel`): weights ``a`` (B, N), ``b`` (B, M) in
    the kernel's order; ``softmin_xy(eps, g)`` (B, N) and ``softmin_yx(eps, f)`` (B, M);
    ``to_kernel_order`` / ``to_caller_order`` for potentials; ``refresh`` (adapt to the
    current potentials, every ``refresh_every`` iterations at the final eps);
    ``coarse_problem`` (a problem to solve first, or None) and ``extrapolate``;
    ``cell_step`` (a step on the constants of cells of points, or None); ``verify``
    (whether the updates may stop at these potentials); ``promotable`` and ``promote``
    (sum in float64 from here); ``remake_list`` (a new pair list after a stall);
    ``finish``;
    ``differentiable_softmin`` for the gradient's one reduction, ``softmin_gradient``
    for the accuracy checks, ``displacement`` for the stopping rule's weights and
    ``rounding_floor`` for the stall rule. ``symmetric``: x
    against itself (y and b are x and a).
    """

    refresh_every = 1
    #: what :meth:`cell_step` steps on, for ``result.acceleration``
    step_kind = "far-point"
    #: how many times the kernel gained pairs (never: every pair is summed)
    patterns_grown = 0
    #: what :meth:`coarse_problem` solved first, for ``result.acceleration`` ("": nothing)
    coarse_story = ""

    def __init__(
        self,
        p: Problem,
        x: torch.Tensor,
        a: torch.Tensor,
        y: torch.Tensor | None = None,
        b: torch.Tensor | None = None,
    ) -> None:
        self.p, self.symmetric = p, y is None
        self._use(x, a, *((x, a) if y is None else (y, b)))
        # each direction's last softmin: the next one's estimate (the blocked backend
        # then shifts the rows by it instead of by their maxima; see _estimate)
        self._last: dict[str, torch.Tensor] = {}
        self._caller: tuple | None = None  # the caller's tensors while promoted
        self._far_steps = 0  # far-point steps taken (cell_step)
        # the size of the terms a dense cost is computed from, for the rounding floor
        # (|x|^2 / 2 + |y|^2 / 2 for the expansion of |x - y|^2 / 2; |x| + |y| for p = 1)
        self._cost_scale = sum(
            float(t.detach().norm(dim=-1).max()) ** p.cost.p / p.cost.p for t in (self.x, self.y)
        )

    def _use(self, x, a, y, b) -> None:
        self.x, self.a, self.y, self.b = x, a, y, b
        self._a_log, self._b_log = a.log(), b.log()

    @property
    def promotable(self) -> bool:
        """Whether :meth:`promote` would sum in float64 (the points are not yet)."""
        return self.x.dtype != torch.float64

    def promote(self) -> None:
        """Sum in float64 from here (the caller's points, exactly; only where
        :attr:`promotable`), for the final updates once float32's rounding floor stops them
        above ``tol``. :meth:`finish` goes back to the caller's tensors."""
        self._caller = (self.x, self.a, self.y, self.b)
        x, a, y, b = (t.double() for t in self._caller)
        if self.p.rho is None:  # totals equal in float32 differ at 1e-8 in float64
            b = b * (a.sum(1) / b.sum(1))[:, None]
        self._use(x, a, y, b)

    def softmin_xy(self, eps: float, g: torch.Tensor) -> torch.Tensor:
        out = form_softmin(self.p, eps, self.x, self.y, self._b_log, g, self._estimate("xy"))
        self._last["xy"] = out
        return out

    def softmin_yx(self, eps: float, f: torch.Tensor) -> torch.Tensor:
        out = form_softmin(self.p, eps, self.y, self.x, self._a_log, f, self._estimate("yx"))
        self._last["yx"] = out
        return out

    def _estimate(self, direction: str) -> torch.Tensor | None:
        """The last softmin of this direction, as the next one's estimate, in float32 only.
        In float64 (references, and the final updates once float32's rounding stops
        them) the rows' maxima shift them, as before: there the update's rounding then
        is one function of its input. With estimates, a float64 solve of 300 heavy-tailed
        points to tol 1e-13 took Anderson mixing onto a plateau at 2e-11 that it did not
        leave in 3,000 updates; with the maxima it converged in 448."""
        return self._last.get(direction) if self.x.dtype == torch.float32 else None

    def to_kernel_order(self, f, g):
        return f, g

    def to_caller_order(self, f, g):
        return f, g

    def refresh(self, f, g, eps: float, full: bool = False) -> None:
        """Nothing to adapt: every pair is summed."""

    def remake_list(self) -> bool:
        """No pair list to make again (:meth:`~otreg.ot.multiscale.TruncatedKernel.remake_list`)."""
        return False

    def cell_step(self, f, g, min_gain: float, previous=None):
        """A step on the potentials of the ``cells.FAR_POINTS`` points of y whose columns of
        the plan hold the mass furthest from their own, each raised or lowered so that it
        receives its mass with f eliminated (:func:`otreg.ot.cells.far_point_shifts`, each
        point on its own; all together, halved until the dual rises): the far points of
        heavy-tailed clouds that the updates settle last. f (B, N) is the softmin of
        ``previous`` (B, M), g the softmin of f (``previous`` and g tell each column's
        mass). Returns the new (f, g), f the softmin of g; ``cells.NOT_NOW`` where the
        chosen points (at most one in ``cells.FAR_SPARSITY`` of y) hold less than
        ``cells.FAR_CONCENTRATION`` of the error (the bulk's error: later updates may leave
        the far points'); or None where no step is taken from here: no ``previous`` (an
        over-relaxed f), a batch, a cloud against itself, an unbalanced problem, more than
        ``cells.FAR_MAX_ENTRIES`` logits, ``cells.FAR_MAX_STEPS`` steps taken, or no shift
        raising the dual. ``min_gain`` (the cells' threshold) is not used: these steps move
        little mass and promise little dual, yet take what tens of updates crawl through."""
        eps, (n, m) = self.p.eps, (self.x.shape[1], self.y.shape[1])
        unfit = self.symmetric or self.p.rho is not None or self.p.damping(eps) != 1
        large = n * cells.FAR_POINTS > cells.FAR_MAX_ENTRIES
        spent = self._far_steps >= cells.FAR_MAX_STEPS
        if previous is None or unfit or large or spent or f.shape[0] != 1:
            return None
        a, b = self.a[0].double(), self.b[0].double()
        f, s, g = f[0].double(), g[0].double(), previous[0].double()
        off = (b * torch.exp((g - s) / eps) - b).abs()  # each column's error at (f, g)
        worst = off.topk(max(1, min(cells.FAR_POINTS, m // cells.FAR_SPARSITY)))
        if float(worst.values.sum()) < cells.FAR_CONCENTRATION * float(off.sum()):
            return cells.NOT_NOW
        chosen = worst.indices
        cost = self.p.cost.dense(self.x, self.y[:, chosen])[0].double()
        terms = b[chosen].log() + (g[chosen] - cost) / eps  # (N, K), each row's log-term
        u = cells.far_point_shifts(self._far_logits(f, g, chosen, terms), a.log(), b[chosen].log())
        start = float((a * f).sum() + (b * g).sum())
        for scale in cells.FAR_SCALES:
            # (the other points of y stay, so that the next softmins' estimates stay close)
            moved = g.index_add(0, chosen, scale * eps * u)
            g_new = moved[None].to(self.x.dtype)
            f_new = self.softmin_xy(eps, g_new)
            if float((a * f_new[0].double()).sum() + (b * moved).sum()) > start:
                self._far_steps += 1
                return f_new, g_new
        return None

    def _far_logits(self, f, g, chosen, terms) -> torch.Tensor:
        """Each chosen point's log-term in each row against the row's other terms, (N, K)
        float64, from f (N,), g (M,) (f the softmin of g) and the terms (N, K): the log of
        share / (1 - share), share = exp(terms + f / eps) the point's part of its row.
        Where the share is above a half, 1 - share loses its digits (a row that sends a far
        point nearly all its mass): the row's other terms are summed instead, for the
        ``cells.FAR_EXACT_ROWS`` rows of largest share (fewer where their terms would number more
        than ``cells.FAR_MAX_ENTRIES``)."""
        eps = self.p.eps
        log_share = terms + f[:, None] / eps
        share = torch.exp(log_share).clamp(max=1.0)
        z = log_share - torch.log1p(-share).clamp_min(math.log(_TINY))
        rows, k = (share > 0.5).nonzero(as_tuple=True)
        # (the rows' terms, (rows, M), within the logits' bound)
        most = min(cells.FAR_EXACT_ROWS, cells.FAR_MAX_ENTRIES // self.y.shape[1])
        if len(rows) > most:
            keep = share[rows, k].topk(most).indices
            rows, k = rows[keep], k[keep]
        if len(rows):
            x, y = self.x[0, rows].double(), self.y[0].double()
            others = self._b_log[0].double() + (g - self.p.cost.dense(x[None], y[None])[0]) / eps
            others[torch.arange(len(rows), device=rows.device), chosen[k]] = -math.inf
            z[rows, k] = terms[rows, k] - torch.logsumexp(others, 1)
        return z

    def verify(self, f, g) -> bool:
        """Every pair is summed: nothing can be missing."""
        return True

    def rounding_floor(self, eps: float, *potentials: torch.Tensor) -> float:
        """The marginals' rounding noise at these potentials (the stall rule's floor)."""
        return rounding_floor(eps, *potentials, cost_scale=self._cost_scale)

    def coarse_problem(self):
        """``(problem, X, A, Y, B)``: the same problem on the centroids X, Y of grid cells,
        carrying the cells' masses A, B (Y and B None for a cloud against itself), solved
        first; or None. The cells' side is ``COARSE_CELL`` times the blur of the last eps
        of the schedule where their pairs are few enough (``COARSE_MAX_FRACTION``; tried
        from the final eps up, ``COARSE_TRIES`` eps at most). At the final eps, the coarse
        problem is solved to the same ``tol``: its potentials, extended to the points by one
        softmin over the cells (:meth:`extrapolate`), leave the points' updates a few where
        from the eps-scaling they take tens (heavy-tailed clouds of 5,000 points, every
        pair summed, the divergence's half-way solve at blur 0.371: 33 updates and 3.5 s
        from the points' eps-scaling, 4 updates after the cells' solve, 0.9 s in all; the
        whole divergence with its gradient at blur 0.1, five draws, 4.2 to 5.1 s against
        6.5 to 11.5 s, docs/guide/ot.md). At an earlier eps, the coarse
        problem is the eps-scaling down to it (one update an eps, as the multiscale
        solver's coarse stage), and the points' go on from there. Only where it pays
        (``COARSE_MIN_PAIRS``) and its potentials are what the loop wants: balanced, one
        problem, the squared distance, on the CPU (not measured on a GPU), a
        marginal-error ``tol`` above 0, no warm start and an acceleration left to otreg (an
        unrolled gradient replays the plain schedule)."""
        p, (n, m) = self.p, (self.x.shape[1], self.y.shape[1])
        fits = (
            isinstance(p.relaxation, str)
            and p.rho is None
            and p.form == "log"
            and p.cost.name == "sqeuclidean"
            and self.x.shape[0] == 1
            and self.x.device.type == "cpu"
            and not isinstance(p.tol, Accuracy)
            and p.tol > 0
            and n * m >= COARSE_MIN_PAIRS
        )
        if not fits:
            return None
        last = len(p.schedule) - 1
        for k in range(last, max(last - COARSE_TRIES, -1), -1):
            scale = COARSE_CELL * p.schedule[k] ** (1 / p.cost.p)
            cx = grid_clusters(self.x[0], self.a[0], scale)
            cy = cx if self.symmetric else grid_clusters(self.y[0], self.b[0], scale)
            if cx.n_clusters * cy.n_clusters <= COARSE_MAX_FRACTION * n * m:
                break
        else:
            return None
        if not (bool((cx.masses > 0).all()) and bool((cy.masses > 0).all())):
            return None  # (a cell of weightless points: its centroid has no mass to carry)
        self._coarse = (cx.centres[None], cx.masses[None], cy.centres[None], cy.masses[None])
        self._coarse_eps = p.schedule[k]
        cells_told = f"{cx.n_clusters:,}" + ("" if self.symmetric else f" and {cy.n_clusters:,}")
        if k == last:  # (half the iterations at most: the points' updates get the rest)
            problem = dataclasses.replace(
                p, max_iter=max(p.max_iter // 2, len(p.schedule) + 1), multiscale=None
            )
            self.coarse_story = f"on the centroids of {cells_told} cells first"
        else:
            blur = p.schedule[k] ** (1 / p.cost.p)
            problem = dataclasses.replace(
                p, schedule=p.schedule[: k + 1], max_iter=k + 1, tol=0.0, relaxation=1.0,
                multiscale=None,
            )  # fmt: skip
            self.coarse_story = f"the eps-scaling to blur {blur:.3g} on {cells_told} cells"
        X, A, Y, B = self._coarse
        return (problem, X, A) + ((None, None) if self.symmetric else (Y, B))

    def extrapolate(self, fc: torch.Tensor, gc: torch.Tensor):
        """The coarse potentials fc (1, Kx), gc (1, Ky) extended to the points, (1, N) and
        (1, M): f(x_i) the softmin over the cells of log B + gc / eps (the update the
        points' f would get from the cells' g), g(y_j) likewise from fc."""
        p, eps, (X, A, Y, B) = self.p, self._coarse_eps, self._coarse
        f = form_softmin(p, eps, self.x, Y, B.log(), gc.to(self.x.dtype))
        if self.symmetric:
            return f, f
        return f, form_softmin(p, eps, self.y, X, A.log(), fc.to(self.x.dtype))

    def finish(self, f, g, eps: float) -> None:
        """Back to the caller's tensors after :meth:`promote`."""
        if self._caller is not None:
            self._use(*self._caller)
            self._caller = None

    def differentiable_softmin(self, x, y, b, g, eps: float) -> torch.Tensor:
        """lambda-free softmin of log b + g / eps, differentiable in x, y and b, (B, N)."""
        last = self._estimate("xy")
        estimate = last if last is not None and last.shape == x.shape[:2] else None
        return form_softmin(self.p, eps, x, y, b.log(), g, estimate)

    def displacement(self, eps: float, pot: torch.Tensor, s: torch.Tensor, transpose: bool):
        """|x_i - T_i| (B, N), T_i the barycentre of row i of the plan at the potential
        ``pot`` of y (``s`` its softmin, unused here: one reduction); with ``transpose``,
        |y_j - S_j| (B, M) at the potential of x. For the stopping rule's weights."""
        x, y, w_log = (self.y, self.x, self._a_log) if transpose else (self.x, self.y, self._b_log)
        h = w_log + pot.to(x.dtype) / eps
        t = reductions.softmax_average(x, y, h, y, eps, self.p.cost, self.p.backend)
        return (x - t).norm(dim=-1)

    def softmin_gradient(self, eps: float, g: torch.Tensor, s: torch.Tensor, w: torch.Tensor):
        """The gradient of ``sum_i w_i s_i`` with s = ``softmin_xy(eps, g)`` with respect to
        the points: ``(x,)`` for a cloud against itself, else ``(x, y)``; for
        :class:`~otreg.ot.convergence.Accuracy`'s checks."""
        x = self.x.detach().requires_grad_(True)
        y = x if self.symmetric else self.y.detach().requires_grad_(True)
        with torch.enable_grad():
            out = form_softmin(self.p, eps, x, y, self._b_log, g, s.detach())
            return torch.autograd.grad(out, (x,) if self.symmetric else (x, y), w)


def make_kernel(p: Problem, x, a, y=None, b=None):
    """The kernel for (x, a) against (y, b), or against itself when y is None."""
    if p.multiscale is not None:
        return TruncatedKernel(p, x, a, y, b)
    return DenseKernel(p, x, a, y, b)
