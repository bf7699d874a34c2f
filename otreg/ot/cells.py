r"""Steps beyond the updates: Newton steps on one constant per cell of a Sinkhorn
potential, and exact shifts of the potentials of a few far points.

Where one cloud's points form groups that the plan links to the other cloud weakly (tight
clusters against a uniform ball), the alternating updates balance the groups' masses
slowly: the potentials' error is then nearly a constant on each group. Measured on eight
clusters of 625 points (std 0.02) against a uniform unit ball at blur 0.01: at the start
of the final eps the clusters' mean errors were -580 to +490 eps and the error within a
cluster 61 eps (std); 50 updates brought the latter to 13 eps, but the clusters' means
still took 1,000 updates to fall to 70 eps. A step on the cells' constants removes most of
such an error at once.

With f's cells ``I`` (the multiscale solver's grid cells) and ``g`` eliminated (each column
of the plan summing to its weight ``b_j``), the semi-dual ``F(f) = <a, f> + <b, g(f)>``
restricted to ``f + sum_I alpha_I 1_I`` has the gradient ``a_I - R_I`` (the cell's mass
minus its points' total in the plan) and the Hessian ``-(diag(R) - Q diag(1/b) Q^T) / eps``
with ``Q_Ij`` the plan's mass between cell ``I`` and point ``j``. The step solves the
damped (Levenberg-Marquardt) system ``(H + mu diag(H)) alpha = eps (a - R)`` with ``H =
diag(R) - Q diag(1/b) Q^T``, a constant mode fixed (F does not change when every cell
moves together), and is scaled down to at most ``TRUST`` eps (a quarter as much at each
larger damping: a cell the plan links weakly has a tiny diagonal, which damping barely
shrinks). The same holds with the roles of f and g swapped. The side that steps is the
one whose diagonal alone promises more (``diagonal_gain``), so that only its Hessian, a
sparse product of cost growing with its cells, is made.

Two earlier tries differ (docs/guide/ot.md, "Tried on the final iterations"): Newton's
method on every point's potential (the semi-dual's Hessian over points is nearly singular
there) and a correction of one constant per cell solved on the cells' aggregated plan
(which moves a whole cell of the other cloud with it: the points on the border between
two clusters' regions cannot change sides). Here the other potential stays per point and
is eliminated exactly, so that the model knows which points switch, and the system has
one unknown per cell (17 and 664 on the problem above).

Far points (:func:`far_point_shifts`). Over every pair (heavy-tailed clouds, which the
multiscale solver does not take), a few far points of y whose column of the plan holds the
wrong mass can hold the updates for a hundred iterations: the points of x that serve such
a point send it most of their mass, so that raising its potential lowers theirs and
barely changes what it receives, until the potential has risen enough for other points of
x to reach it. A quadratic model cannot take that (its Hessian is nearly flat there,
then steep: on the fourth heavy-tailed draw of ``benchmarks/sinkhorn_family.py`` the
Newton steps on singletons asked for 180 to 1,000 eps and lowered the dual; shrunk to 15
to 20 eps they were taken and undone by the next updates). The semi-dual in one such
point's potential, f eliminated, is concave and its maximum solves a monotone equation
in one unknown, ``sum_i a_i sigma(z_ij + u_j) = b_j`` (sigma the logistic function, z_ij
the point's logit in row i against the row's other terms, u_j its shift in eps), which
Newton's method, kept in a bracket, solves in a few passes over the (N, K) logits.
"""

from __future__ import annotations

import functools

import torch

__all__: list[str] = []

#: a cell step is tried after the first ``FIRST_AT`` final updates (they bring the error
#: within the cells down), then after every ``EVERY``, until one is not taken. Measured
#: on the clusters against a ball (divergence with its gradient, two cores, back to back):
#: a first step after 3 updates instead of 10, 139 iterations and 2.37 s at N = 5,000
#: against 164 and 2.9 s; after 1 or 5 updates, 147 and 175 iterations
EVERY = 10
FIRST_AT = 3
#: the damping factors tried, in order, until the dual rises
DAMPING = (1e-2, 1e-1, 1.0, 10.0)
#: no cell moves by more than this many eps in one step (a cell the plan barely reaches
#: has a tiny Hessian row: undamped, its step would be of 1e9 eps)
TRUST = 1000.0
#: ... and by this factor less at each damping tried after it
SHRINK = 0.25
#: no first step where the model's dual gain is below this many eps (masses sum to one),
#: and no step after one below ``MIN_GAIN``. Measured (blur 0.01, two cores): the clusters
#: against a ball's first steps promise 12 to 42 eps (N = 1,000 to 5,000), noisy spheres'
#: 0.13 to 0.9; on the spheres steps did not pay (N = 20,000, 0.25 apart: 242 iterations
#: and 4.5 s with them, 192 and 3.7 s without; at N = 5,000 about the same time)
FIRST_GAIN = 2.0
#: ... while on the clusters each later step, down to a promise of 0.01 eps, takes what
#: some 10 updates would not: 167 iterations and 10 steps at N = 5,000, where steps that
#: stopped below 2 eps took 275 iterations and 2 steps (185 against 361 at N = 1,000, 186
#: against 590 at N = 20,000)
MIN_GAIN = 0.01
#: a side with more cells than this takes no step (its dense K x K solve would cost more
#: than the updates it saves)
MAX_CELLS = 2048


