r"""GPU kernels for the three reductions, written in Triton: the ``triton`` backend.

Every reduction is a sum over j of a function of the score

.. math::

    s_{ij} = h_j - C(x_i, y_j) / \varepsilon

(h = 0 for the kernel product). One program takes a tile of ``BLOCK_N`` rows i and loops over
tiles of ``BLOCK_M`` columns j, so that the N x M scores never exist: the softmin and the
softmax average keep a running maximum and a running sum (the online log-sum-exp of
FlashAttention), the kernel product a running sum. Distances are computed coordinate by
coordinate from the points, exactly (no matrix-product expansion, no TF32), in the points'
dtype (float32 or float64).

The gradients use the weights :math:`W_{ij} = \partial L / \partial s_{ij}`, which the
forward pass's row log-sum-exp makes cheap to recompute:

- softmin, out_i = -eps log sum_j exp(s_ij): :math:`W_{ij} = -\varepsilon g_i P_{ij}`,
  P the row softmax;
- kernel product, out_i = sum_j exp(s_ij) v_j: :math:`W_{ij} = e^{s_{ij}} \langle g_i, v_j\rangle`;
- softmax average, out_i = sum_j P_ij v_j: :math:`W_{ij} = P_{ij} \langle g_i, v_j - out_i\rangle`.

With :math:`\partial C / \partial x_i = c_{ij} (x_i - y_j)` (c = 1 for the squared distance,
1 / |x_i - y_j| for the distance), one more row pass gives

.. math::

    \partial L / \partial x_i = -\tfrac{1}{\varepsilon}
        \big(x_i \textstyle\sum_j c_{ij} W_{ij} - \sum_j c_{ij} W_{ij} y_j\big)

and one column pass (tiles of j, a loop over tiles of i) the gradients in y, h
(:math:`\sum_i W_{ij}`) and v. A second derivative (``create_graph``) goes through the dense
formulas instead, block by block (``_blocked``).

Triton compiles the kernels for the GPU on first use (cached by Triton). With
``TRITON_INTERPRET=1`` set before the first use, its interpreter runs them on the CPU: that is
how the tests check them where there is no GPU; it is slow, for small sizes only. Triton is
imported on first use: it ships with torch's CUDA wheels, and nothing else needs it.
"""

from __future__ import annotations

import functools
import os
import types

import torch

from ..costs import Cost
from ._blocked import dense_backward

__all__: list[str] = []

