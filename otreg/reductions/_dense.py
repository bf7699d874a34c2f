"""Dense torch kernels on one block of pairs: scores, shifted exponentials, reductions.

Used whole by the ``tensorized`` backend and block by block by the ``blocked`` one. Two
tricks make them fast and safe on the CPU:

- for the squared distance, one matrix product gives the scores (after centring the clouds,
  which the cost does not see and the rounding does);
- arguments of exp are clamped at -80 (float32) or -700 (float64): below that the result is
  negligible, and torch's CPU exp runs 30 to 100 times slower on arguments that underflow.
"""

from __future__ import annotations

import torch

from ..costs import Cost


def exp_floor(dtype: torch.dtype) -> float:
    """Arguments of exp are clamped here: below it the result is negligible (< 1e-34 relative)
    and torch's CPU exp slows down 30 to 100 times (underflow handling)."""
    return -700.0 if dtype == torch.float64 else -80.0


#: a block's matrix products with at most this many columns run transposed (:func:`times`)
NARROW_COLUMNS = 11


def times(
    a: torch.Tensor, b: torch.Tensor, b_t: torch.Tensor | None = None, out=None
) -> torch.Tensor:
    """``a @ b`` for a block a (B, n, M) and values b (B, M, C), C few: ``(b^T a^T)^T``
    (into ``out`` where given, else a view). ``b_t``: b transposed and contiguous, where
    the caller keeps it for many blocks. MKL's batched product with a few columns on the
    right runs several times slower than the same product transposed (an AMD EPYC, two
    cores: a block of 52 x 5,000 times 3 columns, 1.0 against 0.33 ns a pair; 9 columns,
    1.5 against 0.8; chunks of 64 x 32 x 400, 1.07 against 0.19); from 12 columns on the
    two were even, so wider ``b`` goes through ``torch.bmm`` as it is. For ``a^T b``, pass
    ``a.transpose(1, 2)``."""
    if b.shape[-1] > NARROW_COLUMNS:
        return torch.bmm(a, b, out=out)
    if b_t is None:
        b_t = b.transpose(1, 2).contiguous()
    product = torch.bmm(b_t, a.transpose(1, 2)).transpose(1, 2)
    return product if out is None else out.copy_(product)


def scores(x, y, h, eps, cost: Cost):
    """``(s, r)`` with ``s + r = h_j - C(x_i, y_j)/eps``: s (B, N, M), r (B, N, 1) or 0.

    For the squared distance, one matrix product gives s_ij = (<x_i, y_j> - |y_j|^2/2)/eps + h_j
    and the row constant r_i = -|x_i|^2/(2 eps), which softmax and log-sum-exp need not see.
    The clouds are first centred on y's centroid (the cost is translation invariant), which
    keeps the rounding error of the expansion small.
    """
    if cost.p == 2:
        c = y.detach().mean(1, keepdim=True)
        x, y = x - c, y - c
        col = (h - (y * y).sum(-1) / (2 * eps)).unsqueeze(1)
        s = torch.baddbmm(col, x, y.transpose(1, 2), alpha=1.0 / eps)
        return s, -(x * x).sum(-1, keepdim=True) / (2 * eps)
    return h.unsqueeze(1) - cost.dense(x, y) / eps, 0.0


def exp_shifted(s: torch.Tensor):
    """``(exp(s - m), m)`` with m the row maxima (B, N, 1), detached, 0 where a row is -inf."""
    m = s.detach().amax(dim=2, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    floor = exp_floor(s.dtype)
    if s.requires_grad:
        return torch.exp((s - m).clamp(min=floor)), m
    return s.sub_(m).clamp_(min=floor).exp_(), m


def softmin(x, y, h, eps, cost):
    s, r = scores(x, y, h, eps, cost)
    z, m = exp_shifted(s)
    return -eps * (z.sum(2).log() + (m + r).squeeze(2))


def kernel_product(x, y, v, eps, cost):
    s, r = scores(x, y, torch.zeros_like(y[..., 0]), eps, cost)
    floor = exp_floor(s.dtype)
    if s.requires_grad:
        return times(torch.exp((s + r).clamp(min=floor)), v)
    return times(s.add_(r).clamp_(min=floor).exp_(), v)


def softmax_average(x, y, h, v, eps, cost):
    s, _ = scores(x, y, h, eps, cost)  # a row constant does not change a softmax
    z, _ = exp_shifted(s)
    return times(z, v) / z.sum(2, keepdim=True)


# Products of the exponentials with gradients and coordinates must stay normal numbers:
# a matrix product over denormals runs 100 times slower on x86 (measured: 80 ms instead of
# 0.6 ms for a (1400, 3000) @ (3000, 3) product), and flushing them to zero
# (torch.set_flush_denormal) reaches the calling thread only, not torch's worker threads.
# So exp(s - max) is clamped at e^-50 (float32) or e^-600 (float64), negligible next to the
# row's largest term 1 (a million such terms add 2e-16 relative), and gradient weights are
# scaled to at most 1 with the negligible ones (below _TINY) set to 0. Used by the blocked,
# block-sparse and fused (compiled) paths.
_PRODUCT_FLOOR = {torch.float32: -50.0, torch.float64: -600.0}
_TINY = {torch.float32: 1e-12, torch.float64: 1e-30}


def product_floor(dtype: torch.dtype) -> float:
    """Where exponents of terms that multiply weights are clamped (see above)."""
    return _PRODUCT_FLOOR.get(dtype, exp_floor(dtype))


def scaled(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u / scale, scale)`` with max |u / scale| = 1 and the entries below _TINY set to 0
    (their products with the exponentials would be denormal)."""
    scale = u.abs().amax().clamp_min(torch.finfo(u.dtype).tiny)
    us = u / scale
    return us.masked_fill_(us.abs() < _TINY.get(u.dtype, 0.0), 0.0), scale
