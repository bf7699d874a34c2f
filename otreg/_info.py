"""``otreg.info()``: versions, working backends and the compiled code's cache folders."""

from __future__ import annotations

import platform
import sys

import torch

from . import reductions
from .costs import get_cost

__all__ = ["info"]


def package_version(name: str) -> str:
    """The installed version of a distribution, from its metadata, or "not installed"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _try_backend(name: str) -> str:
    x = torch.rand(1, 5, 3)
    try:
        out = reductions.softmin(x, x, torch.zeros(1, 5), 0.1, get_cost("sqeuclidean"), name)
        return "ok" if bool(torch.isfinite(out).all()) else "gives non-finite values"
    except Exception as err:
        return f"fails: {type(err).__name__}: {str(err)[:200]}"


def info(check_keops: bool = True, file=None) -> dict:
    """Print and return what otreg runs on here.

    Args:
        check_keops: compile and run one small KeOps formula (about 10 s the first time,
            cached afterwards) to tell whether the keops backend works.
        file: where to print (default ``sys.stdout``); ``False`` prints nothing.

    Returns:
        ``{name: version or status}``: otreg, Python, the platform, torch, the backends.

    Example:
        >>> import contextlib, io, otreg
        >>> with contextlib.redirect_stdout(io.StringIO()):  # pykeops may print on import
        ...     report = otreg.info(check_keops=False, file=io.StringIO())
        >>> "otreg" in report and "torch" in report
        True
    """
    report: dict = {
        "otreg": package_version("otreg"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "numpy": package_version("numpy"),
        "pykeops": package_version("pykeops"),
    }
    status = reductions.status()
    ok, reason = status["keops"]
    if ok:
        report["keops cache"] = status["keops build folder"]
    report["compiled loops cache"] = status["fused cache folder"]
    backends = {"tensorized": "ok", "blocked": "ok"}
    if not ok:
        backends["keops"] = f"unavailable: {reason}"
    elif check_keops:
        backends["keops"] = _try_backend("keops")
    else:
        backends["keops"] = "importable (not compiled: check_keops=False)"
    key = "blocked, fused loops"
    if status["fused"]:
        backends[key] = f"off: {status['fused']}"
    else:
        backends[key] = (
            f"on for softmin and kernel products from "
            f"{status['fused min pairs']:.0e} pairs, float32/64 (torch.compile, "
            f"after {status['fused tier-up seconds']:g} s on the blocked path)"
        )
    report["backends"] = backends
    report["auto backend for large problems"] = reductions.resolve_backend(
        "auto", reductions.TENSORIZED_MAX_PAIRS + 1, torch.device("cpu")
    )
    if file is not False:
        out = file or sys.stdout
        for key, value in report.items():
            if isinstance(value, dict):
                print(f"{key}:", file=out)
                for k, v in value.items():
                    print(f"  {k:<24} {v}", file=out)
            else:
                print(f"{key + ':':<34} {value}", file=out)
    return report
