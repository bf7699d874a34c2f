r"""Multiscale Sinkhorn: a coarse-to-fine solver with kernel truncation.

1. Each cloud is grouped into grid cells of side ``cluster_scale`` (clusters); the clusters'
   centroids, carrying the clusters' masses, form two coarse measures.
2. The eps-scaling runs on the coarse measures (a small dense problem, itself solved this
   way if it has ``MIN_PAIRS`` pairs of clusters or more) while the blur is above half the
   ``cluster_scale``.
3. The coarse potentials are extended to the points to first order:
   f(x_i) = f_I + <c_I - T_I, x_i - c_I>, where T_I is the barycentre of the coarse plan's
   row I (for the cost ``|x - y|^2 / 2`` the gradient of f is x - T(x)).
4. The rest of the schedule and the final iterations run on the points, each softmin summing
   over the cluster pairs a *truncation pattern* keeps
   (:class:`otreg.reductions.sparse.BlockSparse`).
5. At the final eps, where a point's terms that matter are a few (a plan near a
   permutation: points sparser than the blur), the softmins sum over a list of the point
   pairs within reach (:class:`otreg.reductions.sparse.PairList`), with the potentials in
   float64 (``LIST_MARGIN`` says when the list is rebuilt); where such a list would hold
   too many pairs (a blur near the points' spacing or above), over the pattern's terms
   computed once for reference potentials (:class:`otreg.reductions.sparse.BlockFactors`;
   ``FACTOR_SPREAD`` says when they are made again).

The pattern drops a pair of clusters (I, J) only when every term it holds is below
``exp(-truncate)`` times its weight, relative to the row's total. With the slack
``s_ij = C_ij - f_i - g_j`` (a term is ``b_j exp(-s_ij / eps)`` of a row total 1 at
convergence), ``x_i = c_I + delta``, ``y_j = c_J + eta``, ``Delta = c_I - c_J``,
``|delta| <= r_I``, ``|eta| <= r_J``, ``R = r_I + r_J`` and any vectors d_I, e_J, writing
``w = delta - eta`` in ``|Delta + w|^2 / 2 - <d, delta> - <e, eta>`` gives

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

from .. import reductions
from ..costs import diameter as bounding_diameter
from ..reductions.sparse import (
    BlockFactors,
    BlockSparse,
    Clusters,
    PairList,
    close_pairs,
    clusters_by_label,
    grid_clusters,
    grid_labels,
)
from . import cells
from .convergence import rounding_floor

__all__: list[str] = []

#: pattern rebuilt every this many iterations at the final eps
REFRESH = 10
#: ... when the new pattern keeps at most this fraction of the current one's pairs
KEEP_FRACTION = 0.75
#: extra margin (in units of eps) for the first pattern, built from extrapolated potentials
FIRST_MARGIN = 2.0
#: ``multiscale="auto"`` turns on from this many pairs N * M (with the other conditions of
#: :func:`worthwhile`); a coarse problem that large is itself solved multiscale. Measured on
#: two noisy spheres at blur 0.01 (benchmarks/sinkhorn_peers.py, 1,000 iterations): 2.2 times
#: as fast as every pair at 4e6 pairs (N = 2,000), 3.8 at 9e6, 2.9 at 2.5e7 (it was 1e8)
MIN_PAIRS = 4_000_000
#: ... or from this many where a GPU kernel sums every pair (``reductions.fast_all_pairs``):
#: at N = M = 1e5 the kernel's softmin takes 19 ms (0.52 T pairs/s on an H200), so the some
#: 230 iterations of 2 to 4 softmins of every pair would take 9 to 17 s, and the multiscale
#: default call (its truncated softmins in Triton kernels) took 1.5 s with its gradient
#: (docs/benchmarks.md, "otreg on a GPU"); at 1e4 (1e8 pairs) every pair took 0.53 s. Where
#: between 1e8 and 1e10 pairs multiscale starts to pay on a card is not measured.
MIN_PAIRS_GPU = 10_000_000_000
#: a pattern found to lack pairs at the final eps (:meth:`TruncatedKernel.verify`) gains
#: those within this many eps more than ``truncate``. Measured on fsaverage5 against
#: Conte69 at 3 mm (divergence with its gradient, two cores): with none, the check failed
#: 8 times in OT(a, b) and the call took 12.7 s (7.5 s without the check); with 10 eps,
#: once and 9.7 s; with 30, once and 11.2 s
VERIFY_MARGIN = 10.0
#: extra margin (in units of eps) for the pattern searched after a cell step: with none,
#: on two noisy spheres 0.5 apart (N = 5,000, blur 0.01) the updates after a step stalled
#: at a marginal error of 1.4e-3 (the pattern lacked pairs); with 2 or 10 they converged
CELL_MARGIN = 10.0
#: after a cell step, the pattern made for the other potential's first-order guess is
#: checked against a search of every cluster pair at the potentials it gives (and gains
#: the pairs it lacks) up to this many times: on the clusters against a ball at N = 2,000
#: the pattern for the guess lacked pairs, the softmin over it overestimated the dual's
#: rise, and the updates after the step stalled at a marginal error of 0.24
CELL_CHECKS = 3
#: a softmin over the pattern sums the other direction's chunks by columns where that
#: direction's clusters hold this many times as many points on average: a chunk's matrix
#: product is short where its rows are a small cluster's points. Measured (two cores,
#: float32, one pattern each way): eight tight clusters against a uniform ball (N = 5,000,
#: 17 against 653 cells, 4.3 million pairs) 14 ms by columns against 27 ms by the small
#: cells' rows; two spheres of radii 1 and 0.5 (465 against 128 cells, a ratio of 3.6)
#: 21 ms by columns against 16 ms by rows; cells of equal sizes 2 to 3 times slower by
#: columns
COLUMNS_RATIO = 8.0
#: the search for a first pattern goes through coarser clusters above this many cluster pairs
HIERARCHY_MIN_PAIRS = 1 << 24
#: the coarse stage runs while the blur is above this fraction of the cluster scale
JUMP = 0.5
#: ``multiscale="auto"`` needs a blur below this many cell sides. Measured (divergence with
#: its gradient, N = 5,000, two cores, cell side 0.2 to 0.23): every pair against multiscale
#: took 2.51 / 0.89 s on the clusters against a ball at blur 0.1, 1.59 / 1.20 at 0.2,
#: 1.39 / 1.50 at 0.3; on two noisy spheres 2.23 / 0.52, 1.63 / 0.87, 1.41 / 1.71
AUTO_MAX_BLUR = 1.0
#: truncation (in units of the current eps) during the annealing
ANNEAL_TRUNCATE = 3.0
#: at the final eps the softmins sum over a list of the pattern's point pairs
#: (:class:`PairList`) whose slack was within ``truncate + margin`` eps, while the
#: potentials have moved by less than ``margin`` eps since (then no pair of the pattern
#: the list dropped is above ``exp(-truncate)`` of its row); past that, the pattern's
#: softmin runs and the list is rebuilt from it. The first margin; a list that would hold
#: too many pairs (below) is tried again at half the margin, down to ``LIST_MIN_MARGIN``.
#: Measured with the list's sparse matrix-vector products (benchmarks/sinkhorn_family.py,
#: N = 5,000, divergence with its gradient, two cores): on the clusters against a ball
#: (1,300 iterations) 20, 30, 40 and 60 eps took 7.9, 7.0, 6.3 and 27 s (at 60 the list
#: held too many pairs and the pattern's softmins ran); on noisy spheres 0.5 apart 0.83,
#: 0.69 and 0.73 s at 20, 40 and 60 eps; on two brain surfaces (where the list does not
#: pay) the same 5.0 to 5.6 s. (With the earlier gathers and scatters a pair, 20 eps was
#: the fastest: the clusters took 18.9, 12.0, 11.0, 13.5 and 28.2 s at 5, 10, 20, 40, 80.)
LIST_MARGIN = 40.0
#: the smallest margin a list is tried at before the pattern's softmins are kept
LIST_MIN_MARGIN = 10.0
#: ... if it holds at most this fraction of the cluster pattern's pairs (a blur larger than
#: the points' spacing keeps many pairs a point: the blocks' matrix products are faster then)
LIST_FRACTION = 0.1
#: ... and at most this many pairs (about 40 bytes each)
LIST_MAX_PAIRS = 1 << 24
#: where no list pays, the final eps's softmins sum the pattern's factors, stored
#: (:class:`BlockFactors`) if their padded chunks take at most this many bytes
FACTOR_MAX_BYTES = 1 << 28
#: ... made again once the potentials' moves from theirs differ by more than this many eps
FACTOR_SPREAD = 30.0


def auto_cluster_scale(diameter: float, n_points: int, dim: int) -> float:
    """Default cell side: ``diameter * n ** (-1/3)`` (for 3-D clouds), which balances the
    coarse dense problem against the truncated fine one."""
    return diameter * n_points ** (-1.0 / max(dim, 1))


def worthwhile(
    n_pairs: int, dim: int, blur: float, scale: float, fast_all_pairs: bool = False
) -> bool:
    """Whether truncation pays: at least ``MIN_PAIRS`` pairs (``MIN_PAIRS_GPU`` where a GPU
    kernel sums every pair), D <= 3, and a blur below ``AUTO_MAX_BLUR`` times the cell side
    (beyond, the truncation keeps nearly every pair)."""
    least = MIN_PAIRS_GPU if fast_all_pairs else MIN_PAIRS
    return dim <= 3 and n_pairs >= least and blur < AUTO_MAX_BLUR * scale


def multiscale_unfit(cost, form: str, backward: str) -> str | None:
    """Why options rule the multiscale solver out (``None`` when they do not): it needs the
    squared Euclidean cost, the log form and the envelope backward."""
    if cost.p != 2:
        return f"the cost is {cost.name!r} (multiscale needs 'sqeuclidean')"
    if form != "log":
        return f"form is {form!r} (multiscale needs 'log')"
    if backward != "envelope":
        return f"backward is {backward!r} (multiscale needs 'envelope')"
    return None


def _fewest_within(truncate: float, margin: float) -> float:
    """The least fraction of the pairs within ``truncate + margin`` eps that stay within
    ``truncate + margin / 2``: in a D-dimensional cloud the pairs within a slack s of a
    point's best number about s^(D / 2) (a ball of radius sqrt(2 s)), at most D = 3."""
    return ((truncate + margin / 2) / (truncate + margin)) ** 1.5


