"""The ``blocked`` backend: dense torch on blocks of rows, with hand-written gradients.

Forward and backward both sweep the rows of x in blocks of about ``block_elements`` pairs,
reusing one or two block buffers, so memory stays O(block + N + M) and no autograd graph is
built per block. The backward pass recomputes each block's scores and applies the gradient
formulas below; with ``W_ij = d out / d C_ij`` (times the incoming gradient G):

- softmin ``out_i = -eps log sum_j exp(h_j - C_ij/eps)``: W_ij = G_i P_ij,
  d/dh_j = -eps sum_i G_i P_ij, with P the row softmax;
- kernel product ``out_i = sum_j exp(-C_ij/eps) v_j``: W_ij = -K_ij <G_i, v_j> / eps,
  d/dv_j = sum_i K_ij G_i;
- softmax average ``out_i = sum_j P_ij v_j``: with S_ij = P_ij (<G_i, v_j> - <G_i, out_i>),
  W_ij = -S_ij / eps, d/dh_j = sum_i S_ij, d/dv_j = sum_i P_ij G_i;

then d/dx_i = sum_j W_ij dC/dx (x_i - y_j for |x - y|^2/2, (x_i - y_j)/C_ij for |x - y|) and
d/dy_j likewise (for |x - y| from the coordinates' differences, as C itself: expanded, the
two sums cancel where x_i is near y_j and leave the rounding over C_ij). A second
derivative (``create_graph=True``) falls back to autograd through the dense formulas, block
by block, which stores that graph.

Where :mod:`otreg.reductions._compiled` serves the call (``fused``: squared Euclidean
softmin or kernel
product, float32/64, CPU) and the reduction has run long enough here to repay a compile,
forward and backward run as its fused loops instead of the sweeps above.
"""

from __future__ import annotations

import torch

from ..costs import SQRT_FLOOR, Cost, squared_differences
from . import _compiled, _dense

__all__: list[str] = []

_DENSE = {
    "softmin": _dense.softmin,
    "kernel_product": _dense.kernel_product,
    "softmax_average": _dense.softmax_average,
}


