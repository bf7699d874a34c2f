"""The keops backend: pykeops LazyTensor formulas and the policy when pykeops fails.

The only module of otreg that imports pykeops. Each formula compiles on first use (6 to 10 s
with g++, cached in pykeops' build folder) and never stores an N x M array. eps enters as a
parameter, so a new eps does not recompile.
"""

from __future__ import annotations

import contextlib
import io

import torch

from ..costs import Cost

__all__ = ["KeOpsUnavailable"]

HELP = (
    "KeOps compiles each formula with a C++ compiler on first use. Check that g++ (>= 8) and "
    'the Python headers (python3-dev) are installed and that `python -c "import pykeops; '
    'pykeops.test_torch_bindings()"` works; a stale cache is cleared with '
    '`python -c "import pykeops; pykeops.clean_pykeops()"`.'
)


class KeOpsUnavailable(RuntimeError):
    """pykeops is missing or could not compile a formula.

    Example:
        >>> import otreg
        >>> issubclass(otreg.KeOpsUnavailable, RuntimeError)  # backend="keops" raises it
        True
    """


_failure: str | None = None  # why pykeops failed in this process, once it has


def status() -> tuple[bool, str]:
    """Whether pykeops imports here, and a reason when it does not (compiles are not tried)."""
    if _failure is not None:
        return False, _failure
    try:
        # pykeops prints "CUDA libraries not found ... CPU only" on a CPU machine at its
        # first import; otreg.info() says which device is used, so the line is kept quiet
        with contextlib.redirect_stdout(io.StringIO()):
            import pykeops  # noqa: F401
            from pykeops.torch import LazyTensor  # noqa: F401
    except Exception as err:  # ImportError, or pykeops' own errors at import
        return False, f"pykeops cannot be imported ({type(err).__name__}: {err})"
    return True, "ok"


def record_failure(err: Exception) -> str:
    """Remember that a formula failed: ``status()`` then reports it and ``auto`` stops
    trying keops in this process. Returns the reason."""
    global _failure
    _failure = f"pykeops failed ({type(err).__name__}: {str(err)[:300]})"
    return _failure


def build_folder() -> str:
    """Pykeops' cache of compiled formulas."""
    import pykeops

    return pykeops.get_build_folder()


def _lazy(x, y, eps):
    """x_i, y_j and 1/eps as LazyTensors (eps a parameter: no recompilation per eps)."""
    from pykeops.torch import LazyTensor

    inv_eps = torch.tensor([1.0 / eps], dtype=x.dtype, device=x.device)
    return LazyTensor(x[:, :, None, :]), LazyTensor(y[:, None, :, :]), LazyTensor(inv_eps)


def softmin(x, y, h, eps, cost: Cost):
    from pykeops.torch import LazyTensor

    x_i, y_j, inv_eps = _lazy(x, y, eps)
    h_j = LazyTensor(h[:, None, :, None])
    lse = (h_j - cost.keops(x_i, y_j) * inv_eps).logsumexp(dim=2)
    return -eps * lse.squeeze(-1)


def kernel_product(x, y, v, eps, cost: Cost):
    from pykeops.torch import LazyTensor

    x_i, y_j, inv_eps = _lazy(x, y, eps)
    v_j = LazyTensor(v[:, None, :, :])
    return ((-cost.keops(x_i, y_j) * inv_eps).exp() * v_j).sum(dim=2)


def softmax_average(x, y, h, v, eps, cost: Cost):
    from pykeops.torch import LazyTensor

    x_i, y_j, inv_eps = _lazy(x, y, eps)
    h_j = LazyTensor(h[:, None, :, None])
    v_j = LazyTensor(v[:, None, :, :])
    return (h_j - cost.keops(x_i, y_j) * inv_eps).sumsoftmaxweight(v_j, dim=2)
