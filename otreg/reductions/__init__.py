r"""Kernel reductions over all pairs (i, j) of two point clouds, without storing N x M arrays.

Three primitives serve every solver (all batched: x ``(B, N, D)``, y ``(B, M, D)``):

.. math::

    \mathrm{softmin}_i &= -\varepsilon \log \sum_j \exp(h_j - C(x_i, y_j)/\varepsilon)

    \mathrm{kernel\_product}_i &= \sum_j \exp(-C(x_i, y_j)/\varepsilon)\, v_j

    \mathrm{softmax\_average}_i &= \sum_j \mathrm{softmax}_j(h_j - C(x_i, y_j)/\varepsilon)
        \, v_j

Backends (the solvers never know which one runs):

- ``"triton"``: GPU kernels (:mod:`otreg.reductions._triton`): online log-sum-exp over
  tiles, never stores N x M, gradients by one row and one column pass; CUDA tensors
  (Triton's interpreter runs them on the CPU for the tests).
- ``"keops"``: pykeops LazyTensors; compiled on first use of each formula, never stores N x M.
  :mod:`otreg.reductions._keops` is the only module that imports pykeops, and only after a
  child process compiled and ran otreg's formulas on that device (a crashing pykeops then
  ends that process, not this one; the verdict is cached on disk).
- ``"tensorized"``: dense torch; fast for small problems, the reference for tests.
- ``"blocked"``: dense torch on blocks of rows with hand-written gradients that recompute
  each block (:mod:`otreg.reductions._blocked`): memory O(block + N + M), no autograd graph. Its
  softmin and kernel product (squared Euclidean cost, float32/64) and their gradients run
  as fused loops that torch.compile generates (:mod:`otreg.reductions._compiled`, ``COMPILED``), 1.5
  to 2.9 times as fast, once a reduction has taken long enough in a process to repay the
  compile.
- ``"auto"``: tensorized up to ``TENSORIZED_MAX_PAIRS`` pairs on the CPU
  (``TENSORIZED_MAX_PAIRS_GPU`` on a GPU, ``TENSORIZED_MAX_PAIRS_RECORDED`` when autograd
  records the call, since the dense path then keeps its matrices for backward); above,
  blocked on the CPU (measured 5 to 8 times faster than pykeops' CPU backend here, see
  docs/benchmarks.md) and triton on a GPU (keops where Triton is
  missing and KeOps passed its check). Where KeOps fails its check, ``auto`` warns once,
  says how to fix it, and uses the blocked path; an explicit ``backend="keops"`` raises
  that error.

Every primitive supports autograd with respect to x, y, h and v. :func:`track` records which
backends the reductions of a block of code actually ran (results report it, rather than
predicting the choice).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from .._checks import warn
from ..costs import Cost, get_cost
from ..loops.budget import charge_one_offs_to_budgets, fit_one_offs_to_budgets
from . import _compiled, _dense, _keops, _triton
from ._blocked import blocked_reduction
from ._keops import KeOpsUnavailable
from ._triton import triton_reduction

# a budgeted loop's planner compiles the fused reductions it will use before measuring it,
# and a budget too small for torch's compiler keeps them uncompiled
charge_one_offs_to_budgets(_compiled.compile_now)
fit_one_offs_to_budgets(_compiled.fit_to_budget)

__all__ = [
    "BACKENDS",
    "TENSORIZED_MAX_PAIRS",
    "TENSORIZED_MAX_PAIRS_RECORDED",
    "TENSORIZED_MAX_PAIRS_GPU",
    "KEOPS_ON_CPU",
    "BLOCK_ELEMENTS",
    "COMPILED",
    "KeOpsUnavailable",
    "Cost",
    "get_cost",
    "resolve_backend",
    "keops_status",
    "status",
    "fast_all_pairs",
    "track",
    "softmin",
    "kernel_product",
    "softmax_average",
]

BACKENDS = ("auto", "keops", "tensorized", "blocked", "triton")
#: ``auto`` uses the dense path up to this many pairs B * N * M on the CPU: the blocked
#: path is faster from about there (float32, D = 3, 2 cores: forward 0.20 ms against 0.30
#: at N = M = 500 but 0.14 against 0.11 at 300; 2.3 against 2.7 ms at 2,000).
TENSORIZED_MAX_PAIRS = 250_000
#: ... or up to this many when autograd records the call: the dense path keeps its N x M
#: matrices until backward, and a loop (Sinkhorn unrolled, LDDMM shooting) keeps one set per
#: call; the blocked path recomputes them in backward instead (and with the gradient it is
#: faster from there too: 1.2 against 1.3 ms at N = M = 500, 5.9 against 16.6 at 2,000).
TENSORIZED_MAX_PAIRS_RECORDED = 250_000
#: ... and up to this many on a GPU when autograd does not record the call (about 16 MB in
#: float32): one kernel a reduction.
TENSORIZED_MAX_PAIRS_GPU = 4_000_000
#: ``auto`` uses KeOps on the CPU too when this is True (it is slower there than blocked).
KEOPS_ON_CPU = False
#: The blocked path computes blocks of about this many pairs at a time (8 MB of float64 a
#: block buffer). Measured on an Intel Xeon (best of two, 2 cores), before the products with
#: few columns ran transposed: float32 N = 30,000 forward 0.49 s at 2^21 and 2^22, 0.53 at
#: 2^20; with the gradient 1.48, 1.50-1.52, 1.60. Since, on an AMD EPYC (2 cores, two runs
#: each, 2^21 against 2^20): a softmin with its gradient at N = 30,000 4.2 / 4.1 s against
#: 3.75 / 3.70; a kernel product of 10,242 by 3,001 points, 3 channels (a registration's
#: flow) with its gradient 219 / 214 ms against 183 / 185, forward 80 / 83 against 65 / 69.
BLOCK_ELEMENTS = 2**20
#: The blocked path's softmin and kernel product (squared Euclidean, float32/64, CPU, from
#: ``_compiled.MIN_PAIRS`` pairs) and their gradients run as loops generated by
#: torch.compile once they have taken ``_compiled.TIER_UP_SECONDS`` in this process: 1.5 to
#: 2.9 times as fast (:mod:`otreg.reductions._compiled`). False keeps every call on the
#: blocked path.
COMPILED = True

_keops_warned = False
_tracking = threading.local()


@contextlib.contextmanager
def track() -> Iterator[list[str]]:
    """Within the block, the backends that this thread's reductions run, in the order of
    their first use (``"tensorized"``, ``"blocked"``, ``"keops"``, ``"multiscale"`` for the
    block-sparse truncated softmins, ``"truncated"`` for the truncated Gaussian kernel
    products of :mod:`otreg.reductions.sparse`), as they ran: after ``auto``'s choice and any
    fallback. A reduction's backward pass runs on the backend of its forward pass. Blocks
    may nest; each records what ran inside it.

    Example:
        >>> import torch
        >>> from otreg.costs import get_cost
        >>> from otreg.reductions import softmin, track
        >>> with track() as ran:
        ...     _ = softmin(torch.zeros(1, 2, 3), torch.zeros(1, 4, 3), torch.zeros(1, 4), 0.1,
        ...                 get_cost("sqeuclidean"))
        >>> ran
        ['tensorized']
    """
    ran: list[str] = []
    stack = _tracking.__dict__.setdefault("stack", [])
    stack.append(ran)
    try:
        yield ran
    finally:
        stack.remove(ran)


def _note_backend(backend: str) -> None:
    """Record that a reduction ran on ``backend`` (for :func:`track`)."""
    for ran in getattr(_tracking, "stack", ()):
        if backend not in ran:
            ran.append(backend)


def status() -> dict:
    """What each backend can do here, for :func:`otreg.info` (no compile is tried):
    ``{"keops": (ok, reason), "fused": None or why the fused loops are off, ...}``.

    Example:
        >>> from otreg.reductions import status
        >>> "keops" in status() and "fused cache folder" in status()
        True
    """
    return {
        "keops": _keops.status(),
        "keops check file": str(_keops.cache_file()),
        "triton": _triton.unavailable() or "ok",
        "fused": (
            "off (otreg.reductions.COMPILED = False)" if not COMPILED else _compiled.failure()
        ),
        "fused min pairs": _compiled.MIN_PAIRS,
        "fused tier-up seconds": _compiled.TIER_UP_SECONDS,
        "fused cache folder": _compiled.cache_folder(),
        "fused verdicts file": _compiled.verdict_file(),
        "kept uncompiled by a memory budget": _compiled.held(),
    }


def keops_status(
    device: torch.device | str | None = None, announce=_keops.say_checking
) -> tuple[bool, str]:
    """Whether KeOps can be used: without ``device``, whether pykeops is installed (nothing
    is imported); with it, the verdict of the check that compiles and runs otreg's formulas
    on that device in a child process (once a machine; cached on disk), so that a crash in
    pykeops never takes this process down. ``announce(device)`` is called before such a
    check starts (it may take minutes; by default a line on stderr; None: silently).

    Example:
        >>> from otreg.reductions import keops_status
        >>> ok, reason = keops_status()
        >>> isinstance(ok, bool) and isinstance(reason, str)
        True
    """
    if device is None:
        return _keops.status()
    return _keops.verdict(torch.device(device), announce)


#: The dtypes KeOps computes in (float16 on GPUs only).
KEOPS_DTYPES = (torch.float32, torch.float64)


def resolve_backend(
    backend: str,
    pairs: int,
    device: torch.device,
    recorded: bool = False,
    dtype: torch.dtype = torch.float32,
) -> str:
    """The backend that ``backend`` means for ``pairs`` = B * N * M pairs of ``dtype`` on
    ``device`` (``recorded``: autograd records the call).

    Example:
        >>> import torch
        >>> from otreg.reductions import resolve_backend
        >>> cpu = torch.device("cpu")
        >>> resolve_backend("auto", 10_000, cpu), resolve_backend("auto", 10**9, cpu)
        ('tensorized', 'blocked')
    """
    keops_dtype = dtype in KEOPS_DTYPES or (dtype == torch.float16 and device.type == "cuda")
    if backend == "keops" and not keops_dtype:
        raise TypeError(
            f"backend='keops' computes in float32 or float64 (float16 on a GPU); the points "
            f"are {dtype}: convert them (x.float()) or use backend='auto'"
        )
    if backend == "triton":
        _check_triton(device, dtype)
    if backend != "auto":
        return backend
    if recorded:
        most = TENSORIZED_MAX_PAIRS_RECORDED
    else:
        most = TENSORIZED_MAX_PAIRS if device.type == "cpu" else TENSORIZED_MAX_PAIRS_GPU
    if pairs <= most:
        return "tensorized"
    if device.type == "cuda" and dtype in _triton.DTYPES and _triton.unavailable() is None:
        return "triton"
    if (device.type == "cpu" and not KEOPS_ON_CPU) or not keops_dtype:
        return "blocked"
    ok, reason = _keops.verdict(device)
    if not ok:
        _keops_fallback(reason)
    return "keops" if ok else "blocked"


def _keops_fallback(reason: str) -> None:
    """Warn once a process that ``auto`` uses the blocked backend where KeOps failed."""
    global _keops_warned
    if not _keops_warned:
        _keops_warned = True
        warn(
            f"otreg: {reason}; using the 'blocked' torch backend instead, which is slower "
            f"(backend='blocked' chooses it without this warning). {_keops.HELP}",
            RuntimeWarning,
        )


def _check_triton(device: torch.device, dtype: torch.dtype) -> None:
    """backend='triton' on tensors it cannot take: an error that says why."""
    why = _triton.unavailable()
    if why is not None:
        raise KeOpsUnavailable(  # a GPU library that failed: the same class of error
            f"backend='triton' but {why}; Triton ships with torch's CUDA wheels"
        )
    if dtype not in _triton.DTYPES:
        raise TypeError(
            f"backend='triton' computes in float32 or float64; the points are {dtype}: "
            "convert them (x.float()) or use backend='auto'"
        )
    if device.type != "cuda" and not _triton.interpreted():
        raise ValueError(
            f"backend='triton' runs on CUDA tensors; these are on {device} (the tests run "
            "its kernels on the CPU with TRITON_INTERPRET=1)"
        )


def fast_all_pairs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a GPU kernel sums every pair here (``auto`` picks the ``triton`` backend), so
    that truncating them (multiscale) pays only on far larger problems.

    Example:
        >>> import torch
        >>> from otreg.reductions import fast_all_pairs
        >>> fast_all_pairs(torch.device("cpu"), torch.float32)
        False
    """
    return device.type == "cuda" and dtype in _triton.DTYPES and _triton.unavailable() is None