class _Blocks:
    """Centred clouds and block buffers for one reduction."""

    def __init__(self, x, y, h, eps: float, cost: Cost, block_elements: int) -> None:
        B, N, M = x.shape[0], x.shape[1], y.shape[1]
        c = y.mean(1, keepdim=True)  # the cost is translation invariant; rounding is not
        self.x, self.y = x - c, y - c
        self.y_sq = (self.y * self.y).sum(-1)  # (B, M)
        self.h, self.eps, self.p = h, eps, cost.p
        self.rows = max(1, min(N, block_elements // max(1, B * M)))
        self.buf = x.new_empty(B, self.rows, M)
        self.buf_c = x.new_empty(B, self.rows, M) if cost.p == 1 else None
        self._buf_w: torch.Tensor | None = None

    def second(self, n: int) -> torch.Tensor:
        """A second block buffer (for the backward's products), made once: a fresh large
        tensor every block would be mapped and faulted in again each time (with glibc's
        mmap threshold fixed low, as under a memory budget)."""
        if self._buf_w is None:
            self._buf_w = torch.empty_like(self.buf)
        return self._buf_w[:, :n]

    def slices(self):
        N = self.x.shape[1]
        for start in range(0, N, self.rows):
            yield slice(start, min(N, start + self.rows))

    def scores(self, sl: slice):
        """``(s, r, C)``: s + r = h_j - C_ij/eps (s in the block buffer), r (B, n, 1) or 0,
        and C for p = 1."""
        xb = self.x[:, sl]
        n = xb.shape[1]
        eps, yt = self.eps, self.y.transpose(1, 2)
        if self.p == 2:
            col = -self.y_sq / (2 * eps)
            if self.h is not None:
                col = col + self.h
            s = torch.baddbmm(col.unsqueeze(1), xb, yt, alpha=1.0 / eps, out=self.buf[:, :n])
            return s, -(xb * xb).sum(-1, keepdim=True) / (2 * eps), None
        # from the differences: a matrix product's rounding under the root would be a
        # distance of about sqrt(u) |x| between coincident points (costs.py)
        C = squared_differences(xb, self.y, out=self.buf_c[:, :n])
        C.add_(SQRT_FLOOR).sqrt_()
        s = torch.mul(C, -1.0 / eps, out=self.buf[:, :n])
        if self.h is not None:
            s.add_(self.h.unsqueeze(1))
        return s, 0.0, C


def _softmax_(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In place: s <- exp(s - m) (clamped), returns (s, m, row sums)."""
    m = s.amax(dim=2, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s.sub_(m).clamp_(min=_dense.product_floor(s.dtype)).exp_()
    return s, m, s.sum(2, keepdim=True)


def _forward(kind: str, blocks: _Blocks, v) -> torch.Tensor:
    B, N = blocks.x.shape[0], blocks.x.shape[1]
    out = blocks.x.new_empty((B, N) if kind == "softmin" else (B, N, v.shape[-1]))
    for sl in blocks.slices():
        s, r, _ = blocks.scores(sl)
        if kind == "kernel_product":
            s.add_(r).clamp_(min=_dense.exp_floor(s.dtype)).exp_()
            torch.bmm(s, v, out=out[:, sl])
            continue
        z, m, total = _softmax_(s)
        if kind == "softmin":
            out[:, sl] = -blocks.eps * (total.log() + m + r).squeeze(2)
        else:
            torch.bmm(z, v, out=out[:, sl])
            out[:, sl] /= total
    return out


def _backward(kind: str, blocks: _Blocks, v, out, grad_out, needs) -> list:
    """Gradients with respect to (x, y, h, v), None where not needed."""
    eps = blocks.eps
    gx = torch.zeros_like(blocks.x) if needs[0] else None
    gy = torch.zeros_like(blocks.y) if needs[1] else None
    gh = torch.zeros_like(blocks.y_sq) if needs[2] else None
    gv = torch.zeros_like(v) if needs[3] else None
    if kind == "kernel_product":
        vs, v_scale = _dense.scaled(v)  # once: v is the same for every block
    for sl in blocks.slices():
        G = grad_out[:, sl]
        s, r, C = blocks.scores(sl)
        if kind == "kernel_product":  # K, G and v scaled so that their products stay normal
            K = s.add_(r).clamp_(min=_dense.product_floor(s.dtype)).exp_()
            Gs, scale = _dense.scaled(G)
            if gv is not None:
                gv.add_(torch.bmm(K.transpose(1, 2), Gs), alpha=float(scale))
            W = K.mul_(torch.bmm(Gs, vs.transpose(1, 2), out=blocks.second(K.shape[1])))
            scale = scale * v_scale * (-1.0 / eps)
        elif kind == "softmin":  # W = P G = z (G / total), scaled to stay normal
            z, _, total = _softmax_(s)
            u, scale = _dense.scaled(G.unsqueeze(2) / total)
            W = z.mul_(u)
            if gh is not None:
                gh.add_(W.sum(1), alpha=-eps * float(scale))
        else:
            P, _, total = _softmax_(s)
            P.div_(total)
            if gv is not None:
                gv.baddbmm_(P.transpose(1, 2), G)
            GV = torch.bmm(G, v.transpose(1, 2), out=blocks.second(P.shape[1]))
            S = GV.sub_((G * out[:, sl]).sum(-1, keepdim=True)).mul_(P)
            if gh is not None:
                gh.add_(S.sum(1))
            W, scale = S, -1.0 / eps
        if gx is None and gy is None:
            continue
        xb = blocks.x[:, sl]
        if C is not None:  # |x - y|: the unit vectors from the differences, not expanded
            _unit_gradients(W.div_(C), xb, blocks.y, sl, scale, gx, gy)
            continue
        if gx is not None:
            gx[:, sl] = (xb * W.sum(2, keepdim=True) - torch.bmm(W, blocks.y)) * scale
        if gy is not None:
            dy = blocks.y * W.sum(1).unsqueeze(-1) - torch.bmm(W.transpose(1, 2), xb)
            gy.add_(dy, alpha=float(scale))
    return [gx, gy, gh, gv]


def _unit_gradients(U, xb, y, sl, scale, gx, gy) -> None:
    """Set gx[:, sl] to ``scale`` times sum_j U_ij (x_i - y_j) and add its opposite, summed
    over i, to gy, coordinate by coordinate from the differences: expanded as x_i sum_j
    U_ij - sum_j U_ij y_j, the two terms cancel where x_i is near y_j and U_ij (a weight
    over the distance) is large, and the rounding is left."""
    diff = torch.empty_like(U)
    for k in range(xb.shape[-1]):
        torch.sub(xb[..., k, None], y[..., k].unsqueeze(-2), out=diff).mul_(U)
        if gx is not None:
            gx[:, sl, k] = diff.sum(2) * scale
        if gy is not None:
            gy[..., k].add_(diff.sum(1), alpha=-float(scale))


class _BlockedReduction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kind, eps, cost, block_elements, fused, x, y, h, v):
        w = h if v is None else v
        out = _compiled.tiered(
            _compiled.signature(kind, "forward", x, y, w) if fused else None,
            lambda: _compiled.forward(kind, x, y, (w,), eps),
            lambda: _forward(kind, _Blocks(x, y, h, eps, cost, block_elements), v),
        )
        ctx.kind, ctx.eps, ctx.cost, ctx.block_elements = kind, eps, cost, block_elements
        ctx.fused = fused
        ctx.save_for_backward(x, y, h, v, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, y, h, v, out = ctx.saved_tensors
        needs = ctx.needs_input_grad[5:]
        if torch.is_grad_enabled():  # create_graph: differentiate the dense formulas
            grads = dense_backward(
                ctx.kind, ctx.eps, ctx.cost, x, y, h, v, grad_out, needs, ctx.block_elements
            )
            return (None, None, None, None, None, *grads)
        w, need_w = (h, needs[2]) if v is None else (v, needs[3])

        def fused():
            got = _compiled.backward(
                ctx.kind, x, y, (w,), ctx.eps, out, grad_out, (needs[0], needs[1], need_w)
            )
            if got is None:
                return None
            return got[:2] + ([got[2], None] if v is None else [None, got[2]])

        grads = _compiled.tiered(
            _compiled.signature(ctx.kind, "backward", x, y, w) if ctx.fused else None,
            fused,
            lambda: _backward(
                ctx.kind,
                _Blocks(x, y, h, ctx.eps, ctx.cost, ctx.block_elements),
                v,
                out,
                grad_out.contiguous(),
                needs,
            ),
        )
        return (None, None, None, None, None, *grads)


def dense_backward(
    kind, eps, cost, x, y, h, v, grad_out, needs, block_elements: int = 2**21
) -> list:
    """The gradients in (x, y, h, v) by autograd through the dense formulas, a block of
    rows at a time, with ``create_graph``: what a second derivative differentiates (the
    hand-written and the GPU backward passes are not differentiable)."""
    dense = _DENSE[kind]
    rest = [t for t in (h, v) if t is not None]
    inputs = [x, y, *rest]
    rows = max(1, block_elements // max(1, x.shape[0] * y.shape[1]))
    total = [None] * len(inputs)
    for start in range(0, x.shape[1], rows):
        sl = slice(start, start + rows)
        out_b = dense(x[:, sl], y, *rest, eps, cost)
        wanted = [t for t, need in zip(inputs, needs) if need]
        got = iter(
            torch.autograd.grad(
                out_b, wanted, grad_out[:, sl], create_graph=True, allow_unused=True
            )
        )
        for k, need in enumerate(needs[: len(inputs)]):
            if need:
                g = next(got)
                if g is not None:
                    total[k] = g if total[k] is None else total[k] + g
    grads = total[:2] + [None, None]
    for t, g in zip(rest, total[2:]):
        grads[2 if t is h else 3] = g
    return grads


def blocked_reduction(
    kind: str,
    x: torch.Tensor,
    y: torch.Tensor,
    *rest: torch.Tensor,
    eps: float,
    cost: Cost,
    block_elements: int,
    fused: bool = False,
) -> torch.Tensor:
    """``kind`` in softmin / kernel_product / softmax_average, computed block by block.

    ``rest`` is ``(h,)``, ``(v,)`` or ``(h, v)`` as the kind needs. ``fused``: the call may
    run as :mod:`otreg.reductions._compiled`'s fused loops (once they are worth their compile).
    """
    h = rest[0] if kind in ("softmin", "softmax_average") else None
    v = rest[-1] if kind in ("kernel_product", "softmax_average") else None
    if v is not None:
        v = v.contiguous()
    return _BlockedReduction.apply(
        kind, eps, cost, block_elements, fused, x.contiguous(), y.contiguous(), h, v
    )
