r"""Multiscale Sinkhorn: a coarse-to-fine solver with kernel truncation.

1. Each cloud is grouped into grid cells of side ``cluster_scale`` (clusters); the clusters'
   centroids, carrying the clusters' masses, form two coarse measures.
2. The eps-scaling runs on the coarse measures (a small dense problem, itself solved this
   way if it has over 1e8 pairs of clusters) while the blur is above half the
   ``cluster_scale``.
3. The coarse potentials are extended to the points to first order:
   f(x_i) = f_I + <c_I - T_I, x_i - c_I>, where T_I is the barycentre of the coarse plan's
   row I (for the cost |x - y|^2 / 2 the gradient of f is x - T(x)).
4. The rest of the schedule and the final iterations run on the points, each softmin summing
   over the cluster pairs a *truncation pattern* keeps (:class:`otreg._sparse.BlockSparse`).

The pattern drops a pair of clusters (I, J) only when every term it holds is below
``exp(-truncate)`` times its weight, relative to the row's total. With the slack
s_ij = C_ij - f_i - g_j (a term is b_j exp(-s_ij / eps) of a row total 1 at convergence),
x_i = c_I + delta, y_j = c_J + eta, Delta = c_I - c_J, |delta| <= r_I, |eta| <= r_J,
R = r_I + r_J and any vectors d_I, e_J, writing w = delta - eta in
|Delta + w|^2 / 2 - <d, delta> - <e, eta> gives

.. math::

    s_{ij} \ge \tfrac12 |\Delta|^2 - \tfrac12 \rho^2 + \tfrac12 \max(0, \rho - R)^2
        - |d_I + e_J|\, r_J - \max_{i \in I} (f_i - \langle d_I, x_i - c_I \rangle)
        - \max_{j \in J} (g_j - \langle e_J, y_j - c_J \rangle),
    \qquad \rho = |\Delta - d_I|

(and the same with the roles of the clouds swapped; the larger of the two is used). With
d_I and e_J the potentials' least-squares gradients over each cluster (x - T(x) for this
cost) the bound is tight for the pairs that matter. Dropped terms then change each softmin
by at most eps * exp(-truncate) (relative mass), the accuracy control. The pattern is
rebuilt at each eps of the schedule and every ``REFRESH`` iterations at the final eps,
among the pairs the previous pattern kept (the kept set shrinks as eps does).

Only the squared Euclidean cost and one problem at a time (no batch) are supported.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import reductions as R
from .._sparse import BlockSparse, Clusters, clusters_by_label, grid_clusters, grid_labels
from ..costs import diameter as _diameter

__all__ = ["auto_cluster_scale", "use_multiscale", "MultiscaleProblem"]

#: pattern rebuilt every this many iterations at the final eps
REFRESH = 10
#: extra margin (in units of eps) for the first pattern, built from extrapolated potentials
FIRST_MARGIN = 2.0
#: ``multiscale="auto"`` turns on from this many pairs N * M (with the other conditions of
#: :func:`worthwhile`); a coarse problem that large is itself solved multiscale
MIN_PAIRS = 100_000_000
#: the search for a first pattern goes through coarser clusters above this many cluster pairs
HIERARCHY_MIN_PAIRS = 1 << 24
#: the coarse stage runs while the blur is above this fraction of the cluster scale
JUMP = 0.5
#: truncation (in units of the current eps) during the annealing
ANNEAL_TRUNCATE = 3.0


def auto_cluster_scale(diameter: float, n_points: int, dim: int) -> float:
    """Default cell side: ``diameter * n ** (-1/3)`` (for 3-D clouds), which balances the
    coarse dense problem against the truncated fine one."""
    return diameter * n_points ** (-1.0 / max(dim, 1))


def worthwhile(n_pairs: int, dim: int, blur: float, scale: float) -> bool:
    """Whether truncation pays: at least ``MIN_PAIRS`` pairs, D <= 3, and a blur below
    ``JUMP`` times the cell side (the coarse stage then has steps to take)."""
    return dim <= 3 and n_pairs >= MIN_PAIRS and blur < JUMP * scale


def use_multiscale(fn: str, multiscale, x, y, cost, form: str, backward: str, diam: float,
                   blur: float, scale: float | None) -> bool:
    """Resolve ``multiscale`` ("auto", True or False) for the batched problem x (B, N, D),
    y (B, M, D); ``True`` where it cannot run raises ``ValueError`` naming why."""
    if multiscale not in ("auto", True, False):
        raise ValueError(f"{fn}: multiscale is {multiscale!r}; use 'auto', True or False")
    if multiscale is False:
        return False
    unfit = None
    if cost.p != 2:
        unfit = f"the cost is {cost.name!r} (multiscale needs 'sqeuclidean')"
    elif x.shape[0] > 1:
        unfit = f"the inputs are a batch of {x.shape[0]} problems (multiscale solves one)"
    elif form != "log":
        unfit = f"form is {form!r} (multiscale needs 'log')"
    elif backward != "envelope":
        unfit = f"backward is {backward!r} (multiscale needs 'envelope')"
    if multiscale is True:
        if unfit:
            raise ValueError(f"{fn}: multiscale=True but {unfit}; use multiscale=False")
        return True
    scale = scale or auto_cluster_scale(diam, max(x.shape[1], y.shape[1]), x.shape[-1])
    return unfit is None and worthwhile(x.shape[1] * y.shape[1], x.shape[-1], blur, scale)


def _pattern_pairs(cx: Clusters, cy: Clusters, fx, gy, dx, dy, threshold: float,
                   candidates=None, scale: float | None = None, block: int = 1 << 20):
    """The kept cluster pairs (I, J): lower bound of the slack <= threshold (cost units).

    ``fx`` (N,), ``gy`` (M,) potentials in sorted order; ``dx`` (Kx, D), ``dy`` (Ky, D) the
    potentials' gradients per cluster. ``candidates``: (I, J) to test, default all pairs;
    with ``scale`` (the clusters' cell side) and over ``HIERARCHY_MIN_PAIRS`` pairs, all
    pairs are first screened through clusters twice as wide (recursively). Every row
    cluster and every column cluster keeps at least its best pair.
    """
    F = cx.per_cluster_max(fx - _dot_rel(cx, dx))  # (Kx,)
    G = cy.per_cluster_max(gy - _dot_rel(cy, dy))  # (Ky,)

    def bound(I, J):
        delta = cx.centres[I] - cy.centres[J]
        half_sq = (delta * delta).sum(-1) / 2
        R = cx.radii[I] + cy.radii[J]
        d_sum = (dx[I] + dy[J]).norm(dim=-1)
        out = []
        for rho, r in (((delta - dx[I]).norm(dim=-1), cy.radii[J]),
                       ((delta + dy[J]).norm(dim=-1), cx.radii[I])):
            out.append(half_sq - rho**2 / 2 + (rho - R).clamp_min(0) ** 2 / 2 - d_sum * r)
        return torch.maximum(*out) - F[I] - G[J]

    Kx, Ky = cx.n_clusters, cy.n_clusters
    if candidates is not None:
        cI, cJ = candidates
        chunks = [(cI[k:k + block], cJ[k:k + block]) for k in range(0, len(cI), block)]
    elif scale is not None and Kx * Ky > HIERARCHY_MIN_PAIRS:
        chunks = _parent_candidates(cx, cy, fx, gy, threshold, scale, block)
    else:
        chunks = None
    if chunks is None:
        kept_I, kept_J = [], []
        best_col = torch.full((Ky,), math.inf, dtype=fx.dtype, device=fx.device)
        best_col_row = torch.zeros(Ky, dtype=torch.long, device=fx.device)
        rows = max(1, block // max(1, Ky))
        J_all = torch.arange(Ky, device=fx.device)
        for start in range(0, Kx, rows):
            I = torch.arange(start, min(Kx, start + rows), device=fx.device)
            lb = bound(I[:, None], J_all[None, :])  # (rows, Ky)
            keep = lb <= threshold
            keep[torch.arange(len(I)), lb.argmin(1)] = True
            col_min, col_arg = lb.min(0)
            better = col_min < best_col
            best_col = torch.where(better, col_min, best_col)
            best_col_row = torch.where(better, I[col_arg], best_col_row)
            i, j = keep.nonzero(as_tuple=True)
            kept_I.append(I[i])
            kept_J.append(j)
        I = torch.cat(kept_I + [best_col_row])
        J = torch.cat(kept_J + [J_all])
    else:
        # keep what passes, and each row's and column's best pair: a chunk keeps the pairs
        # at or below the running best, a superset of the final best pairs, then filtered
        best_row = torch.full((Kx,), math.inf, dtype=fx.dtype, device=fx.device)
        best_col = torch.full((Ky,), math.inf, dtype=fx.dtype, device=fx.device)
        kept = []
        for I, J in chunks:
            lb = bound(I, J)
            best_row.scatter_reduce_(0, I, lb, "amin")
            best_col.scatter_reduce_(0, J, lb, "amin")
            keep = (lb <= threshold) | (lb <= best_row[I]) | (lb <= best_col[J])
            kept.append((I[keep], J[keep], lb[keep]))
        I, J, lb = (torch.cat(t) for t in zip(*kept))
        keep = (lb <= threshold) | (lb <= best_row[I]) | (lb <= best_col[J])
        I, J = I[keep], J[keep]
    key = torch.unique(I * Ky + J)  # sorted, without the duplicates added above
    return key // Ky, key % Ky


def _parent_candidates(cx: Clusters, cy: Clusters, fx, gy, threshold: float, scale: float,
                       block: int):
    """Chunks (I, J) of the cluster pairs whose parents (clusters of the clusters' centres,
    cells ``2 * scale`` wide) the bound keeps: every pair the bound could keep, as a parent
    pair's bound is a lower bound for all its children's points."""
    def parent_level(c: Clusters, f: torch.Tensor):
        of = grid_labels(c.centres, 2 * scale)  # (K,) parent of each cluster
        pc = clusters_by_label(c.points, torch.ones_like(f), of[c.labels])
        pf = f[pc.order]
        return of, pc, pf, _cluster_gradients(pc, pf)

    ofx, px, pfx, pdx = parent_level(cx, fx)
    same = cy is cx and torch.equal(gy, fx)  # a cloud against itself: one parent level
    ofy, py, pgy, pdy = (ofx, px, pfx, pdx) if same else parent_level(cy, gy)
    P, Q = _pattern_pairs(px, py, pfx, pgy, pdx, pdy, threshold, scale=2 * scale,
                          block=block)
    (sx, nx, ox), (sy, ny, oy) = (_children(of) for of in (ofx, ofy))
    count = nx[P] * ny[Q]  # child pairs of each kept parent pair
    ends = torch.cumsum(count, 0)
    marks = torch.tensor(range(block, int(ends[-1]), block), dtype=ends.dtype,
                         device=ends.device)
    bounds = [0, *torch.searchsorted(ends, marks, right=True).unique().tolist(), len(P)]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi <= lo:
            continue
        p, q, n = P[lo:hi], Q[lo:hi], count[lo:hi]
        owner = torch.repeat_interleave(torch.arange(hi - lo, device=P.device), n)
        k = torch.arange(len(owner), device=P.device) - (torch.cumsum(n, 0) - n)[owner]
        width = ny[q][owner]
        yield ox[sx[p][owner] + k // width], oy[sy[q][owner] + k % width]


def _children(parent_of: torch.Tensor):
    """For the parent label of each cluster (K,): each parent's first slot (P,), child count
    (P,) and the clusters ordered by parent (K,)."""
    order = torch.argsort(parent_of, stable=True)
    count = torch.bincount(parent_of)
    return torch.cumsum(count, 0) - count, count, order


def _cluster_gradients(c: Clusters, f: torch.Tensor) -> torch.Tensor:
    """Least-squares gradient of the potential f (N,) (sorted) over each cluster, (K, D).

    Any vectors make the truncation bound valid; the closer to the gradient, the tighter.
    """
    lab, n = c.labels, c.sizes.to(f.dtype)
    K, D = c.n_clusters, c.points.shape[1]
    mean_x = torch.zeros(K, D, dtype=f.dtype, device=f.device).index_add_(0, lab, c.points)
    mean_f = torch.zeros(K, dtype=f.dtype, device=f.device).index_add_(0, lab, f)
    dx = c.points - (mean_x / n[:, None])[lab]
    df = f - (mean_f / n)[lab]
    cov = torch.zeros(K, D, D, dtype=f.dtype, device=f.device).index_add_(
        0, lab, dx[:, :, None] * dx[:, None, :])
    rhs = torch.zeros(K, D, dtype=f.dtype, device=f.device).index_add_(0, lab, dx * df[:, None])
    ridge = 1e-3 * cov.diagonal(dim1=1, dim2=2).sum(-1) + 1e-12 * float(c.radii.max()) ** 2 + \
        torch.finfo(f.dtype).tiny
    eye = torch.eye(D, dtype=f.dtype, device=f.device)
    return torch.linalg.solve(cov + ridge[:, None, None] * eye, rhs)


def _dot_rel(c: Clusters, d: torch.Tensor) -> torch.Tensor:
    """<d_I, x_i - c_I> for the sorted points, (N,)."""
    return ((c.points - c.centres[c.labels]) * d[c.labels]).sum(-1)


@dataclasses.dataclass
class _Kernels:
    """The two directed block-sparse kernels of one pattern."""

    xy: BlockSparse
    yx: BlockSparse | None  # None once the solve is over (the gradient needs x -> y only)
    pairs: tuple[torch.Tensor, torch.Tensor]


class MultiscaleProblem:
    """One multiscale solve between the clouds x (N, D) and y (M, D) (or x with itself).

    The clouds are sorted by cluster once; potentials are kept in sorted order during the
    solve and returned in the caller's order.
    """

    def __init__(self, p, x: torch.Tensor, a: torch.Tensor, y: torch.Tensor | None = None,
                 b: torch.Tensor | None = None, scale: float | None = None,
                 truncate: float = 5.0) -> None:
        self.p, self.truncate = p, truncate
        self.self_problem = y is None
        self.scale = scale
        self.cx = grid_clusters(x, a, scale)
        self.a = a[self.cx.order]
        if self.self_problem:
            self.cy, self.b = self.cx, self.a
        else:
            self.cy = grid_clusters(y, b, scale)
            self.b = b[self.cy.order]
        self.kernels: _Kernels | None = None
        self.n_pairs: list[int] = []  # pairs summed by each pattern, for reports

    # -------------------------------------------------------------- patterns
    def _bound_potentials(self, f, g, lam):
        # the row terms are exp((f/lam + g - C)/eps) (unbalanced: f = lam softmin): use the
        # larger of f and f / lam on each side, which keeps more pairs, never fewer
        return torch.maximum(f, f / lam), torch.maximum(g, g / lam)

    def update_pattern(self, f, g, eps: float, margin: float = 0.0, full: bool = False):
        """Rebuild the kernels for the potentials f (N,), g (M,) (sorted) at this eps.

        The threshold is ``truncate`` times the final eps, or ``ANNEAL_TRUNCATE`` times the
        current one if larger (the annealing's potentials need less accuracy), plus
        ``margin`` times eps. Among the previous pattern's pairs, the kernels are rebuilt
        only if at least a quarter of them can go.
        """
        lam = self.p.damping(eps)
        fb, gb = self._bound_potentials(f, g, lam)
        dx = _cluster_gradients(self.cx, f)
        dy = dx if self.self_problem else _cluster_gradients(self.cy, g)
        threshold = max(ANNEAL_TRUNCATE * eps, self.truncate * self.p.eps) + margin * eps
        refresh = not full and self.kernels is not None
        candidates = self.kernels.pairs if refresh else None
        I, J = _pattern_pairs(self.cx, self.cy, fb, gb, dx, dy, threshold, candidates,
                              self.scale)
        if refresh and len(I) > 0.75 * len(candidates[0]):
            return  # the current kernels hold every pair that matters
        xy = BlockSparse(self.cx, self.cy, I, J)
        yx = xy if self.self_problem else BlockSparse(self.cy, self.cx, J, I)
        self.kernels = _Kernels(xy, yx, (I, J))
        self.n_pairs.append(xy.n_pairs)

    def finish(self, f, g, eps: float) -> None:
        """The last pattern, for the converged potentials f (N,), g (M,) (sorted); then keep
        only what the gradient needs: the x -> y kernel (the dual value's one reduction)
        without its cached geometry, so that finished problems hold little memory while the
        others are solved."""
        self.update_pattern(f, g, eps)
        self.kernels.yx = None
        self.kernels.xy.release_geometry()

    # -------------------------------------------------------------- coarse stage
    def coarse_start(self):
        """Anneal on the clusters while the blur is above the cluster scale; return the
        extrapolated fine potentials (sorted) and the iterations used."""
        from .sinkhorn import _solve_pair, _solve_self

        p = self.p
        coarse = [e for e in p.schedule[:-1] if e > (JUMP * self.scale) ** p.cost.p]
        if not coarse:
            coarse = p.schedule[:1]
        X, A = self.cx.centres[None], self.cx.masses[None]
        Yc = X if self.self_problem else self.cy.centres[None]
        # a coarse problem still too large is itself solved multiscale (recursively)
        sub_scale = auto_cluster_scale(_diameter(X, Yc), max(X.shape[1], Yc.shape[1]),
                                       X.shape[-1])
        recurse = worthwhile(X.shape[1] * Yc.shape[1], X.shape[-1], math.sqrt(coarse[-1]),
                             sub_scale)
        cp = dataclasses.replace(p, schedule=coarse, max_iter=len(coarse), tol=0.0,
                                 relaxation=1.0, multiscale=recurse, cluster_scale=sub_scale)
        if self.self_problem:
            fc, n_iter, _, _ = _solve_self(cp, X, A)
            gc, Y, B = fc, X, A
        else:
            Y, B = self.cy.centres[None], self.cy.masses[None]
            fc, gc, n_iter, _, _ = _solve_pair(cp, X, Y, A, B)
        eps = coarse[-1]
        # barycentres of the coarse plan's rows and columns: the potentials' gradients
        tx = R.softmax_average(X, Y, B.log() + gc / eps, Y, eps, p.cost, p.backend)[0]
        dx = self.cx.centres - tx
        if self.self_problem:
            dy = dx
        else:
            ty = R.softmax_average(Y, X, A.log() + fc / eps, X, eps, p.cost, p.backend)[0]
            dy = self.cy.centres - ty
        f = fc[0][self.cx.labels] + _dot_rel(self.cx, dx)
        g = gc[0][self.cy.labels] + _dot_rel(self.cy, dy)
        return f, g, n_iter, len(coarse)

    def warm_start(self, f, g):
        """Potentials (caller's order) of a nearby problem, to start at the final eps."""
        return f[self.cx.order], (f[self.cx.order] if self.self_problem else g[self.cy.order])

    # -------------------------------------------------------------- reductions
    def softmin_xy(self, h, eps, x=None, y=None):
        x = self.cx.points if x is None else x
        y = self.cy.points if y is None else y
        return self.kernels.xy.softmin(x, y, h, eps)

    def softmin_yx(self, h, eps, x=None, y=None):
        x = self.cx.points if x is None else x
        y = self.cy.points if y is None else y
        kernel = self.kernels.xy if self.self_problem else self.kernels.yx
        return kernel.softmin(y, x, h, eps)

    def unsort_x(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t)
        out[self.cx.order] = t
        return out

    def unsort_y(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(t)
        out[self.cy.order] = t
        return out
