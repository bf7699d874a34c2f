"""``otreg.info()``: versions, working backends and the compiled code's cache folders."""

from __future__ import annotations

import os
import platform
import sys

import torch

from . import reductions

__all__ = ["info"]


def package_version(name: str) -> str:
    """The installed version of a distribution, from its metadata, or "not installed"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def usable_cores() -> int:
    """The CPUs this process may use: the fewest of the machine's, its affinity's (taskset, a
    cluster job's cpuset) and its cgroup's quota (a container's or a job's CPU limit), as
    Dask counts them. ``os.cpu_count()`` counts the machine's alone: in a job given 8 of a
    node's 64 cores, a batch sized by it would start 32 workers whose threads take turns on
    8 cores (on 2 cores, one busy competitor made an LDDMM gradient 15 to 40 times slower).
    Without Dask (not installed), the affinity's count.

    Example:
        >>> import os
        >>> from otreg._info import usable_cores
        >>> 1 <= usable_cores() <= os.cpu_count()
        True
    """
    try:
        from dask.system import cpu_count
    except ImportError:
        return (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1
        )
    return cpu_count()


def info(check_keops: bool = True, file=None) -> dict:
    """Print and return what otreg runs on here.

    Args:
        check_keops: whether KeOps works here: otreg's formulas compiled and run in a child
            process (a minute or two the first time on a machine, cached afterwards), so that
            a crashing pykeops cannot take this process down.
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
        "usable CPUs": usable_cores(),
        # torch's OpenMP threads' spins at a barrier (otreg sets 10,000 where it loads first)
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "not set (libgomp's 300,000)"),
        "cuda": torch.cuda.is_available(),
        "numpy": package_version("numpy"),
        "pykeops": package_version("pykeops"),
    }
    status = reductions.status()
    ok, reason = status["keops"]
    report["keops check file"] = status["keops check file"]
    report["compiled loops cache"] = status["fused cache folder"]
    report["compiled loops verdicts"] = status["fused verdicts file"]
    backends = {"tensorized": "ok", "blocked": "ok"}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not ok:
        backends["keops"] = f"unavailable: {reason}"
    elif check_keops:  # compiled and run in a child process (once a machine)
        if file is False:
            ok, reason = reductions.keops_status(device, announce=None)
        else:  # the first time on a machine: minutes, said on stderr
            ok, reason = reductions.keops_status(device)
        backends["keops"] = (
            f"ok on {device.type} (checked in a child process)" if ok else f"off: {reason}"
        )
    else:
        backends["keops"] = "installed (not checked: check_keops=False)"
    triton = status["triton"]
    backends["triton"] = (
        ("ok: the default above the dense size on CUDA" if device.type == "cuda" else
         "installed (its kernels run on CUDA tensors)")
        if triton == "ok"
        else f"unavailable: {triton}"
    )  # fmt: skip
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
        "auto",
        max(reductions.TENSORIZED_MAX_PAIRS, reductions.TENSORIZED_MAX_PAIRS_GPU) + 1,
        device,
    )
    if file is not False:
        out = file or sys.stdout
        if report["torch threads"] > report["usable CPUs"]:
            print(
                f"warning: torch runs {report['torch threads']} threads on "
                f"{report['usable CPUs']} usable CPUs (an affinity or a CPU quota): its "
                "threads take turns and reductions can run 10 times slower; call "
                f"torch.set_num_threads({report['usable CPUs']})",
                file=out,
            )
        for key, value in report.items():
            if isinstance(value, dict):
                print(f"{key}:", file=out)
                for k, v in value.items():
                    print(f"  {k:<24} {v}", file=out)
            else:
                print(f"{key + ':':<34} {value}", file=out)
    return report
