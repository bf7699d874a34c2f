r"""Block-sparse reductions over clustered clouds: the kernel truncation of multiscale
Sinkhorn, and of narrow Gaussian kernels.

The points of each cloud are grouped into the cells of a regular grid (clusters), stored
contiguously (the cloud sorted by cluster). A *pattern* lists the pairs of clusters (I, J)
whose points may interact; the softmin

.. math::

    \mathrm{softmin}_i = -\varepsilon \log \sum_{j \in J(i)}
        \exp(h_j - C(x_i, y_j)/\varepsilon)

then runs over the kept pairs only (and so does :func:`gaussian_product`, the sum
:math:`\sum_{j \in J(i)} \exp(-|x_i - y_j|^2 / 2\sigma^2) v_j`, for the pairs of cells
closer than ``TRUNCATION_SIGMAS`` widths), in chunks of row clusters: each chunk gathers its rows
(padded to the chunk's largest cluster) and the points of the column clusters each row
cluster keeps (padded to the chunk's longest list), and makes one batched matrix product.
Coordinates are taken relative to the row cluster's centre, which keeps float32 scores
accurate at small eps. Clusters are sorted by size, then by list length, so that padding
stays small.

:class:`PairList` sums over an explicit list of point pairs instead (the final iterations
of a plan near a permutation, a few pairs a point), and :func:`close_pairs` finds them in a
pattern; :class:`BlockFactors` sums a pattern's terms computed once (the final iterations
where many pairs a point matter).

No well-kept CPU library does block-sparse log-sum-exp or kernel reductions (KeOps' ``ranges`` do on
its own, slower CPU backend), so this module is written here. Only the squared Euclidean cost
|x - y|^2 / 2 is supported (the truncation bound in :mod:`otreg.ot.multiscale` relies on it).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from . import _dense, _note_backend, _triton
from ._blocked import _softmax_

__all__: list[str] = []


@dataclass
class Clusters:
    """A cloud grouped into K grid cells, points sorted by cell.

    Attributes:
        order: ``(N,)`` the permutation that sorts the cloud by cluster (sorted = x[order]).
        starts: ``(K + 1,)`` offsets of each cluster in the sorted cloud.
        labels: ``(N,)`` the cluster of each sorted point.
        centres: ``(K, D)`` mass-weighted centroids (the plain mean for a massless cell).
        masses: ``(K,)`` total mass of each cluster.
        radii: ``(K,)`` the largest distance from a point of the cluster to its centre.
        points: ``(N, D)`` the sorted cloud.
    """

    order: torch.Tensor
    starts: torch.Tensor
    labels: torch.Tensor
    centres: torch.Tensor
    masses: torch.Tensor
    radii: torch.Tensor
    points: torch.Tensor

    @property
    def n_clusters(self) -> int:
        return self.centres.shape[0]

    @property
    def sizes(self) -> torch.Tensor:
        return self.starts[1:] - self.starts[:-1]

    def per_cluster_max(self, values: torch.Tensor) -> torch.Tensor:
        """The largest of ``values`` (N,) (sorted order) in each cluster, (K,)."""
        out = values.new_full((self.n_clusters,), -torch.inf)
        return out.scatter_reduce_(0, self.labels, values, "amax")


def grid_clusters(x: torch.Tensor, a: torch.Tensor, scale: float) -> Clusters:
    """Group the points ``x`` (N, D) of weights ``a`` (N,) into grid cells of side ``scale``."""
    return clusters_by_label(x, a, grid_labels(x, scale))


def grid_labels(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The grid cell of side ``scale`` holding each point of ``x`` (N, D), numbered 0..K-1."""
    cells = torch.floor((x - x.min(0).values) / scale).long()
    dims = cells.max(0).values + 1
    key = torch.zeros_like(cells[:, 0])
    for d in range(x.shape[1]):
        key = key * dims[d] + cells[:, d]
    return torch.unique(key, return_inverse=True)[1]


def clusters_by_label(x: torch.Tensor, a: torch.Tensor, labels: torch.Tensor) -> Clusters:
    """The clusters of ``x`` (N, D) of weights ``a`` (N,) given each point's label (N,) in
    0..K-1 (every label used)."""
    order = torch.argsort(labels, stable=True)
    labels = labels[order]
    K = int(labels[-1]) + 1
    counts = torch.bincount(labels, minlength=K)
    starts = torch.zeros(K + 1, dtype=torch.long, device=x.device)
    starts[1:] = torch.cumsum(counts, 0)
    xs, as_ = x[order], a[order]
    masses = torch.zeros(K, dtype=x.dtype, device=x.device).index_add_(0, labels, as_)
    weighted = torch.zeros(K, x.shape[1], dtype=x.dtype, device=x.device).index_add_(
        0, labels, xs * as_[:, None]
    )
    plain = torch.zeros_like(weighted).index_add_(0, labels, xs) / counts[:, None]
    centres = torch.where(
        masses[:, None] > 0, weighted / masses.clamp_min(torch.finfo(x.dtype).tiny)[:, None], plain
    )
    dist = (xs - centres[labels]).norm(dim=1)
    radii = torch.zeros(K, dtype=x.dtype, device=x.device).scatter_reduce_(0, labels, dist, "amax")
    return Clusters(order, starts, labels, centres, masses, radii, xs)


