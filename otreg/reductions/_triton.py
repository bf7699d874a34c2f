r"""GPU kernels for the three reductions, written in Triton: the ``triton`` backend.

Every reduction is a sum over j of a function of the score

.. math::

    s_{ij} = h_j - C(x_i, y_j) / \varepsilon

(h = 0 for the kernel product). One program takes a tile of ``BN`` rows i and loops over
tiles of ``BM`` columns j, so that the N x M scores never exist: the softmin and the
softmax average keep a running maximum and a running sum (the online log-sum-exp of
FlashAttention), the kernel product a running sum. Distances are computed coordinate by
coordinate from the points, exactly (no matrix-product expansion, no TF32), in the points'
dtype (float32 or float64). The points and h come scaled so that the scores are in base 2
(one ``exp2`` a pair, no multiplication). Where the tiles of rows are too few to fill the
card (N = 1e4), the loop over j is split among several programs, whose partial sums and
log-sum-exps are combined afterwards (and likewise the column pass's loop over i).

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
import math
import os
import types
from dataclasses import dataclass

import torch

from ..costs import SQRT_FLOOR, Cost, get_cost
from ._blocked import dense_backward

__all__: list[str] = []

#: The reductions, as the kernels number them.
KINDS = {"softmin": 0, "kernel_product": 1, "softmax_average": 2}
#: Rows and columns a tile, and warps a program, by dtype: the fastest of
#: ``benchmarks/gpu.py --tune`` on an H100 (docs/benchmarks.md, "otreg on a GPU"). float32:
#: 128 x 32 with 8 warps, 0.54 T pairs/s for the softmin (64 x 64: 0.40; 256 x 64 or
#: 128 x 128 with 4 warps: 0.11, registers spilled); float64: 32 x 32 with 4 warps, 0.18.
BLOCKS = {torch.float32: (128, 32), torch.float64: (32, 32)}
NUM_WARPS = {torch.float32: 8, torch.float64: 4}
#: Programs a multiprocessor that a call aims at: a loop is split (over j for the rows'
#: kernels, over i for the columns') until there are that many, and the splits' partial
#: sums are added up (log-sum-exps combined) afterwards.
PROGRAMS_PER_SM = 4
LOG2E = 1 / math.log(2)
LN2 = math.log(2)
#: The dtypes the kernels compute in.
DTYPES = (torch.float32, torch.float64)
_SQEUCLIDEAN = get_cost("sqeuclidean")
#: The kernels' size arguments, which Triton would otherwise specialise on (== 1, a multiple
#: of 16), compiling a kernel anew for each such kind of size (about a second each on a cold
#: cache): the first registration of fsaverage5 to Conte69 on an H200 compiled 16 kernels in
#: 15.1 s with them specialised, 13 in 12.4 s without.
DENSE_SIZES = ["N", "M", "CHUNK", "S"]
SPARSE_SIZES = ["N", "M"]


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


@functools.cache
def _kernels() -> types.SimpleNamespace:
    """The jitted kernels (Triton imported here, on first use)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _scores(X, Y, H, b, rn, rm, mask_n, mask_m, N, M, floor,
                HAS_H: tl.constexpr, COST: tl.constexpr, D: tl.constexpr,
                BN: tl.constexpr, BM: tl.constexpr):  # fmt: skip
        """The base-2 scores s (BN, BM) of rows rn and columns rm, -inf past M, and the
        scaled cost c: the points come scaled so that s = h_j - c_ij = log2(e) times the
        natural score, and c = |x_i - y_j|^2 (COST 0) or |x_i - y_j| (COST 1)."""
        sq = tl.zeros((BN, BM), dtype=X.dtype.element_ty)
        for d in tl.static_range(D):
            xd = tl.load(X + (b * N + rn) * D + d, mask=mask_n, other=0.0)
            yd = tl.load(Y + (b * M + rm) * D + d, mask=mask_m, other=0.0)
            diff = xd[:, None] - yd[None, :]
            sq += diff * diff
        if COST == 0:
            c = sq
        else:
            c = tl.sqrt(sq + floor)
        if HAS_H:
            s = tl.load(H + b * M + rm, mask=mask_m, other=0.0)[None, :] - c
        else:
            s = -c
        return tl.where(mask_m[None, :], s, float("-inf")), c

    @triton.jit
    def _accumulate(acc, w, P, b, rows, mask, R, re, E: tl.constexpr, AXIS: tl.constexpr):
        """Add w @ P[b, rows] to acc (AXIS 1: acc (BN, EP), P's rows the columns j), or w^T @
        P[b, rows] (AXIS 0: acc (BM, EP), P's rows the rows i), E columns one by one."""
        for e in tl.static_range(E):
            pe = tl.load(P + (b * R + rows) * E + e, mask=mask, other=0.0)
            if AXIS == 1:
                col = tl.sum(w * pe[None, :], axis=1)
            else:
                col = tl.sum(w * pe[:, None], axis=0)
            acc += tl.where(re[None, :] == e, col[:, None], 0.0)
        return acc

    @triton.jit
    def _displacements(acc, w, X, Y, b, rn, rm, mask_n, mask_m, N, M, rd, D: tl.constexpr,
                       AXIS: tl.constexpr):  # fmt: skip
        """Add sum_j w_ij (x_i - y_j) to acc (AXIS 1: acc (BN, DP)), or sum_i w_ij (y_j - x_i)
        (AXIS 0: acc (BM, DP)), coordinate by coordinate."""
        for d in tl.static_range(D):
            xd = tl.load(X + (b * N + rn) * D + d, mask=mask_n, other=0.0)
            yd = tl.load(Y + (b * M + rm) * D + d, mask=mask_m, other=0.0)
            if AXIS == 1:
                col = tl.sum(w * (xd[:, None] - yd[None, :]), axis=1)
            else:
                col = tl.sum(w * (yd[None, :] - xd[:, None]), axis=0)
            acc += tl.where(rd[None, :] == d, col[:, None], 0.0)
        return acc

    @triton.jit
    def _row_dot(A, B2, b, rn, mask_n, N, E: tl.constexpr, BN: tl.constexpr):
        """sum_e A[b, i, e] B2[b, i, e] for the rows rn: (BN,)."""
        total = tl.zeros((BN,), dtype=A.dtype.element_ty)
        for e in tl.static_range(E):
            a = tl.load(A + (b * N + rn) * E + e, mask=mask_n, other=0.0)
            c = tl.load(B2 + (b * N + rn) * E + e, mask=mask_n, other=0.0)
            total += a * c
        return total

    @triton.jit
    def _row_column_dot(G, V, b, rn, rm, mask_n, mask_m, N, M, E: tl.constexpr,
                        BN: tl.constexpr, BM: tl.constexpr):  # fmt: skip
        """<g_i, v_j> for the tiles: (BN, BM)."""
        total = tl.zeros((BN, BM), dtype=G.dtype.element_ty)
        for e in tl.static_range(E):
            ge = tl.load(G + (b * N + rn) * E + e, mask=mask_n, other=0.0)
            ve = tl.load(V + (b * M + rm) * E + e, mask=mask_m, other=0.0)
            total += ge[:, None] * ve[None, :]
        return total

    @triton.jit(do_not_specialize=DENSE_SIZES)
    def _forward(
        X, Y, H, V, OUT, LSE, N, M, CHUNK, S, floor,
        KIND: tl.constexpr, COST: tl.constexpr, D: tl.constexpr, E: tl.constexpr,
        EP: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ):  # fmt: skip
        """One tile of rows against the columns of one split: OUT (B, S, N, E) the kernel
        product or the softmax average of the split, LSE (B, S, N) its base-2 log-sum-exp."""
        b = tl.program_id(1)
        split = tl.program_id(2)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        re = tl.arange(0, EP)
        mask_n = rn < N
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, M)
        m_i = tl.full((BN,), float("-inf"), dtype=X.dtype.element_ty)
        l_i = tl.zeros((BN,), dtype=X.dtype.element_ty)
        acc = tl.zeros((BN, EP), dtype=X.dtype.element_ty)
        for start in range(lo, hi, BM):
            rm = start + tl.arange(0, BM)
            mask_m = rm < hi
            s, _ = _scores(X, Y, H, b, rn, rm, mask_n, mask_m, N, M, floor, KIND != 1, COST,
                           D, BN, BM)  # fmt: skip
            if KIND == 1:
                acc = _accumulate(acc, tl.exp2(s), V, b, rm, mask_m, M, re, E, 1)
            else:
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - shift)
                p = tl.exp2(s - shift[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if KIND == 2:
                    acc = _accumulate(acc * alpha[:, None], p, V, b, rm, mask_m, M, re, E, 1)
                m_i = m_new
        row = (b * S + split) * N + rn
        live = mask_n[:, None] & (re[None, :] < E)
        if KIND == 1:
            tl.store(OUT + row[:, None] * E + re[None, :], acc, mask=live)
        else:
            tl.store(LSE + row, m_i + tl.log2(l_i), mask=mask_n)
            if KIND == 2:
                safe = tl.where(l_i > 0.0, l_i, 1.0)
                tl.store(OUT + row[:, None] * E + re[None, :], acc / safe[:, None], mask=live)

    @triton.jit
    def _weights(s, lse, G, V, OUT, b, rn, rm, mask_n, mask_m, N, M, KIND: tl.constexpr,
                 E: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr):  # fmt: skip
        """(W'_ij, K_ij): W' is dL / ds_ij up to the constant the caller applies, g_i P_ij
        (softmin), K_ij <g_i, v_j> (kernel product), P_ij (<g_i, v_j> - <g_i, out_i>)
        (softmax average); K the kernel's factor, e^s_ij (kernel product) or the plan's row
        P_ij (the others); both zero outside the tiles' rows and columns."""
        live = mask_n[:, None] & mask_m[None, :]
        if KIND == 1:
            k = tl.where(live, tl.exp2(s), 0.0)
        else:
            k = tl.where(live, tl.exp2(s - lse[:, None]), 0.0)
        if KIND == 0:
            g = tl.load(G + b * N + rn, mask=mask_n, other=0.0)
            w = g[:, None] * k
        elif KIND == 1:
            w = k * _row_column_dot(G, V, b, rn, rm, mask_n, mask_m, N, M, E, BN, BM)
        else:
            go = _row_dot(G, OUT, b, rn, mask_n, N, E, BN)
            gv = _row_column_dot(G, V, b, rn, rm, mask_n, mask_m, N, M, E, BN, BM)
            w = k * (gv - go[:, None])
        return w, k

    @triton.jit(do_not_specialize=DENSE_SIZES)
    def _backward_rows(
        X, Y, H, V, OUT, LSE, G, GX, N, M, CHUNK, S, floor,
        KIND: tl.constexpr, COST: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        E: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ):  # fmt: skip
        """GX (B, S, N, D): sum_j W'_ij f_ij (x_i - y_j) over one split's columns (f = 1,
        or 1 / c for the distance)."""
        b = tl.program_id(1)
        split = tl.program_id(2)
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rd = tl.arange(0, DP)
        mask_n = rn < N
        lse = tl.load(LSE + b * N + rn, mask=mask_n, other=0.0)
        acc = tl.zeros((BN, DP), dtype=X.dtype.element_ty)
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, M)
        for start in range(lo, hi, BM):
            rm = start + tl.arange(0, BM)
            mask_m = rm < hi
            s, c = _scores(X, Y, H, b, rn, rm, mask_n, mask_m, N, M, floor, KIND != 1, COST,
                           D, BN, BM)  # fmt: skip
            w, _ = _weights(s, lse, G, V, OUT, b, rn, rm, mask_n, mask_m, N, M, KIND, E, BN, BM)
            if COST == 1:
                w = w / c
            acc = _displacements(acc, w, X, Y, b, rn, rm, mask_n, mask_m, N, M, rd, D, 1)
        row = (b * S + split) * N + rn
        tl.store(GX + row[:, None] * D + rd[None, :], acc, mask=mask_n[:, None] & (rd[None, :] < D))

    @triton.jit(do_not_specialize=DENSE_SIZES)
    def _backward_columns(
        X, Y, H, V, OUT, LSE, G, GY, GH, GV, N, M, CHUNK, S, floor,
        KIND: tl.constexpr, COST: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        E: tl.constexpr, EP: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ):  # fmt: skip
        """For one tile of columns over one split's rows: GY (B, S, M, D) sum_i W'_ij f_ij
        (y_j - x_i), GH (B, S, M) sum_i W'_ij, GV (B, S, M, E) sum_i K_ij g_i (K = e^s, or
        P for the softmax average)."""
        b = tl.program_id(1)
        split = tl.program_id(2)
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rd, re = tl.arange(0, DP), tl.arange(0, EP)
        mask_m = rm < M
        plain = tl.zeros((BM,), dtype=X.dtype.element_ty)
        acc = tl.zeros((BM, DP), dtype=X.dtype.element_ty)
        gv = tl.zeros((BM, EP), dtype=X.dtype.element_ty)
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, N)
        for start in range(lo, hi, BN):
            rn = start + tl.arange(0, BN)
            mask_n = rn < hi
            lse = tl.load(LSE + b * N + rn, mask=mask_n, other=0.0)
            s, c = _scores(X, Y, H, b, rn, rm, mask_n, mask_m, N, M, floor, KIND != 1, COST,
                           D, BN, BM)  # fmt: skip
            w, k = _weights(s, lse, G, V, OUT, b, rn, rm, mask_n, mask_m, N, M, KIND, E, BN, BM)
            plain += tl.sum(w, axis=0)
            if COST == 1:
                w = w / c
            acc = _displacements(acc, w, X, Y, b, rn, rm, mask_n, mask_m, N, M, rd, D, 0)
            if KIND != 0:
                gv = _accumulate(gv, k, G, b, rn, mask_n, N, re, E, 0)
        row = (b * S + split) * M + rm
        tl.store(GY + row[:, None] * D + rd[None, :], acc, mask=mask_m[:, None] & (rd[None, :] < D))
        tl.store(GH + row, plain, mask=mask_m)
        if KIND != 0:
            tl.store(
                GV + row[:, None] * E + re[None, :], gv, mask=mask_m[:, None] & (re[None, :] < E)
            )

    @triton.jit
    def _task(T_LO, T_HI, T_OWNER, R_PTR):
        """This program's task of a block-sparse kernel: its first and past-the-last points
        and its owning cluster's ranges, ``(lo, hi, r0, r1)``."""
        t = tl.program_id(0)
        owner = tl.load(T_OWNER + t)
        r0, r1 = tl.load(R_PTR + owner), tl.load(R_PTR + owner + 1)
        return tl.load(T_LO + t), tl.load(T_HI + t), r0, r1

    @triton.jit(do_not_specialize=SPARSE_SIZES)
    def _sparse_forward(
        X, Y, H, LSE, T_LO, T_HI, T_OWNER, R_PTR, R_LO, R_HI, N, M,
        D: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ):  # fmt: skip
        """One task (rows T_LO..T_HI of one cluster) against its cluster's column ranges
        R_LO..R_HI (R_PTR[owner] .. R_PTR[owner + 1]): LSE (N,) the rows' base-2
        log-sum-exp."""
        lo, hi, r0, r1 = _task(T_LO, T_HI, T_OWNER, R_PTR)
        rn = lo + tl.arange(0, BN)
        mask_n = rn < hi
        m_i = tl.full((BN,), float("-inf"), dtype=X.dtype.element_ty)
        l_i = tl.zeros((BN,), dtype=X.dtype.element_ty)
        for r in range(r0, r1):
            first, last = tl.load(R_LO + r), tl.load(R_HI + r)
            for start in range(first, last, BM):
                rm = start + tl.arange(0, BM)
                mask_m = rm < last
                s, _ = _scores(X, Y, H, 0, rn, rm, mask_n, mask_m, N, M, 0.0, True, 0, D, BN, BM)
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - shift[:, None])
                l_i = l_i * tl.exp2(m_i - shift) + tl.sum(p, axis=1)
                m_i = m_new
        tl.store(LSE + rn, m_i + tl.log2(l_i), mask=mask_n)

    @triton.jit(do_not_specialize=SPARSE_SIZES)
    def _sparse_rows(
        X, Y, H, LSE, TOTAL, GX, T_LO, T_HI, T_OWNER, R_PTR, R_LO, R_HI, N, M,
        D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ):  # fmt: skip
        """For one task's rows, over its cluster's column ranges: TOTAL (N,) sum_j P_ij and
        GX (N, D) sum_j P_ij (x_i - y_j), with P_ij = 2^(s_ij - LSE_i)."""
        lo, hi, r0, r1 = _task(T_LO, T_HI, T_OWNER, R_PTR)
        rn = lo + tl.arange(0, BN)
        rd = tl.arange(0, DP)
        mask_n = rn < hi
        lse = tl.load(LSE + rn, mask=mask_n, other=0.0)
        total = tl.zeros((BN,), dtype=X.dtype.element_ty)
        acc = tl.zeros((BN, DP), dtype=X.dtype.element_ty)
        for r in range(r0, r1):
            first, last = tl.load(R_LO + r), tl.load(R_HI + r)
            for start in range(first, last, BM):
                rm = start + tl.arange(0, BM)
                mask_m = rm < last
                s, _ = _scores(X, Y, H, 0, rn, rm, mask_n, mask_m, N, M, 0.0, True, 0, D, BN, BM)
                w = tl.where(mask_n[:, None] & mask_m[None, :], tl.exp2(s - lse[:, None]), 0.0)
                total += tl.sum(w, axis=1)
                acc = _displacements(acc, w, X, Y, 0, rn, rm, mask_n, mask_m, N, M, rd, D, 1)
        tl.store(TOTAL + rn, total, mask=mask_n)
        tl.store(GX + rn[:, None] * D + rd[None, :], acc, mask=mask_n[:, None] & (rd[None, :] < D))

    @triton.jit(do_not_specialize=SPARSE_SIZES)
    def _sparse_columns(
        X, Y, H, LSE, WEIGHT, GY, GH, T_LO, T_HI, T_OWNER, R_PTR, R_LO, R_HI, N, M,
        D: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    ):  # fmt: skip
        """For one task's columns (T_LO..T_HI of one column cluster), over the row ranges
        of the row clusters that keep it: GH (M,) sum_i w_i P_ij and GY (M, D) sum_i w_i
        P_ij (y_j - x_i), with w = WEIGHT (N,) and P_ij = 2^(s_ij - LSE_i)."""
        lo, hi, r0, r1 = _task(T_LO, T_HI, T_OWNER, R_PTR)
        rm = lo + tl.arange(0, BM)
        rd = tl.arange(0, DP)
        mask_m = rm < hi
        plain = tl.zeros((BM,), dtype=X.dtype.element_ty)
        acc = tl.zeros((BM, DP), dtype=X.dtype.element_ty)
        for r in range(r0, r1):
            first, last = tl.load(R_LO + r), tl.load(R_HI + r)
            for start in range(first, last, BN):
                rn = start + tl.arange(0, BN)
                mask_n = rn < last
                lse = tl.load(LSE + rn, mask=mask_n, other=0.0)
                wi = tl.load(WEIGHT + rn, mask=mask_n, other=0.0)
                s, _ = _scores(X, Y, H, 0, rn, rm, mask_n, mask_m, N, M, 0.0, True, 0, D, BN, BM)
                live = mask_n[:, None] & mask_m[None, :]
                w = tl.where(live, wi[:, None] * tl.exp2(s - lse[:, None]), 0.0)
                plain += tl.sum(w, axis=0)
                acc = _displacements(acc, w, X, Y, 0, rn, rm, mask_n, mask_m, N, M, rd, D, 0)
        tl.store(GH + rm, plain, mask=mask_m)
        tl.store(GY + rm[:, None] * D + rd[None, :], acc, mask=mask_m[:, None] & (rd[None, :] < D))

    # a kernel finds the jitted functions it calls among its module's globals, when it is
    # compiled (or interpreted): they are made here, on first use, so they go there now
    globals().update(
        _scores=_scores,
        _accumulate=_accumulate,
        _displacements=_displacements,
        _row_dot=_row_dot,
        _row_column_dot=_row_column_dot,
        _weights=_weights,
        _task=_task,
    )
    return types.SimpleNamespace(
        triton=triton,
        forward=_forward,
        backward_rows=_backward_rows,
        backward_columns=_backward_columns,
        sparse_forward=_sparse_forward,
        sparse_rows=_sparse_rows,
        sparse_columns=_sparse_columns,
    )


