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
two sums cancel where x_i is near y_j and leave the rounding over C_ij). For the squared
distance the scores are one matrix product of augmented clouds, and the softmin's and
kernel product's backward passes never form W (:func:`_backward_products`). A second
derivative (``create_graph=True``) falls back to autograd through the dense formulas, block
by block, which stores that graph.

Where :mod:`otreg.reductions._compiled` serves the call (``fused``: squared Euclidean
softmin or kernel
product, float32/64, CPU) and the reduction has run long enough here to repay a compile,
forward and backward run as its fused loops instead of the sweeps above.
"""

from __future__ import annotations

import math

import torch

from ..costs import SQRT_FLOOR, Cost, squared_differences
from . import _compiled, _dense

__all__: list[str] = []

#: pairs of a softmin's forward block: five sweeps of a block that stays in the processor's
#: cache (1 MB in float32) ran 1.2 times as fast as of one of 2^21 pairs (N = M = 5,000,
#: two cores); the kernel product and the backward passes, whose matrix products dominate,
#: ran 1.2 to 1.4 times slower with such blocks
CACHE_PAIRS = 2**18

#: the kernel product's backward meets its blocks with E (1 + D) columns of values and
#: coordinates (:func:`_backward_products`) up to this many channels E; beyond, through the
#: weights W. N = M = 5,000, forward + gradient in x and v: 38 ms against 55 at E = 3,
#: 49 against 53 at E = 16, but 69 against 60 at E = 32
MAX_CHANNELS_WITHOUT_W = 16

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
        if cost.p == 2:  # s_ij = <(x_i, 1), (y_j / eps, h_j - |y_j|^2 / (2 eps))>
            col = -self.y_sq / (2 * eps)
            if h is not None:
                col = col + h
            self.xa = torch.cat([self.x, self.x.new_ones(B, N, 1)], 2)
            self.ya = torch.cat([self.y.transpose(1, 2) / eps, col.unsqueeze(1)], 1)
            self.r = -(self.x * self.x).sum(-1, keepdim=True) / (2 * eps)  # (B, N, 1)
        self.rows = max(1, min(N, block_elements // max(1, B * M)))
        self.buf = x.new_empty(B, self.rows, M)
        self.buf_c = x.new_empty(B, self.rows, M) if cost.p == 1 else None
        self._buf_w: torch.Tensor | None = None

    def shifts(self, result: torch.Tensor) -> torch.Tensor:
        """The log-sum-exps (B, N, 1) of the rows of the scores (for the squared distance)
        that a softmin's result (B, N) means: -result / eps - r (0 where not finite)."""
        lse = result.to(self.r.dtype).unsqueeze(2).mul(-1.0 / self.eps).sub_(self.r)
        return lse.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    def second(self, n: int) -> torch.Tensor:
        """A second block buffer (for the backward's products), made once: a fresh large
        tensor every block would be mapped and faulted in again each time (with glibc's
        mmap threshold fixed low, as under a memory budget)."""
        if self._buf_w is None:
            self._buf_w = torch.empty_like(self.buf)
        return self._buf_w[:, :n]

    def slices(self, pairs: int | None = None):
        """Blocks of rows of at most ``self.rows`` rows, and of about ``pairs`` pairs."""
        B, N, M = self.x.shape[0], self.x.shape[1], self.y.shape[1]
        rows = self.rows if pairs is None else max(1, min(self.rows, pairs // max(1, B * M)))
        for start in range(0, N, rows):
            yield slice(start, min(N, start + rows))

    def scores(self, sl: slice):
        """``(s, r, C)``: s + r = h_j - C_ij/eps (s in the block buffer), r (B, n, 1) or 0,
        and C for p = 1."""
        xb = self.x[:, sl]
        n = xb.shape[1]
        eps = self.eps
        if self.p == 2:  # one product of the augmented clouds (a baddbmm whose added term
            # is broadcast over rows ran at half the speed)
            return torch.bmm(self.xa[:, sl], self.ya, out=self.buf[:, :n]), self.r[:, sl], None
        # from the differences: a matrix product's rounding under the root would be a
        # distance of about sqrt(u) |x| between coincident points (costs.py)
        C = squared_differences(xb, self.y, out=self.buf_c[:, :n])
        C.add_(SQRT_FLOOR).sqrt_()
        s = torch.mul(C, -1.0 / eps, out=self.buf[:, :n])
        if self.h is not None:
            s.add_(self.h.unsqueeze(1))
        return s, 0.0, C


def _softmax_(s: torch.Tensor, m=None, total=None):
    """In place: s <- exp(s - m) (clamped), returns (s, m, row sums); m and the row sums
    (B, n, 1) go into ``m`` and ``total`` where given."""
    m = s.amax(dim=2, keepdim=True) if m is None else torch.amax(s, 2, keepdim=True, out=m)
    m.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # a row of -inf: 0
    s.sub_(m).clamp_(min=_dense.product_floor(s.dtype)).exp_()
    if total is None:
        return s, m, s.sum(2, keepdim=True)
    return s, m, torch.sum(s, 2, keepdim=True, out=total)


def _forward(kind: str, blocks: _Blocks, v, estimate=None) -> torch.Tensor:
    B, N = blocks.x.shape[0], blocks.x.shape[1]
    if kind == "kernel_product":
        out = blocks.x.new_empty(B, N, v.shape[-1])
        values = _Columns(v)
        for sl in blocks.slices():
            s, r, _ = blocks.scores(sl)
            s.add_(r).clamp_(min=_dense.exp_floor(s.dtype)).exp_()
            values.times(s, out=out[:, sl])
        return out
    # the row maxima and sums of all blocks, finished together: a block's few small
    # operations cost as much as its sweep once blocks fit the processor's cache
    m, total = blocks.x.new_empty(B, N, 1), blocks.x.new_empty(B, N, 1)
    if kind == "softmin" and blocks.p == 2 and estimate is not None:
        _shifted_sums(blocks, estimate, m, total)
    else:
        out = None if kind == "softmin" else blocks.x.new_empty(B, N, v.shape[-1])
        values = None if out is None else _Columns(v)
        for sl in blocks.slices(CACHE_PAIRS):
            s, _, _ = blocks.scores(sl)
            z, _, _ = _softmax_(s, m[:, sl], total[:, sl])
            if values is not None:
                values.times(z, out=out[:, sl])
        if out is not None:
            return out.div_(total)
    lse = total.log_().add_(m)
    if blocks.p == 2:  # the row term the scores leave out
        lse.add_(blocks.r)
    return lse.squeeze(2).mul_(-blocks.eps)


def _shifted(blocks: _Blocks, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The augmented clouds whose product is a block's scores less the rows' shifts m
    (B, N, 1): (x_i, 1, -m_i) and (y_j / eps, h_j - |y_j|^2 / (2 eps), 1)."""
    ones = blocks.ya.new_ones(blocks.ya.shape[0], 1, blocks.ya.shape[2])
    return torch.cat([blocks.xa, -m], 2), torch.cat([blocks.ya, ones], 1)


def _shifted_sums(blocks: _Blocks, estimate: torch.Tensor, m, total) -> None:
    """The softmin's row shifts and sums into m and total (B, N, 1) from an estimate of
    its result (B, N) (the previous Sinkhorn iterate) instead of the rows' maxima: the
    shift goes into the scores' matrix product, which saves two of a block's five
    sweeps (the maximum and the subtraction; 7.5 against 10.4 ms a softmin at N = M =
    5,000). A row whose sum comes out of range (an estimate far from the result: the
    terms' exponentials overflow, or all of them fall so far below 1 that the clamped
    ones would count) is summed again from its maximum."""
    floor = _dense.exp_floor(blocks.x.dtype)
    m.copy_(blocks.shifts(estimate))
    xs, ys = _shifted(blocks, m)
    for sl in blocks.slices(CACHE_PAIRS):
        s = torch.bmm(xs[:, sl], ys, out=blocks.buf[:, : sl.stop - sl.start])
        torch.sum(s.clamp_(min=floor).exp_(), 2, keepdim=True, out=total[:, sl])
    # the clamped terms (exp(floor) each) together below the rounding of a row's sum (an
    # estimate 674 eps below a float64 result left a sum of 1e-293, where the clamped terms
    # made 1e-11 of it)
    low = blocks.y.shape[1] * math.exp(floor) / torch.finfo(blocks.x.dtype).eps
    bad = ~((total >= low) & (total < torch.inf))  # (NaN: not in range either)
    if bool(bad.any()):
        _exact_rows(blocks, bad.squeeze(2), m, total)


def _exact_rows(blocks: _Blocks, rows: torch.Tensor, m, total) -> None:
    """Overwrite m and total (B, N, 1) at ``rows`` (B, N, bool) with the rows' maxima and
    the sums of their exponentials less them."""
    step = max(1, CACHE_PAIRS // blocks.y.shape[1])
    for b in range(rows.shape[0]):
        idx = rows[b].nonzero().squeeze(1)
        for start in range(0, len(idx), step):
            i = idx[start : start + step]
            s = torch.bmm(blocks.xa[b : b + 1, i], blocks.ya[b : b + 1])
            _, mb, tb = _softmax_(s)
            m[b, i], total[b, i] = mb[0], tb[0]


def _backward(kind: str, blocks: _Blocks, v, out, grad_out, needs) -> list:
    """Gradients with respect to (x, y, h, v), None where not needed."""
    without_w = kind == "softmin" or (
        kind == "kernel_product" and v.shape[-1] <= MAX_CHANNELS_WITHOUT_W
    )
    if blocks.p == 2 and without_w:
        return _backward_products(kind, blocks, v, out, grad_out, needs)
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


def _backward_products(kind: str, blocks: _Blocks, v, out, grad_out, needs) -> list:
    """The softmin's and the kernel product's gradients for the squared distance.

    Each block's weights meet two matrix products, one over rows and one over columns,
    that carry every sum the gradients need (W never formed: five sweeps of a block
    instead of ten). With z the block's exponentials:

    - softmin: gx_i = G_i (x_i - sum_j z_ij y_j / sum_j z_ij), gy_j and gh_j from
      sum_i z_ij u_i (x_i, 1), u_i = G_i / sum_j z_ij;
    - kernel product (K = z): gx_i = -(1/eps) sum_e G_ie (x_i (K v_e)_i - (K (v_e y))_i),
      gy_j = -(1/eps) sum_e v_je (y_j (K^T G_e)_j - (K^T (G_e x))_j), gv_j = (K^T G)_j.

    The weights that meet the exponentials are scaled to at most 1 with negligible entries
    zeroed (:func:`_dense.scaled`), so that no product is a denormal number. The kernel
    product's products carry E (1 + D) columns (up to ``MAX_CHANNELS_WITHOUT_W``). The
    softmin's rows are shifted by their log-sum-exps, known from its result ``out``
    (:func:`_shifted`: no pass for the maxima)."""
    eps, x, y = blocks.eps, blocks.x, blocks.y
    B, N, D = x.shape
    gx = torch.zeros_like(x) if needs[0] else None
    gy = torch.zeros_like(y) if needs[1] else None
    gh = torch.zeros_like(blocks.y_sq) if needs[2] else None
    gv = torch.zeros_like(v) if needs[3] else None
    if kind == "softmin":
        cols = torch.cat([y, x.new_ones(B, y.shape[1], 1)], 2)  # sum_j z_ij (y_j, 1)
        xs, ys = _shifted(blocks, blocks.shifts(out))
        floor = _dense.product_floor(x.dtype)
    else:
        vs, v_scale = _dense.scaled(v)
        E = v.shape[-1]
        cols = _with_products(vs, y)
    cols = _Columns(cols)
    col_sums = None  # sum_i z_ij (u_i x_i, u_i) or sum_i K_ij (G_i, G_i x_i): (B, M, .)
    if gy is not None or gh is not None or gv is not None:
        col_sums = _ColumnSums(x, y.shape[1], cols.width)
    for sl in blocks.slices():
        G = grad_out[:, sl]
        xb = x[:, sl]
        if kind == "softmin":
            z = torch.bmm(xs[:, sl], ys, out=blocks.buf[:, : xb.shape[1]])
            z.clamp_(min=floor).exp_()
            rows = cols.times(z)  # (B, n, D + 1)
            total = rows[..., D:]
            if gx is not None:
                gx[:, sl] = G.unsqueeze(2) * (xb - rows[..., :D] / total)
            if col_sums is not None:
                u, scale = _dense.scaled(G.unsqueeze(2) / total)
                col_sums.add(z, torch.cat([u * xb, u], 2), alpha=float(scale))
            continue
        s, r, _ = blocks.scores(sl)
        K = s.add_(r).clamp_(min=_dense.product_floor(s.dtype)).exp_()
        Gs, g_scale = _dense.scaled(G)
        if gx is not None:
            rows = cols.times(K)  # (B, n, E + E D)
            gx[:, sl] = _moved(Gs, xb, rows) * (g_scale * v_scale * (-1.0 / eps))
        if col_sums is not None:
            col_sums.add(K, _with_products(Gs, xb), alpha=float(g_scale))
    if col_sums is None:
        return [gx, gy, gh, gv]
    col_sums = col_sums.total()
    if kind == "softmin":
        if gh is not None:
            gh.copy_(col_sums[..., D]).mul_(-eps)
        if gy is not None:
            gy.copy_(y * col_sums[..., D:] - col_sums[..., :D])
        return [gx, gy, gh, gv]
    if gv is not None:
        gv.copy_(col_sums[..., :E])
    if gy is not None:
        gy.copy_(_moved(vs, y, col_sums) * (v_scale * (-1.0 / eps)))
    return [gx, gy, gh, gv]


class _Columns:
    """Columns (B, M, C) that meet every block (B, n, M) of a reduction in a matrix product
    (:func:`_dense.times`), transposed once where they are few."""

    def __init__(self, cols: torch.Tensor) -> None:
        self.cols, self.width = cols, cols.shape[-1]
        narrow = self.width <= _dense.NARROW_COLUMNS
        self.t = cols.transpose(1, 2).contiguous() if narrow else None

    def times(self, z: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``z @ cols`` (B, n, C) for a block z (B, n, M), into ``out`` where given."""
        return _dense.times(z, self.cols, self.t, out)


class _ColumnSums:
    """The sums over a reduction's blocks of ``z^T @ w`` (B, M, C): z (B, n, M) a block,
    w (B, n, C) its rows' weights; kept transposed where the columns are few
    (:func:`_dense.times`)."""

    def __init__(self, like: torch.Tensor, M: int, width: int) -> None:
        self.transposed = width <= _dense.NARROW_COLUMNS
        shape = (like.shape[0], width, M) if self.transposed else (like.shape[0], M, width)
        self.sums = like.new_zeros(shape)

    def add(self, z: torch.Tensor, w: torch.Tensor, alpha: float = 1.0) -> None:
        if self.transposed:
            self.sums.baddbmm_(w.transpose(1, 2), z, alpha=alpha)
        else:
            self.sums.baddbmm_(z.transpose(1, 2), w, alpha=alpha)

    def total(self) -> torch.Tensor:
        return self.sums.transpose(1, 2) if self.transposed else self.sums


def _with_products(w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """(w_e, w_e p) for each channel e of w (B, n, E) and points p (B, n, D): (B, n, E + E D)."""
    return torch.cat([w, (w.unsqueeze(3) * p.unsqueeze(2)).flatten(2)], 2)


def _moved(w: torch.Tensor, p: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """sum_e w_e (p S_e - T_e) for w (B, n, E), points p (B, n, D) and the sums of a block's
    products with :func:`_with_products`' columns, sums = (S, T) (B, n, E + E D): (B, n, D)."""
    E, D = w.shape[-1], p.shape[-1]
    moved = p.unsqueeze(2) * sums[..., :E, None] - sums[..., E:].unflatten(2, (E, D))
    return (w.unsqueeze(3) * moved).sum(2)


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
    def forward(ctx, kind, eps, cost, block_elements, fused, x, y, h, v, estimate):
        w = h if v is None else v
        out = _compiled.tiered(
            _compiled.signature(kind, "forward", x, y, w) if fused else None,
            lambda: _compiled.forward(kind, x, y, (w,), eps),
            lambda: _forward(kind, _Blocks(x, y, h, eps, cost, block_elements), v, estimate),
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
            return (None, None, None, None, None, *grads, None)
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
        return (None, None, None, None, None, *grads, None)


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
    estimate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kind`` in softmin / kernel_product / softmax_average, computed block by block.

    ``rest`` is ``(h,)``, ``(v,)`` or ``(h, v)`` as the kind needs. ``fused``: the call may
    run as :mod:`otreg.reductions._compiled`'s fused loops (once they are worth their compile).
    ``estimate``: a softmin's likely result (B, N), whose rows shift the scores instead of
    their maxima (:func:`_shifted_sums`); the result does not depend on it beyond rounding.
    """
    h = rest[0] if kind in ("softmin", "softmax_average") else None
    v = rest[-1] if kind in ("kernel_product", "softmax_average") else None
    if v is not None:
        v = v.contiguous()
    return _BlockedReduction.apply(
        kind, eps, cost, block_elements, fused, x.contiguous(), y.contiguous(), h, v, estimate
    )
