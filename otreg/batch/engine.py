"""Run a batch: plan (resume keys), preflight, dispatch to worker processes on Dask,
collect the records, write ``summary.csv`` and ``failed.csv``.

Workers are Dask worker processes: by default an embedded local cluster on 127.0.0.1
(``workers`` processes of ``threads`` torch threads each), or an existing cluster
(``scheduler``/``scheduler_file``). A pair's exception fails that pair only (its record says
why); a worker that dies (a crash, an out-of-memory kill) is restarted by its nanny and its
pair rescheduled, and a pair that kills :data:`ALLOWED_FAILURES` + 1 workers is recorded
failed while the batch goes on.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .keys import effective_options, file_digest, pair_key, why_rerun
from .locks import HEARTBEAT, read_lock
from .manifest import Pair
from .records import DONE_NAME, FAILED_NAME, read_record
from .worker import STAGING_PREFIX, record_path, run_pair, write_failure

__all__ = [
    "run_batch",
    "plan_batch",
    "BatchResult",
    "Planned",
    "EXIT_OK",
    "EXIT_USAGE",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "ALLOWED_FAILURES",
    "MEMORY_PER_PAIR_MB",
]

EXIT_OK, EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 3, 130
#: Worker deaths a pair may cause before it is recorded failed (Dask's allowed-failures).
ALLOWED_FAILURES = 2
#: Peak memory assumed for a pair (MB) until records of this batch measured one.
MEMORY_PER_PAIR_MB = 1500.0
#: Disk a pair's outputs take besides a copy of its source file (MB; pictures, JSON, log).
DISK_PER_PAIR_MB = 2.0

SUMMARY_METRICS = (
    "before_mean_mm",
    "mean_mm",
    "hausdorff_mm",
    "varifold",
    "jacobian_min",
    "jacobian_negative_fraction",
    "energy",
)


@dataclass
class Planned:
    """A pair and what this run does with it.

    ``state``: ``"done"`` (record with the current key), ``"run"`` (no record),
    ``"rerun"`` (``why`` says what changed, or that its output was partial),
    ``"failed"`` (failed before with the current key; rerun with ``rerun_failed``) or
    ``"missing input"``.
    """

    pair: Pair
    state: str
    why: str = ""
    key: str = ""
    parts: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    record: dict | None = None

    @property
    def runs(self) -> bool:
        return self.state in ("run", "rerun")


@dataclass
class BatchResult:
    """What :func:`run_batch` did: the plan, the final records by pair id, the exit code."""

    planned: list[Planned]
    records: dict[str, dict]
    exit_code: int
    seconds: float = 0.0

    @property
    def failed(self) -> list[str]:
        return [pid for pid, r in self.records.items() if r.get("status") != "done"]


def plan_batch(
    pairs: Sequence[Pair],
    out: str | Path,
    options: Mapping | None = None,
    *,
    rerun_failed: bool = False,
    only: Iterable[str] | None = None,
) -> list[Planned]:
    """Decide, per pair, whether it is done, runs, reruns (and why) or stays failed."""
    out = Path(out)
    pairs = _select(pairs, only)
    digests: dict[str, str] = {}
    planned = []
    for pair in pairs:
        opts = effective_options(options, pair)
        pair_files = (pair.source, pair.target)
        try:
            d = [digests.get(f) or digests.setdefault(f, file_digest(f)) for f in pair_files]
        except FileNotFoundError as err:
            planned.append(Planned(pair, "missing input", str(err), options=opts))
            continue
        key, parts = pair_key(d[0], d[1], opts)
        done = read_record(record_path(out, pair, "done"))
        failed = read_record(record_path(out, pair, "failed"))
        if done is not None and done.get("key") == key:
            planned.append(Planned(pair, "done", "", key, parts, opts, done))
        elif failed is not None and failed.get("key") == key:
            if rerun_failed:
                why = f"failed before ({failed['error']['class']}); --rerun-failed"
                planned.append(Planned(pair, "rerun", why, key, parts, opts, failed))
            else:
                planned.append(Planned(pair, "failed", _reason(failed), key, parts, opts, failed))
        elif done is not None or failed is not None:
            why = why_rerun(done or failed, parts, opts)
            planned.append(Planned(pair, "rerun", why, key, parts, opts, done or failed))
        elif _partial(out, pair):
            why = "partial output of an interrupted run"
            planned.append(Planned(pair, "rerun", why, key, parts, opts))
        else:
            planned.append(Planned(pair, "run", "", key, parts, opts))
    return planned


def _select(pairs: Sequence[Pair], only: Iterable[str] | None) -> list[Pair]:
    pairs = list(pairs)
    if not pairs:
        raise ValueError("the batch has no pairs")
    for p in pairs:
        if not isinstance(p, Pair):
            raise TypeError(f"pairs must be otreg.batch.Pair objects, got {type(p).__name__}")
    ids = [p.pair_id for p in pairs]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"pair ids appear twice: {', '.join(dup[:5])}")
    folders = [(p.folder, p.prefix) for p in pairs]
    if len(set(folders)) != len(folders):
        raise ValueError("two pairs write the same output folder and file names")
    if only is None:
        return pairs
    only = list(only)
    unknown = sorted(set(only) - set(ids))
    if unknown:
        raise ValueError(f"only: no pair has the id(s) {', '.join(unknown[:10])}")
    return [p for p in pairs if p.pair_id in set(only)]


def _partial(out: Path, pair: Pair) -> bool:
    folder = out / pair.folder
    if any(folder.glob(f"{STAGING_PREFIX}{pair.pair_id}-*")):
        return True
    return (folder / f"{pair.prefix}warped.vtk").exists()


def _reason(record: dict) -> str:
    err = record.get("error") or {}
    return f"{err.get('class', '?')}: {err.get('reason', '')}"


def describe(p: Planned) -> str:
    """One line of ``--dry-run``."""
    text = {
        "done": "done",
        "run": "will run",
        "rerun": "will rerun",
        "failed": "failed (--rerun-failed to retry)",
        "missing input": "will fail: missing input",
    }[p.state]
    return f"{p.pair.pair_id}: {text}" + (f" ({p.why})" if p.why else "")


def run_batch(
    pairs: Sequence[Pair],
    out: str | Path,
    options: Mapping | None = None,
    *,
    workers: int | None = None,
    threads: int | None = None,
    scheduler: str | None = None,
    scheduler_file: str | Path | None = None,
    timeout: float | None = None,
    memory_limit: str | float | None = "auto",
    rerun_failed: bool = False,
    only: Iterable[str] | None = None,
    progress: bool = False,
    echo: Callable[[str], None] | None = None,
    report: bool = True,
    tables: bool = True,
) -> BatchResult:
    """Register every pair not done yet, in worker processes; see the module docstring.

    Args:
        pairs: the batch (:func:`~otreg.batch.read_manifest`).
        out: the batch folder; each pair writes into ``out / pair.folder``.
        options: registration options for every pair (keys of
            :data:`~otreg.batch.manifest.ROW_OPTIONS`); a row's own options win.
        workers: local worker processes (default: one per 2 cores, at least 1; measured in
            docs/benchmarks.md).
        threads: torch threads per worker (default: cores // workers locally; on an
            existing cluster, each host's cores // its workers).
        scheduler, scheduler_file: an existing Dask scheduler's address or file.
        timeout: seconds a pair may run before it fails with class ``timeout``.
        memory_limit: per local worker (bytes, ``"4GB"``, ``"auto"``: memory / workers);
            a worker above 95% of it is restarted and its pair fails ``out of memory``.
        rerun_failed: run again the pairs that failed with the current key.
        only: pair ids to consider (the others are left as they are).
        progress: a progress bar on stderr (else one line per finished pair via ``echo``).
        echo: where lines go (default: stderr).
        report: rebuild ``index.html`` at the end.
        tables: write ``summary.csv``/``failed.csv`` (of the selected pairs); off for runs
            that share a folder with others (BIDS participant jobs, see
            :func:`tables_from_records`).

    Returns:
        :class:`BatchResult`; ``exit_code`` is 0 when every selected pair is done, 3 when
        some failed, 130 when interrupted (KeyboardInterrupt or SIGTERM).
    """
    echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
    out = Path(out)
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if scheduler and scheduler_file:
        raise ValueError("give scheduler or scheduler_file, not both")
    start = time.perf_counter()
    planned = plan_batch(pairs, out, options, rerun_failed=rerun_failed, only=only)
    out.mkdir(parents=True, exist_ok=True)
    batch_id = uuid.uuid4().hex
    records: dict[str, dict] = {}
    for p in planned:
        if p.state in ("done", "failed"):
            records[p.pair.pair_id] = p.record
        elif p.state == "missing input":
            spec = _spec(out, p, batch_id, None, None)
            records[p.pair.pair_id] = write_failure(
                spec, "missing input", "FileNotFoundError", p.why, None
            )
    todo = [p for p in planned if p.runs]
    n_done = sum(p.state == "done" for p in planned)
    echo(
        f"otreg batch: {len(planned)} pairs: {n_done} done, {len(todo)} to run, "
        f"{len(planned) - n_done - len(todo)} failed"
    )
    interrupted = False
    if todo:
        workers = workers or max(1, (os.cpu_count() or 1) // 2)
        _preflight(out, todo, workers, echo)
        try:
            with _Cluster(out, workers, threads, scheduler, scheduler_file, memory_limit) as cl:
                _dispatch(cl, out, todo, batch_id, timeout, records, progress, echo)
        except KeyboardInterrupt:
            interrupted = True
            echo("otreg batch: interrupted; the pairs not finished run on the next call")
        finally:
            for p in todo:  # staging folders of pairs killed mid-way
                for staging in (out / p.pair.folder).glob(f"{STAGING_PREFIX}{p.pair.pair_id}-*"):
                    if read_lock(out / ".locks" / f"{p.pair.pair_id}.lock") is None:
                        shutil.rmtree(staging, ignore_errors=True)
    selected = [p.pair for p in planned]
    if tables:
        write_tables(out, selected, records)
    if report:
        try:
            from .report import build_report

            build_report(out)
        except ImportError:  # pragma: no cover - report not available
            pass
    n_failed = sum(1 for p in selected if records.get(p.pair_id, {}).get("status") == "failed")
    n_ok = sum(1 for p in selected if records.get(p.pair_id, {}).get("status") == "done")
    seconds = time.perf_counter() - start
    echo(
        f"otreg batch: {n_ok} done, {n_failed} failed, {len(selected) - n_ok - n_failed} "
        f"not run, in {seconds:.0f} s; see {out / 'summary.csv'}"
        + (f" and {out / 'failed.csv'}" if n_failed else "")
    )
    if interrupted:
        code = EXIT_INTERRUPTED
    elif n_ok == len(selected):
        code = EXIT_OK
    else:
        code = EXIT_FAILED
    return BatchResult(planned, records, code, seconds)


def _spec(out: Path, p: Planned, batch_id: str, threads, timeout) -> dict:
    return {
        "out": str(out.absolute()),
        "pair": asdict(p.pair) | {"options": dict(p.pair.options)},
        "options": p.options,
        "key": p.key,
        "key_parts": p.parts,
        "threads": threads,
        "timeout": timeout,
        "batch_id": batch_id,
    }


def _preflight(out: Path, todo: list[Planned], workers: int, echo) -> None:
    """Refuse a batch whose outputs cannot fit on the disk; warn when the workers' memory
    may not fit (numbers in both)."""
    need = sum(2 * os.path.getsize(p.pair.source) / 2**20 + DISK_PER_PAIR_MB for p in todo)
    free = shutil.disk_usage(out).free / 2**20
    if need > free:
        raise OSError(
            f"{out} has {free:,.0f} MB free but the {len(todo)} pairs to run need about "
            f"{need:,.0f} MB (twice each source file + {DISK_PER_PAIR_MB:g} MB); free space "
            "or choose another folder"
        )
    if need > 0.5 * free:
        echo(f"warning: the outputs will take about {need:,.0f} MB of the {free:,.0f} MB free")
    try:
        import psutil

        total = psutil.virtual_memory().total / 2**20
    except ImportError:  # pragma: no cover
        return
    peaks = [
        r.get("peak_rss_mb")
        for r in (read_record(record_path(out, p.pair, "done")) for p in todo)
        if r and r.get("peak_rss_mb")
    ]
    per_pair = max(peaks) * 1.2 if peaks else MEMORY_PER_PAIR_MB
    if workers * per_pair > total:
        echo(
            f"warning: {workers} workers x about {per_pair:,.0f} MB a pair exceeds this "
            f"machine's {total:,.0f} MB; workers near their limit are restarted and their "
            "pairs fail 'out of memory': use fewer --workers"
        )


class _Cluster:
    """A Dask client on an embedded local cluster or an existing scheduler."""

    def __init__(self, out, workers, threads, scheduler, scheduler_file, memory_limit):
        self.out, self.workers, self.threads = out, workers, threads
        self.scheduler, self.scheduler_file = scheduler, scheduler_file
        self.memory_limit = memory_limit
        self.cluster = self.client = None

    def __enter__(self):
        for name in ("distributed", "tornado"):  # shutdown races log tracebacks: not ours
            logging.getLogger(name).setLevel(logging.CRITICAL)
        try:
            import dask
            from distributed import Client, LocalCluster
        except ImportError as err:
            raise ImportError(
                "otreg batch runs its workers on Dask: pip install 'otreg[batch]'"
            ) from err
        self.memory_limit_bytes = None
        if self.scheduler or self.scheduler_file:
            file = str(self.scheduler_file) if self.scheduler_file else None
            self.client = Client(self.scheduler, scheduler_file=file, timeout=30)
            self.threads = self.threads or _threads_on_cluster(self.client)
            return self
        cores = os.cpu_count() or 1
        self.threads = self.threads or max(1, cores // self.workers)
        env = {
            "OMP_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads),
            "OPENBLAS_NUM_THREADS": str(self.threads),
        }  # and not Dask's MALLOC_TRIM_THRESHOLD_: see worker._fast_allocator
        with dask.config.set(
            {
                "distributed.scheduler.allowed-failures": ALLOWED_FAILURES,
                # one pair a worker at a time: a worker's death then counts against the
                # pair it was running only, not against one queued behind it
                "distributed.scheduler.worker-saturation": 1.0,
                "distributed.nanny.pre-spawn-environ": env,
                "distributed.worker.memory.spill": False,
                "distributed.worker.memory.target": False,
                "distributed.worker.memory.pause": False,
                "distributed.worker.memory.terminate": 0.95,
                "distributed.admin.system-monitor.gil.enabled": False,
            }
        ):
            self.cluster = LocalCluster(
                n_workers=self.workers,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
                memory_limit=self.memory_limit,
                local_directory=str(self.out / ".dask"),
                silence_logs=logging.CRITICAL,
            )
            self.client = Client(self.cluster)
        info = self.client.scheduler_info()["workers"]
        limits = [w.get("memory_limit") for w in info.values() if w.get("memory_limit")]
        self.memory_limit_bytes = min(limits) if limits else None
        return self

    def __exit__(self, *exc):
        try:
            if self.client is not None:
                self.client.close(timeout=10)
        finally:
            if self.cluster is not None:
                self.cluster.close(timeout=20)
            shutil.rmtree(self.out / ".dask", ignore_errors=True)
        return False


def _threads_on_cluster(client) -> int:
    """Torch threads per task on an existing cluster: the fewest cores a worker has per
    worker process of its host (Dask's nanny sets OMP_NUM_THREADS=1, which torch follows)."""
    import socket

    hosts = client.run(lambda: (socket.gethostname(), os.cpu_count() or 1))
    per_host: dict[str, list[int]] = {}
    for host, cores in hosts.values():
        per_host.setdefault(host, []).append(cores)
    return max(1, min(cores[0] // len(cores) for cores in per_host.values()))


def _dispatch(cl: _Cluster, out, todo, batch_id, timeout, records, progress, echo) -> None:
    from distributed import as_completed
    from distributed.scheduler import KilledWorker

    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_DFL, None):  # a scheduler's kill: stop as for Ctrl-C
        signal.signal(signal.SIGTERM, _raise_interrupt)
    client = cl.client
    by_key, specs, futures = {}, {}, []
    innocent: dict[str, int] = {}  # resubmissions of pairs killed before they started

    def submit(p: Planned, spec: dict):
        fut = client.submit(run_pair, spec, key=f"otreg-{p.pair.pair_id}-{uuid.uuid4().hex[:8]}")
        by_key[fut.key], specs[fut.key] = p, spec
        futures.append(fut)  # a future nobody holds is cancelled
        return fut

    for p in todo:
        submit(p, _spec(out, p, batch_id, cl.threads, timeout))
    bar = _bar(len(todo)) if progress else None
    finished, failed, t0 = 0, 0, time.perf_counter()
    pending = as_completed(list(futures))
    try:
        for fut in pending:
            p, spec = by_key[fut.key], specs[fut.key]
            try:
                rec = fut.result()
            except KilledWorker:
                lock = out / ".locks" / f"{p.pair.pair_id}.lock"
                if not lock.exists() and innocent.get(fut.key, 0) < ALLOWED_FAILURES:
                    # queued on workers that died of other pairs: it never started
                    again = submit(p, spec)
                    innocent[again.key] = innocent.get(fut.key, 0) + 1
                    pending.add(again)
                    continue
                rec = _killed(cl, out, spec)
            except Exception as err:  # the task itself failed outside run_pair's guard
                name = type(err).__name__
                rec = write_failure(spec, "error", name, f"{name}: {err}", None)
            if rec.get("status") == "locked":  # another process runs it: ask again later
                time.sleep(min(HEARTBEAT, 2.0))
                pending.add(submit(p, spec))
                continue
            records[p.pair.pair_id] = rec
            finished += 1
            failed += rec.get("status") != "done"
            if bar is not None:
                bar.update(1)
                bar.set_postfix(failed=failed)
            else:
                echo(_line(finished, len(todo), rec, time.perf_counter() - t0))
    finally:
        if bar is not None:
            bar.close()
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="pairs", unit="pair", smoothing=0)


def _line(k: int, n: int, rec: dict, elapsed: float) -> str:
    eta = elapsed / k * (n - k)
    head = f"[{k}/{n}] {rec['pair_id']}: "
    if rec.get("status") == "done":
        m = rec.get("metrics", {})
        body = (
            f"done in {rec.get('seconds', 0):.1f} s, mean surface distance "
            f"{m.get('before_mean_mm', math.nan):.2f} -> {m.get('mean_mm', math.nan):.2f} mm"
        )
    else:
        body = f"FAILED ({_reason(rec)})"
    return head + body + (f"; about {_duration(eta)} left" if k < n else "")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _killed(cl: _Cluster, out: Path, spec: dict) -> dict:
    """The record of a pair whose worker died ALLOWED_FAILURES + 1 times: out of memory
    when the last heartbeat was near the worker's memory limit, a crash otherwise."""
    pid = spec["pair"]["pair_id"]
    lock_path = out / ".locks" / f"{pid}.lock"
    lock = read_lock(lock_path)
    rss = (lock or {}).get("rss_mb")
    limit = cl.memory_limit_bytes
    oom = rss is not None and limit and rss * 2**20 > 0.7 * limit
    lock_path.unlink(missing_ok=True)
    cls = "out of memory" if oom else "crash"
    reason = f"the worker process died {ALLOWED_FAILURES + 1} times running this pair" + (
        f" (last reading {rss:,.0f} MB of a {limit / 2**20:,.0f} MB limit)"
        if oom
        else " (a crash or a kill; see the Dask worker's log)"
    )
    return write_failure(spec, cls, "KilledWorker", reason, None, peak_rss_mb=rss)


def write_tables(out: Path, pairs: Sequence[Pair], records: Mapping[str, dict]) -> None:
    """``summary.csv`` (one row a pair) and ``failed.csv`` (the failed ones), atomically."""
    from ..io import atomic_write

    columns = [
        "pair_id",
        "status",
        "class",
        "reason",
        "seconds",
        "peak_rss_mb",
        "host",
        "threads",
        *SUMMARY_METRICS,
        "folder",
    ]
    rows, failed = [], []
    for pair in pairs:
        rec = records.get(pair.pair_id) or {}
        err = rec.get("error") or {}
        row = {
            "pair_id": pair.pair_id,
            "status": rec.get("status", "not run"),
            "class": err.get("class", ""),
            "reason": err.get("reason", ""),
            "seconds": _num(rec.get("seconds")),
            "peak_rss_mb": _num(rec.get("peak_rss_mb")),
            "host": rec.get("host", ""),
            "threads": rec.get("threads", ""),
            "folder": pair.folder,
        }
        for m in SUMMARY_METRICS:
            row[m] = _num((rec.get("metrics") or {}).get(m))
        rows.append(row)
        if rec.get("status") == "failed":
            failed.append(
                {
                    "pair_id": pair.pair_id,
                    "class": err.get("class", ""),
                    "type": err.get("type", ""),
                    "reason": err.get("reason", ""),
                    "folder": pair.folder,
                }
            )
    for name, cols, data in (
        ("summary.csv", columns, rows),
        ("failed.csv", ["pair_id", "class", "type", "reason", "folder"], failed),
    ):
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
        writer.writeheader()
        writer.writerows(data)
        text = buf.getvalue()
        if name == "failed.csv" and not failed:
            (out / name).unlink(missing_ok=True)
            continue
        atomic_write(out / name, lambda tmp, text=text: tmp.write_text(text))


def tables_from_records(out: str | Path) -> int:
    """``summary.csv`` and ``failed.csv`` from every record in a folder (several runs'
    pairs, e.g. one BIDS participant job a subject); returns the number of pairs."""
    from .records import find_records

    out = Path(out)
    records: dict[str, dict] = {}
    folders: dict[str, Path] = {}
    for path, doc in find_records(out):
        old = records.get(doc["pair_id"])
        if old is None or str(doc.get("finished", "")) > str(old.get("finished", "")):
            records[doc["pair_id"]] = doc
            folders[doc["pair_id"]] = path.parent.relative_to(out)
    pairs = [
        Pair(pid, doc.get("source") or "?", doc.get("target") or "?", folder=str(folders[pid]))
        for pid, doc in records.items()
    ]
    write_tables(out, pairs, records)
    return len(pairs)


def _num(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return str(value)


# names used by the command line
__all__ += ["describe", "write_tables", "DONE_NAME", "FAILED_NAME"]
