"""One pair of a batch, run inside a worker process: :func:`run_pair`.

The pair's files are written into a hidden staging folder beside its output folder and
renamed into place at the end, the record last; the old record goes first, so an interrupted
pair never looks done and a rerun redoes it. Every exception becomes a failure record with
its reason and traceback; a timeout writes its record and then kills its own worker process
(a thread running torch cannot be stopped otherwise), which Dask's nanny restarts.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
import warnings
import zlib
from pathlib import Path

from ..io import atomic_write
from .job import JOB_OPTION_NAMES, InputError, JobOptions, run_job
from .locks import LockedError, PairLock
from .manifest import Pair
from .records import DONE_NAME, FAILED_NAME, FORMAT, read_record

__all__: list[str] = []

#: Hidden staging folders of pairs being written (removed when found stale).
STAGING_PREFIX = ".partial-"


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def record_path(out: Path, pair: Pair, status: str) -> Path:
    name = DONE_NAME if status == "done" else FAILED_NAME
    return out / pair.folder / f"{pair.prefix}{name}"


def _base_record(spec: dict, pair: Pair) -> dict:
    return {
        "format": FORMAT,
        "pair_id": pair.pair_id,
        "key": spec["key"],
        "key_parts": spec["key_parts"],
        "source": pair.source,
        "target": pair.target,
        "source_subject": pair.source_subject,
        "target_subject": pair.target_subject,
        "hemisphere": pair.hemisphere,
        "options": spec["options"],
        "batch_id": spec.get("batch_id"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "threads": spec.get("threads"),
        "device": spec.get("device") or "cpu",
        "otreg_version": _version(),
    }


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("otreg")
    except Exception:  # pragma: no cover - not installed as a distribution
        return "unknown"


def _write_json(path: Path, doc: dict) -> None:
    import json

    text = json.dumps(doc, indent=2, default=str, allow_nan=True)
    atomic_write(path, lambda tmp: tmp.write_text(text))


def _clear_old_outputs(out: Path, pair: Pair, statuses=("done", "failed")) -> None:
    """Remove the pair's previous records of ``statuses`` first (so that nothing
    half-replaced looks done), then the files they listed."""
    for status in statuses:
        path = record_path(out, pair, status)
        old = read_record(path)
        path.unlink(missing_ok=True)
        for name in (old or {}).get("files", {}).values():
            (path.parent / str(name)).unlink(missing_ok=True)


def write_failure(spec: dict, cls: str, err_type: str, reason: str, tb: str | None, **extra):
    """Write a failure record into the pair's folder, replacing an older failure's. An
    earlier result of the pair (of other inputs or options) stays, its record and files
    beside the failure: a rerun that failed on a changed values file had deleted a
    registration that took minutes. The tables and the group page show the failure (the
    record finished last); the next run that succeeds replaces both."""
    pair = Pair(**spec["pair"])
    out = Path(spec["out"])
    doc = _base_record(spec, pair)
    doc.update(extra)
    doc.update(
        status="failed",
        error={"class": cls, "type": err_type, "reason": reason, "traceback": tb},
        finished=now_iso(),
    )
    doc.setdefault("files", {})
    _clear_old_outputs(out, pair, statuses=("failed",))
    if read_record(record_path(out, pair, "done")) is not None:
        doc["earlier_result_kept"] = record_path(out, pair, "done").name
    (out / pair.folder).mkdir(parents=True, exist_ok=True)
    _write_json(record_path(out, pair, "failed"), doc)
    return doc


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark of this process (Linux), so that the peak read
    after a pair is that pair's, not the worker's lifetime's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # pragma: no cover - not Linux, or not allowed
        pass


def _peak_rss_mb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_ALLOCATOR_SET = False


def _fast_allocator() -> None:
    """Undo what Dask's nanny does to glibc's malloc for torch's sake.

    The nanny starts workers with ``MALLOC_TRIM_THRESHOLD_=65536``; setting any such
    variable turns off glibc's dynamic mmap threshold, so every tensor above 128 kB is
    mmapped and unmapped again, page faults included: registrations ran 2x slower in a
    worker than in a plain process here. Fixed thresholds (32 MB mmap, 64 MB trim) give the
    plain process's speed back."""
    global _ALLOCATOR_SET
    if _ALLOCATOR_SET or not sys.platform.startswith("linux"):
        return
    _ALLOCATOR_SET = True
    if not any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 * 2**20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 * 2**20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