_IMPLEMENTATIONS = {
    "softmin": (_dense.softmin, _keops.softmin),
    "kernel_product": (_dense.kernel_product, _keops.kernel_product),
    "softmax_average": (_dense.softmax_average, _keops.softmax_average),
}


def _check_shapes(kind: str, x, y, rest: tuple) -> None:
    """X (B, N, D) and y (B, M, D), and each of ``rest`` (B, M) or (B, M, E): else a
    ValueError naming what was given (a batch axis first, even for one problem)."""
    names = ("h", "v") if kind == "softmax_average" else ("h",) if kind == "softmin" else ("v",)
    for name, t in (("x", x), ("y", y), *zip(names, rest)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{kind}: {name} must be a tensor, got {type(t).__name__}")
    if x.dim() != 3 or y.dim() != 3 or x.shape[0] != y.shape[0] or x.shape[2] != y.shape[2]:
        raise ValueError(
            f"{kind}: x and y must be (B, N, D) and (B, M, D) with the same B and D, got "
            f"{tuple(x.shape)} and {tuple(y.shape)} (one problem: x[None], y[None])"
        )
    for name, t in zip(names, rest):
        if t.dim() not in (2, 3) or tuple(t.shape[:2]) != (y.shape[0], y.shape[1]):
            raise ValueError(
                f"{kind}: {name} must be (B, M) or (B, M, E) with y's B = {y.shape[0]} and "
                f"M = {y.shape[1]}, got {tuple(t.shape)}"
            )


def _run(
    kind: str,
    backend: str,
    x: torch.Tensor,
    y: torch.Tensor,
    *rest,
    eps: float,
    cost: Cost,
    estimate: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_shapes(kind, x, y, rest)
    dense_fn, keops_fn = _IMPLEMENTATIONS[kind]
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (x, y, *rest))
    pairs = x.shape[0] * x.shape[1] * y.shape[1]
    chosen = resolve_backend(backend, pairs, x.device, recorded, x.dtype)
    if chosen == "tensorized":
        _note_backend(chosen)
        return dense_fn(x, y, *rest, eps, cost)
    if chosen == "triton":
        _note_backend(chosen)
        return triton_reduction(kind, x, y, *rest, eps=eps, cost=cost)
    if chosen == "keops":
        ok, reason = _keops.verdict(x.device)  # a child process tried it: no crash here
        if ok:
            try:
                out = keops_fn(x, y, *rest, eps, cost)
                _note_backend(chosen)
                return out
            except Exception as err:
                if backend == "keops":
                    raise KeOpsUnavailable(
                        f"{kind}: the keops backend failed ({type(err).__name__}: {err}). "
                        f"{_keops.HELP}"
                    ) from err
                reason = _keops.record_failure(err)
        elif backend == "keops":
            raise KeOpsUnavailable(f"{kind}: backend='keops' but {reason}. {_keops.HELP}")
        _keops_fallback(reason)
    fused = (
        COMPILED
        and kind != "softmax_average"
        and cost.name == "sqeuclidean"
        and x.dtype in (torch.float32, torch.float64)
        and x.device.type == "cpu"
        and x.shape[0] * x.shape[1] * y.shape[1] >= max(1, _compiled.MIN_PAIRS)
    )
    _note_backend("blocked")
    return blocked_reduction(
        kind,
        x,
        y,
        *rest,
        eps=eps,
        cost=cost,
        block_elements=BLOCK_ELEMENTS,
        fused=fused,
        estimate=estimate,
    )


def softmin(
    x: torch.Tensor,
    y: torch.Tensor,
    h: torch.Tensor,
    eps: float,
    cost: Cost,
    backend: str = "auto",
    estimate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``-eps log sum_j exp(h_j - C(x_i, y_j)/eps)``.

    x (B, N, D), y (B, M, D), h (B, M) -> (B, N). ``estimate`` (B, N), optional: a likely
    result (a Sinkhorn loop's previous iterate). The blocked backend then shifts each
    row's exponentials by it instead of by their maximum, two sweeps of the pairs fewer
    of five (a row it leaves out of range is summed again from its maximum); the result does not
    depend on it beyond rounding, and the other backends ignore it.

    Example:
        >>> import math, torch
        >>> from otreg.costs import get_cost
        >>> from otreg.reductions import softmin
        >>> x, y = torch.zeros(1, 2, 3), torch.zeros(1, 4, 3)      # every cost 0
        >>> out = softmin(x, y, torch.zeros(1, 4), 0.1, get_cost("sqeuclidean"))
        >>> torch.allclose(out, torch.full((1, 2), -0.1 * math.log(4)))
        True
    """
    if estimate is not None and (
        not isinstance(estimate, torch.Tensor) or tuple(estimate.shape) != tuple(x.shape[:2])
    ):
        got = tuple(estimate.shape) if isinstance(estimate, torch.Tensor) else type(estimate)
        raise ValueError(f"softmin: estimate must be (B, N) = {tuple(x.shape[:2])}, got {got}")
    return _run("softmin", backend, x, y, h, eps=eps, cost=cost, estimate=estimate)


def kernel_product(
    x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, eps: float, cost: Cost, backend: str = "auto"
) -> torch.Tensor:
    """``sum_j exp(-C(x_i, y_j)/eps) v_j``: v (B, M, E) -> (B, N, E).

    For ``cost="sqeuclidean"`` this is the Gaussian kernel ``exp(-|x - y|^2 / (2 sigma^2))`` with
    sigma^2 = eps.

    Example:
        >>> import torch
        >>> from otreg.costs import get_cost
        >>> from otreg.reductions import kernel_product
        >>> x, y = torch.zeros(1, 2, 3), torch.zeros(1, 4, 3)
        >>> kernel_product(x, y, torch.ones(1, 4, 1), 1.0, get_cost("sqeuclidean")).flatten()
        tensor([4., 4.])
    """
    return _run("kernel_product", backend, x, y, v, eps=eps, cost=cost)


def softmax_average(
    x: torch.Tensor,
    y: torch.Tensor,
    h: torch.Tensor,
    v: torch.Tensor,
    eps: float,
    cost: Cost,
    backend: str = "auto",
) -> torch.Tensor:
    """``sum_j softmax_j(h_j - C(x_i, y_j)/eps) v_j``: h (B, M), v (B, M, E) -> (B, N, E).

    Example:
        >>> import torch
        >>> from otreg.costs import get_cost
        >>> from otreg.reductions import softmax_average
        >>> x, y = torch.zeros(1, 2, 3), torch.zeros(1, 4, 3)
        >>> v = torch.arange(4.0).reshape(1, 4, 1)                 # equal weights: the mean, 1.5
        >>> softmax_average(x, y, torch.zeros(1, 4), v, 1.0, get_cost("sqeuclidean")).flatten()
        tensor([1.5000, 1.5000])
    """
    return _run("softmax_average", backend, x, y, h, v, eps=eps, cost=cost)
