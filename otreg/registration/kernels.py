"""Gaussian kernels of several widths for deformations, on otreg's lazy reductions.

``k(x, y) = sum_s w_s exp(-|x - y|^2 / (2 sigma_s^2))``, widths sigma_s in mm (Deformetrica
and the KeOps tutorials write ``exp(-|x - y|^2 / sigma^2)``: their sigma is ours times sqrt(2)).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from .. import reductions
from .._checks import check_positive
from ..costs import get_cost
from ..reductions import sparse

__all__: list[str] = []

_SQ = get_cost("sqeuclidean")
#: up to this many pairs N * M the kernel sums form their matrices directly (all widths in
#: one pass); above, they go through :mod:`otreg.reductions` (no N x M matrix kept)
DENSE_MAX_PAIRS = 250_000


class GaussianKernel:
    """A sum of Gaussian kernels with widths ``sigma`` (mm) and ``weights``."""

    def __init__(
        self,
        sigma: float | Sequence[float],
        weights: Sequence[float] | None = None,
        backend: str = "auto",
        caller: str = "GaussianKernel",
    ) -> None:
        sigmas = [sigma] if isinstance(sigma, numbers.Real) else list(sigma)
        if not sigmas:
            raise ValueError(f"{caller}: sigma is empty; give at least one width in mm")
        self.sigmas = [check_positive(caller, "sigma", s) for s in sigmas]
        if weights is None:
            weights = [1.0] * len(self.sigmas)
        weights = list(weights)
        if len(weights) != len(self.sigmas):
            raise ValueError(f"{caller}: {len(weights)} weights for {len(self.sigmas)} widths")
        self.weights = [check_positive(caller, "kernel weight", w) for w in weights]
        self.backend = backend

    def __repr__(self) -> str:
        return f"GaussianKernel(sigma={self.sigmas}, weights={self.weights})"

    def _dense(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether to form the (N, M) matrices here, once for all widths: small problems,
        where the cost is the number of torch calls rather than the pairs."""
        return self.backend == "auto" and x.shape[0] * y.shape[0] <= DENSE_MAX_PAIRS

    def _exponentials(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        c = y.detach().mean(0)
        x, y = x - c, y - c  # the expansion of |x - y|^2 rounds less near the origin
        d2 = ((x * x).sum(1, keepdim=True) + (y * y).sum(1) - 2 * x @ y.T).clamp_min(0)
        return [torch.exp(d2 * (-0.5 / (s * s))) for s in self.sigmas]

    def __call__(self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``sum_j k(x_i, y_j) v_j``: x (N, D), y (M, D), v (M, E) -> (N, E)."""
        if self._dense(x, y):
            return self.matrix(x, y) @ v
        out = None
        for s, w in zip(self.sigmas, self.weights):
            term = self._product(x, y, v, s)
            out = w * term if out is None else out + w * term
        return out

    def _product(self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, s: float):
        """One width's ``sum_j exp(-|x_i - y_j|^2 / (2 s^2)) v_j``: on the CPU, over the
        pairs closer than :data:`~otreg.reductions.sparse.TRUNCATION_SIGMAS` widths where
        those are few (a narrow kernel on a large surface:
        :func:`otreg.reductions.sparse.gaussian_product`), else a reduction over all pairs."""
        if self.backend == "auto" and x.device.type == "cpu":
            term = sparse.gaussian_product(x, y, v, s)
            if term is not None:
                return term
        return reductions.kernel_product(x[None], y[None], v[None], s * s, _SQ, self.backend)[0]

    def matrix(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The dense kernel matrix ``k(x_i, y_j)``: x (N, D), y (M, D) -> (N, M) (for a few
        thousand points: it is stored)."""
        return sum(w * m for w, m in zip(self.weights, self._exponentials(x, y)))

    def with_derivative(
        self, x: torch.Tensor, y: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum_j k(x_i, y_j) v_j, sum_j k'(x_i, y_j) v_j)`` with one reduction per width;
        ``k' = sum_s w_s / sigma_s^2 exp(-|x - y|^2 / (2 sigma_s^2))`` (for gradients of k)."""
        if self._dense(x, y):
            e = self._exponentials(x, y)
            k = sum(w * m for w, m in zip(self.weights, e))
            kd = sum((w / (s * s)) * m for s, w, m in zip(self.sigmas, self.weights, e))
            return k @ v, kd @ v
        out = deriv = None
        for s, w in zip(self.sigmas, self.weights):
            term = self._product(x, y, v, s)
            out = w * term if out is None else out + w * term
            d = (w / (s * s)) * term
            deriv = d if deriv is None else deriv + d
        return out, deriv
