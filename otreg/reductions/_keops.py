"""The keops backend: pykeops LazyTensor formulas, and the check that keeps a crashing
pykeops from taking the user's process down.

The only module of otreg that imports pykeops. Each formula compiles on first use (6 to 10 s
with g++, or nvrtc on a GPU, cached in pykeops' build folder) and never stores an N x M
array. eps enters as a parameter, so a new eps does not recompile.

pykeops can crash its process while it compiles: 2.3 segfaults inside its nvrtc binding on
CUDA 13, even on a trivial formula, where an exception would be caught. So pykeops is
imported in the user's process only after a child process has compiled and run otreg's own
formulas on that device (:func:`verdict`: the softmin, the kernel product and the softmax
average, forward and backward, in float32 and float64) and exited cleanly within
:data:`CHECK_SECONDS`. The verdict (ok, an error, killed by a signal, a timeout) is kept on
disk (:func:`cache_file`) under the versions of pykeops, keopscore, torch, CUDA, the driver,
the GPU and Python, so the check runs once a machine and again after an upgrade; a passing
check leaves the compiled formulas in pykeops' cache for the user's process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import platform
import signal
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from ..costs import Cost, get_cost
from . import _dense, _kept

__all__ = ["KeOpsUnavailable"]

HELP = (
    "KeOps compiles each formula with a C++ compiler on first use. Check that g++ (>= 8) and "
    'the Python headers (python3-dev) are installed and that `python -c "import pykeops; '
    'pykeops.test_torch_bindings()"` works; a stale cache is cleared with '
    '`python -c "import pykeops; pykeops.clean_pykeops()"`. otreg checks KeOps once a machine '
    "in a child process; delete OTREG_CACHE_DIR/keops-check.json (by default "
    "~/.cache/otreg) to check again. backend='auto' does not need KeOps."
)
#: Seconds the check's child process may take (a dozen formulas, 6 to 10 s each when cold).
CHECK_SECONDS = 900
#: What the check's child prints last when every formula compiled, ran and agreed.
_PASSED = "otreg-keops-check-passed"


class KeOpsUnavailable(RuntimeError):
    """pykeops (or another optional GPU library) is missing, failed its check, or could not
    compile a formula.

    Example:
        >>> import otreg
        >>> issubclass(otreg.KeOpsUnavailable, RuntimeError)  # backend="keops" raises it
        True
    """


_failure: str | None = None  # why pykeops failed in this process, once it has
_verdicts: dict[str, tuple[bool, str]] = {}  # this process's verdicts, by environment


def status() -> tuple[bool, str]:
    """Whether pykeops is installed and has not failed (its check is not run here: see
    :func:`verdict`); a reason when not."""
    if _failure is not None:
        return False, _failure
    if importlib.util.find_spec("pykeops") is None:
        return False, "pykeops is not installed (pip install pykeops)"
    return True, "installed"


def record_failure(err: Exception) -> str:
    """Remember that a formula failed: ``status()`` then reports it and ``auto`` stops
    trying keops in this process. Returns the reason."""
    global _failure
    _failure = f"pykeops failed ({type(err).__name__}: {str(err)[:300]})"
    return _failure


def cache_file() -> Path:
    """Where the checks' verdicts are kept: ``$OTREG_CACHE_DIR/keops-check.json``
    (default ``~/.cache/otreg``, or ``$XDG_CACHE_HOME/otreg``)."""
    base = os.environ.get("OTREG_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "otreg"
    )
    return Path(base) / "keops-check.json"


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "none"


def environment(device: torch.device) -> dict[str, str]:
    """What a verdict holds for: the versions and the device it was made on."""
    env = {
        "pykeops": _version("pykeops"),
        "keopscore": _version("keopscore"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device.type,
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        env["gpu"] = torch.cuda.get_device_name(index)
        env["cuda"] = str(torch.version.cuda)
        driver = Path("/proc/driver/nvidia/version")
        env["driver"] = driver.read_text().split("\n")[0] if driver.exists() else "unknown"
    return env


def say_checking(device: torch.device) -> None:
    """One line on stderr before the check's child process: minutes of silence otherwise
    (134 s on two cores with a cold cache, for a call with ``backend="keops"``)."""
    print(
        f"otreg: checking KeOps on {device.type}: compiling otreg's formulas in a child "
        "process, once a machine and version (up to a few minutes)...",
        file=sys.stderr,
        flush=True,
    )


def verdict(device: torch.device, announce=say_checking) -> tuple[bool, str]:
    """Whether pykeops compiles and runs otreg's formulas on ``device``: ``(ok, reason)``,
    from this process's memory, the cache file, or a child process that tries them (the
    first time on a machine, or after an upgrade; minutes when its cache is cold), after
    calling ``announce(device)`` (None: silently)."""
    ok, reason = status()
    if not ok:
        return ok, reason
    env = environment(device)
    key = json.dumps(env, sort_keys=True)
    if key in _verdicts:
        return _verdicts[key]
    path = cache_file()
    saved = _kept.read(path)
    if key in saved and isinstance(saved[key], list) and len(saved[key]) == 2:
        _verdicts[key] = (bool(saved[key][0]), str(saved[key][1]))
        return _verdicts[key]
    if announce is not None:
        announce(device)
    _verdicts[key] = _check_in_a_child(device)
    saved[key] = list(_verdicts[key])
    _kept.write(path, saved)  # a read-only home: the verdict holds for this process only
    return _verdicts[key]


def _check_in_a_child(device: torch.device) -> tuple[bool, str]:
    code = (
        "import sys\n"
        "from otreg.reductions import _keops\n"
        "_keops.self_test(sys.argv[1])\n"
        f"print({_PASSED!r})\n"
    )
    where = "the GPU" if device.type == "cuda" else "the CPU"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(device)],
            capture_output=True,
            text=True,
            timeout=CHECK_SECONDS,
        )
    except subprocess.TimeoutExpired:
        return False, (
            f"pykeops' check did not finish within {CHECK_SECONDS} s (compiling otreg's "
            f"formulas for {where})"
        )
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = "unknown"
        return False, (
            f"pykeops killed its check process with signal {-done.returncode} ({name}) while "
            f"it compiled or ran otreg's formulas for {where} (a crash that would have taken "
            "this process down)"
        )
    if done.returncode != 0 or _PASSED not in done.stdout:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1][:300]
        return False, f"pykeops failed its check for {where} ({last})"
    return True, "ok"


def self_test(device: str) -> None:
    """Compile and run otreg's formulas on ``device`` and compare them with the dense path
    (what the check's child process runs; an AssertionError names a wrong result)."""
    dev = torch.device(device)
    cost = get_cost("sqeuclidean")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        x, y = (torch.rand(1, n, 3, generator=g, dtype=dtype).to(dev) for n in (7, 9))
        h = torch.rand(1, 9, generator=g, dtype=dtype).to(dev)
        v = torch.rand(1, 9, 2, generator=g, dtype=dtype).to(dev)
        for name, rest in (
            ("softmin", (h,)),
            ("kernel_product", (v,)),
            ("softmax_average", (h, v)),
        ):
            inputs = [t.clone().requires_grad_(True) for t in (x, y, *rest)]
            ours = globals()[name](*inputs, 0.3, cost)
            grads = torch.autograd.grad(ours.sum(), inputs)
            ref = getattr(_dense, name)(*(t.detach().cpu() for t in (x, y, *rest)), 0.3, cost)
            tol = 1e-4 if dtype == torch.float32 else 1e-9
            if not torch.allclose(ours.detach().cpu(), ref, rtol=tol, atol=tol):
                raise AssertionError(f"pykeops' {name} ({dtype}) differs from the dense one")
            if not all(bool(torch.isfinite(t).all()) for t in grads):
                raise AssertionError(f"pykeops' {name} ({dtype}) gives non-finite gradients")


def build_folder() -> str:
    """Pykeops' cache of compiled formulas."""
    import pykeops

    return pykeops.get_build_folder()


def _lazy_tensor():
    """Pykeops' LazyTensor (pykeops prints "CUDA libraries not found ... CPU only" on a CPU
    machine at its first import; otreg.info() says which device is used: kept quiet)."""
    with contextlib.redirect_stdout(io.StringIO()):
        from pykeops.torch import LazyTensor
    return LazyTensor


def _lazy(x, y, eps):
    """x_i, y_j and 1/eps as LazyTensors (eps a parameter: no recompilation per eps)."""
    LazyTensor = _lazy_tensor()

    inv_eps = torch.tensor([1.0 / eps], dtype=x.dtype, device=x.device)
    return LazyTensor(x[:, :, None, :]), LazyTensor(y[:, None, :, :]), LazyTensor(inv_eps)


def softmin(x, y, h, eps, cost: Cost):
    LazyTensor = _lazy_tensor()
    x_i, y_j, inv_eps = _lazy(x, y, eps)
    h_j = LazyTensor(h[:, None, :, None])
    lse = (h_j - cost.keops(x_i, y_j) * inv_eps).logsumexp(dim=2)
    return -eps * lse.squeeze(-1)


def kernel_product(x, y, v, eps, cost: Cost):
    LazyTensor = _lazy_tensor()
    x_i, y_j, inv_eps = _lazy(x, y, eps)
    v_j = LazyTensor(v[:, None, :, :])
    return ((-cost.keops(x_i, y_j) * inv_eps).exp() * v_j).sum(dim=2)


def softmax_average(x, y, h, v, eps, cost: Cost):
    LazyTensor = _lazy_tensor()
    x_i, y_j, inv_eps = _lazy(x, y, eps)
    h_j = LazyTensor(h[:, None, :, None])
    v_j = LazyTensor(v[:, None, :, :])
    return (h_j - cost.keops(x_i, y_j) * inv_eps).sumsoftmaxweight(v_j, dim=2)
