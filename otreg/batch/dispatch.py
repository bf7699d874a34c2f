"""The workers of a batch on Dask: an embedded local cluster on 127.0.0.1 or an existing
scheduler (:class:`Cluster`), and :func:`dispatch`, which submits the pairs and collects
their records. A worker that dies is restarted by its nanny and its pair rescheduled; a pair
that kills :data:`ALLOWED_FAILURES` + 1 workers is recorded failed (``crash``, or ``out of
memory`` when its last heartbeat was near the worker's memory limit)."""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator

from .._info import usable_cores
from .locks import HEARTBEAT, lock_path, read_lock
from .records import failure_reason
from .worker import run_pair, write_failure

__all__: list[str] = []

#: Worker deaths a pair may cause before it is recorded failed (Dask's allowed-failures).
ALLOWED_FAILURES = 2
#: Seconds between the dispatcher's looks at the cluster while no pair finishes.
WATCH_SECONDS = 5.0
#: With no worker alive this long, the pairs not finished fail ``no worker`` and the batch
#: ends: a local cluster's (its workers die as they start: too little memory, a broken
#: environment), and an existing cluster's, which may wait for queued jobs far longer.
NO_WORKER_SECONDS = {"local": 120.0, "existing": 3600.0}
#: With no worker alive this long, a local cluster starts its workers afresh, once an outage:
#: a nanny whose worker fails to restart (its start timed out on a loaded machine) keeps no
#: worker and is not restarted by Dask.
REPLACE_SECONDS = 30.0