def _pattern_pairs(
    cx: Clusters,
    cy: Clusters,
    fx,
    gy,
    dx,
    dy,
    threshold: float,
    candidates=None,
    scale: float | None = None,
    block: int = 1 << 20,
):
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
        for rho, r in (
            ((delta - dx[I]).norm(dim=-1), cy.radii[J]),
            ((delta + dy[J]).norm(dim=-1), cx.radii[I]),
        ):
            out.append(half_sq - rho**2 / 2 + (rho - R).clamp_min(0) ** 2 / 2 - d_sum * r)
        return torch.maximum(*out) - F[I] - G[J]

    Kx, Ky = cx.n_clusters, cy.n_clusters
    if candidates is not None:
        cI, cJ = candidates
        chunks = [(cI[k : k + block], cJ[k : k + block]) for k in range(0, len(cI), block)]
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


def _listed_softmin(listed, pot: torch.Tensor, transpose: bool):
    """The softmin of ``pot`` over a pair list or stored factors (over the rows' other side,
    or the columns' if ``transpose``) and the moves (df, dg) of the two potentials it gives
    from the list's reference ones."""
    out = listed.softmin_cols(pot) if transpose else listed.softmin_rows(pot)
    f, g = (pot, out) if transpose else (out, pot)
    return out, f - listed.f0, g - listed.g0