def _pow2(n: int) -> int:
    return max(2, 1 << (max(1, n) - 1).bit_length())


def _programs_wanted(device: torch.device) -> int:
    """How many programs keep the device busy: a few per multiprocessor (4 under the
    interpreter, so that the tests split small problems too)."""
    if device.type != "cuda":
        return 4
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def _splits(tiles: int, length: int, block: int, device: torch.device) -> tuple[int, int]:
    """(S, CHUNK): the loop of ``length`` split into S chunks of CHUNK (a multiple of
    ``block``) so that ``tiles`` x S programs fill the device, none of them empty."""
    blocks = -(-length // block)
    want = -(-_programs_wanted(device) // max(1, tiles))
    per = -(-blocks // max(1, min(want, blocks)))
    chunk = per * block
    return -(-length // chunk), chunk


def _scaled(x, y, h, eps: float, cost: Cost):
    """The points and h scaled so that the kernels' base-2 scores are h_j - c_ij (see
    ``_scores``), the scale of the points and the square-root floor in those units."""
    scale = math.sqrt(LOG2E / (2 * eps)) if cost.p == 2 else LOG2E / eps
    hs = None if h is None else (h * LOG2E).contiguous()
    return (x * scale).contiguous(), (y * scale).contiguous(), hs, scale, SQRT_FLOOR * scale**2


def _launch(kernel, grid, *args, dtype, **sizes):
    bn, bm = BLOCKS[dtype]
    kernel[grid](*args, BN=bn, BM=bm, num_warps=NUM_WARPS[dtype], **sizes)


def _forward(kind: str, x, y, h, v, eps: float, cost: Cost):
    """(out (B, N, E), the base-2 log-sum-exp (B, N) or None)."""
    k = _kernels()
    B, N, D = x.shape
    M = y.shape[1]
    E = 1 if v is None else v.shape[2]
    bn, bm = BLOCKS[x.dtype]
    tiles = -(-N // bn)
    S, chunk = _splits(tiles * B, M, bm, x.device)
    xs, ys, hs, _, floor = _scaled(x, y, h, eps, cost)
    out = torch.empty(B, S, N, E, dtype=x.dtype, device=x.device)
    lse = torch.empty(B, S, N, dtype=x.dtype, device=x.device)
    dummy = x.new_empty(1)
    _launch(
        k.forward, (tiles, B, S), xs, ys, dummy if hs is None else hs,
        dummy if v is None else v, out, lse, N, M, chunk, S, floor,
        dtype=x.dtype, KIND=KINDS[kind], COST=0 if cost.p == 2 else 1, D=D, E=E, EP=_pow2(E),
    )  # fmt: skip
    if kind == "kernel_product":
        return out.sum(1), None
    if S == 1:
        total = lse[:, 0]
    else:  # the splits' base-2 log-sum-exps combined
        total = torch.logsumexp(lse * LN2, dim=1) * LOG2E
    if kind == "softmin":
        return (-eps * LN2) * total[..., None], total
    if S == 1:
        return out[:, 0], total
    share = torch.softmax(lse * LN2, dim=1)  # each split's part of the row's mass
    return (share[..., None] * out).sum(1), total


def _backward(ctx, grad_out):
    x, y, h, v, out, lse = ctx.saved_tensors
    need_x, need_y, need_h, need_v = ctx.needs_input_grad[3:7]
    k = _kernels()
    B, N, D = x.shape
    M = y.shape[1]
    E = 1 if v is None else v.shape[2]
    bn, bm = BLOCKS[x.dtype]
    xs, ys, hs, scale, floor = _scaled(x, y, h, ctx.eps, ctx.cost)
    g = grad_out.contiguous()
    dummy = x.new_empty(1)
    args = (xs, ys, dummy if hs is None else hs, dummy if v is None else v, out,
            dummy if lse is None else lse, g)  # fmt: skip
    # W = dL/ds (natural scores) is kappa W' (the kernels' weights); dL/dx sums
    # -W f (x - y) / eps, which the kernels' scaled displacements give up to 1 / scale
    kappa = -ctx.eps if ctx.kind == "softmin" else 1.0
    cost = 0 if ctx.cost.p == 2 else 1
    moved = -kappa / ctx.eps / (scale if cost == 0 else 1.0)
    sizes = dict(KIND=KINDS[ctx.kind], COST=cost, D=D, DP=_pow2(D), E=E)
    gx = gy = gh = gv = None
    if need_x:
        S, chunk = _splits(-(-N // bn) * B, M, bm, x.device)
        part = torch.empty(B, S, N, D, dtype=x.dtype, device=x.device)
        _launch(k.backward_rows, (-(-N // bn), B, S), *args, part, N, M, chunk, S, floor,
                dtype=x.dtype, **sizes)  # fmt: skip
        gx = moved * part.sum(1)
    if need_y or need_h or need_v:
        S, chunk = _splits(-(-M // bm) * B, N, bn, x.device)
        gy = torch.empty(B, S, M, D, dtype=x.dtype, device=x.device)
        gh = torch.empty(B, S, M, dtype=x.dtype, device=x.device)
        gv = torch.empty(B, S, M, E, dtype=x.dtype, device=x.device)
        _launch(k.backward_columns, (-(-M // bm), B, S), *args, gy, gh, gv, N, M, chunk, S,
                floor, dtype=x.dtype, EP=_pow2(E), **sizes)  # fmt: skip
        gy, gh, gv = moved * gy.sum(1), kappa * gh.sum(1), gv.sum(1)
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


# ------------------------------------------------------------------ block-sparse softmin
@dataclass
class Ranges:
    """A block-sparse pattern as the sparse kernels read it: *tasks* (consecutive points of
    one cluster, at most a tile, ``(T,)`` each: first, past-the-last, owning cluster) and,
    for each cluster, the ranges of the other cloud it sums over (``ptr`` ``(K + 1,)``
    into ``lo`` and ``hi``, ``(R,)``: runs of kept clusters stored one after the other,
    merged). All int32 tensors on the points' device."""

    task_lo: torch.Tensor
    task_hi: torch.Tensor
    task_owner: torch.Tensor
    ptr: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor

    @property
    def n_tasks(self) -> int:
        return int(self.task_lo.shape[0])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The six tensors, in the kernels' argument order."""
        return self.task_lo, self.task_hi, self.task_owner, self.ptr, self.lo, self.hi


def sparse_softmin(rows: Ranges, x, y, h, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``-eps log sum_j exp(h_j - |x_i - y_j|^2 / (2 eps))`` over the kept columns of each
    row (x (N, D), y (M, D), h (M,), sorted by cluster), and its base-2 log-sum-exp; no
    autograd. ``rows``: the tasks over x and the column ranges of each row cluster."""
    k = _kernels()
    N, D = x.shape
    xs, ys, hs, _, _ = _scaled(x, y, h, eps, _SQEUCLIDEAN)
    lse = torch.empty(N, dtype=x.dtype, device=x.device)
    bn, bm = BLOCKS[x.dtype]
    if rows.n_tasks:
        _launch(k.sparse_forward, (rows.n_tasks,), xs, ys, hs, lse, *rows.tensors(), N,
                y.shape[0], dtype=x.dtype, D=D)  # fmt: skip
    return (-eps * LN2) * lse, lse


def sparse_gradients(
    rows: Ranges, cols: Ranges, x, y, h, eps: float, out, grad_out, needs=(True, True, True)
) -> list[torch.Tensor | None]:
    """The gradients of ``sum_i grad_out_i softmin_i`` (:func:`sparse_softmin`'s ``out``) in
    x (N, D), y (M, D) and h (M,), None where ``needs`` is False: G_i (x_i - sum_j P_ij y_j),
    sum_i G_i P_ij (y_j - x_i) and -eps sum_i G_i P_ij, each row of P normalised by its
    computed sum (as the torch path does). ``cols``: the tasks over y and the row ranges of
    the row clusters keeping each column cluster."""
    k = _kernels()
    N, D = x.shape
    M = y.shape[0]
    xs, ys, hs, scale, _ = _scaled(x, y, h, eps, _SQEUCLIDEAN)
    lse = (out / (-eps * LN2)).contiguous()
    total = torch.empty(N, dtype=x.dtype, device=x.device)
    moved = torch.empty(N, D, dtype=x.dtype, device=x.device)
    sizes = dict(dtype=x.dtype, D=D, DP=_pow2(D))
    if rows.n_tasks:
        _launch(k.sparse_rows, (rows.n_tasks,), xs, ys, hs, lse, total, moved, *rows.tensors(),
                N, M, **sizes)  # fmt: skip
    weight = (grad_out.to(x.dtype) / total.clamp_min(torch.finfo(x.dtype).tiny)).contiguous()
    gx = weight[:, None] * moved / scale if needs[0] else None
    gy = gh = None
    if needs[1] or needs[2]:
        gy = torch.zeros(M, D, dtype=x.dtype, device=x.device)
        gh = torch.zeros(M, dtype=x.dtype, device=x.device)
        if cols.n_tasks:
            _launch(k.sparse_columns, (cols.n_tasks,), xs, ys, hs, lse, weight, gy, gh,
                    *cols.tensors(), N, M, **sizes)  # fmt: skip
        gy, gh = gy / scale, -eps * gh
    return [gx, gy if needs[1] else None, gh if needs[2] else None]