def _device(device: str | None) -> str | None:
    """The device of this worker: with ``"cuda"`` and several GPUs, the one of the worker's
    number (a local cluster numbers its workers 0, 1, ...) modulo their number."""
    if device != "cuda":
        return device
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count <= 1:
        return device
    try:
        from distributed import get_worker

        name = get_worker().name
    except (ImportError, ValueError):  # not in a Dask worker
        name = os.getpid()
    index = name if isinstance(name, int) else zlib.crc32(str(name).encode())
    return f"cuda:{index % count}"


def _set_threads(threads: int | None) -> int:
    import torch

    if threads:
        torch.set_num_threads(int(threads))
        os.environ["OMP_NUM_THREADS"] = str(threads)  # KeOps' OpenMP, if it compiles now
    # the batch planned its workers' threads: none given up beside its other workers
    os.environ["OTREG_SHARE_CORES"] = "0"
    return torch.get_num_threads()


def run_pair(spec: dict) -> dict:
    """Run one pair (see the module docstring) and return its record.

    A pair whose record already has this key is not run again (a retried task); a pair
    whose lock a live process holds returns ``{"status": "locked", ...}`` without running.
    """
    _fast_allocator()
    pair = Pair(**spec["pair"])
    out = Path(spec["out"])
    done = read_record(record_path(out, pair, "done"))
    if done is not None and done.get("key") == spec["key"]:
        return done
    failed = read_record(record_path(out, pair, "failed"))
    if (  # this batch's timeout killed the worker: Dask retries the task, we do not
        failed is not None
        and failed.get("key") == spec["key"]
        and failed.get("batch_id") == spec.get("batch_id")
        and failed["error"]["class"] in ("timeout",)
    ):
        return failed
    try:
        lock = PairLock(out, pair.pair_id)
        lock.acquire()
    except LockedError as err:
        return {"pair_id": pair.pair_id, "status": "locked", "reason": str(err)}
    try:
        return _run_locked(spec, pair, out, lock)
    finally:
        lock.release()


