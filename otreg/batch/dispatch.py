"""The workers of a batch on Dask: an embedded local cluster on 127.0.0.1 or an existing
scheduler (:class:`Cluster`), and :func:`dispatch`, which submits the pairs and collects
their records. A worker that dies is restarted by its nanny and its pair rescheduled; a pair
that kills :data:`ALLOWED_FAILURES` + 1 workers is recorded failed (``crash``, or ``out of
memory`` when its last heartbeat was near the worker's memory limit)."""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import time
import uuid

from .locks import HEARTBEAT, lock_path, read_lock
from .records import failure_reason
from .worker import run_pair, write_failure

__all__: list[str] = []

#: Worker deaths a pair may cause before it is recorded failed (Dask's allowed-failures).
ALLOWED_FAILURES = 2


class Cluster:
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


def dispatch(cl: Cluster, specs: list[dict], records: dict, progress: bool, echo) -> None:
    """Run the pairs' specs on the cluster; each final record goes into ``records`` (by
    pair id) as it comes, with a progress bar or a line a pair."""
    from distributed import as_completed
    from distributed.scheduler import KilledWorker

    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_DFL, None):  # a scheduler's kill: stop as for Ctrl-C
        signal.signal(signal.SIGTERM, _raise_interrupt)
    client = cl.client
    by_key, futures = {}, []
    innocent: dict[str, int] = {}  # resubmissions of pairs killed before they started

    def submit(spec: dict):
        pid = spec["pair"]["pair_id"]
        fut = client.submit(run_pair, spec, key=f"otreg-{pid}-{uuid.uuid4().hex[:8]}")
        by_key[fut.key] = spec
        futures.append(fut)  # a future nobody holds is cancelled
        return fut

    for spec in specs:
        submit(spec)
    bar = _bar(len(specs)) if progress else None
    finished, failed, t0 = 0, 0, time.perf_counter()
    pending = as_completed(list(futures))
    try:
        for fut in pending:
            spec = by_key[fut.key]
            pid = spec["pair"]["pair_id"]
            try:
                rec = fut.result()
            except KilledWorker:
                lock = lock_path(cl.out, pid)
                if not lock.exists() and innocent.get(fut.key, 0) < ALLOWED_FAILURES:
                    # queued on workers that died of other pairs: it never started
                    again = submit(spec)
                    innocent[again.key] = innocent.get(fut.key, 0) + 1
                    pending.add(again)
                    continue
                rec = _killed(cl, spec)
            except Exception as err:  # the task itself failed outside run_pair's guard
                name = type(err).__name__
                rec = write_failure(spec, "error", name, f"{name}: {err}", None)
            if rec.get("status") == "locked":  # another process runs it: ask again later
                time.sleep(min(HEARTBEAT, 2.0))
                pending.add(submit(spec))
                continue
            records[pid] = rec
            finished += 1
            failed += rec.get("status") != "done"
            if bar is not None:
                bar.update(1)
                bar.set_postfix(failed=failed)
            else:
                echo(_line(finished, len(specs), rec, time.perf_counter() - t0))
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
        body = f"FAILED ({failure_reason(rec)})"
    return head + body + (f"; about {_duration(eta)} left" if k < n else "")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _killed(cl: Cluster, spec: dict) -> dict:
    """The record of a pair whose worker died ALLOWED_FAILURES + 1 times: out of memory
    when the last heartbeat was near the worker's memory limit, a crash otherwise."""
    path = lock_path(cl.out, spec["pair"]["pair_id"])
    lock = read_lock(path)
    rss = (lock or {}).get("rss_mb")
    limit = cl.memory_limit_bytes
    oom = rss is not None and limit and rss * 2**20 > 0.7 * limit
    path.unlink(missing_ok=True)
    cls = "out of memory" if oom else "crash"
    reason = f"the worker process died {ALLOWED_FAILURES + 1} times running this pair" + (
        f" (last reading {rss:,.0f} MB of a {limit / 2**20:,.0f} MB limit)"
        if oom
        else " (a crash or a kill; see the Dask worker's log)"
    )
    return write_failure(spec, cls, "KilledWorker", reason, None, peak_rss_mb=rss)