class CellModel:
    """The dual's quadratic model in one constant per cell of one side's potential, the
    other side's eliminated.

    Attributes:
        masses: ``(K,)`` the cells' masses.
        totals: ``(K,)`` the cells' totals in the plan (R).
        gradient: ``(K,)`` the masses minus the totals.
        entries: ``(rows, cells, q)``: the plan's mass ``q`` between each eliminated point
            and each cell it reaches (sorted by row, then cell).
        weights: ``(n,)`` the eliminated side's weights w.
    """

    def __init__(self, masses, totals, entries, weights) -> None:
        self.masses, self.totals, self.gradient = masses, totals, masses - totals
        self.entries, self.weights = entries, weights
        rows, cells, q = entries
        self._scaled = q / weights.index_select(0, rows).sqrt()
        self.diagonal = totals - torch.zeros_like(totals).index_add_(0, cells, self._scaled**2)

    @functools.cached_property
    def hessian(self) -> torch.Tensor:
        """``(K, K)`` ``diag(R) - Q diag(1/w) Q^T`` (eps times minus the Hessian): made on
        first use (a sparse product, the model's one cost that grows with K^2)."""
        rows, cells, _ = self.entries
        K, n = len(self.totals), len(self.weights)
        scaled = torch.sparse_coo_tensor(
            torch.stack([rows, cells]), self._scaled, (n, K), check_invariants=False
        )
        coupling = torch.sparse.mm(scaled.t().coalesce(), scaled.coalesce()).to_dense()
        return torch.diag(self.totals) - coupling

    def diagonal_gain(self) -> float:
        """The dual gain, in eps, of the step on the Hessian's diagonal alone (each cell
        as if the others stayed): cheap, to choose the side that steps."""
        d = self.diagonal
        usable = d > 1e-12 * float(d.max())
        return float((self.gradient[usable] ** 2 / d[usable]).sum()) / 2

    def step(self, eps: float, damping: float, trust: float = TRUST) -> torch.Tensor:
        """The damped Newton step ``alpha`` (K,), in the potential's units, scaled down to
        at most ``trust`` eps a cell."""
        H, K = self.hessian, len(self.gradient)
        d = H.diagonal()
        system = H + torch.diag(damping * d + 1e-12 * float(d.max())) + float(d.mean()) / K
        alpha = eps * torch.linalg.solve(system, self.gradient)
        alpha -= (alpha * self.masses).sum() / self.masses.sum()
        over = float(alpha.abs().max()) / (trust * eps)
        return alpha / over if over > 1 else alpha

    def gain(self, alpha: torch.Tensor, eps: float) -> float:
        """The model's dual gain for the step alpha, in eps."""
        quadratic = (alpha * (self.hessian @ alpha)).sum() / (2 * eps)
        return float((self.gradient * alpha).sum() - quadratic) / eps

    def eliminated_change(self, alpha: torch.Tensor) -> torch.Tensor:
        """The eliminated potential's change to first order, (n,): minus the plan's
        average of alpha over each point's cells."""
        rows, cells, q = self.entries
        moved = torch.zeros_like(self.weights).index_add_(0, rows, q * alpha[cells])
        return -moved / self.weights