class Cluster:
    """A Dask client on an embedded local cluster or an existing scheduler."""

    def __init__(self, out, workers, threads, scheduler, scheduler_file, memory_limit, echo):
        self.out, self.workers, self.threads, self.echo = out, workers, threads, echo
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
            try:
                self.client = Client(self.scheduler, scheduler_file=file, timeout=30)
            except (OSError, TimeoutError, ValueError) as err:
                given = ("scheduler", self.scheduler)
                if not self.scheduler:
                    given = ("scheduler_file", file)
                raise OSError(
                    f"the Dask scheduler given as {given[0]} (--{given[0].replace('_', '-')}) "
                    f"{given[1]} cannot be reached: {err}"
                ) from err
            if not self.client.scheduler_info()["workers"]:  # e.g. their jobs are queued
                self.echo("otreg batch: the scheduler has no worker yet; waiting for one")
                wait = NO_WORKER_SECONDS["existing"]
                try:
                    self.client.wait_for_workers(1, timeout=wait)
                except (TimeoutError, OSError) as err:
                    self.client.close()
                    raise OSError(
                        f"no worker joined the scheduler {self.scheduler or file} within "
                        f"{wait:.0f} s: start workers (dask worker ADDRESS) or check the "
                        "job queue"
                    ) from err
            self.threads = self.threads or _threads_on_cluster(self.client)
            return self
        self.threads = self.threads or max(1, usable_cores() // self.workers)
        env = {
            "OMP_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads),
            "OPENBLAS_NUM_THREADS": str(self.threads),
        }  # and not Dask's MALLOC_TRIM_THRESHOLD_: see worker._fast_allocator
        self.config = {
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
            # the scheduler's scratch space (its locks) in the batch folder too, not in
            # /tmp/dask-scratch-space
            "temporary-directory": str(self.out / ".dask"),
        }
        with dask.config.set(self.config):
            # the workers leave Ctrl-C to this process, which closes them: each printed a
            # traceback of its own (about 30 lines a worker)
            interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                self.cluster = LocalCluster(
                    n_workers=self.workers,
                    threads_per_worker=1,
                    processes=True,
                    host="127.0.0.1",
                    dashboard_address="127.0.0.1:0",  # a free port: no clash with another batch
                    memory_limit=self.memory_limit,
                    local_directory=str(self.out / ".dask"),
                    silence_logs=logging.CRITICAL,
                )
            except (RuntimeError, OSError, TimeoutError) as err:
                shutil.rmtree(self.out / ".dask", ignore_errors=True)
                raise OSError(
                    f"the local Dask cluster could not start its {self.workers} worker "
                    f"process(es) ({type(err).__name__}: {err}); with memory limit "
                    f"{self.memory_limit}, a worker may be killed as it starts: raise "
                    "--memory-limit or use fewer --workers"
                ) from err
            finally:
                signal.signal(signal.SIGINT, interrupt)
            self.client = Client(self.cluster)
        info = self.client.scheduler_info()["workers"]
        limits = [w.get("memory_limit") for w in info.values() if w.get("memory_limit")]
        self.memory_limit_bytes = min(limits) if limits else None
        return self

    def replace_workers(self, timeout: float) -> bool:
        """Close the local cluster's workers and start as many afresh; True when one joined
        within ``timeout`` seconds. A nanny whose worker failed to restart keeps no worker
        (its start timed out on a loaded machine) and Dask does not restart it."""
        import dask

        deadline = time.monotonic() + timeout
        self.cluster.scale(0)
        while self.cluster.workers and time.monotonic() < deadline:  # the new take their names
            time.sleep(0.2)
        with dask.config.set(self.config):  # the new nannies read it as they start
            self.cluster.scale(self.workers)
            try:
                self.client.wait_for_workers(1, timeout=max(deadline - time.monotonic(), 1.0))
            except (TimeoutError, OSError):
                return False
        return True

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
    """Torch threads per task on an existing cluster: the fewest cores a worker may use
    (:func:`usable_cores`, on the worker) per worker process of its host (Dask's nanny sets
    OMP_NUM_THREADS=1, which torch follows)."""
    import socket

    hosts = client.run(lambda: (socket.gethostname(), usable_cores()))
    per_host: dict[str, list[int]] = {}
    for host, cores in hosts.values():
        per_host.setdefault(host, []).append(cores)
    return max(1, min(cores[0] // len(cores) for cores in per_host.values()))


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While active, SIGTERM (a scheduler's or a user's kill) raises KeyboardInterrupt, so
    that the work stops and cleans up as for Ctrl-C; only in the main thread, and where
    SIGTERM had its default action (a handler someone set is kept)."""
    main = threading.current_thread() is threading.main_thread()
    active = main and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
    if active:
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        if active:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def dispatch(cl: Cluster, specs: list[dict], records: dict, progress: bool, echo) -> None:
    """Run the pairs' specs on the cluster; each final record goes into ``records`` (by
    pair id) as it comes, with a progress bar or a line a pair; SIGTERM stops it as Ctrl-C
    does."""
    with sigterm_as_interrupt():
        _dispatch(cl, specs, records, progress, echo)


def _dispatch(cl: Cluster, specs: list[dict], records: dict, progress: bool, echo) -> None:
    from distributed import wait
    from distributed.scheduler import KilledWorker

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
    not_done = set(futures)
    watch = _Watch(cl, echo)
    try:
        while not_done:
            try:
                done, not_done = wait(
                    not_done, timeout=WATCH_SECONDS, return_when="FIRST_COMPLETED"
                )
            except TimeoutError:  # nothing finished in WATCH_SECONDS: is anyone working?
                done = set()
            if not done:
                if watch.no_worker_for_too_long():
                    for fut in not_done:
                        spec = by_key[fut.key]
                        records[spec["pair"]["pair_id"]] = write_failure(
                            spec, "no worker", "NoWorker", watch.reason(), None
                        )
                        fut.cancel()
                    return
                continue
            watch.progress()
            for fut in done:
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
                        not_done.add(again)
                        continue
                    rec = _killed(cl, spec)
                except Exception as err:  # the task itself failed outside run_pair's guard
                    name = type(err).__name__
                    rec = write_failure(spec, "error", name, f"{name}: {err}", None)
                if rec.get("status") == "locked":  # another process runs it: ask again later
                    time.sleep(min(HEARTBEAT, 2.0))
                    not_done.add(submit(spec))
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


class _Watch:
    """Whether a batch waits on nothing: no worker alive for
    :data:`NO_WORKER_SECONDS` while pairs wait (a line on the way, on an existing cluster)."""

    def __init__(self, cl: Cluster, echo) -> None:
        self.cl, self.echo = cl, echo
        self.kind = "local" if cl.cluster is not None else "existing"
        self.alone_since: float | None = None
        self.told = 0.0
        self.replaced = False  # the workers were started afresh in this outage

    def progress(self) -> None:
        self.alone_since = None

    def no_worker_for_too_long(self) -> bool:
        try:
            alive = len(self.cl.client.scheduler_info()["workers"])
        except Exception:  # the scheduler itself is gone
            alive = 0
        now = time.monotonic()
        if alive:
            self.alone_since, self.replaced = None, False
            return False
        self.alone_since = self.alone_since or now
        waited = now - self.alone_since
        if self.kind == "local" and not self.replaced and waited > REPLACE_SECONDS:
            self.replaced = True
            left = NO_WORKER_SECONDS["local"] - waited
            if self.cl.replace_workers(timeout=max(left, 1.0)):
                self.alone_since = None
                return False
            waited = time.monotonic() - self.alone_since
        if self.kind == "existing" and now - self.told > 300:
            self.told = now
            self.echo(f"otreg batch: no worker alive for {waited:.0f} s; waiting for one to join")
        return waited > NO_WORKER_SECONDS[self.kind]

    def reason(self) -> str:
        limit = self.cl.memory_limit_bytes
        size = "" if limit is None else f" ({limit / 1e6:,.0f} MB)"
        hint = (
            f"each worker was killed as it started or ran: its memory limit{size} may be "
            "too small, or its environment broken (see the Dask worker's log)"
            if self.kind == "local"
            else "start workers for the scheduler (dask worker ADDRESS) or check the job queue"
        )
        return (
            f"no worker process was alive for {NO_WORKER_SECONDS[self.kind]:.0f} s while "
            f"this pair waited; {hint}"
        )


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
        f" (last reading {rss * 2**20 / 1e6:,.0f} MB of a {limit / 1e6:,.0f} MB limit)"
        if oom
        else " (a crash or a kill; see the Dask worker's log)"
    )
    return write_failure(spec, cls, "KilledWorker", reason, None, peak_rss_mb=rss)
