"""Measured memory: the peak a function reaches, and the allocator settings that make the
process's resident memory follow what tensors hold.

On a GPU the peak is ``torch.cuda.max_memory_allocated``. On a Linux CPU it is the growth of
the process's peak resident set (VmHWM, reset through ``/proc/self/clear_refs`` after
returning freed memory to the system with ``malloc_trim``): what the machine sees, allocator
overheads included.

glibc keeps freed blocks in its heap when they were allocated below its mmap threshold, and
raises that threshold (up to 32 MB) each time a large mmapped block is freed: a loop that
frees and reallocates 8 MB tensors then holds more resident memory than its tensors need
(measured: 241 MB against 115 MB for one budget). :func:`limit_heap_retention` fixes the
threshold at 1 MiB, so that large blocks are mapped and unmapped and the resident set tracks
what is alive; :func:`otreg.loops.iterate` calls it when given a memory budget.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

__all__: list[str] = []

#: blocks from this size are mmapped (and returned to the system when freed)
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_limited = False


def _proc_status_bytes(key: str) -> int | None:
    """A memory line of /proc/self/status (``VmRSS``, ``VmHWM``: the peak) in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def limit_heap_retention() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD`` for this process (once): large
    blocks are then given back to the system when freed, so measured memory follows live
    tensors. Returns whether it applied (Linux with glibc).

    Example:
        >>> from otreg.loops.memory import limit_heap_retention
        >>> isinstance(limit_heap_retention(), bool)
        True
    """
    global _limited
    if _limited:
        return True
    libc = _libc() if sys.platform.startswith("linux") else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    _limited = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return _limited


def resident_bytes(device: torch.device) -> int | None:
    """Memory the process holds now: a GPU's allocated bytes, or on Linux the resident set
    after freed heap memory is returned to the system (``malloc_trim``); None elsewhere.

    Example:
        >>> import torch
        >>> from otreg.loops.memory import resident_bytes
        >>> held = resident_bytes(torch.device("cpu"))
        >>> held is None or held > 0
        True
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    if not sys.platform.startswith("linux"):
        return None
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    return _proc_status_bytes("VmRSS")


def measure_peak(
    fn: Callable[[], object], device: torch.device
) -> tuple[object, float, int | None]:
    """Run fn(); return (its result, seconds, peak bytes above the starting level or None).

    Example:
        >>> import torch
        >>> from otreg.loops.memory import measure_peak
        >>> out, seconds, peak = measure_peak(lambda: torch.ones(4_000_000).sum(),
        ...                                   torch.device("cpu"))
        >>> float(out), peak is None or peak > 10_000_000    # 16 MB were touched
        (4000000.0, True)
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize(device)
        return out, time.perf_counter() - start, torch.cuda.max_memory_allocated(device) - base
    base = resident_bytes(device)  # freed heap returned first
    if base is not None:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from here
        except OSError:
            pass
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    peak = _proc_status_bytes("VmHWM")
    return out, seconds, (None if peak is None or base is None else max(0, peak - base))
