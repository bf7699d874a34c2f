"""``otreg.info()``: versions, working backends and the compiled code's cache folders; the
CPUs this process may use, and those other processes leave it now."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator

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
    cluster job's cpuset) and its cgroup's quota (a container's or a job's CPU limit,
    :func:`cgroup_quota`, rounded up). ``os.cpu_count()`` counts the machine's alone: in a
    job given 8 of a node's 64 cores, a batch sized by it would start 32 workers whose
    threads take turns on 8 cores (on 2 cores, one busy competitor made an LDDMM gradient
    15 to 40 times slower). Read here rather than through Dask's ``cpu_count``, whose
    import cost a process's first call 0.24 s (these reads: 0.4 ms).

    Example:
        >>> import os
        >>> from otreg._info import usable_cores
        >>> 1 <= usable_cores() <= os.cpu_count()
        True
    """
    cores = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        cores = min(cores, len(os.sched_getaffinity(0)))
    quota = cgroup_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores


def cgroup_quota(
    root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup"
) -> float | None:
    """The CPU time this process's control group may use, in cores (quota / period), the
    smallest along its path from its own group up to ``root``; None where none is set or
    there is no cgroup file system (not Linux). Reads cgroup v2 (``cpu.max``, "max 100000"
    or "200000 100000") and v1 (``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` under the
    cpu controller's folder, -1: none); ``membership`` lists the process's groups
    ("0::/path" for v2, "4:cpu,cpuacct:/path" for v1). Inside a container the group is
    usually "/" and the quota is read at ``root``.

    Example:
        >>> from otreg._info import cgroup_quota
        >>> cgroup_quota("/no/such/folder") is None
        True
    """
    try:
        with open(membership) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    places = []  # (the controller's folder, the group's path in it)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[1] == "":
            places.append(("", parts[2]))
        elif "cpu" in parts[1].split(","):
            places += [(parts[1], parts[2]), ("cpu", parts[2])]
    places += [("", "/"), ("cpu,cpuacct", "/"), ("cpu", "/")]
    found: list[float] = []
    for controller, path in dict.fromkeys(places):
        folder = os.path.join(root, controller) if controller else root
        steps = [s for s in path.split("/") if s]
        for k in range(len(steps), -1, -1):
            quota = _quota_in(os.path.join(folder, *steps[:k]))
            if quota is not None:
                found.append(quota)
    return min(found) if found else None


def _quota_in(folder: str) -> float | None:
    """The quota set in one cgroup folder, in cores (v2's cpu.max, else v1's pair), or None."""
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            quota, period = (f.read().split() + ["100000"])[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


#: the other processes' running threads are counted at most this often (seconds): a loss
#: called in a training loop reads /proc/loadavg once a second, not once a call
COUNT_EVERY = 1.0
#: ... each time as the fewest of this many reads, ``COUNT_SPACING`` seconds apart (a short
#: task is not a competitor; a process that computes runs at each read). 1 ms apart, a
#: process that had just ended was still counted in 5 of 80 counts; 2.5 ms apart, in 0
COUNT_READS = 3
COUNT_SPACING = 2.5e-3
_counted: dict = {"at": -math.inf, "threads": 0, "usable": 1}
_sharing = threading.local()


def busy_elsewhere() -> int:
    """The threads of other processes running on this machine now: the kernel's count of
    runnable threads (the fourth field of /proc/loadavg) less this process's own running
    threads (/proc/self/task), the fewest of ``COUNT_READS`` reads ``COUNT_SPACING`` apart;
    0 where there is no /proc/loadavg (not Linux). This process's own count matters: right
    after any torch operation its OpenMP threads still spin, runnable, for a while, and
    counted as another process's they put every call after the first on one thread (on 2
    cores, a divergence that takes 7.5 s took 11.2 s).

    Example:
        >>> from otreg._info import busy_elsewhere
        >>> busy_elsewhere() >= 0
        True
    """
    fewest = math.inf
    for k in range(COUNT_READS):
        if k:
            time.sleep(COUNT_SPACING)
        try:
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0
        fewest = min(fewest, running - _running_here())
    return max(0, int(fewest))


def _running_here() -> int:
    """This process's threads that are running or runnable now (state R in
    /proc/self/task/*/stat), at least 1 (the one reading)."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                count += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue  # (a thread that ended meanwhile)
    return max(count, 1)


def threads_for_call() -> int:
    """The threads a long call runs on now: ``torch.get_num_threads()``, fewer where other
    processes' running threads leave fewer of the usable CPUs (:func:`usable_cores`) free,
    at least one. torch's OpenMP threads meet at a barrier after each of the many short
    operations of a Sinkhorn loop or an LDDMM gradient; a thread that shares its core
    with a busy process holds the others at each: on 2 cores beside one busy process, a
    multiscale divergence took 13.4 to 13.9 s on 2 threads and 6.8 to 7.0 s on one (5.4
    to 6.3 s alone on 2; benchmarks/contention.py). Not counted (torch's threads kept):
    ``OTREG_SHARE_CORES=0``, a process limited to some of the machine's CPUs (a cluster
    job's cpuset or quota: /proc counts the whole node's threads), otreg's batch workers
    (their threads are planned). Counted once a ``COUNT_EVERY`` seconds.

    Example:
        >>> import torch
        >>> from otreg._info import threads_for_call
        >>> 1 <= threads_for_call() <= torch.get_num_threads()
        True
    """
    threads = torch.get_num_threads()
    if threads == 1 or os.environ.get("OTREG_SHARE_CORES", "1") == "0":
        return threads
    now = time.monotonic()
    if now - _counted["at"] > COUNT_EVERY:
        usable = usable_cores()
        whole = usable >= (os.cpu_count() or usable)  # else the counts are the node's
        _counted.update(at=now, threads=busy_elsewhere() if whole else 0, usable=usable)
    return max(1, min(threads, _counted["usable"] - _counted["threads"]))


@contextlib.contextmanager
def sharing_cores(device: torch.device | str = "cpu") -> Iterator[int]:
    """A block of a long computation on ``device`` run on :func:`threads_for_call`'s
    threads, torch's count restored after it; a block within another keeps the outer's.
    Yields the threads it runs on.

    Example:
        >>> import torch
        >>> from otreg._info import sharing_cores
        >>> before = torch.get_num_threads()
        >>> with sharing_cores() as threads:
        ...     threads == torch.get_num_threads()
        True
        >>> torch.get_num_threads() == before
        True
    """
    if torch.device(device).type != "cpu" or getattr(_sharing, "active", False):
        yield torch.get_num_threads()
        return
    before = torch.get_num_threads()
    threads = threads_for_call()
    _sharing.active = True
    try:
        if threads != before:
            torch.set_num_threads(threads)
        yield threads
    finally:
        _sharing.active = False
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


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
        # fewer than torch's where other processes keep the cores busy (threads_for_call)
        "threads a call runs on now": threads_for_call(),
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