def _ranges_of(
    own: Clusters, other: Clusters, I: torch.Tensor, J: torch.Tensor, tile: int
) -> _triton.Ranges:
    """The Triton kernels' view of the pattern ``(I, J)`` (clusters of ``own``, clusters of
    ``other``): tasks of at most ``tile`` points of one cluster of ``own``, and for each
    cluster the runs of consecutive kept clusters of ``other`` as point ranges. Computed on
    the clusters' device: in numpy, these took 0.35 s of a 1.5 s divergence on an H200
    (N = 1e5); on the CPU, torch's sort takes a quarter of numpy's lexsort's time."""
    device = own.starts.device
    I, J = I.to(device, torch.long), J.to(device, torch.long)
    sizes, starts = own.sizes, own.starts[:-1]
    per = -(-sizes // tile)
    n_tasks = int(per.sum())
    owner = torch.repeat_interleave(
        torch.arange(len(sizes), device=device), per, output_size=n_tasks
    )
    first_task = torch.repeat_interleave(per.cumsum(0) - per, per, output_size=n_tasks)
    task_lo = starts[owner] + (torch.arange(n_tasks, device=device) - first_task) * tile
    task_hi = torch.minimum(task_lo + tile, starts[owner] + sizes[owner])
    order = torch.argsort(I * (len(other.starts) + 1) + J)
    I, J = I[order], J[order]
    new = torch.ones(len(I), dtype=torch.bool, device=device)
    new[1:] = (I[1:] != I[:-1]) | (J[1:] != J[:-1] + 1)  # a run of consecutive clusters
    first = torch.nonzero(new).squeeze(1)
    last = torch.cat([first[1:], first.new_tensor([len(I)])]) - 1
    ptr = torch.cat([first.new_zeros(1), torch.bincount(I[first], minlength=len(sizes)).cumsum(0)])
    as_int = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return _triton.Ranges(
        as_int(task_lo), as_int(task_hi), as_int(owner), as_int(ptr),
        as_int(other.starts[J[first]]), as_int(other.starts[J[last] + 1]),
    )  # fmt: skip


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated ``arange(s, s + n)`` for each (s, n): (values, owner of each value)."""
    owner = np.repeat(np.arange(len(lengths)), lengths)
    first = np.cumsum(lengths) - lengths
    return np.repeat(starts, lengths) + (np.arange(owner.size) - first[owner]), owner


def _greedy_chunks(heights: list, widths: list, block: int) -> list:
    """Consecutive slices whose padded size (count x max height x max width) stays within
    ``block`` and, once past ``MIN_CHUNK`` elements, within ``SLACK`` times the elements it
    holds (a slice holds at least one item). Padding is computed for nothing (one chunk of
    clusters of every size padded 3.4x the kept pairs); a chunk costs a few tensor
    operations."""
    out, start, tall, wide, held = [], 0, 0, 0, 0
    for k, (h, w) in enumerate(zip(heights, widths)):
        t, v, a = max(tall, h), max(wide, w), held + h * w
        padded = (k - start + 1) * t * v
        if k > start and (padded > block or (padded > MIN_CHUNK and padded > SLACK * a)):
            out.append(slice(start, k))
            start, t, v, a = k, h, w, h * w
        tall, wide, held = t, v, a
    out.append(slice(start, len(heights)))
    return out


#: a chunk past this many padded elements is cut where its padding would exceed SLACK.
#: Measured on the noisy spheres at blur 0.01 (divergence and gradient): N = 5,000 3.7 s ->
#: 1.9 s (padding 3.4x -> 1.6x the kept pairs); at N = 100,000 chunks down to 2^18 elements
#: ran 15 % slower than 2^19 (smaller matrix products)
MIN_CHUNK = 1 << 19
SLACK = 1.5


class BlockSparse:
    """The softmin of rows (one clustered cloud) over columns (another), restricted to the
    kept cluster pairs ``(I[k], J[k])``.

    Args:
        rows, cols: the two clusterings (the same object for a cloud against itself).
        I, J: ``(P,)`` kept pairs of (row cluster, column cluster); every row cluster must
            keep at least one column cluster.
        block_elements: about how many (row, column) pairs a chunk holds.
        cache_bytes: memory for the chunks' column indices and centred coordinates
            (default 256 MB; gathering and centring them costs as much as the chunk's
            matrix product): the indices first (4 bytes a column slot, slower to rebuild),
            the coordinates in what is left. Chunks beyond it rebuild them at each call, so
            memory stays O(cluster pairs + chunk) however many point pairs the pattern
            holds.
        backend: ``"auto"`` (the Triton kernels on a GPU where Triton imports, the chunked
            torch products elsewhere), ``"triton"`` or ``"torch"``. The Triton kernels sum
            each tile of a cluster's rows over the runs of its kept column clusters,
            stored one after the other (as KeOps' ranges do): no padding, no gathered copy.
    """

    def __init__(
        self,
        rows: Clusters,
        cols: Clusters,
        I: torch.Tensor,
        J: torch.Tensor,
        block_elements: int = 1 << 22,
        cache_bytes: int = 1 << 28,
        backend: str = "auto",
    ) -> None:
        self.rows, self.cols = rows, cols
        self.backend = backend
        self._pattern = (I, J)
        self._ranges: dict = {}  # the Triton kernels' tasks and ranges, by dtype
        self._own = None  # padded copies of the clusterings' own points
        self._geometry_cache: dict = {}
        self._bytes_left = cache_bytes  # for the column indices, then the geometry
        self.n_pairs = int((rows.sizes[I] * cols.sizes[J]).sum())
        n_rows = rows.sizes.cpu().numpy()
        self._col_sizes = cols.sizes.cpu().numpy()
        self._col_starts = cols.starts[:-1].cpu().numpy()
        I_np, J_np = I.cpu().numpy(), J.cpu().numpy()
        by_row = np.argsort(I_np, kind="stable")
        I_np, self._J = I_np[by_row], J_np[by_row]
        K = len(n_rows)
        self._ptr = np.concatenate([[0], np.cumsum(np.bincount(I_np, minlength=K))])
        lengths = np.bincount(I_np, weights=self._col_sizes[self._J], minlength=K).astype(np.int64)
        self._layout = (n_rows, lengths, block_elements)
        self._chunks: list | None = None

    @property
    def chunks(self) -> list:
        """The torch path's chunks: (row clusters (C,), row indices (C, R), column indices
        (C, L) or None), built on first use (the Triton path needs them only to list close
        pairs)."""
        if self._chunks is None:
            self._chunks, self._widths = [], []
            self._build_chunks(*self._layout)
        return self._chunks

    def _build_chunks(self, n_rows: np.ndarray, lengths: np.ndarray, block_elements: int):
        # sorted by size then by list length: neighbours in this order pad little
        order = np.lexsort((lengths, n_rows))
        N = int(self.rows.starts[-1])
        row_starts = self.rows.starts[:-1].cpu().numpy()
        device = self.rows.centres.device
        for chunk in _greedy_chunks(
            n_rows[order].tolist(), lengths[order].tolist(), block_elements
        ):
            chunk = order[chunk]
            tallest, longest = int(n_rows[chunk].max()), int(lengths[chunk].max())
            # rows: (C, tallest) indices into the sorted rows, N for padding
            row_idx = row_starts[chunk, None] + np.arange(tallest)
            row_idx = np.where(np.arange(tallest) < n_rows[chunk, None], row_idx, N)
            self._widths.append(longest)
            chunk_t = torch.from_numpy(chunk).to(device)
            self._chunks.append((chunk_t, torch.from_numpy(row_idx).to(device), None))
            if self._bytes_left >= 4 * len(chunk) * longest:  # keep the columns while they fit
                self._bytes_left -= 4 * len(chunk) * longest
                k = len(self._chunks) - 1
                self._chunks[-1] = (*self._chunks[-1][:2], self._column_indices(k))

    @property
    def padded_pairs(self) -> int:
        """The (row, column) slots the torch path's chunks hold, padding included."""
        return sum(rows.numel() * w for (_, rows, _), w in zip(self.chunks, self._widths))

    def release_geometry(self) -> None:
        """Drop the cached centred coordinates (the gradient gathers its own); the column
        indices stay."""
        self._geometry_cache.clear()
        self._own = None

    def _column_indices(self, k: int) -> torch.Tensor:
        """Chunk k's (C, L) column indices (the points of each row cluster's kept column
        clusters, M for padding): stored when they fit the cache, else rebuilt per call."""
        if self._chunks[k][2] is not None:
            return self._chunks[k][2]
        chunk = self._chunks[k][0].cpu().numpy()
        pairs, pair_owner = _ranges(self._ptr[chunk], self._ptr[chunk + 1] - self._ptr[chunk])
        Jc = self._J[pairs]
        pts, pt_pair = _ranges(self._col_starts[Jc], self._col_sizes[Jc])
        owner = pair_owner[pt_pair]
        first = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=len(chunk)))])
        slot = np.arange(owner.size) - first[owner]
        col_idx = np.full((len(chunk), self._widths[k]), int(self.cols.starts[-1]), dtype=np.int32)
        col_idx[owner, slot] = pts
        return torch.from_numpy(col_idx).to(self.rows.centres.device)

    def softmin(
        self, x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """-eps log sum_{kept j} exp(h_j - |x_i - y_j|^2 / (2 eps)), (N,), for the sorted
        clouds x (N, D), y (M, D) and h (M,); differentiable in x, y and h."""
        _note_backend("multiscale")
        return _SparseSoftmin.apply(self, eps, x.contiguous(), y.contiguous(), h.contiguous())

    def softmin_columns(
        self, x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """-eps log sum_{kept i} exp(h_i - |x_i - y_j|^2 / (2 eps)), (M,), for the sorted
        clouds x (N, D), y (M, D) and h (N,) on the rows: the softmin of the transposed
        pattern, summed over this pattern's chunks (each chunk's columns, then each column's
        slots in every chunk that holds it), without autograd (torch path)."""
        px, py, ph = self._padded(x, y, h)  # ph: the rows' (N + 1,), -inf for padding
        M = y.shape[0]
        slots, values = [], []
        for k, (_, row_idx, _) in enumerate(self.chunks):
            col_idx = self._column_indices(k)
            X, x_sq, Y, y_sq = self._geometry(k, px, py, col_idx)
            row = ph.index_select(0, row_idx.view(-1)).view(*row_idx.shape, 1)
            s = torch.baddbmm(row.sub_(x_sq, alpha=1 / eps), X, Y.transpose(1, 2), alpha=1 / eps)
            _, m, total = _softmax_(s.transpose(1, 2))  # by columns: (C, L, 1) each
            lse = total.log_().add_(m).squeeze(2)
            values.append(lse.sub_(y_sq, alpha=1 / eps).view(-1))
            slots.append(col_idx.view(-1).long())
        slot, value = torch.cat(slots), torch.cat(values)  # padding slots: column M
        top = value.new_full((M + 1,), -torch.inf).scatter_reduce_(0, slot, value, "amax")
        top.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        sums = torch.zeros_like(top).index_add_(0, slot, (value - top[slot]).exp_())
        return sums.log_().add_(top)[:M].mul_(-eps)

    def uses_triton(self, x: torch.Tensor) -> bool:
        """Whether the reductions on ``x`` go through the Triton kernels."""
        if self.backend == "torch":
            return False
        if self.backend == "triton":
            return True
        return (
            x.device.type == "cuda" and x.dtype in _triton.DTYPES and _triton.unavailable() is None
        )

    def triton_ranges(self, dtype: torch.dtype) -> tuple[_triton.Ranges, _triton.Ranges]:
        """The Triton kernels' (rows, columns) tasks and ranges for tiles of ``dtype``."""
        if dtype not in self._ranges:
            I, J = self._pattern
            bn, bm = _triton.BLOCKS[dtype]
            self._ranges[dtype] = (
                _ranges_of(self.rows, self.cols, I, J, bn),
                _ranges_of(self.cols, self.rows, J, I, bm),
            )
        return self._ranges[dtype]

    def _geometry(self, k: int, px: torch.Tensor, py: torch.Tensor, col_idx: torch.Tensor):
        """Chunk k's centred rows X (C, R, D), |X|^2/2 (C, R, 1), columns Y (C, L, D) and
        |Y|^2/2 (C, L); cached for the clusterings' own points while the budget allows."""
        own = self._own is not None and px is self._own[0] and py is self._own[1]
        if own and k in self._geometry_cache:
            return self._geometry_cache[k]
        clusters, row_idx, stored = self.chunks[k]
        c = self.rows.centres[clusters].unsqueeze(1)  # (C, 1, D)
        D = px.shape[1]
        X = px.index_select(0, row_idx.view(-1)).view(*row_idx.shape, D) - c
        Y = py.index_select(0, col_idx.view(-1)).view(*col_idx.shape, D) - c
        out = (X, (X * X).sum(-1, keepdim=True) / 2, Y, (Y * Y).sum(-1) / 2)
        size = (X.numel() + Y.numel() + X.shape[0] * (X.shape[1] + Y.shape[1])) * X.element_size()
        if own and stored is not None and self._bytes_left >= size:
            self._bytes_left -= size
            self._geometry_cache[k] = out
        return out

    def _padded(self, x, y, h):
        own = x is self.rows.points and y is self.cols.points
        if own and self._own is not None:
            px, py = self._own
        else:
            px = torch.cat([x, x.new_zeros(1, x.shape[1])])
            py = torch.cat([y, y.new_zeros(1, y.shape[1])])
            if own:
                self._own = (px, py)
        ph = torch.cat([h, h.new_full((1,), -torch.inf)])
        return px, py, ph

    def gradients(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        h: torch.Tensor,
        eps: float,
        out: torch.Tensor,
        grad_out: torch.Tensor,
        needs: tuple[bool, bool, bool] = (True, True, True),
    ) -> list[torch.Tensor | None]:
        """The gradients of ``sum_i grad_out_i softmin_i`` with respect to x (N, D), y (M, D)
        and h (M,) (None where ``needs`` is False), given ``out`` = :meth:`softmin`; no
        autograd. With P_ij = exp(h_j - |x_i - y_j|^2 / (2 eps) + out_i / eps) (each row
        sums to 1) and G = grad_out, they are G_i (x_i - sum_j P_ij y_j),
        sum_i G_i P_ij (y_j - x_i) and -eps sum_i G_i P_ij: each chunk's P once (each row
        normalised by its computed sum), then two batched products. G is scaled to at most 1
        and its negligible entries zeroed, so that no product is a denormal number (as the
        blocked backward does). On the Triton path (:meth:`uses_triton`), the kernels'."""
        if self.uses_triton(x):
            rows, cols = self.triton_ranges(x.dtype)
            return _triton.sparse_gradients(rows, cols, x, y, h, eps, out, grad_out, needs)
        px, py, ph = self._padded(x, y, h)
        D = x.shape[1]
        gx = torch.zeros_like(px) if needs[0] else None
        gy = torch.zeros_like(py) if needs[1] else None
        gh = torch.zeros_like(ph) if needs[2] else None
        G, scale = _dense.scaled(grad_out)
        pad_g = torch.cat([G, G.new_zeros(1)])
        pad_out = torch.cat([out, out.new_zeros(1)])
        floor = _dense.product_floor(x.dtype)
        for k, (_, row_idx, _) in enumerate(self.chunks):
            col_idx = self._column_indices(k)
            X, x_sq, Y, y_sq = self._geometry(k, px, py, col_idx)
            col = ph.index_select(0, col_idx.view(-1)).view(col_idx.shape)
            rows = row_idx.view(-1)
            # log of each row's total: (|x|^2 / 2 - out) / eps in centred coordinates
            lse = x_sq.squeeze(2).sub(pad_out.index_select(0, rows).view(row_idx.shape))
            col = col.sub(y_sq, alpha=1 / eps).unsqueeze(1)
            P = torch.baddbmm(col, X, Y.transpose(1, 2), alpha=1.0 / eps)
            P.sub_(lse.unsqueeze(2), alpha=1 / eps).clamp_(min=floor).exp_()
            # each row normalised by its own sum: out's rounding, divided by eps, would
            # otherwise leave it 1 +- 1e-5 in float32 at small eps
            total = P.sum(2, keepdim=True)
            Gk = pad_g.index_select(0, rows).view(row_idx.shape).unsqueeze(2)  # (C, R, 1)
            if gx is not None:  # each row in one chunk: copied, not added (index_add_
                # ran 10 times slower)
                gx.index_copy_(0, rows, (Gk * (X - _dense.times(P, Y) / total)).reshape(-1, D))
            Gk = Gk / total
            if gy is None and gh is None:
                continue
            Q = P.mul_(Gk)
            weight = Q.sum(1)  # (C, L): sum_i G_i P_ij
            cols = col_idx.view(-1).long()
            if gh is not None:
                gh.index_add_(0, cols, weight.view(-1), alpha=-eps)
            if gy is not None:
                moved = weight.unsqueeze(2) * Y - _dense.times(Q.transpose(1, 2), X)
                gy.index_add_(0, cols, moved.reshape(-1, D))
        return [None if g is None else g[:-1] * scale for g in (gx, gy, gh)]

    def gaussian_product(
        self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, sigma: float
    ) -> torch.Tensor:
        """sum_{kept j} exp(-|x_i - y_j|^2 / (2 sigma^2)) v_j, (N, E), for the sorted clouds x
        (N, D), y (M, D) and values v (M, E); differentiable in x, y and v (torch path)."""
        _note_backend("truncated")
        return _SparseGaussian.apply(self, sigma, x.contiguous(), y.contiguous(), v.contiguous())

    def _gaussian_chunks(self, x, y, v, sigma):
        """Each chunk's (row indices (C, R), column indices (C, L), centred rows X (C, R, D)
        and columns Y (C, L, D), kernel values K (C, R, L), values V (C, L, E))."""
        px, py, _ = self._padded(x, y, x.new_zeros(y.shape[0]))
        pv = torch.cat([v, v.new_zeros(1, v.shape[1])])
        floor = _dense.product_floor(x.dtype)
        a = 1.0 / (sigma * sigma)
        for k, (_, row_idx, _) in enumerate(self.chunks):
            col_idx = self._column_indices(k)
            X, x_sq, Y, y_sq = self._geometry(k, px, py, col_idx)
            # -|X - Y|^2 / (2 sigma^2) = (<X, Y> - |X|^2 / 2 - |Y|^2 / 2) / sigma^2
            K = torch.baddbmm(y_sq.neg().unsqueeze(1), X, Y.transpose(1, 2)).sub_(x_sq)
            K.mul_(a).clamp_(min=floor).exp_()
            V = pv.index_select(0, col_idx.view(-1)).view(*col_idx.shape, v.shape[1])
            yield row_idx, col_idx, X, Y, K, V


class _SparseGaussian(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel: BlockSparse, sigma: float, x, y, v):
        ctx.kernel, ctx.sigma = kernel, sigma
        out = x.new_zeros(x.shape[0] + 1, v.shape[1])
        for row_idx, _, _, _, K, V in kernel._gaussian_chunks(x, y, v, sigma):
            out.index_copy_(0, row_idx.view(-1), _dense.times(K, V).reshape(-1, v.shape[1]))
        ctx.save_for_backward(x, y, v)
        return out[:-1]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        """With K_ij the kernel and W_ij = K_ij (G_i . v_j): x_i gets
        sum_j W_ij (y_j - x_i) / sigma^2, y_j gets sum_i W_ij (x_i - y_j) / sigma^2 and v_j
        gets sum_i K_ij G_i; each chunk's K recomputed, no autograd graph."""
        x, y, v = ctx.saved_tensors
        kernel, a = ctx.kernel, 1.0 / (ctx.sigma * ctx.sigma)
        need_x, need_y, need_v = ctx.needs_input_grad[2:]
        D, E = x.shape[1], v.shape[1]
        gx = x.new_zeros(x.shape[0] + 1, D) if need_x else None
        gy = y.new_zeros(y.shape[0] + 1, D) if need_y else None
        gv = v.new_zeros(v.shape[0] + 1, E) if need_v else None
        pad_g = torch.cat([grad_out, grad_out.new_zeros(1, E)])
        for row_idx, col_idx, X, Y, K, V in kernel._gaussian_chunks(x, y, v, ctx.sigma):
            G = pad_g.index_select(0, row_idx.view(-1)).view(*row_idx.shape, E)
            cols = col_idx.view(-1).long()
            if gv is not None:
                gv.index_add_(0, cols, _dense.times(K.transpose(1, 2), G).reshape(-1, E))
            if gx is None and gy is None:
                continue
            W = K.mul_(torch.bmm(G, V.transpose(1, 2)))
            if gx is not None:  # each row in one chunk: copied, not added
                moved = _dense.times(W, Y) - W.sum(2, keepdim=True) * X
                gx.index_copy_(0, row_idx.view(-1), moved.reshape(-1, D).mul_(a))
            if gy is not None:
                moved = _dense.times(W.transpose(1, 2), X) - W.sum(1).unsqueeze(2) * Y
                # (scaled first: index_add_ with alpha ran 4 times slower on (K, 3) rows)
                gy.index_add_(0, cols, moved.reshape(-1, D).mul_(a))
        return (None, None, *(None if g is None else g[:-1] for g in (gx, gy, gv)))


#: the Gaussian kernel product drops the pairs farther apart than this many widths (the
#: terms left out are below exp(-TRUNCATION_SIGMAS^2 / 2) = 1.3e-14 of the largest)
TRUNCATION_SIGMAS = 8.0
#: its grid cells are this many widths wide. Measured on a real hemisphere's vertices (a
#: varifold term's products, forward and gradient, float32): cells 2 widths wide took 2 to 5
#: times as long as 4 to 6 (more, smaller matrix products)
CELL_SIGMAS = 5.0
#: the truncated product runs where it keeps at most this fraction of the pairs: at a third
#: (3,000 control points and 8,000 vertices of a hemisphere, a 4.3 mm kernel) it was as slow
#: as the blocked reduction over all pairs
MAX_KEPT_FRACTION = 0.25
#: before the pattern is built, the fraction of pairs within reach is estimated on about
#: this many points of each cloud (evenly strided): the pattern keeps at least those pairs,
#: so where they are already more than the largest kept fraction it is not built (a refused
#: pattern took 1.4 to 2.4 ms between 1,000 control points and 1,000 to 10,000 vertices of a
#: hemisphere; the call that the sample refuses, 0.3 to 0.45 ms)
SAMPLED_POINTS = 256


def truncated_gaussian(
    x: torch.Tensor, y: torch.Tensor, sigma: float, max_fraction: float = MAX_KEPT_FRACTION
) -> tuple[BlockSparse, torch.Tensor, torch.Tensor] | None:
    """The block-sparse pattern of the Gaussian kernel of width ``sigma`` between ``x``
    (N, D) and ``y`` (M, D): grid cells ``CELL_SIGMAS * sigma`` wide, the pairs of cells
    that may hold points within ``TRUNCATION_SIGMAS * sigma`` of each other kept. Returns
    ``(kernel, x's order, y's order)`` (the permutations that sort each cloud by cell), or
    None when the kept pairs are more than ``max_fraction`` of all N * M (a dense
    reduction is then as fast), or when an evenly strided sample of the pairs
    (:data:`SAMPLED_POINTS` a side) already has more than that fraction within reach."""
    x, y = x.detach(), y.detach()
    if x.shape[0] == 0 or y.shape[0] == 0:
        return None
    reach = TRUNCATION_SIGMAS * sigma
    both = torch.cat([x, y])
    extent = both.amax(0) - both.amin(0)
    if float(extent.norm()) <= reach:
        return None
    xs = x[:: max(1, x.shape[0] // SAMPLED_POINTS)]
    ys = y[:: max(1, y.shape[0] // SAMPLED_POINTS)]
    if float((torch.cdist(xs, ys) <= reach).double().mean()) > max_fraction:
        return None
    rows = grid_clusters(x, x.new_ones(x.shape[0]), CELL_SIGMAS * sigma)
    cols = grid_clusters(y, y.new_ones(y.shape[0]), CELL_SIGMAS * sigma)
    gap = torch.cdist(rows.centres, cols.centres) - rows.radii[:, None] - cols.radii[None, :]
    I, J = (gap <= reach).nonzero(as_tuple=True)
    kept = int((rows.sizes[I] * cols.sizes[J]).sum())
    if kept > max_fraction * x.shape[0] * y.shape[0]:
        return None
    return BlockSparse(rows, cols, I, J, backend="torch"), rows.order, cols.order


def gaussian_product(
    x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, sigma: float
) -> torch.Tensor | None:
    """``sum_j exp(-|x_i - y_j|^2 / (2 sigma^2)) v_j`` for x (N, D), y (M, D), v (M, E),
    over the pairs of :func:`truncated_gaussian`'s pattern: (N, E), differentiable in x, y
    and v; None where the pattern would keep most pairs."""
    found = truncated_gaussian(x, y, sigma)
    if found is None:
        return None
    kernel, x_order, y_order = found
    sorted_out = kernel.gaussian_product(x[x_order], y[y_order], v[y_order], sigma)
    return torch.empty_like(sorted_out).index_copy(0, x_order, sorted_out)


class _SparseSoftmin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel: BlockSparse, eps: float, x, y, h):
        ctx.kernel, ctx.eps = kernel, eps
        if kernel.uses_triton(x):
            rows, _ = kernel.triton_ranges(x.dtype)
            result = _triton.sparse_softmin(rows, x, y, h, eps)[0]
            ctx.save_for_backward(x, y, h, result)
            return result
        px, py, ph = kernel._padded(x, y, h)
        out = x.new_empty(x.shape[0] + 1)
        for k, (_, row_idx, _) in enumerate(kernel.chunks):
            col_idx = kernel._column_indices(k)
            X, x_sq, Y, y_sq = kernel._geometry(k, px, py, col_idx)
            col = ph.index_select(0, col_idx.view(-1)).view(col_idx.shape)
            s = torch.baddbmm(
                col.sub_(y_sq, alpha=1 / eps).unsqueeze(1), X, Y.transpose(1, 2), alpha=1.0 / eps
            )
            # (torch.logsumexp here took 6 times as long: 0.9 s against 0.16 s for a
            # pattern of 114 million pairs on two cores)
            _, m, total = _softmax_(s)
            row = total.log_().add_(m).mul_(-eps).add_(x_sq)
            out.index_copy_(0, row_idx.view(-1), row.view(-1))
        result = out[:-1]
        ctx.save_for_backward(x, y, h, result)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        """:meth:`BlockSparse.gradients` (hand-written: no autograd graph of the chunks)."""
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "multiscale Sinkhorn does not support second derivatives (create_graph=True); "
                "use multiscale=False"
            )
        x, y, h, out = ctx.saved_tensors
        grads = ctx.kernel.gradients(x, y, h, ctx.eps, out, grad_out, ctx.needs_input_grad[2:])
        return (None, None, *grads)


def _flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """The flat indices (K,) where ``mask`` is True: numpy's on the CPU (a sparse mask of 4
    million entries: 2.3 ms against torch's 7.9 ms on two cores), torch's elsewhere."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.view(-1).nonzero().squeeze(1)


def _row_runs(keep: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """For sorted flat indices ``keep`` (K,) into a ``(rows, width)`` matrix: how many fall
    in each row, (rows,). A search of the rows' starts among them, with no division a pair
    (numpy's and torch's integer divisions cost 4 to 6 ns an element on two cores: more
    than the rest of a pair's bookkeeping)."""
    starts = torch.arange(rows + 1, dtype=keep.dtype, device=keep.device) * width
    if keep.device.type == "cpu":
        bounds = torch.from_numpy(np.searchsorted(keep.numpy(), starts.numpy()))
    else:
        bounds = torch.searchsorted(keep, starts)
    return bounds.diff()


def _repeat(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each of ``values`` (G,) ``counts`` (G,) times, (sum(counts),): numpy's on the CPU
    (0.27 ms for 750,000 values against torch's ``repeat_interleave``'s 1.7 ms on two
    cores), torch's elsewhere."""
    if values.device.type == "cpu":
        return torch.from_numpy(np.repeat(values.numpy(), counts.numpy()))
    return torch.repeat_interleave(values, counts)


#: :func:`close_pairs` computes a chunk's slacks about this many at a time (whole row
#: clusters, or a few rows of one against all its columns), so that the passes over them
#: (the threshold, the smallest dropped slacks) find them in the processor's cache: on the
#: eight clusters against a ball (N = 20,000, 110 million pairs in chunks of up to 18
#: million), the fastest of five searches took 0.28 s at 2^20 pairs, 0.29 at 2^21, 0.31 at
#: 2^22 and 0.34 at 2^23 (whole chunks of float64 coordinates gathered at each search, as
#: before: 0.40); at N = 5,000 (8 million pairs), 43, 35, 33 and 33 ms (before: 36)
SEARCH_PIECE = 1 << 21


def _pieces(C: int, R: int, L: int):
    """A chunk of C row clusters of R rows against L columns each, in pieces of about
    ``SEARCH_PIECE`` pairs: ``(c0, c1, r0, r1)``, whole row clusters where one holds at most
    that many pairs, else a few rows of one cluster at a time, in the chunk's order."""
    per_cluster = R * L
    if per_cluster <= SEARCH_PIECE:
        step = SEARCH_PIECE // per_cluster
        return [(c, min(C, c + step), 0, R) for c in range(0, C, step)]
    step = max(1, SEARCH_PIECE // L)
    return [(c, c + 1, r, min(R, r + step)) for c in range(C) for r in range(0, R, step)]


def close_pairs(
    kernel: BlockSparse,
    x: torch.Tensor,
    y: torch.Tensor,
    f: torch.Tensor,
    g: torch.Tensor,
    threshold: float,
    limit: int,
    estimate: list | None = None,
    dropped: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The point pairs (i, j) of ``kernel``'s pattern whose slack |x_i - y_j|^2 / 2 - f_i -
    g_j is at most ``threshold`` (cost units), for its own sorted clouds x (N, D), y (M, D)
    and potentials f (N,), g (M,): ``(i, j, slack)``, each (P,), the slacks in float64,
    grouped by row (each row's pairs in a run, the rows in the pattern's chunk order) and
    within a row by column; None as soon as more than ``limit`` are found (then
    ``estimate``, a list, receives how many the whole pattern would hold at the rate found
    so far). ``dropped``, a list, receives the smallest slack of the pattern's pairs left
    out, per row and per column: ``(N,)`` and ``(M,)``, float64, inf where none (so that a
    caller can tell how far the potentials may move before one of them comes within
    reach).

    The slack is summed in the points' dtype from the chunk's centred coordinates (the
    kernel's, cached between calls while its budget allows) as the per-point terms
    ``|x_i - c|^2 / 2 - f_i`` and ``|y_j - c|^2 / 2 - g_j`` (c the row cluster's centre), less
    and plus the row cluster's smallest first term, and ``<x_i - c, y_j - c>``, in one matrix
    product; the two terms' rounding restored in float64: for a pair within the threshold
    every number then is of the size of the slack and the cell, not of the potentials, so
    the slack is exact to the points' precision times the cell's size whatever |f| / eps (a
    pair within its rounding of the threshold may go either way). A chunk's slacks are
    computed about ``SEARCH_PIECE`` at a time (:func:`_pieces`).
    """
    wide = torch.float64
    px, py, _ = kernel._padded(x, y, y.new_zeros(y.shape[0]))
    # padding: potentials -inf, so an infinite slack, never kept
    pf, pg = (torch.cat([p.to(wide), p.new_full((1,), -torch.inf, dtype=wide)]) for p in (f, g))
    found, count, searched = [], 0, 0
    if dropped is not None:  # (a slot for the padding, dropped at the end)
        row_min = px.new_full((x.shape[0] + 1,), torch.inf)
        col_min = py.new_full((y.shape[0] + 1,), torch.inf)
    for k, (_, row_idx, _) in enumerate(kernel.chunks):
        col_idx = kernel._column_indices(k)
        X, x_sq, Y, y_sq = kernel._geometry(k, px, py, col_idx)
        rows = x_sq.squeeze(2).to(wide) - pf.index_select(0, row_idx.view(-1)).view(row_idx.shape)
        # (C, 1): the potentials' size out of both terms; the smallest finite first term (an
        # infinite potential's row, or padding, would make every other row's sum NaN)
        shift = torch.where(rows.isfinite(), rows, torch.inf).amin(1, keepdim=True)
        shift = torch.where(shift.isfinite(), shift, 0.0)
        rows -= shift
        cols = pg.index_select(0, col_idx.view(-1)).view(col_idx.shape)
        cols = cols.sub_(shift).neg_().add_(y_sq)
        rows_low, cols_low = rows.to(x.dtype), cols.to(x.dtype)
        # s = rows + cols - <X, Y> (C, R, L) as one matrix product of [X, rows, 1] and
        # [-Y, 1, cols]: written once (a sum of the two terms, then a product added to it,
        # took 2.2 times as long: 4.3 ms against 1.9 for 6 million pairs on two cores)
        ones = rows_low.new_ones(())
        Xa = torch.cat([X, rows_low.unsqueeze(2), ones.expand(*rows.shape, 1)], 2)
        Ya = torch.cat([-Y, ones.expand(*cols.shape, 1), cols_low.unsqueeze(2)], 2)
        Ya = Ya.transpose(1, 2)
        C, R, L = Xa.shape[0], Xa.shape[1], Ya.shape[2]
        col_low = None if dropped is None else Ya.new_full((C, L), torch.inf)
        for c0, c1, r0, r1 in _pieces(C, R, L):  # in the chunk's order: rows stay in runs
            w = r1 - r0
            s = torch.bmm(Xa[c0:c1, r0:r1], Ya[c0:c1])  # (c1 - c0, w, L)
            keep = _flat_nonzero(s <= threshold)
            count += len(keep)
            searched += s.numel()
            if count > limit:
                if estimate is not None:
                    estimate.append(count * kernel.padded_pairs / searched)
                return None
            # each kept pair's row slot and column slot from how many fall in each row of
            # the piece (c * w + r, in the chunk's row c0 * R + r0 + c * w + r): what a row's
            # pairs share (their row, its term, their column cell's offset) by repetition
            per_row = _row_runs(keep, s.shape[0] * w, L)
            piece_rows = torch.arange(s.shape[0] * w, device=keep.device)
            offset = (piece_rows.div(w, rounding_mode="floor") + c0 - piece_rows) * L
            col_slot = keep + _repeat(offset, per_row)
            rows_piece = slice(c0 * R + r0, c0 * R + r0 + s.shape[0] * w)  # whole or one cluster
            slack = s.view(-1).index_select(0, keep).to(wide)
            if dropped is not None:  # (s is not needed after this)
                s.view(-1).index_fill_(0, keep, torch.inf)  # (the kept pairs: few)
                rows_of = row_idx[c0:c1, r0:r1].reshape(-1)
                row_min.scatter_reduce_(0, rows_of, s.amin(2).view(-1), "amin")
                torch.minimum(col_low[c0:c1], s.amin(1), out=col_low[c0:c1])
            slack += _repeat((rows - rows_low).view(-1)[rows_piece], per_row)
            slack += (cols - cols_low).view(-1).index_select(0, col_slot)
            i = _repeat(row_idx.view(-1)[rows_piece], per_row)
            j = col_idx.view(-1).index_select(0, col_slot).long()
            found.append((i, j, slack))
        if dropped is not None:
            col_min.scatter_reduce_(0, col_idx.view(-1).long(), col_low.view(-1), "amin")
    i, j, slack = (torch.cat(t) for t in zip(*found))
    if dropped is not None:
        dropped.extend((row_min[:-1].to(wide), col_min[:-1].to(wide)))
    return i, j, slack


class PairList:
    """Softmins over an explicit list of point pairs (i, j), both ways: the multiscale
    solver's kernel at the final eps, where the pairs whose terms matter are a few per point
    (a transport plan near a permutation) while the kept cluster pairs hold hundreds.

    Scores are stored relative to reference potentials (f0, g0):
    ``r_ij = (|x_i - y_j|^2 / 2 - f0_i - g0_j) / eps``, small, from slacks exact to the
    points' precision (:func:`close_pairs`, or float64 here), so that a softmin is ``f0_i -
    eps log sum_j b_j exp((g_j - g0_j) / eps - r_ij)``: every number in it is of order one,
    whatever the size of the potentials. The largest ``log b_j - r_ij`` (each row's own
    where they spread over more than ``SHARED_SHIFT_RANGE``) is kept, so that the
    log-sum-exp's shift is that plus the largest (g_j - g0_j) / eps, with no pass for a
    maximum: a row whose terms all fall far below that shift (or that has no pair) gets an
    infinite softmin, which the caller sees. The pairs' factors ``exp(log b_j - r_ij -
    top_i)`` are computed once, as a sparse (CSR) matrix over the rows that have pairs, so
    that a softmin is one exponential a point and one sparse matrix-vector product
    (torch's, which is MKL's on the CPU and cuSPARSE's on a GPU): no padding, no block, no
    exponential a pair.

    Args:
        x, y: the sorted clouds (N, D), (M, D).
        i, j: ``(P,)`` the pairs, grouped by row (each row's pairs in one run, the rows in
            any order), within a row by column cell (as :func:`close_pairs` gives them).
        log_a, log_b: the log-weights (N,), (M,) the softmins will use.
        f0, g0: the reference potentials (N,), (M,); the softmins are in their dtype
            (float64 for the solver), the sums in the points' dtype.
        eps: the temperature the scores are divided by.
        slack: ``(P,)`` the pairs' slacks ``|x_i - y_j|^2 / 2 - f0_i - g0_j`` in float64,
            where known (:func:`close_pairs`); else computed here from the points.
        dropped: the smallest slack (float64) of the pairs left out of the list, per row
            (N,) and per column (M,), among those a caller searched (:func:`close_pairs`),
            kept as ``self.dropped`` for the caller's test of when to make the list again.
    """

    def __init__(
        self,
        x,
        y,
        i,
        j,
        log_a,
        log_b,
        f0,
        g0,
        eps: float,
        slack: torch.Tensor | None = None,
        dropped: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.eps = eps
        self.f0, self.g0 = f0, g0
        self.dropped = dropped
        if slack is None:
            xd, yd = x.double(), y.double()
            slack = x.new_zeros(i.shape, dtype=torch.float64)
            for k in range(x.shape[1]):  # coordinate by coordinate: no (P, D) copies
                d = xd[:, k].index_select(0, i) - yd[:, k].index_select(0, j)
                slack.addcmul_(d, d)
            slack.mul_(0.5)
            slack -= f0.double().index_select(0, i)
            slack -= g0.double().index_select(0, j)
        r = (slack / eps).to(x.dtype)
        n, m = x.shape[0], y.shape[0]
        # the pairs' indices in 32 bits where they fit: torch's sparse product (MKL's) with
        # 32-bit indices took 1.5 ms against 4.3 for 7 million pairs, and gathers by them
        # half the time
        if max(n, m) <= torch.iinfo(torch.int32).max:
            i, j = i.int(), j.int()
        rows, row_counts = torch.unique_consecutive(i, return_counts=True)
        self._rows = _Side(rows.long(), row_counts, j, log_b.index_select(0, j) - r, n, m)
        # the other way: the pairs by column, within a column in their order here (grouped
        # by row cell)
        run, cols, base = _by_columns(row_counts, j, log_a.index_select(0, i) - r, m)
        used = cols > 0
        other = rows.index_select(0, run)
        self._cols = _Side(used.nonzero().squeeze(1), cols[used], other, base, m, n)
        self.n_pairs = int(i.shape[0])

    def softmin_rows(self, g: torch.Tensor) -> torch.Tensor:
        """-eps log sum_j b_j exp((g_j - C_ij) / eps) over each row's pairs, (N,)."""
        return self.f0 - self.eps * self._rows.lse((g - self.g0) / self.eps).to(self.f0.dtype)

    def softmin_cols(self, f: torch.Tensor) -> torch.Tensor:
        """-eps log sum_i a_i exp((f_i - C_ij) / eps) over each column's pairs, (M,)."""
        return self.g0 - self.eps * self._cols.lse((f - self.f0) / self.eps).to(self.g0.dtype)

    def plan(self, pot: torch.Tensor, weights: torch.Tensor, transpose: bool = False):
        """The transport plan's entries over the listed pairs for the potential ``pot`` of
        the other side (g (M,); f (N,) if ``transpose``), the first side's potential
        eliminated: each row i (each column j if ``transpose``) scaled to sum to its
        ``weights``. Returns ``(rows, others, values)``, float64 (P,), grouped by row and,
        within a row, by the other point's cell."""
        side, ref = (self._cols, self.f0) if transpose else (self._rows, self.g0)
        return side.plan((pot - ref) / self.eps, weights)


#: a :class:`PairList`'s factors share one shift where every point's largest term is
#: within this many e-folds of the largest (float32 keeps 87 below 1 normal), else each
#: point's sum gets its own
SHARED_SHIFT_RANGE = 60.0

#: a :class:`PairList`'s softmin scales the other side's moves ``exp(dh - max(dh))`` up by
#: this many e-folds, so that one point that moved far (an outlier whose potential rose by
#: 50 eps) does not push every other point's terms below float32's smallest number (their
#: sums 0, their softmins infinite); a term then is at most exp(60), a sum of 10^7 of them
#: 1e33, within float32's 3e38
SHIFT_HEADROOM = 60.0


#: :func:`_by_columns` goes through scipy from this many pairs (importing scipy.sparse costs
#: 0.13 s once; its pass saves about 10 ms a million pairs over torch's sort)
SCIPY_PAIRS = 1 << 22


def _by_columns(counts: torch.Tensor, j: torch.Tensor, values: torch.Tensor, m: int):
    """For pairs in runs of ``counts`` (G,) (a run a row), their columns ``j`` (P,) < m and
    ``values`` (P,): the pairs ordered by column, within a column by run, as ``(run (P,),
    column counts (m,), values (P,))``. On the CPU with 32-bit indices and at least
    ``SCIPY_PAIRS`` pairs, scipy's conversion of a compressed sparse row matrix to columns
    (one pass, no sort: 55 ms for 6 million pairs against 80 to 140 ms for torch's sort and
    the gathers it needs); elsewhere a stable sort of the columns (16 bits where they fit:
    faster)."""
    if j.device.type == "cpu" and j.dtype == torch.int32 and SCIPY_PAIRS <= len(j) < 2**31:
        import scipy.sparse as sp

        starts = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts.numpy(), out=starts[1:])
        by_rows = sp.csr_matrix((values.numpy(), j.numpy(), starts), shape=(len(counts), m))
        by_cols = by_rows.tocsc()
        run = torch.from_numpy(by_cols.indices).to(j.dtype)
        return run, torch.from_numpy(np.diff(by_cols.indptr)), torch.from_numpy(by_cols.data)
    key = j.short() if m <= torch.iinfo(torch.int16).max else j
    order = torch.argsort(key, stable=True)
    run = _repeat(torch.arange(len(counts), dtype=j.dtype, device=j.device), counts)
    return run.index_select(0, order), torch.bincount(j, minlength=m), values.index_select(0, order)


def _run_max(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The largest of ``values`` (P,) in each of the runs of ``counts`` (G,) (each at least
    1) that they are made of, (G,): numpy's on the CPU (1.1 ms for 6 million values in 20,000
    runs, against torch's ``segment_reduce``'s 16 ms), torch's elsewhere."""
    if values.device.type == "cpu" and len(counts):
        starts = (torch.cumsum(counts, 0) - counts).numpy()
        return torch.from_numpy(np.maximum.reduceat(values.numpy(), starts))
    return torch.segment_reduce(values, "max", lengths=counts)


class _Side:
    """One direction of a :class:`PairList`: for the ``points`` (G,) of this side that
    have pairs, each with ``counts`` (G,) of them in a run, the other side's point
    (``other``, (P,)) and ``base = log w[other] - r`` (P,), as the sparse matrix
    (G, n_other) of ``exp(base - top)``, with ``top`` the largest ``base`` (each point's
    own where they spread over more than ``SHARED_SHIFT_RANGE``)."""

    def __init__(self, points, counts, other, base, n: int, n_other: int) -> None:
        self.points, self.counts, self.n = points, counts, n
        top = _run_max(base, counts)
        highest = float(top.max()) if len(top) else 0.0
        if len(top) == 0 or highest - float(top.min()) <= SHARED_SHIFT_RANGE:
            self.top = torch.full_like(top, highest, dtype=torch.float64)
            factors = base.sub_(highest).exp_()
        else:
            self.top = top.double()
            factors = base.sub_(torch.repeat_interleave(top, counts)).exp_()
        starts = torch.zeros(len(points) + 1, dtype=other.dtype, device=other.device)
        starts[1:] = counts.cumsum(0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            self.factors = torch.sparse_csr_tensor(
                starts, other, factors, size=(len(points), n_other), check_invariants=False
            )

    def lse(self, dh: torch.Tensor) -> torch.Tensor:
        """Log sum exp(log w - r + dh[other]) per point, (n,) (-inf for a point with no
        pair)."""
        shift = float(dh.max()) - SHIFT_HEADROOM
        u = (dh - shift).exp_().to(self.factors.dtype)
        sums = torch.mv(self.factors, u).double().log_().add_(self.top).add_(shift)
        out = sums.new_full((self.n,), -torch.inf)
        return out.index_copy_(0, self.points, sums)

    def plan(self, dh: torch.Tensor, weights: torch.Tensor):
        """The terms exp(log w - r + dh[other]) of each point's sum scaled to sum to its
        ``weights`` (n,): ``(points, others, values)``, float64."""
        other = self.factors.col_indices().long()
        u = (dh - (float(dh.max()) - SHIFT_HEADROOM)).exp()
        totals = torch.mv(self.factors, u.to(self.factors.dtype)).double()
        point = torch.repeat_interleave(self.points, self.counts)
        values = self.factors.values().double() * u.double().index_select(0, other)
        scale = weights.double().index_select(0, self.points) / totals
        return point, other, values.mul_(torch.repeat_interleave(scale, self.counts))


#: :class:`BlockFactors` are trusted where every column's total at the reference is at least
#: exp(-COLUMN_SLACK): a dropped term then stays exp(-16) below its column's total (for
#: float32 and a spread of 30, and weights of one size) as the potentials move
COLUMN_SLACK = 10.0


class BlockFactors:
    """Softmins over a :class:`BlockSparse` pattern with each kept pair's factor computed
    once: the multiscale solver's kernel at the final eps where the pattern is dense (a blur
    near the points' spacing or above, where a :class:`PairList` would hold too many
    pairs), both ways.

    For reference potentials (f0, g0), f0 the softmin of g0 over the pattern, the factors
    are the row-normalised plan ``P_ij = b_j exp((f0_i + g0_j - |x_i - y_j|^2 / 2) / eps)``
    (at most 1; each row sums to 1), stored in the points' dtype in the pattern's chunks
    (padding 0), so that a softmin is ``f0_i - eps log sum_j P_ij exp((g_j - g0_j) / eps)``
    (and ``g0_j - eps log (1 / b_j) sum_i a_i P_ij exp((f_i - f0_i) / eps)`` the other way):
    one exponential a point and one batched matrix-vector product a chunk, no exponential a
    pair (on two cores, 2 ms instead of 17 for 1e7 pairs). The scores are computed in
    float64 from the points, as :class:`PairList`'s are, and the factors stored in the
    points' dtype; a factor below the dtype's smallest normal number times
    ``exp(spread + 1)`` is dropped (for float32 and a spread of 30, ``exp(-56)`` of its
    row's total). The softmins are exact on the pattern
    while the potentials' moves from the reference differ by at most ``spread`` eps on each
    side (:meth:`holds`), beyond which the caller makes new factors. ``trusted`` is False
    where a column's total at the reference is below ``exp(-COLUMN_SLACK)`` (its terms are
    each below the cut relative to their rows, not necessarily to it: potentials far from
    the columns' marginals, as unbalanced transport's can be); a column's sum could then
    miss terms that matter, and the caller sums the pattern instead.

    Args:
        kernel: the pattern, with its sorted clouds x (N, D) and y (M, D).
        log_a, log_b: the log-weights (N,), (M,).
        f0, g0: the reference potentials (N,), (M,), float64 (the softmins' dtype).
        eps: the temperature.
        spread: how much (in eps) the potentials' moves from the reference may differ.
    """

    def __init__(
        self, kernel: BlockSparse, x, y, log_a, log_b, f0, g0, eps: float, spread: float
    ) -> None:
        self.eps, self.spread = eps, spread
        self.f0, self.g0 = f0, g0
        dtype = x.dtype
        self._log_a, self._log_b = log_a.to(f0.dtype), log_b.to(f0.dtype)
        self._n, self._m = x.shape[0], y.shape[0]
        px, py, _ = kernel._padded(x, y, g0)
        px, py = px.double(), py.double()
        # log P = (f0_i - |x_i|^2 / 2) / eps + (log b_j + (g0_j - |y_j|^2 / 2) / eps)
        # + <x_i, y_j> / eps, in float64 from the points (float32 scores would round at
        # u (|f0| + |g0|) / eps, which the float64 final iterations are there to avoid;
        # float64 leaves 1e-16 |x|^2 / eps, so no centring); padding: potentials -inf
        inf = f0.new_full((1,), -torch.inf, dtype=torch.float64)
        pf = (torch.cat([f0.double(), inf]) - (px * px).sum(1) / 2) / eps
        pg = (torch.cat([g0.double(), inf]) - (py * py).sum(1) / 2) / eps
        pg += torch.cat([self._log_b.double(), inf.new_zeros(1)])
        # factors below exp(cut) are dropped: times an exp((dg - max dg) / eps) within the
        # spread they would be subnormal numbers, which run many times slower; such a term
        # stays exp(cut + spread) below its row's total (float32: exp(-26))
        cut = math.log(torch.finfo(dtype).tiny) + spread + 1
        self._chunks = []
        for k, (_, row_idx, _) in enumerate(kernel.chunks):
            col_idx = kernel._column_indices(k)
            rows, cols = row_idx.view(-1), col_idx.view(-1)
            X = px.index_select(0, rows).view(*row_idx.shape, -1)
            Y = py.index_select(0, cols).view(*col_idx.shape, -1)
            col_terms = pg.index_select(0, cols).view(col_idx.shape).unsqueeze(1)  # (C, 1, L)
            row_terms = pf.index_select(0, rows).view(row_idx.shape).unsqueeze(2)  # (C, R, 1)
            log_p = torch.baddbmm(col_terms, X, Y.transpose(1, 2), alpha=1 / eps)
            # clamped, not set to -inf (an exponential of -inf or of a number below the
            # dtype's smallest runs 3 to 20 times slower than of a normal one), and rounded
            # to the dtype within [cut, 0] (a relative rounding of 60 u at most)
            factors = log_p.add_(row_terms).clamp_(min=cut).to(dtype).exp_()
            factors = torch.nn.functional.threshold_(factors, math.exp(cut) * 1.5, 0.0)
            self._chunks.append((rows.long(), cols.int(), factors))
        self.n_elements = sum(e.numel() for _, _, e in self._chunks)
        # the cut is relative to the rows' totals (1); a column's is exp((g0 - g1) / eps)
        # (a column of weight 0 has none: it receives no mass)
        lack = (self.softmin_cols(f0) - g0)[self._log_b > -torch.inf]
        self.trusted = lack.numel() > 0 and float(lack.max()) <= COLUMN_SLACK * eps  # NaN: no

    def holds(self, df: torch.Tensor, dg: torch.Tensor) -> bool:
        """Whether potentials that moved by df (N,), dg (M,) from the reference moved by
        amounts within ``spread`` eps of each other, on each side (a constant is absorbed
        by the sums' shift; NaN or infinite: no)."""
        reach = self.spread * self.eps
        return all(float(d.max() - d.min()) <= reach for d in (df, dg))

    def softmin_rows(self, g: torch.Tensor) -> torch.Tensor:
        """-eps log sum_j b_j exp((g_j - C_ij) / eps) over each row's kept pairs, (N,)."""
        dh = (g - self.g0) / self.eps
        shift = float(dh.max())
        u = torch.cat([(dh - shift).exp_(), dh.new_zeros(1)]).to(self._chunks[0][2].dtype)
        sums = u.new_zeros(self._n + 1)
        for rows, cols, factors in self._chunks:
            part = torch.bmm(factors, u.index_select(0, cols).view(factors.shape[0], -1, 1))
            sums.index_copy_(0, rows, part.view(-1))
        return self.f0 - self.eps * (sums[: self._n].to(self.f0.dtype).log_() + shift)

    def softmin_cols(self, f: torch.Tensor) -> torch.Tensor:
        """-eps log sum_i a_i exp((f_i - C_ij) / eps) over each column's kept pairs, (M,)."""
        dh = (f - self.f0) / self.eps
        shift = float(dh.max())
        v = (self._log_a + dh - shift).exp_()
        v = torch.cat([v, v.new_zeros(1)]).to(self._chunks[0][2].dtype)
        sums = v.new_zeros(self._m + 1)
        for rows, cols, factors in self._chunks:
            C = factors.shape[0]
            part = torch.bmm(factors.transpose(1, 2), v.index_select(0, rows).view(C, -1, 1))
            sums.index_add_(0, cols, part.view(-1))
        total = sums[: self._m].to(self.g0.dtype).log_() - self._log_b
        return self.g0 - self.eps * (total + shift)
