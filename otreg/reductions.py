"""Kernel reductions over all pairs (i, j) of two point clouds, without storing N x M arrays.

Three primitives serve every solver (all batched: x ``(B, N, D)``, y ``(B, M, D)``):

.. math::

    \\mathrm{softmin}_i &= -\\varepsilon \\log \\sum_j \\exp(h_j - C(x_i, y_j)/\\varepsilon)

    \\mathrm{kernel\\_product}_i &= \\sum_j \\exp(-C(x_i, y_j)/\\varepsilon)\\, v_j

    \\mathrm{softmax\\_average}_i &= \\sum_j \\mathrm{softmax}_j(h_j - C(x_i, y_j)/\\varepsilon)
        \\, v_j

Backends (the solvers never know which one runs):

- ``"keops"``: pykeops LazyTensors; compiled on first use of each formula, never stores N x M.
  This module is the only one that imports pykeops.
- ``"tensorized"``: dense torch; fast for small problems, the reference for tests.
- ``"blocked"``: dense torch on blocks of rows with hand-written gradients that recompute
  each block (:mod:`otreg._blocked`): memory O(block + N + M), no autograd graph.
- ``"auto"``: tensorized up to ``TENSORIZED_MAX_PAIRS`` pairs (``TENSORIZED_MAX_PAIRS_RECORDED``
  when autograd records the call, since the dense path then keeps its matrices for
  backward); above, blocked on the CPU
  (measured 5 to 8 times faster than pykeops' CPU backend here, see docs/benchmarks.md) and
  keops on a GPU. If pykeops is missing or fails to compile, ``auto`` warns once, says how
  to fix it, and uses the blocked path; an explicit ``backend="keops"`` raises that error.

Every primitive supports autograd with respect to x, y, h and v.
"""

from __future__ import annotations

import warnings

import torch

from . import _dense
from ._blocked import blocked_reduction
from .costs import Cost

__all__ = [
    "BACKENDS",
    "TENSORIZED_MAX_PAIRS",
    "TENSORIZED_MAX_PAIRS_RECORDED",
    "KEOPS_ON_CPU",
    "BLOCK_ELEMENTS",
    "KeOpsUnavailable",
    "resolve_backend",
    "keops_status",
    "softmin",
    "kernel_product",
    "softmax_average",
]

BACKENDS = ("auto", "keops", "tensorized", "blocked")
#: ``auto`` uses the dense path up to this many pairs B * N * M (about 16 MB in float32).
TENSORIZED_MAX_PAIRS = 4_000_000
#: ... or up to this many when autograd records the call: the dense path keeps its N x M
#: matrices until backward, and a loop (Sinkhorn unrolled, LDDMM shooting) keeps one set per
#: call; the blocked path recomputes them in backward instead.
TENSORIZED_MAX_PAIRS_RECORDED = 250_000
#: ``auto`` uses KeOps on the CPU too when this is True (it is slower there than blocked).
KEOPS_ON_CPU = False
#: The blocked path computes blocks of about this many pairs at a time.
BLOCK_ELEMENTS = 2**22

_KEOPS_HELP = (
    "KeOps compiles each formula with a C++ compiler on first use. Check that g++ (>= 8) and "
    "the Python headers (python3-dev) are installed and that `python -c \"import pykeops; "
    "pykeops.test_torch_bindings()\"` works; a stale cache is cleared with "
    "`python -c \"import pykeops; pykeops.clean_pykeops()\"`."
)


class KeOpsUnavailable(RuntimeError):
    """pykeops is missing or could not compile a formula."""


_keops_failure: str | None = None
_keops_warned = False


def keops_status() -> tuple[bool, str]:
    """Whether pykeops imports here, and a reason when it does not (compiles are not tried)."""
    if _keops_failure is not None:
        return False, _keops_failure
    try:
        import pykeops  # noqa: F401
        from pykeops.torch import LazyTensor  # noqa: F401
    except Exception as err:  # ImportError, or pykeops' own errors at import
        return False, f"pykeops cannot be imported ({type(err).__name__}: {err})"
    return True, "ok"


def resolve_backend(backend: str, pairs: int, device: torch.device,
                    recorded: bool = False) -> str:
    """The backend that ``backend`` means for ``pairs`` = B * N * M pairs on ``device``
    (``recorded``: autograd records the call)."""
    if backend != "auto":
        return backend
    if pairs <= (TENSORIZED_MAX_PAIRS_RECORDED if recorded else TENSORIZED_MAX_PAIRS):
        return "tensorized"
    if device.type == "cpu" and not KEOPS_ON_CPU:
        return "blocked"
    ok, _ = keops_status()
    return "keops" if ok else "blocked"