def _parent_candidates(
    cx: Clusters, cy: Clusters, fx, gy, threshold: float, scale: float, block: int
):
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
    P, Q = _pattern_pairs(px, py, pfx, pgy, pdx, pdy, threshold, scale=2 * scale, block=block)
    (sx, nx, ox), (sy, ny, oy) = (_children(of) for of in (ofx, ofy))
    count = nx[P] * ny[Q]  # child pairs of each kept parent pair
    ends = torch.cumsum(count, 0)
    marks = torch.tensor(range(block, int(ends[-1]), block), dtype=ends.dtype, device=ends.device)
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
        0, lab, dx[:, :, None] * dx[:, None, :]
    )
    rhs = torch.zeros(K, D, dtype=f.dtype, device=f.device).index_add_(0, lab, dx * df[:, None])
    ridge = (
        1e-3 * cov.diagonal(dim1=1, dim2=2).sum(-1)
        + 1e-12 * float(c.radii.max()) ** 2
        + torch.finfo(f.dtype).tiny
    )
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


class TruncatedKernel:
    """Softmins over the cluster pairs a truncation pattern keeps, for one problem between
    the clouds x (1, N, D) and y (1, M, D) (or x with itself): the multiscale solver's
    kernel, with the interface of :class:`otreg.ot.kernels.DenseKernel`.

    The clouds are sorted by cluster once; potentials are kept in sorted order during the
    solve (``to_kernel_order`` / ``to_caller_order`` convert). ``coarse_problem`` describes
    the problem on the clusters' centroids that the loop solves first; ``extrapolate``
    extends its potentials to the points.
    """

    refresh_every = REFRESH
    #: what :meth:`cell_step` steps on, for ``result.acceleration``
    step_kind = "cell"
    #: (its coarse stage, always taken, is part of the multiscale solve: no note)
    coarse_story = ""

    def __init__(
        self,
        p,
        x: torch.Tensor,
        a: torch.Tensor,
        y: torch.Tensor | None = None,
        b: torch.Tensor | None = None,
    ) -> None:
        self.p = p
        self.truncate, self.scale = p.multiscale.truncate, p.multiscale.cluster_scale
        self.symmetric = y is None
        self.cx = grid_clusters(x[0], a[0], self.scale)
        self.a = a[:, self.cx.order]
        if self.symmetric:
            self.cy, self.b = self.cx, self.a
        else:
            self.cy = grid_clusters(y[0], b[0], self.scale)
            self.b = b[:, self.cy.order]
        self._a_log, self._b_log = self.a[0].log(), self.b[0].log()
        self._unsort_x = torch.argsort(self.cx.order)
        self._unsort_y = self._unsort_x if self.symmetric else torch.argsort(self.cy.order)
        self._margin = 0.0  # added once, to the first pattern after an extrapolation
        self.kernels: _Kernels | None = None
        self.n_pairs: list[int] = []  # pairs summed by each pattern, for reports
        self.patterns_grown = 0  # patterns that gained pairs (a new map for the loop)
        self._list: PairList | BlockFactors | None = None  # the final eps's kernel
        self._list_pays = True  # False once a list held too many pairs to pay
        self.list_margin = LIST_MARGIN  # halved while a list would hold too many pairs
        self.list_builds = 0  # lists tried, and the pairs of each one used, for reports
        self.list_pairs: list[int] = []
        self.factor_builds = 0  # the pattern's factors stored where no list pays
        self._factors_pay = True  # False once factors were not trusted
        self._finished = False  # True after finish(): softmins keep nothing
        self.pairs_added: list[int] = []  # cluster pairs found missing (verify, refresh)
        self._list_remade = False  # once, after a stall (remake_list)
        self._last_eps: float | None = None  # the eps of the last softmin
        self._search_every, self._refreshes = 1, 0  # searches of every pair (_lacks_pairs)

    # -------------------------------------------------------------- reductions
    def softmin_xy(self, eps: float, g: torch.Tensor) -> torch.Tensor:
        """The softmin over y of log b + g / eps for each x, (1, N); at the final eps in
        float64 (see :meth:`_final_softmin`)."""
        if eps == self.p.eps:
            return self._final_softmin(g[0], transpose=False)[None]
        return self._block_softmin(eps, g[0], transpose=False)[None]

    def softmin_yx(self, eps: float, f: torch.Tensor) -> torch.Tensor:
        """The softmin over x of log a + f / eps for each y, (1, M) (as :meth:`softmin_xy`)."""
        if eps == self.p.eps:
            return self._final_softmin(f[0], transpose=True)[None]
        return self._block_softmin(eps, f[0], transpose=True)[None]

    def _block_softmin(self, eps: float, pot: torch.Tensor, transpose: bool) -> torch.Tensor:
        """The softmin over the kept cluster pairs, in the points' dtype; summed over the
        columns of the other direction's chunks where that direction's clusters are
        ``COLUMNS_RATIO`` times as large (:meth:`BlockSparse.softmin_columns`) and nothing
        needs its gradient."""
        self._last_eps = eps
        pot = pot.to(self.cx.points.dtype)
        if self._by_columns(pot, transpose):
            if transpose:
                h = self._a_log + pot / eps
                return self.kernels.xy.softmin_columns(self.cx.points, self.cy.points, h, eps)
            h = self._b_log + pot / eps
            return self.kernels.yx.softmin_columns(self.cy.points, self.cx.points, h, eps)
        if not transpose:
            h = self._b_log + pot / eps
            return self.kernels.xy.softmin(self.cx.points, self.cy.points, h, eps)
        kernel = self.kernels.xy if self.symmetric else self.kernels.yx
        if kernel is None:  # finished (the weights' gradient): made for this softmin only
            I, J = self.kernels.pairs
            kernel = BlockSparse(self.cy, self.cx, J, I, backend=self.kernels.xy.backend)
        h = self._a_log + pot / eps
        return kernel.softmin(self.cy.points, self.cx.points, h, eps)

    def _by_columns(self, pot: torch.Tensor, transpose: bool) -> bool:
        """Whether a softmin over the pattern sums the other direction's chunks by columns:
        their rows, the clusters of the other cloud, hold ``COLUMNS_RATIO`` times as many
        points on average (torch path, no gradient wanted)."""
        if self.symmetric or self.kernels.yx is None or self._finished:
            return False
        own, other = (self.cy, self.cx) if transpose else (self.cx, self.cy)
        if other.points.shape[0] * own.n_clusters < (
            COLUMNS_RATIO * own.points.shape[0] * other.n_clusters
        ):
            return False
        grad = torch.is_grad_enabled() and (
            pot.requires_grad or self.cx.points.requires_grad or self.cy.points.requires_grad
        )
        return not grad and not self.kernels.xy.uses_triton(self.cx.points)

    def _final_softmin(self, pot: torch.Tensor, transpose: bool) -> torch.Tensor:
        """A softmin at the final eps, in float64: over the pair list (or the pattern's
        stored factors, where no list pays) while the potentials stay within its margin,
        else over the cluster pattern (the list or the factors then made again from it).
        The list's softmin is its reference potential plus a small correction, so that
        float64 potentials keep the marginals' rounding far below float32's u |f| / eps (4e-3
        for potentials of size 2 at eps 1e-4, which stalled the loop above tol)."""
        pot = pot.double()
        # pot was summed at a larger eps (the annealing's last): a list made now would
        # hold pairs for potentials the next update moves far from (rows with no pair)
        stale = self._last_eps not in (None, self.p.eps)
        listed = self._list
        if listed is not None and not self._finished:
            out, df, dg = _listed_softmin(listed, pot, transpose)
            if listed.holds(df, dg) if isinstance(listed, BlockFactors) else self._within(df, dg):
                return out
            if isinstance(listed, PairList) and self._list_near(listed.f0 + df, listed.g0 + dg):
                out, df, dg = _listed_softmin(self._list, pot, transpose)
                if self._within(df, dg):
                    return out
        out = self._block_softmin(self.p.eps, pot, transpose).double()
        if self._finished:  # a softmin for the gradient: nothing more to keep
            return out
        f, g = (pot, out) if transpose else (out, pot)
        if self._list_pays:
            if not stale:
                self._build_list(f, g)
        elif self._factors_pay and not transpose:  # the factors' rows need f exact
            self._store_factors(f, g)
        return out

    def rounding_floor(self, eps: float, *potentials: torch.Tensor) -> float:
        """The marginals' rounding noise (the stall rule's floor): on a pair list, the
        points' dtype's at the size of its scores (``truncate + list_margin``), since the
        potentials are float64; else at the size of the potentials over eps."""
        dtype = self.cx.points.dtype
        if eps == self.p.eps and isinstance(self._list, BlockFactors):
            return torch.finfo(dtype).eps * (self.truncate + FACTOR_SPREAD)
        if eps == self.p.eps and self._list is not None:
            return torch.finfo(dtype).eps * (self.truncate + self.list_margin)
        return rounding_floor(eps, *potentials, dtype=dtype)

    def _within(self, df: torch.Tensor, dg: torch.Tensor) -> bool:
        """Whether potentials that moved by df (N,), dg (M,) since the list was built
        leave every pair it dropped below ``exp(-truncate)`` of its row (NaN: no). A pair's
        slack falls by df_i + dg_j. First the largest rise of f in a cell plus that of g in
        a cell it keeps, over the pattern's cell pairs, against the list's margin; where
        that fails, each point's own smallest dropped slack (``PairList.dropped``) taken
        off its rise: a cell pair holds if its rows' rises beyond their own slack plus its
        columns' largest rise stay below ``-truncate`` eps, or the same with the sides
        swapped. On Gaussian clouds most rises past the margin are a few outliers', whose
        dropped pairs were far: 28 lists made instead of 59 at N = 5,000."""
        I, J = self.kernels.pairs
        rise_f, rise_g = self.cx.per_cluster_max(df), self.cy.per_cluster_max(dg)
        rises = rise_f[I] + rise_g[J]
        eps = self.p.eps
        if float(rises.max()) <= self.list_margin * eps:
            return True
        if self._list.dropped is None:  # (a list made without its dropped slacks)
            return False
        dropped_f, dropped_g = self._list.dropped
        by_rows = self.cx.per_cluster_max(df - dropped_f)[I] + rise_g[J]
        by_cols = rise_f[I] + self.cy.per_cluster_max(dg - dropped_g)[J]
        return bool((torch.minimum(by_rows, by_cols) <= -self.truncate * eps).all())

    def _list_near(self, f: torch.Tensor, g: torch.Tensor) -> bool:
        """Make the pair list for potentials f (N,), g (M,) (sorted, float64) near those
        wanted, not a softmin of each other: the softmin an old list just summed, which
        may lack terms of the pairs it dropped and so be too large (a slack smaller: the
        search then keeps more pairs, none fewer). The caller sums the softmin again over
        the new list and keeps it where the list holds at the result (``_within``). This
        spares the softmin over the whole pattern that gives exact potentials to make a
        list from (on the eight clusters against a ball, N = 20,000: 0.3 s for its 114
        million pairs, at each of 34 lists). Whether a list was made: not where f or g is
        not finite (a row of the old list that lost all its pairs) or the list would hold
        too many pairs."""
        if not bool(torch.isfinite(f).all() & torch.isfinite(g).all()):
            return False
        margin = self.list_margin
        self._build_list(f, g)
        if self._list is None:  # (too many pairs: the pattern's softmin next, as before)
            self.list_margin, self._list_pays = margin, True
            return False
        return True

    def _build_list(self, f: torch.Tensor, g: torch.Tensor) -> None:
        """The pairs of the cluster pattern within ``truncate + list_margin`` eps of the
        potentials f (N,), g (M,) (sorted, float64), as the final eps's kernel, if few
        enough (else at half the margin, down to ``LIST_MIN_MARGIN``; then no list)."""
        eps, xy = self.p.eps, self.kernels.xy
        limit = int(min(LIST_FRACTION * xy.n_pairs, LIST_MAX_PAIRS))
        while True:
            threshold = (self.truncate + self.list_margin) * eps
            seen: list[float] = []
            dropped: list[torch.Tensor] = []
            found = close_pairs(
                xy, self.cx.points, self.cy.points, f, g, threshold, limit, seen, dropped
            )
            self.list_builds += 1
            if found is not None:
                break
            expected = seen[0]
            while True:  # halved until a list might fit: tried only then
                if self.list_margin / 2 < LIST_MIN_MARGIN:
                    self._list, self._list_pays = None, False
                    return
                expected *= _fewest_within(self.truncate, self.list_margin)
                self.list_margin /= 2
                if expected <= limit:
                    break
        i, j, slack = found
        self.list_pairs.append(len(i))
        self._list = PairList(
            self.cx.points,
            self.cy.points,
            i,
            j,
            self._a_log,
            self._b_log,
            f,
            g,
            eps,
            slack,
            tuple(dropped),
        )

    def _store_factors(self, f: torch.Tensor, g: torch.Tensor) -> None:
        """The cluster pattern's factors for the potentials f (N,), g (M,) (sorted, float64,
        f the pattern's softmin of g), as the final eps's kernel, if they fit in
        ``FACTOR_MAX_BYTES``, the pattern's softmins run in torch and they are trusted
        (else none; once untrusted, none from then on)."""
        xy, points = self.kernels.xy, self.cx.points
        self._list = None
        if xy.uses_triton(points):
            self._factors_pay = False
        if not self._factors_pay or xy.padded_pairs * points.element_size() > FACTOR_MAX_BYTES:
            return  # (a later, smaller pattern may fit)
        factors = BlockFactors(
            xy, points, self.cy.points, self._a_log, self._b_log, f, g, self.p.eps, FACTOR_SPREAD
        )
        self.factor_builds += 1
        self._list = factors if factors.trusted else None
        self._factors_pay = factors.trusted  # else the pattern's softmins, from now on

    def differentiable_softmin(self, x, y, b, g, eps: float) -> torch.Tensor:
        """The x -> y softmin of log b + g / eps on the final pattern, differentiable in x,
        y and b (caller's order in and out, (1, N))."""
        ox, oy = self.cx.order, self.cy.order
        h = b[0, oy].log() + g[0, oy] / eps
        return self.kernels.xy.softmin(x[0, ox], y[0, oy], h, eps)[self._unsort_x][None]

    def softmin_gradient(self, eps: float, g: torch.Tensor, s: torch.Tensor, w: torch.Tensor):
        """The gradient of ``sum_i w_i s_i``, s = ``softmin_xy(eps, g)`` (1, N), with respect
        to the sorted points: ``(x,)`` or ``(x, y)`` (hand-written, on the current pattern)."""
        dtype = self.cx.points.dtype
        h = self._b_log + g[0].to(dtype) / eps
        xy = self.kernels.xy
        gx, gy, _ = xy.gradients(
            self.cx.points,
            self.cy.points,
            h,
            eps,
            s[0].to(dtype),
            w[0].to(dtype),
            (True, True, False),
        )
        return (gx + gy,) if self.symmetric else (gx, gy)

    def displacement(self, eps: float, pot: torch.Tensor, s: torch.Tensor, transpose: bool):
        """|x_i - T_i| (1, N), T_i the barycentre of row i of the plan at the potential
        ``pot`` of y (``s`` its softmin, (1, N)), on the current pattern: the gradient of s_i
        with respect to x_i; with ``transpose``, |y_j - S_j| (1, M) at the potential of x."""
        dtype = self.cx.points.dtype
        kernel, points, others, w_log = self.kernels.xy, self.cx.points, self.cy.points, self._b_log
        if transpose:
            points, others, w_log = others, points, self._a_log
            if not self.symmetric:
                kernel = self.kernels.yx
        h = w_log + pot[0].to(dtype) / eps
        ones = torch.ones_like(s[0], dtype=dtype)
        grad = kernel.gradients(points, others, h, eps, s[0].to(dtype), ones, (True, False, False))
        return grad[0].norm(dim=-1)[None]

    def to_kernel_order(self, f, g):
        return f[:, self.cx.order], g[:, self.cy.order]

    def to_caller_order(self, f, g):
        return f[:, self._unsort_x], g[:, self._unsort_y]

    # -------------------------------------------------------------- cell steps
    def cell_step(self, f: torch.Tensor, g: torch.Tensor, min_gain: float, previous=None):
        """A Newton step on one constant per cell of f or of g (:mod:`otreg.ot.cells`) at
        the final eps, from f (1, N) and g (1, M) = the softmin of f (sorted; ``previous``,
        the g f is the softmin of, is not used here): on the side
        whose model's diagonal promises more, damped until the dual rises. Returns the new
        (f, g) (the potential that did not step is the softmin of the other), or None
        where no step is taken (the kernels then as they were): no pair list, an
        unbalanced problem, a model's gain below ``min_gain`` eps or no damping
        making the dual rise. Where no damping made it rise and the pattern lacked cluster
        pairs holding a point pair within reach (:meth:`_gain_lacking_pairs`), the pattern
        gains them and ``cells.NOT_NOW`` says to try again later: on one draw of the
        clusters against a ball (N = 5,000, seed 11 of benchmarks/sinkhorn_family.py's),
        the pattern three updates into the final eps lacked the pairs of 18 points of the
        ball (their softmins 560 eps too large), no damping raised the dual, and the
        updates went on without steps: 1,789 of them, against 209 (12 steps) with the
        retry. See :meth:`_stepped` for how the step's softmin is summed."""
        eps = self.p.eps
        if not isinstance(self._list, PairList) or self.p.damping(eps) != 1:
            return None
        a, b = self.a[0].double(), self.b[0].double()
        f, g = f[0].double(), g[0].double()
        models = {}
        if self.cx.n_clusters <= cells.MAX_CELLS:  # f's cells, g eliminated
            entries = self._list.plan(f, b, transpose=True)
            models["f"] = cells.cell_model(*entries, self.cx.labels, self.cx.masses.double(), b)
        if self.cy.n_clusters <= cells.MAX_CELLS:  # g's cells, f eliminated
            entries = self._list.plan(g, a)
            models["g"] = cells.cell_model(*entries, self.cy.labels, self.cy.masses.double(), a)
        if not models:
            return None
        side = max(models, key=lambda k: models[k].diagonal_gain())
        model = models[side]
        first = model.step(eps, cells.DAMPING[0])
        if model.gain(first, eps) < min_gain:
            return None

        def dual(f, g):
            return float((a * f).sum() + (b * g).sum())

        start = dual(f, g)
        before = (self.kernels, self._list)
        for k, damping in enumerate(cells.DAMPING):
            alpha = model.step(eps, damping, cells.TRUST * cells.SHRINK**k) if k else first
            stepped = self._stepped(side, f, g, model, alpha)
            if stepped is not None and dual(*stepped) > start:
                if self._list is None and self._list_pays:  # a far step: a list where it led
                    self._build_list(*stepped)
                return stepped[0][None], stepped[1][None]
            self.kernels, self._list = before
        # no damping raised the dual: where the pattern lacked pairs that matter, its
        # sums (the model, the duals) were off; it gains them, and a step is tried later
        if self._gain_lacking_pairs(f[None], g[None], self.truncate * eps):
            return cells.NOT_NOW
        return None

    def _stepped(self, side: str, f, g, model, alpha):
        """``(f, g)`` (float64, (N,), (M,)) after the step ``alpha`` on the cells of f (``side``
        "f") or of g, the other potential the softmin of the one that stepped; None where
        the pattern still lacks pairs after ``CELL_CHECKS`` searches.

        Where that softmin over the pair list leaves the list within its margin (as an
        update does), that is all: the step costs about two updates. Otherwise the cells
        moved far: the pattern is searched again over every cluster pair for the
        first-order guess of the other potential, with ``CELL_MARGIN`` eps to spare, the
        softmin is summed over its blocks, and the pattern must hold every pair that a
        search of all keeps at the result (:meth:`verify`, which adds those it lacks, and
        the softmin is summed again). No list is made for a step that may not be taken:
        :meth:`cell_step` makes one where a step taken led (from the other potential
        summed here, which spares the next update a softmin over the blocks). (A list made
        for the guess instead of the softmin over the blocks, on the eight clusters against
        a ball at N = 20,000: 9 block softmins of 0.26 s spared, 5 more lists of 0.6 s.)"""
        transpose = side == "f"
        moved = (f if transpose else g) + alpha[(self.cx if transpose else self.cy).labels]
        listed = self._list
        if transpose:
            f_new, g_new = moved, listed.softmin_cols(moved)
        else:
            f_new, g_new = listed.softmin_rows(moved), moved
        if self._within(f_new - listed.f0, g_new - listed.g0):
            return f_new, g_new
        change = model.eliminated_change(alpha)
        f_new, g_new = (moved, g + change) if transpose else (f + change, moved)
        self._margin = CELL_MARGIN
        self.refresh(f_new[None], g_new[None], self.p.eps, full=True)  # (the list goes)
        for _ in range(CELL_CHECKS):
            other = self._block_softmin(self.p.eps, moved, transpose).double()
            f_new, g_new = (moved, other) if transpose else (other, moved)
            if self.verify(f_new[None], g_new[None]):
                return f_new, g_new
        return None

    # -------------------------------------------------------------- patterns
    def _bound_potentials(self, f, g, lam):
        # the row terms are exp((f/lam + g - C)/eps) (unbalanced: f = lam softmin): use the
        # larger of f and f / lam on each side, which keeps more pairs, never fewer
        return torch.maximum(f, f / lam), torch.maximum(g, g / lam)

    def refresh(self, f, g, eps: float, full: bool = False) -> None:
        """Rebuild the kernels for the potentials f (1, N), g (1, M) (sorted) at this eps.

        The threshold is ``truncate`` times the final eps, or ``ANNEAL_TRUNCATE`` times the
        current one if larger (the annealing's potentials need less accuracy), plus
        ``FIRST_MARGIN`` times eps for the first pattern after an extrapolation. ``full``
        searches every cluster pair; otherwise only the current pattern's pairs, and the
        kernels are rebuilt only if at least a quarter of them can go. At the final eps a
        refresh searches every cluster pair now and then (:meth:`_lacks_pairs`).
        """
        threshold = max(ANNEAL_TRUNCATE * eps, self.truncate * self.p.eps) + self._margin * eps
        self._margin = 0.0
        refresh = not full and self.kernels is not None
        final = eps == self.p.eps and not self.symmetric  # (a cloud against itself: no drift)
        if refresh and final and self._lacks_pairs(f, g, threshold):
            return
        candidates = self.kernels.pairs if refresh else None
        I, J = self._search(f, g, eps, threshold, candidates)
        if refresh and len(I) > KEEP_FRACTION * len(candidates[0]):
            return  # the current kernels hold every pair that matters
        self._use_pattern(I, J, subset=refresh)
        if full:
            self._finished = False

    def _lacks_pairs(self, f, g, threshold: float) -> bool:
        """Whether a search of every cluster pair at the final eps's potentials f (1, N),
        g (1, M) found cluster pairs missing from the pattern that hold a point pair within
        ``truncate + VERIFY_MARGIN`` eps (:meth:`_hold_close_pairs`): the pattern then has
        them, and those within ``VERIFY_MARGIN`` eps more (a new pattern, and a new pair
        list).

        A refresh among the pattern's own pairs only drops pairs, and potentials far from
        converged move pairs it dropped back within reach: on two Gaussian clouds (N =
        2,100, 2-D, blur 0.05) the pattern lacked 5,030 of the 9,009 cluster pairs a search
        kept after 300 updates, and the loop stalled at a marginal error of 0.02 with a cost
        15% off (every pair: converged in 62 updates). The search is made at the first
        refresh (from the second, 2-D Gaussians of 600 and 1,000 points still diverged),
        then at intervals doubled after each search that found no missing cluster pair
        holding a point pair within reach, and back to one refresh after one that found
        some; a cloud against itself is not searched (its averaged updates start near the
        solution). On two noisy spheres 0.25 apart (N = 5,000) every search found 12 to 105
        cluster pairs missing, none holding a point pair within reach (the cells' bound is
        loose there): searched at each of 31 refreshes the call took 1.57 s, with the
        doubled intervals 1.26 s (1.15 s without searches). A new pattern is a new map for
        the loop: its Anderson mixing starts again (:func:`otreg.ot.loop._pair_updates`)."""
        self._refreshes += 1
        if self._refreshes < self._search_every:
            return False
        self._refreshes = 0
        if not self._gain_lacking_pairs(f, g, threshold):
            self._search_every *= 2
            return False
        self._search_every = 1  # the pattern is drifting: searched at each refresh
        return True

    def _gain_lacking_pairs(self, f, g, threshold: float) -> bool:
        """Whether a search of every cluster pair at the final eps's potentials f (1, N),
        g (1, M) found cluster pairs missing from the pattern that hold a point pair within
        ``truncate + VERIFY_MARGIN`` eps (:meth:`_hold_close_pairs`); if so, the pattern
        gains them and those within ``VERIFY_MARGIN`` eps more of ``threshold``."""
        Ky = self.cy.n_clusters
        held = self.kernels.pairs[0] * Ky + self.kernels.pairs[1]
        I, J = self._search(f, g, self.p.eps, threshold)
        lacking = ~torch.isin(I * Ky + J, held)
        missing = int(lacking.sum())
        # none, or none holding a point pair within reach (the cells' bound is loose there)
        if not missing or not self._hold_close_pairs(f, g, I[lacking], J[lacking]):
            return False
        I, J = self._search(f, g, self.p.eps, threshold + VERIFY_MARGIN * self.p.eps)
        self._use_pattern(I, J, subset=False)
        self.pairs_added.append(missing)
        return True

    def _hold_close_pairs(self, f, g, I, J) -> bool:
        """Whether the cluster pairs (I, J) hold a point pair whose slack at the final eps's
        potentials f (1, N), g (1, M) (sorted) is within ``truncate + VERIFY_MARGIN`` eps:
        every pair of each cell pair, in float64, a chunk of cell pairs at a time."""
        threshold = (self.truncate + VERIFY_MARGIN) * self.p.eps
        cx, cy = self.cx, self.cy
        x, y = cx.points, cy.points  # gathered, then widened: no float64 copy of the clouds
        f, g = f[0].double(), g[0].double()
        wx, wy = int(cx.sizes[I].max()), int(cy.sizes[J].max())
        ax, ay = torch.arange(wx, device=x.device), torch.arange(wy, device=y.device)
        step = max(1, (1 << 22) // (wx * wy))
        for k in range(0, len(I), step):
            cI, cJ = I[k : k + step], J[k : k + step]
            i = cx.starts[cI, None] + ax  # (P, wx): the cells' points, past their ends masked
            j = cy.starts[cJ, None] + ay
            i_in, j_in = ax < cx.sizes[cI, None], ay < cy.sizes[cJ, None]
            i, j = i.clamp_max(len(f) - 1), j.clamp_max(len(g) - 1)
            sq = torch.cdist(x[i].double(), y[j].double()).square() / 2  # (P, wx, wy)
            slack = sq - f[i][:, :, None] - g[j][:, None, :]
            slack = slack.masked_fill(~(i_in[:, :, None] & j_in[:, None, :]), math.inf)
            if bool((slack <= threshold).any()):
                return True
        return False

    def _search(self, f, g, eps: float, threshold: float, candidates=None):
        """The cluster pairs (I, J) whose slack's lower bound at the potentials f (1, N),
        g (1, M) (sorted) is within ``threshold``: among ``candidates``, or all."""
        f, g = f[0].to(self.cx.points.dtype), g[0].to(self.cx.points.dtype)
        fb, gb = self._bound_potentials(f, g, self.p.damping(eps))
        dx = _cluster_gradients(self.cx, f)
        dy = dx if self.symmetric else _cluster_gradients(self.cy, g)
        return _pattern_pairs(self.cx, self.cy, fb, gb, dx, dy, threshold, candidates, self.scale)

    def _use_pattern(self, I: torch.Tensor, J: torch.Tensor, subset: bool) -> None:
        """Sum over the cluster pairs (I, J) from here; ``subset``: they are among the
        current pattern's (a pair list or stored factors made from it still hold)."""
        backend = {"auto": "auto", "triton": "triton"}.get(self.p.backend, "torch")
        xy = BlockSparse(self.cx, self.cy, I, J, backend=backend)
        yx = xy if self.symmetric else BlockSparse(self.cy, self.cx, J, I, backend=backend)
        self.kernels = _Kernels(xy, yx, (I, J))
        if not subset:  # made from a pattern the new one is not a subset of
            self._list = None
            self.patterns_grown += 1
        self.n_pairs.append(xy.n_pairs)

    def verify(self, f, g) -> bool:
        """Whether the pattern holds every cluster pair that a search of all of them keeps
        at the final eps's potentials f (1, N), g (1, M) (sorted); if not, it gains them
        (the updates must then go on). The pattern is refreshed among its own pairs, which
        is fast but loses pairs that matter where the potentials move far from those it
        was built for: on two uniform clouds in a square (N = 5,000, blur 0.005, below the
        points' spacing) the default call converged on such a pattern, to a divergence 1%
        off. At the potentials where the loop stops, a search of every cluster pair (0.01
        to 0.2 s at N = 5,000 on two cores) found pairs missing on each problem of
        benchmarks/sinkhorn_family.py too (97 of 4,286 on the spheres)."""
        eps, Ky = self.p.eps, self.cy.n_clusters
        held = self.kernels.pairs[0] * Ky + self.kernels.pairs[1]
        I, J = self._search(f, g, eps, self.truncate * eps)
        if bool(torch.isin(I * Ky + J, held).all()):
            return True
        # the pairs within a margin too, which the updates from here are likely to need
        I, J = self._search(f, g, eps, (self.truncate + VERIFY_MARGIN) * eps)
        found = I * Ky + J
        missing = found[~torch.isin(found, held)]
        key = torch.unique(torch.cat([held, missing]))  # the union: the pattern only grows
        self._use_pattern(key // Ky, key % Ky, subset=False)
        self.pairs_added.append(len(missing))
        return False

    def remake_list(self) -> bool:
        """Drop the pair list so that the next softmin makes it again at the current
        potentials, once, after the final updates stalled on its rounding floor (its
        scores are relative to the potentials it was made for: the rounding of a softmin
        grows with the potentials' moves since). Whether it did."""
        if not isinstance(self._list, PairList) or self._list_remade:
            return False
        self._list, self._list_remade = None, True
        return True

    #: no float64 promotion: the final softmins already sum in float64 (see
    #: :meth:`rounding_floor`)
    promotable = False

    def finish(self, f, g, eps: float) -> None:
        """The last pattern, for the converged potentials (sorted); then keep only what the
        gradient needs: the x -> y kernel (the dual value's one reduction) without its
        cached geometry, so that finished problems hold little memory while the others are
        solved."""
        self.refresh(f, g, eps)
        self._list = None
        self.kernels.yx = None
        self.kernels.xy.release_geometry()
        self._finished = True

    # -------------------------------------------------------------- coarse stage
    def coarse_problem(self):
        """``(problem, X, A, Y, B)``: the eps-scaling on the clusters' centroids (masses A,
        B; Y and B None for a cloud against itself) while the blur is above ``JUMP`` times
        the cluster scale, no iteration past it; itself multiscale when that pays."""
        p = self.p
        coarse = [e for e in p.schedule[:-1] if e > (JUMP * self.scale) ** p.cost.p]
        if not coarse:
            coarse = p.schedule[:1]
        X, A = self.cx.centres[None], self.cx.masses[None]
        Y, B = (None, None) if self.symmetric else (self.cy.centres[None], self.cy.masses[None])
        Yc = X if Y is None else Y
        sub_scale = auto_cluster_scale(
            bounding_diameter(X, Yc), max(X.shape[1], Yc.shape[1]), X.shape[-1]
        )
        recurse = worthwhile(
            X.shape[1] * Yc.shape[1], X.shape[-1], math.sqrt(coarse[-1]), sub_scale
        )
        self._coarse_eps = coarse[-1]
        problem = dataclasses.replace(
            p,
            schedule=coarse,
            max_iter=len(coarse),
            tol=0.0,
            relaxation=1.0,
            multiscale=None,
        )
        if recurse:  # (a scale of 0, every centroid in one cell, never recurses)
            sub = dataclasses.replace(p.multiscale, cluster_scale=sub_scale, auto=False)
            problem = dataclasses.replace(problem, multiscale=sub)
        return problem, X, A, Y, B

    def extrapolate(self, fc: torch.Tensor, gc: torch.Tensor):
        """The coarse potentials (1, Kx), (1, Ky) extended to the points to first order,
        sorted, (1, N) and (1, M): f(x_i) = f_I + <c_I - T_I, x_i - c_I> with T_I the
        barycentre of the coarse plan's row I."""
        p, eps = self.p, self._coarse_eps
        X, A = self.cx.centres[None], self.cx.masses[None]
        Y, B = (X, A) if self.symmetric else (self.cy.centres[None], self.cy.masses[None])
        tx = reductions.softmax_average(X, Y, B.log() + gc / eps, Y, eps, p.cost, p.backend)[0]
        dx = self.cx.centres - tx
        if self.symmetric:
            dy = dx
        else:
            ty = reductions.softmax_average(Y, X, A.log() + fc / eps, X, eps, p.cost, p.backend)[0]
            dy = self.cy.centres - ty
        f = fc[0][self.cx.labels] + _dot_rel(self.cx, dx)
        g = gc[0][self.cy.labels] + _dot_rel(self.cy, dy)
        self._margin = FIRST_MARGIN
        return f[None], g[None]
