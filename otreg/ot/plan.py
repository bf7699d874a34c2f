"""The transport plan pi_ij = a_i b_j exp((f_i + g_j - C(x_i, y_j))/eps), never stored.

Products with the plan are reductions over j (or i) computed on demand by the backend that
solved the problem; only :meth:`TransportPlan.dense` builds the N x M matrix, and it refuses
above a size limit.
"""

from __future__ import annotations

import torch

from .. import reductions
from ..costs import Cost

__all__ = ["TransportPlan"]

#: :meth:`TransportPlan.dense` refuses plans with more entries than this (400 MB in float32).
DENSE_MAX_ENTRIES = 100_000_000


class TransportPlan:
    """A lazy entropic transport plan between x ``(B, N, D)`` and y ``(B, M, D)``.

    Built by :func:`otreg.sinkhorn` from its potentials; inputs and outputs keep the batch
    dimension only if the problem had one. The plan is held fixed: gradients flow to the
    vectors it is applied to, not to the points or potentials.

    Example:
        >>> import torch, otreg
        >>> plan = otreg.sinkhorn(torch.rand(50, 2), torch.rand(60, 2), blur=0.1).plan
        >>> a, b = plan.marginals()          # the uniform weights: 1/50 and 1/60
        >>> round(float(a.sum()), 4), tuple(plan.barycentric_map().shape)
        (1.0, (50, 2))
    """

    def __init__(
        self, x, y, a, b, f, g, eps: float, cost: Cost, backend: str, batched: bool
    ) -> None:
        self._x, self._y, self._a, self._b, self._f, self._g = x, y, a, b, f, g
        self.eps, self.cost, self.backend, self.batched = eps, cost, backend, batched

    @property
    def shape(self) -> tuple[int, ...]:
        """``(N, M)``, or ``(B, N, M)`` for a batch."""
        n, m = self._x.shape[1], self._y.shape[1]
        return (self._x.shape[0], n, m) if self.batched else (n, m)

    def __repr__(self) -> str:
        return (
            f"TransportPlan(shape={self.shape}, eps={self.eps:.3g}, cost={self.cost.name!r}, "
            f"backend={self.backend!r})"
        )

    # ---------------------------------------------------------------- helpers
    def _vector(self, v: torch.Tensor, n: int, name: str) -> tuple[torch.Tensor, bool]:
        """V as (B, n, E) and whether it was a plain vector."""
        if not isinstance(v, torch.Tensor):
            raise TypeError(
                f"TransportPlan.{name}: v must be a torch.Tensor, got {type(v).__name__}"
            )
        if v.dtype != self._x.dtype or v.device != self._x.device:
            raise TypeError(
                f"TransportPlan.{name}: v has dtype {v.dtype} on {v.device}; the "
                f"plan needs {self._x.dtype} on {self._x.device}"
            )
        B = self._x.shape[0]
        vb = v if self.batched else v.unsqueeze(0)
        vector = vb.dim() == 2
        if vector:
            vb = vb.unsqueeze(-1)
        if vb.dim() != 3 or vb.shape[0] != B or vb.shape[1] != n:
            want = f"(B={B}, {n}[, E])" if self.batched else f"({n},) or ({n}, E)"
            raise ValueError(f"TransportPlan.{name}: v has shape {tuple(v.shape)}; it needs {want}")
        return vb, vector

    def _out(self, t: torch.Tensor, vector: bool) -> torch.Tensor:
        if vector:
            t = t.squeeze(-1)
        return t if self.batched else t.squeeze(0)

    def _side(self, transpose: bool):
        """(points, other points, weights, potential, other weights, other potential)."""
        if transpose:
            return self._y, self._x, self._b, self._g, self._a, self._f
        return self._x, self._y, self._a, self._f, self._b, self._g

    def _row_mass(self, transpose: bool) -> torch.Tensor:
        """sum_j pi_ij (or sum_i pi_ij), (B, N) or (B, M)."""
        p, q, w, pot, w2, pot2 = self._side(transpose)
        s = reductions.softmin(p, q, w2.log() + pot2 / self.eps, self.eps, self.cost, self.backend)
        return w * torch.exp((pot - s) / self.eps)

    def _apply(self, v: torch.Tensor, transpose: bool, name: str) -> torch.Tensor:
        p, q, _, _, w2, pot2 = self._side(transpose)
        vb, vector = self._vector(v, q.shape[1], name)
        avg = reductions.softmax_average(
            p, q, w2.log() + pot2 / self.eps, vb, self.eps, self.cost, self.backend
        )
        return self._out(self._row_mass(transpose).unsqueeze(-1) * avg, vector)

    # ---------------------------------------------------------------- public
    def apply(self, v: torch.Tensor) -> torch.Tensor:
        """``pi @ v``: v ``(M,)``, ``(M, E)`` (or batched) -> ``(N,)``, ``(N, E)``."""
        return self._apply(v, False, "apply")

    def apply_t(self, w: torch.Tensor) -> torch.Tensor:
        """``pi.T @ w``: w ``(N,)``, ``(N, E)`` (or batched) -> ``(M,)``, ``(M, E)``."""
        return self._apply(w, True, "apply_t")

    def marginals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pi 1, pi^T 1)``: ``(N,)`` and ``(M,)`` (or batched)."""
        return (self._out(self._row_mass(False), False), self._out(self._row_mass(True), False))

    def barycentric_map(self) -> torch.Tensor:
        """Where each x_i is sent: ``sum_j pi_ij y_j / sum_j pi_ij``, ``(N, D)`` (or batched)."""
        h = self._b.log() + self._g / self.eps
        t = reductions.softmax_average(
            self._x, self._y, h, self._y, self.eps, self.cost, self.backend
        )
        return self._out(t, False)

    def dense(self, max_entries: int = DENSE_MAX_ENTRIES) -> torch.Tensor:
        """The plan as a dense tensor ``(N, M)`` or ``(B, N, M)``; refuses above max_entries."""
        B, N, M = self._x.shape[0], self._x.shape[1], self._y.shape[1]
        if B * N * M > max_entries:
            raise ValueError(
                f"TransportPlan.dense: the plan has {B * N * M:,} entries, more "
                f"than max_entries={max_entries:,}; use apply/apply_t, or raise "
                "max_entries if the memory is there"
            )
        log_pi = (
            (self._a.log() + self._f / self.eps).unsqueeze(2)
            + (self._b.log() + self._g / self.eps).unsqueeze(1)
            - self.cost.dense(self._x, self._y) / self.eps
        )
        return self._out(torch.exp(log_pi), False)