# --------------------------------------------------------------------------- keops
def _lazy(x, y, eps):
    """x_i, y_j and 1/eps as LazyTensors (eps a parameter: no recompilation per eps)."""
    from pykeops.torch import LazyTensor

    inv_eps = torch.tensor([1.0 / eps], dtype=x.dtype, device=x.device)
    return LazyTensor(x[:, :, None, :]), LazyTensor(y[:, None, :, :]), LazyTensor(inv_eps)


def _keops_softmin(x, y, h, eps, cost):
    from pykeops.torch import LazyTensor

    x_i, y_j, inv_eps = _lazy(x, y, eps)
    h_j = LazyTensor(h[:, None, :, None])
    lse = (h_j - cost.keops(x_i, y_j) * inv_eps).logsumexp(dim=2)
    return -eps * lse.squeeze(-1)


def _keops_kernel_product(x, y, v, eps, cost):
    from pykeops.torch import LazyTensor

    x_i, y_j, inv_eps = _lazy(x, y, eps)
    v_j = LazyTensor(v[:, None, :, :])
    return ((-cost.keops(x_i, y_j) * inv_eps).exp() * v_j).sum(dim=2)


def _keops_softmax_average(x, y, h, v, eps, cost):
    from pykeops.torch import LazyTensor

    x_i, y_j, inv_eps = _lazy(x, y, eps)
    h_j = LazyTensor(h[:, None, :, None])
    v_j = LazyTensor(v[:, None, :, :])
    return (h_j - cost.keops(x_i, y_j) * inv_eps).sumsoftmaxweight(v_j, dim=2)


_IMPLEMENTATIONS = {
    "softmin": (_dense.softmin, _keops_softmin),
    "kernel_product": (_dense.kernel_product, _keops_kernel_product),
    "softmax_average": (_dense.softmax_average, _keops_softmax_average),
}


def _run(kind: str, backend: str, x: torch.Tensor, y: torch.Tensor, *rest, eps: float,
         cost: Cost) -> torch.Tensor:
    global _keops_failure, _keops_warned
    dense_fn, keops_fn = _IMPLEMENTATIONS[kind]
    recorded = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, y, *rest) if isinstance(t, torch.Tensor))
    chosen = resolve_backend(backend, x.shape[0] * x.shape[1] * y.shape[1], x.device, recorded)
    if chosen == "tensorized":
        return dense_fn(x, y, *rest, eps, cost)
    if chosen == "keops":
        ok, reason = keops_status()
        if ok:
            try:
                return keops_fn(x, y, *rest, eps, cost)
            except Exception as err:
                if backend == "keops":
                    raise KeOpsUnavailable(
                        f"{kind}: the keops backend failed ({type(err).__name__}: {err}). "
                        f"{_KEOPS_HELP}") from err
                _keops_failure = f"pykeops failed ({type(err).__name__}: {str(err)[:300]})"
                reason = _keops_failure
        elif backend == "keops":
            raise KeOpsUnavailable(f"{kind}: backend='keops' but {reason}. {_KEOPS_HELP}")
        if not _keops_warned:
            _keops_warned = True
            warnings.warn(f"otreg: {reason}; using the 'blocked' torch backend instead, "
                          f"which is slower. {_KEOPS_HELP}", RuntimeWarning, stacklevel=4)
    return blocked_reduction(kind, x, y, *rest, eps=eps, cost=cost,
                             block_elements=BLOCK_ELEMENTS)


def softmin(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, eps: float, cost: Cost,
            backend: str = "auto") -> torch.Tensor:
    """``-eps log sum_j exp(h_j - C(x_i, y_j)/eps)``: x (B, N, D), y (B, M, D), h (B, M) -> (B, N).
    """
    return _run("softmin", backend, x, y, h, eps=eps, cost=cost)


def kernel_product(x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, eps: float, cost: Cost,
                   backend: str = "auto") -> torch.Tensor:
    """``sum_j exp(-C(x_i, y_j)/eps) v_j``: v (B, M, E) -> (B, N, E).

    For ``cost="sqeuclidean"`` this is the Gaussian kernel exp(-|x - y|^2 / (2 sigma^2)) with
    sigma^2 = eps.
    """
    return _run("kernel_product", backend, x, y, v, eps=eps, cost=cost)


def softmax_average(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, v: torch.Tensor,
                    eps: float, cost: Cost, backend: str = "auto") -> torch.Tensor:
    """``sum_j softmax_j(h_j - C(x_i, y_j)/eps) v_j``: h (B, M), v (B, M, E) -> (B, N, E)."""
    return _run("softmax_average", backend, x, y, h, v, eps=eps, cost=cost)