#: The reductions, as the kernels number them.
KINDS = {"softmin": 0, "kernel_product": 1, "softmax_average": 2}
#: Rows and columns a tile, by dtype (float64 holds twice the registers a value).
BLOCKS = {torch.float32: (64, 64), torch.float64: (32, 32)}
#: The dtypes the kernels compute in.
DTYPES = (torch.float32, torch.float64)


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (on the CPU, for the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def unavailable() -> str | None:
    """Why the kernels cannot run here, or None."""
    try:
        import triton  # noqa: F401
    except Exception as err:  # ImportError, or a broken install
        return f"triton cannot be imported ({type(err).__name__}: {err})"
    return None


def usable(x: torch.Tensor) -> bool:
    """Whether these kernels take the tensor: float32/64, on CUDA (or any device under the
    interpreter), with Triton importable."""
    return (
        x.dtype in DTYPES and (x.device.type == "cuda" or interpreted()) and unavailable() is None
    )


@functools.cache
def _kernels() -> types.SimpleNamespace:
    """The jitted kernels (Triton imported here, on first use)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _scores(x, y, h, inv_eps, mask_m, COST: tl.constexpr):
        """The scores s (BN, BM) of the tiles x (BN, DP), y (BM, DP), h (BM,), and the
        cost's derivative factor c (1, or 1 / |x - y|)."""
        diff = x[:, None, :] - y[None, :, :]
        sq = tl.sum(diff * diff, axis=2)
        if COST == 0:
            c = sq * 0.5
            factor = sq * 0.0 + 1.0
        else:
            c = tl.sqrt(sq + 1e-20)  # costs.SQRT_FLOOR: the gradient is 0 at x = y
            factor = 1.0 / c
        s = h[None, :] - c * inv_eps
        s = tl.where(mask_m[None, :], s, float("-inf"))
        return s, factor

    @triton.jit
    def _load_rows(X, b, rn, rd, mask_n, sxb, sxn, D: tl.constexpr):
        """The tile of points x_i: (BN, DP), zero past N and D."""
        return tl.load(
            X + b * sxb + rn[:, None] * sxn + rd[None, :],
            mask=mask_n[:, None] & (rd[None, :] < D),
            other=0.0,
        )

    @triton.jit
    def _load_row_state(G, OUT, LSE, b, rn, re, mask_n, ne, sob, son, N, KIND: tl.constexpr):
        """For a block of rows: the incoming gradient and the forward's output, (BN, EP),
        and the forward's log-sum-exp (BN,) (zeros for the kernel product, which has none)."""
        g = tl.load(G + b * sob + rn[:, None] * son + re[None, :], mask=ne, other=0.0)
        out = tl.load(OUT + b * sob + rn[:, None] * son + re[None, :], mask=ne, other=0.0)
        if KIND == 1:
            lse = tl.sum(out, axis=1) * 0.0
        else:
            lse = tl.load(LSE + b * N + rn, mask=mask_n, other=0.0)
        return g, out, lse

    @triton.jit
    def _load_columns(
        Y, H, V, b, rm, rd, re, mask_m, syb, sym, shb, svb, svm,
        KIND: tl.constexpr, D: tl.constexpr, E: tl.constexpr, BM: tl.constexpr,
        EP: tl.constexpr,
    ):  # fmt: skip
        """The tiles of y_j (BM, DP), h_j (BM,) (0 for a kernel product) and v_j (BM, EP)
        (0 for a softmin), zero past M, D and E."""
        y = tl.load(
            Y + b * syb + rm[:, None] * sym + rd[None, :],
            mask=mask_m[:, None] & (rd[None, :] < D),
            other=0.0,
        )
        if KIND == 1:
            h = tl.sum(y, axis=1) * 0.0
        else:
            h = tl.load(H + b * shb + rm, mask=mask_m, other=0.0)
        if KIND == 0:
            v = tl.zeros((BM, EP), dtype=y.dtype)
        else:
            v = tl.load(
                V + b * svb + rm[:, None] * svm + re[None, :],
                mask=mask_m[:, None] & (re[None, :] < E),
                other=0.0,
            )
        return y, h, v

    @triton.jit
    def _forward(
        X, Y, H, V, OUT, LSE, N, M, inv_eps, eps,
        sxb, sxn, syb, sym, shb, svb, svm, sob, son,
        KIND: tl.constexpr, COST: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        E: tl.constexpr, EP: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(1)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rd, re = tl.arange(0, DP), tl.arange(0, EP)
        mask_n = rn < N
        x = _load_rows(X, b, rn, rd, mask_n, sxb, sxn, D)
        zero = tl.sum(x, axis=1) * 0.0  # (BN,) zeros of the points' dtype
        m_i = zero + float("-inf")
        l_i = zero
        acc = zero[:, None] + tl.zeros((1, EP), dtype=x.dtype)
        for start in range(0, M, BM):
            rm = start + tl.arange(0, BM)
            mask_m = rm < M
            y, h, v = _load_columns(
                Y, H, V, b, rm, rd, re, mask_m, syb, sym, shb, svb, svm, KIND, D, E, BM, EP
            )
            s, _ = _scores(x, y, h, inv_eps, mask_m, COST)
            if KIND == 1:
                k = tl.exp(s)
                acc += tl.sum(k[:, :, None] * v[None, :, :], axis=1)
            else:
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - shift)
                p = tl.exp(s - shift[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if KIND == 2:
                    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
                m_i = m_new
        out = OUT + b * sob + rn[:, None] * son + re[None, :]
        if KIND == 1:
            tl.store(out, acc, mask=mask_n[:, None] & (re[None, :] < E))
        else:
            lse = m_i + tl.log(l_i)
            tl.store(LSE + b * N + rn, lse, mask=mask_n)
            if KIND == 0:
                res = -eps * lse
                tl.store(out, res[:, None] + acc * 0.0, mask=mask_n[:, None] & (re[None, :] < 1))
            else:
                tl.store(out, acc / l_i[:, None], mask=mask_n[:, None] & (re[None, :] < E))

    @triton.jit
    def _weights(s, lse, g, v, out, eps, KIND: tl.constexpr):
        """W_ij = dL / ds_ij for the tiles: g (BN, EP) the output's gradient, lse (BN,),
        v (BM, EP), out (BN, EP)."""
        if KIND == 0:
            w = -eps * tl.sum(g, axis=1)[:, None] * tl.exp(s - lse[:, None])
        elif KIND == 1:
            w = tl.exp(s) * tl.sum(g[:, None, :] * v[None, :, :], axis=2)
        else:
            gv = tl.sum(g[:, None, :] * v[None, :, :], axis=2)
            w = tl.exp(s - lse[:, None]) * (gv - tl.sum(g * out, axis=1)[:, None])
        return w

    @triton.jit
    def _backward_rows(
        X, Y, H, V, OUT, LSE, G, GX, N, M, inv_eps, eps,
        sxb, sxn, syb, sym, shb, svb, svm, sob, son,
        KIND: tl.constexpr, COST: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        E: tl.constexpr, EP: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(1)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rd, re = tl.arange(0, DP), tl.arange(0, EP)
        mask_n = rn < N
        ne = mask_n[:, None] & (re[None, :] < (1 if KIND == 0 else E))
        x = _load_rows(X, b, rn, rd, mask_n, sxb, sxn, D)
        g, out, lse = _load_row_state(G, OUT, LSE, b, rn, re, mask_n, ne, sob, son, N, KIND)
        total = tl.sum(x, axis=1) * 0.0
        weighted = x * 0.0
        for start in range(0, M, BM):
            rm = start + tl.arange(0, BM)
            mask_m = rm < M
            y, h, v = _load_columns(
                Y, H, V, b, rm, rd, re, mask_m, syb, sym, shb, svb, svm, KIND, D, E, BM, EP
            )
            s, factor = _scores(x, y, h, inv_eps, mask_m, COST)
            w = _weights(s, lse, g, v, out, eps, KIND)
            w = tl.where(mask_m[None, :] & mask_n[:, None], w * factor, 0.0)
            total += tl.sum(w, axis=1)
            weighted += tl.sum(w[:, :, None] * y[None, :, :], axis=1)
        gx = -inv_eps * (x * total[:, None] - weighted)
        tl.store(
            GX + b * N * D + rn[:, None] * D + rd[None, :],
            gx,
            mask=mask_n[:, None] & (rd[None, :] < D),
        )

    @triton.jit
    def _backward_columns(
        X, Y, H, V, OUT, LSE, G, GY, GH, GV, N, M, inv_eps, eps,
        sxb, sxn, syb, sym, shb, svb, svm, sob, son,
        KIND: tl.constexpr, COST: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        E: tl.constexpr, EP: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(1)
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rd, re = tl.arange(0, DP), tl.arange(0, EP)
        mask_m = rm < M
        y, h, v = _load_columns(
            Y, H, V, b, rm, rd, re, mask_m, syb, sym, shb, svb, svm, KIND, D, E, BM, EP
        )
        total = tl.sum(y, axis=1) * 0.0
        plain = tl.sum(y, axis=1) * 0.0
        weighted = y * 0.0
        gv = v * 0.0
        for start in range(0, N, BN):
            rn = start + tl.arange(0, BN)
            mask_n = rn < N
            ne = mask_n[:, None] & (re[None, :] < (1 if KIND == 0 else E))
            x = _load_rows(X, b, rn, rd, mask_n, sxb, sxn, D)
            g, out, lse = _load_row_state(G, OUT, LSE, b, rn, re, mask_n, ne, sob, son, N, KIND)
            s, factor = _scores(x, y, h, inv_eps, mask_m, COST)
            live = mask_m[None, :] & mask_n[:, None]
            w = tl.where(live, _weights(s, lse, g, v, out, eps, KIND), 0.0)
            plain += tl.sum(w, axis=0)
            wf = w * factor
            total += tl.sum(wf, axis=0)
            weighted += tl.sum(wf[:, :, None] * x[:, None, :], axis=0)
            if KIND != 0:
                if KIND == 1:
                    p = tl.where(live, tl.exp(s), 0.0)
                else:
                    p = tl.where(live, tl.exp(s - lse[:, None]), 0.0)
                gv += tl.sum(p[:, :, None] * g[:, None, :], axis=0)
        gy = -inv_eps * (y * total[:, None] - weighted)
        tl.store(
            GY + b * M * D + rm[:, None] * D + rd[None, :],
            gy,
            mask=mask_m[:, None] & (rd[None, :] < D),
        )
        tl.store(GH + b * M + rm, plain, mask=mask_m)
        if KIND != 0:
            tl.store(
                GV + b * M * E + rm[:, None] * E + re[None, :],
                gv,
                mask=mask_m[:, None] & (re[None, :] < E),
            )

    # a kernel finds the jitted functions it calls among its module's globals, when it is
    # compiled (or interpreted): they are made here, on first use, so they go there now
    globals().update(
        _scores=_scores,
        _weights=_weights,
        _load_rows=_load_rows,
        _load_row_state=_load_row_state,
        _load_columns=_load_columns,
    )
    return types.SimpleNamespace(
        triton=triton,
        forward=_forward,
        backward_rows=_backward_rows,
        backward_columns=_backward_columns,
    )


def _pow2(n: int) -> int:
    return max(2, 1 << (max(1, n) - 1).bit_length())


def _shapes(kind: str, x, y, v) -> dict:
    """The constexpr sizes of a call."""
    D = x.shape[2]
    E = 1 if v is None else v.shape[2]
    bn, bm = BLOCKS[x.dtype]
    return dict(
        KIND=KINDS[kind], D=D, DP=_pow2(D), E=E, EP=_pow2(E), BN=bn, BM=bm
    )  # fmt: skip


def _strides(x, y, h, v, out) -> tuple:
    """The batch and row strides of the inputs (their last axes are contiguous)."""
    hb = 0 if h is None else h.stride(0)
    vb, vm = (0, 0) if v is None else (v.stride(0), v.stride(1))
    return (x.stride(0), x.stride(1), y.stride(0), y.stride(1), hb, vb, vm, out.stride(0),
            out.stride(1))  # fmt: skip


def _forward(kind: str, x, y, h, v, eps: float, cost: Cost):
    """(out (B, N, E), lse (B, N) or None)."""
    k = _kernels()
    B, N, _ = x.shape
    M = y.shape[1]
    sizes = _shapes(kind, x, y, v)
    out = torch.empty(B, N, sizes["E"], dtype=x.dtype, device=x.device)
    lse = torch.empty(B, N, dtype=x.dtype, device=x.device)
    dummy = x.new_empty(1)
    grid = (k.triton.cdiv(N, sizes["BN"]), B)
    k.forward[grid](
        x, y, dummy if h is None else h, dummy if v is None else v, out, lse, N, M,
        1.0 / eps, eps, *_strides(x, y, h, v, out), COST=0 if cost.p == 2 else 1, **sizes,
    )  # fmt: skip
    return out, (None if kind == "kernel_product" else lse)


def _backward(ctx, grad_out):
    x, y, h, v, out, lse = ctx.saved_tensors
    need_x, need_y, need_h, need_v = ctx.needs_input_grad[3:7]
    k = _kernels()
    B, N, D = x.shape
    M = y.shape[1]
    sizes = _shapes(ctx.kind, x, y, v)
    g = grad_out.contiguous()
    dummy = x.new_empty(1)
    args = (
        x, y, dummy if h is None else h, dummy if v is None else v, out,
        dummy if lse is None else lse, g,
    )  # fmt: skip
    rest = (N, M, 1.0 / ctx.eps, ctx.eps, *_strides(x, y, h, v, out))
    cost = 0 if ctx.cost.p == 2 else 1
    gx = gy = gh = gv = None
    if need_x:
        gx = torch.empty_like(x)
        k.backward_rows[(k.triton.cdiv(N, sizes["BN"]), B)](*args, gx, *rest, COST=cost, **sizes)
    if need_y or need_h or need_v:
        gy = torch.empty_like(y)
        gh = torch.empty(B, M, dtype=x.dtype, device=x.device)
        gv = torch.empty(B, M, sizes["E"], dtype=x.dtype, device=x.device)
        k.backward_columns[(k.triton.cdiv(M, sizes["BM"]), B)](
            *args, gy, gh, gv, *rest, COST=cost, **sizes
        )
    return (
        gx if need_x else None,
        gy if need_y else None,
        gh if need_h else None,
        gv if need_v and v is not None else None,
    )


class _TritonReduction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kind, eps, cost, x, y, h, v):
        """One reduction; ``out`` is (B, N, 1) for the softmin, (B, N, E) otherwise."""
        out, lse = _forward(kind, x, y, h, v, eps, cost)
        ctx.kind, ctx.eps, ctx.cost = kind, eps, cost
        ctx.save_for_backward(x, y, h, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        """The gradients in x, y, h and v by the kernels (the dense formulas, block by
        block, under ``create_graph``)."""
        if torch.is_grad_enabled():  # a second derivative is coming
            x, y, h, v, out, _ = ctx.saved_tensors
            if ctx.kind == "softmin":  # the dense softmin is (B, N), this one (B, N, 1)
                grad_out = grad_out[..., 0]
            grads = dense_backward(
                ctx.kind, ctx.eps, ctx.cost, x, y, h, v, grad_out, ctx.needs_input_grad[3:7]
            )
            return (None, None, None, *grads)
        return (None, None, None, *_backward(ctx, grad_out))


def triton_reduction(
    kind: str, x: torch.Tensor, y: torch.Tensor, *rest: torch.Tensor, eps: float, cost: Cost
) -> torch.Tensor:
    """``kind`` in softmin / kernel_product / softmax_average by the Triton kernels; ``rest``
    is ``(h,)``, ``(v,)`` or ``(h, v)`` as the kind needs, v ``(B, M)`` or ``(B, M, E)``."""
    h = rest[0] if kind in ("softmin", "softmax_average") else None
    v = rest[-1] if kind in ("kernel_product", "softmax_average") else None
    flat = v is not None and v.dim() == 2
    if flat:
        v = v.unsqueeze(-1)
    x, y = x.contiguous(), y.contiguous()
    h = None if h is None else h.contiguous()
    v = None if v is None else v.contiguous()
    out = _TritonReduction.apply(kind, eps, cost, x, y, h, v)
    if kind == "softmin":
        return out[..., 0]
    return out[..., 0] if flat else out