def _run_locked(spec: dict, pair: Pair, out: Path, lock: PairLock) -> dict:
    folder = out / pair.folder
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(f"{STAGING_PREFIX}{pair.pair_id}-*"):  # a killed run's leftovers
        shutil.rmtree(old, ignore_errors=True)
    staging = folder / f"{STAGING_PREFIX}{pair.pair_id}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    threads = _set_threads(spec.get("threads"))
    spec = {**spec, "threads": threads, "device": _device(spec.get("device"))}
    started, start = now_iso(), time.perf_counter()
    _reset_peak_rss()
    timer = None
    if spec.get("timeout"):
        timer = threading.Timer(float(spec["timeout"]), _on_timeout, (spec, staging, lock))
        timer.daemon = True
        timer.start()
    log_path = staging / "log.txt"
    try:
        with _captured_log(log_path):
            doc = _register(spec, pair, staging)
    except BaseException as err:
        if timer is not None:
            timer.cancel()
        shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(err, Exception):
            raise  # KeyboardInterrupt, SystemExit: no record, the pair is redone
        cls = _failure_class(err)
        return write_failure(
            spec,
            cls,
            type(err).__name__,
            _one_line(err),
            traceback.format_exc(),
            started=started,
            seconds=time.perf_counter() - start,
            peak_rss_mb=_peak_rss_mb(),
        )
    if timer is not None:
        timer.cancel()
    record = _base_record(spec, pair)
    record.update(doc)
    record.update(
        status="done",
        started=started,
        finished=now_iso(),
        seconds=time.perf_counter() - start,
        peak_rss_mb=_peak_rss_mb(),
    )
    files = {role: f"{pair.prefix}{name}" for role, name in doc["files"].items()}
    files["log"] = f"{pair.prefix}log.txt"
    record["files"] = files
    placed: list[Path] = []
    try:
        _write_json(staging / DONE_NAME, record)
        _clear_old_outputs(out, pair)
        for role, name in [*doc["files"].items(), ("log", "log.txt")]:
            os.replace(staging / name, folder / files[role])
            placed.append(folder / files[role])
        os.replace(staging / DONE_NAME, record_path(out, pair, "done"))  # last: now it is done
    except Exception as err:  # a pair half in place is no result: its files go
        for path in placed:
            path.unlink(missing_ok=True)
        return write_failure(
            spec,
            "error",
            type(err).__name__,
            f"writing its outputs: {_one_line(err)}",
            traceback.format_exc(),
            started=started,
            seconds=time.perf_counter() - start,
            peak_rss_mb=_peak_rss_mb(),
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return record


def _register(spec: dict, pair: Pair, staging: Path) -> dict:
    """The job (:func:`~otreg.batch.job.run_job`) written into the staging folder: its
    metrics and the files written, by role."""
    log = logging.getLogger("otreg.batch")
    log.info("%s: %s onto %s", pair.pair_id, pair.source, pair.target)
    options = JobOptions.from_mapping(
        {k: spec["options"][k] for k in JOB_OPTION_NAMES}, f"pair {pair.pair_id}: options"
    )
    out = run_job(
        pair.source,
        pair.target,
        staging,
        options,
        label=pair.label,
        level=pair.level,
        source_values=pair.source_values,
        target_values=pair.target_values,
        device=spec.get("device"),
    )
    metrics = dict(out.registration.metrics)
    metrics["source_vertices"] = out.source.n_points
    metrics["target_vertices"] = out.target.n_points
    checks = {  # what batch.flags reads: which side of the midline each input lies on
        "source_mean_x_mm": float(out.full_source.points[:, 0].double().mean()),
        "target_mean_x_mm": float(out.target.points[:, 0].double().mean()),
    }
    log.info(
        "%s: %d onto %d vertices, mean surface distance %.3f -> %.3f mm in %.1f s",
        pair.pair_id,
        out.source.n_points,
        out.target.n_points,
        metrics["before_mean_mm"],
        metrics["mean_mm"],
        metrics["seconds"],
    )
    return {"metrics": metrics, "checks": checks, "files": out.files}


def _failure_class(err: Exception) -> str:
    if isinstance(err, FileNotFoundError):
        return "missing input"
    if isinstance(err, InputError):
        return "bad input"
    if isinstance(err, MemoryError):
        return "out of memory"
    return "error"


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class _captured_log:
    """Warnings and ``otreg`` log records of this pair go to its log file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self):
        self.file = open(self.path, "w", buffering=1)
        self.handler = logging.StreamHandler(self.file)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.logger = logging.getLogger("otreg")
        self.logger.addHandler(self.handler)
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.simplefilter("default")

        def show(message, category, filename, lineno, file=None, line=None):
            self.file.write(f"{now_iso()} WARNING {category.__name__}: {message}\n")

        warnings.showwarning = show
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            self.file.write(f"{now_iso()} ERROR {''.join(traceback.format_exception(*exc))}")
        self.warnings.__exit__(*exc)
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        self.file.close()
        return False


def _on_timeout(spec: dict, staging: Path, lock: PairLock) -> None:
    """Record the timeout, then kill this worker process (its nanny starts a new one)."""
    try:
        shutil.rmtree(staging, ignore_errors=True)
        write_failure(
            spec,
            "timeout",
            "TimeoutError",
            f"TimeoutError: the pair ran longer than --timeout {spec['timeout']:g} s",
            None,
            seconds=float(spec["timeout"]),
            peak_rss_mb=_peak_rss_mb(),
        )
        lock.release()
    finally:
        os.kill(os.getpid(), signal.SIGKILL)