def cell_model(rows, others, values, cells, masses, weights) -> CellModel:
    """The model for the cells of the non-eliminated side from the plan's entries
    ``(rows, others, values)`` (P,) (float64, sorted by row, then by the other point; rows
    of the eliminated side, each summing to its ``weights`` (n,)), the other points'
    ``cells`` (sorted with the points) and the cells' ``masses`` (K,)."""
    K = len(masses)
    cell = cells.index_select(0, others)
    totals = torch.zeros(K, dtype=values.dtype, device=values.device).index_add_(0, cell, values)
    # each row's mass in each cell: the keys are sorted (cells are sorted with the points)
    keys, where = torch.unique_consecutive(rows * K + cell, return_inverse=True)
    q = torch.zeros(len(keys), dtype=values.dtype, device=values.device).index_add_(
        0, where, values
    )
    return CellModel(masses, totals, (keys // K, keys % K, q), weights)


#: what a kernel's step returns where it takes none at these potentials but may later
NOT_NOW = "not now"
#: a far-point step (:func:`far_point_shifts`) moves the potentials of this many points
FAR_POINTS = 32
#: ... and is taken only where they hold at least this share of the marginal's error
#: (the error is then the far points', not the bulk's): measured at each step's try
#: (every 10 updates), 0.07 to 0.23 on two noisy spheres at N = 1,000, where steps cost
#: Anderson mixing its history (1,730 updates against 422); 0.1 to 0.75 on heavy-tailed
#: clouds, 0.3 to 0.75 at the steps that cut the updates
FAR_CONCENTRATION = 0.3
#: ... the points being at most one in this many of y's (a few points of 200 hold most
#: of the error wherever the plan is near a permutation: there steps cost the mixing its
#: history every 10 updates, 17,033 updates against 11,424 for a tight float64 solve)
FAR_SPARSITY = 64
#: ... and at most this many steps a solve
FAR_MAX_STEPS = 8
#: the points move by their shifts times each of these in turn until the dual rises (each
#: shift is its point's own, the other points held: points that share rows can overshoot
#: together)
FAR_SCALES = (1.0, 0.5, 0.25)
#: where a chosen point's share of a row is above a half, the row's other terms are summed
#: exactly, in at most this many rows (``DenseKernel._far_logits``)
FAR_EXACT_ROWS = 1024
#: ... and is not tried where the chosen points' logits (N, FAR_POINTS, float64) would
#: hold more entries than this (64 MB)
FAR_MAX_ENTRIES = 2**23
#: at most this many passes of Newton's method (each one logistic and one log-sum-exp over
#: the (N, K) logits), until the log of each point's mass received is within ``FAR_TOL``
FAR_PASSES = 50
FAR_TOL = 1e-9
#: a shift not bracketed within this many eps is left at the farthest point tried
FAR_REACH = 2.0**12


def far_point_shifts(z: torch.Tensor, log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """The shifts u (K,), in eps, of K points' potentials that give each point its mass
    with the other side eliminated: ``sum_i a_i sigma(z_ij + u_j) = b_j``, from the logits
    z (N, K) (float64; point j's term in row i against the row's other terms), the rows'
    log-weights ``log_a`` (N,) and the points' ``log_b`` (K,). Each point on its own (the
    other points held), by Newton's method on the log of the mass received, bisecting where
    a step leaves the bracket found by doubling a first shift of 1 eps away from 0, up to
    ``FAR_REACH`` (beyond, the farthest shift tried).

    Example:
        >>> import torch
        >>> z = torch.tensor([[0.0], [-1.0]], dtype=torch.float64)
        >>> log_a = torch.tensor([0.5, 0.5], dtype=torch.float64).log()
        >>> u = far_point_shifts(z, log_a, torch.tensor([0.3], dtype=torch.float64).log())
        >>> total = (0.5 * torch.sigmoid(z[:, 0] + u)).sum()
        >>> round(float(total), 6)
        0.3
    """

    def excess(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The log of the mass each point receives over its own, (K,), and its derivative."""
        logit = z + u
        terms = log_a[:, None] - torch.nn.functional.softplus(-logit)
        received = torch.logsumexp(terms, 0)
        weights = torch.exp(terms - received)  # each row's share of what the point receives
        return received - log_b, (weights * torch.sigmoid(-logit)).sum(0)

    lo = torch.zeros_like(log_b)
    e_lo, d_lo = excess(lo)
    hi = torch.where(e_lo < 0, 1.0, -1.0).to(lo)
    e_hi, d_hi = excess(hi)
    while True:  # double the shift where the sign has not changed
        open_ = torch.sign(e_hi) == torch.sign(e_lo)
        if not bool(open_.any()) or float(hi.abs().max()) >= FAR_REACH:
            break
        pairs = ((hi, lo), (e_hi, e_lo), (d_hi, d_lo))
        lo, e_lo, d_lo = (torch.where(open_, new, old) for new, old in pairs)
        hi = torch.where(open_, 2 * hi, hi)
        e_new, d_new = excess(hi)
        e_hi, d_hi = torch.where(open_, e_new, e_hi), torch.where(open_, d_new, d_hi)
    bracketed = torch.sign(e_hi) != torch.sign(e_lo)
    # Newton's method from the end nearer the root, bisecting where it leaves the bracket
    near_lo = e_lo.abs() < e_hi.abs()
    u, e, d = (torch.where(near_lo, l, h) for l, h in ((lo, hi), (e_lo, e_hi), (d_lo, d_hi)))
    for _ in range(FAR_PASSES):
        done = ~bracketed | (e.abs() <= FAR_TOL)  # (kept: a step of 0 is not inside)
        if bool(done.all()):
            break
        step = u - e / d
        inside = torch.isfinite(step) & ((step - lo) * (step - hi) < 0)
        u = torch.where(done, u, torch.where(inside, step, (lo + hi) / 2))
        e, d = excess(u)
        low = torch.sign(e) == torch.sign(e_lo)
        lo, hi = torch.where(low, u, lo), torch.where(low, hi, u)
    return torch.where(bracketed, u, hi)
