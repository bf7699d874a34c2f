"""Run a batch: plan (resume keys), preflight, dispatch to worker processes on Dask,
collect the records, write ``summary.csv`` and ``failed.csv``.

Workers are Dask worker processes: by default an embedded local cluster on 127.0.0.1
(``workers`` processes of ``threads`` torch threads each), or an existing cluster
(``scheduler``/``scheduler_file``). A pair's exception fails that pair only (its record says
why); a worker that dies (a crash, an out-of-memory kill) is restarted by its nanny and its
pair rescheduled, and a pair that kills ``dispatch.ALLOWED_FAILURES`` + 1 workers is recorded
failed while the batch goes on.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .._checks import check_device
from .._info import usable_cores
from ..loops.budget import parse_bytes
from ..registration.result import OUTPUTS
from .dispatch import Cluster, dispatch
from .keys import effective_options, file_digest, pair_key, why_rerun
from .locks import is_stale, lock_path, read_lock
from .manifest import Pair
from .records import failure_reason, find_records, read_plan, read_record, write_plan
from .report import build_report
from .tables import write_tables
from .worker import STAGING_PREFIX, record_path, write_failure

__all__ = ["run_batch", "plan_batch", "BatchResult", "Planned"]

EXIT_OK, EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 3, 130
#: Peak memory assumed for a pair (MB) until records of this batch measured one.
MEMORY_PER_PAIR_MB = 1500.0
#: Disk a pair's outputs take besides a copy of its source file (MB; pictures, JSON, log).
DISK_PER_PAIR_MB = 2.0
#: The least memory limit of a local worker, in MB of 10^6 bytes as a limit is written
#: ("600MB", dask's units): a worker holds about 300 MB before its first pair (Python,
#: torch, otreg, Dask), and the smallest pairs peak near 550 MiB, 577 MB
#: (docs/benchmarks.md); below it every worker is killed as it starts, or with its pair.
WORKER_MEMORY_MIN_MB = 600


def check_memory_limit(memory_limit: object) -> str | int:
    """A local worker's memory limit: ``"auto"``, bytes (int) or a size with its unit
    (``"4GB"``); a bare number in a string is refused (4 would be 4 bytes, or meant 4 GB),
    and so is a limit below :data:`WORKER_MEMORY_MIN_MB`."""
    if memory_limit == "auto" or memory_limit is None:
        return memory_limit
    if isinstance(memory_limit, float) and memory_limit.is_integer():
        memory_limit = int(memory_limit)
    if isinstance(memory_limit, str) and memory_limit.strip().replace(".", "", 1).isdigit():
        raise ValueError(
            f"memory_limit is {memory_limit!r} without a unit; give one, e.g. "
            f"'{memory_limit.strip()}GB' or '{memory_limit.strip()}MB'"
        )
    limit = parse_bytes("memory_limit", memory_limit)
    if limit < WORKER_MEMORY_MIN_MB * 10**6:  # MB as the user writes them (dask's)
        raise ValueError(
            f"memory_limit is {memory_limit!r} ({limit / 1e6:,.0f} MB); a worker holds "
            "about 300 MB before its first pair and the smallest pairs need about 550 MB "
            f"(more with pictures): give at least {WORKER_MEMORY_MIN_MB}MB (1.5GB suits "
            "hemispheres), or auto"
        )
    return memory_limit


@dataclass
class Planned:
    """A pair and what this run does with it.

    ``state``: ``"done"`` (record with the current key), ``"run"`` (no record),
    ``"rerun"`` (``why`` says what changed, or that its output was partial),
    ``"failed"`` (failed before with the current key; rerun with ``rerun_failed``) or
    ``"missing input"``.

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.batch import Pair, plan_batch
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (d / "a.vtk").write_text("a"), (d / "b.vtk").write_text("b")
        >>> (p,) = plan_batch([Pair("a_to_b", str(d / "a.vtk"), str(d / "b.vtk"))], d / "out")
        >>> p.state, p.runs
        ('run', True)
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
        """Whether this run registers the pair (``"run"`` or ``"rerun"``)."""
        return self.state in ("run", "rerun")


@dataclass
class BatchResult:
    """What :func:`run_batch` did: the plan, the final records by pair id, the exit code.

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.batch import Pair, run_batch
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> res = run_batch([Pair("p", str(d / "gone.vtk"), str(d / "t.vtk"))], d / "out",
        ...                 echo=lambda line: None)
        >>> res.exit_code, res.failed
        (3, ['p'])
    """

    planned: list[Planned]
    records: dict[str, dict]
    exit_code: int
    seconds: float = 0.0

    @property
    def failed(self) -> list[str]:
        """The ids of the pairs not done."""
        return [pid for pid, r in self.records.items() if r.get("status") != "done"]


def plan_batch(
    pairs: Sequence[Pair],
    out: str | Path,
    options: Mapping | None = None,
    *,
    rerun_failed: bool = False,
    only: Iterable[str] | None = None,
) -> list[Planned]:
    """Decide, per pair, whether it is done, runs, reruns (and why) or stays failed: what
    ``otreg batch --dry-run`` prints (see :class:`Planned` for an example).

    Args:
        pairs: the batch.
        out: the batch folder (its records say what is done).
        options: registration options for every pair (a row's own options win).
        rerun_failed: plan the pairs that failed with the current key as reruns.
        only: pair ids to consider.

    Returns:
        A :class:`Planned` per selected pair, in order.

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.batch import Pair, plan_batch
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> [p.state for p in plan_batch([Pair("p", str(d / "x.vtk"), str(d / "y.vtk"))], d)]
        ['missing input']
    """
    out = Path(out)
    pairs = _select(pairs, only)
    digests: dict[str, str] = {}
    planned = []
    for pair in pairs:
        opts = effective_options(options, pair)
        pair_files = (pair.source, pair.target, *pair.source_values, *pair.target_values)
        try:
            d = [digests.get(f) or digests.setdefault(f, file_digest(f)) for f in pair_files]
        except FileNotFoundError as err:
            planned.append(Planned(pair, "missing input", str(err), options=opts))
            continue
        n = len(pair.source_values)
        values = {"source": d[2 : 2 + n], "target": d[2 + n :]}
        key, parts = pair_key(d[0], d[1], opts, values)
        done = read_record(record_path(out, pair, "done"))
        failed = read_record(record_path(out, pair, "failed"))
        if done is not None and done.get("key") == key:
            planned.append(Planned(pair, "done", "", key, parts, opts, done))
        elif failed is not None and failed.get("key") == key:
            if rerun_failed:
                why = f"failed before ({failed['error']['class']}); --rerun-failed"
                planned.append(Planned(pair, "rerun", why, key, parts, opts, failed))
            else:
                why = failure_reason(failed)
                planned.append(Planned(pair, "failed", why, key, parts, opts, failed))
        elif done is not None or failed is not None:
            why = why_rerun(done or failed, parts, opts)
            planned.append(Planned(pair, "rerun", why, key, parts, opts, done or failed))
        elif (running := _running(out, pair)) is not None:
            planned.append(Planned(pair, "run", running, key, parts, opts))
        elif _partial(out, pair):
            why = "partial output of an interrupted run"
            planned.append(Planned(pair, "rerun", why, key, parts, opts))
        else:
            planned.append(Planned(pair, "run", "", key, parts, opts))
    return planned


def _running(out: Path, pair: Pair) -> str | None:
    """Why a pair that a live process holds (its lock: an earlier run's worker on a
    cluster, another batch into this folder) is not run from scratch, or None: this run
    waits for that one's result."""
    doc = read_lock(lock_path(out, pair.pair_id))
    if doc is None or is_stale(doc):
        return None
    return (
        f"running now (locked by host {doc.get('host', '?')}, pid {doc.get('pid', '?')}): "
        "this run waits for its result"
    )


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
    return (folder / f"{pair.prefix}{OUTPUTS['warped']}").exists()


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
    device: str | None = None,
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
            :class:`~otreg.batch.job.JobOptions`); a row's own options win.
        workers: local worker processes (default: one per 2 cores, at least 1; measured in
            docs/benchmarks.md).
        threads: torch threads per worker (default: cores // workers locally; on an
            existing cluster, each host's cores // its workers).
        scheduler: an existing Dask scheduler's address (``tcp://host:8786``).
        scheduler_file: or its scheduler file (``dask scheduler --scheduler-file F``).
        timeout: seconds a pair may run before it fails with class ``timeout``.
        memory_limit: per local worker (bytes, ``"4GB"``, ``"auto"``: memory / workers);
            a worker above 95% of it is restarted and its pair fails ``out of memory``.
        device: where each pair is registered: None (the CPU), ``"cuda"`` (with several
            GPUs, worker k uses GPU k modulo their number) or ``"cuda:N"``. Checked here
            for local workers; on an existing cluster, by each worker. Not part of the
            resume key: it changes where a pair runs, not what it computes.
        rerun_failed: run again the pairs that failed with the current key.
        only: pair ids to consider (the others are left as they are).
        progress: a progress bar on stderr (else one line per finished pair via ``echo``).
        echo: where lines go (default: stderr).
        report: rebuild ``index.html`` at the end.
        tables: write ``summary.csv``/``failed.csv`` (of the selected pairs); off for runs
            that share a folder with others (BIDS participant jobs, see
            :func:`otreg.batch.tables.tables_from_records`).

    Returns:
        :class:`BatchResult`; ``exit_code`` is 0 when every selected pair is done, 3 when
        some failed, 130 when interrupted (KeyboardInterrupt or SIGTERM).

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.batch import Pair, run_batch
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> res = run_batch([Pair("p", str(d / "gone.vtk"), str(d / "t.vtk"))], d / "out",
        ...                 echo=lambda line: None)   # a missing input fails alone, no worker
        >>> res.records["p"]["error"]["class"]
        'missing input'
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
    memory_limit = check_memory_limit(memory_limit)
    if device is not None and not (scheduler or scheduler_file):
        check_device("run_batch", device)  # the local workers see what this process sees
    start = time.perf_counter()
    planned = plan_batch(pairs, out, options, rerun_failed=rerun_failed, only=only)
    out.mkdir(parents=True, exist_ok=True)
    if tables:  # the group page then shows older records of these pairs as "not run"
        keys = read_plan(out) if only is not None else None  # the others' stay
        keys = {**(keys or {}), **{p.pair.pair_id: p.key for p in planned}}
        write_plan(out, keys)
        foreign = sorted({str(rec["pair_id"]) for _, rec in find_records(out)} - set(keys))
        if foreign:
            shown = ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "")
            echo(
                f"note: {out} holds the records of {len(foreign)} pair(s) not in this batch "
                f"({shown}), from an earlier batch: summary.csv and the group page leave "
                "them out (a new batch of other pairs is clearer in a folder of its own)"
            )
    batch_id = uuid.uuid4().hex
    records: dict[str, dict] = {}
    for p in planned:
        if p.state in ("done", "failed"):
            records[p.pair.pair_id] = p.record
        elif p.state == "missing input":
            spec = pair_spec(out, p, batch_id)
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
        workers = workers or max(1, usable_cores() // 2)
        local = memory_limit if not (scheduler or scheduler_file) else None
        _preflight(out, todo, workers, echo, local)
        try:
            cluster = Cluster(out, workers, threads, scheduler, scheduler_file, memory_limit, echo)
            with cluster as cl:
                specs = [pair_spec(out, p, batch_id, cl.threads, timeout, device) for p in todo]
                dispatch(cl, specs, records, progress, echo)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            _sweep_leftovers(out, [p.pair for p in planned])
    _collect_finished(out, todo, records)  # pairs that ended while an interrupt came
    selected = [p.pair for p in planned]
    n_flagged = _write_batch_tables(out, pairs, only, records) if tables else 0
    if report:
        build_report(out)
    n_failed = sum(1 for p in selected if records.get(p.pair_id, {}).get("status") == "failed")
    n_ok = sum(1 for p in selected if records.get(p.pair_id, {}).get("status") == "done")
    seconds = time.perf_counter() - start
    flagged = f" ({n_flagged} flagged: see the flags column)" if n_flagged else ""
    where = (
        f"see {out / 'summary.csv'}" + (f" and {out / 'failed.csv'}" if n_failed else "")
        if tables
        else "the tables of every run come with the group level"
    )
    n_left = len(selected) - n_ok - n_failed
    if interrupted:  # said once the records are read: the last pair may have finished
        left = [p.pair for p in todo if p.pair.pair_id not in records]
        running = sum(_running(out, pair) is not None for pair in left)
        rest = f"the {n_left - running} pair(s) not finished run on the next call"
        if running:  # on an existing cluster: Dask cannot stop a task once it started
            rest = (
                f"{running} pair(s) still run on the cluster's workers (a started task "
                "cannot be stopped): they write their results, which the next run takes as "
                "done" + (f"; {rest}" if n_left > running else "")
            )
        elif not n_left:
            rest = "every pair had finished: nothing is left to run"
        echo(f"otreg batch: interrupted; {rest}")
    others = len(pairs) - len(selected)
    left_out = f" ({others} more in the manifest, not asked for)" if others else ""
    echo(
        f"otreg batch: {n_ok} done{flagged}, {n_failed} failed, "
        f"{n_left} not run{left_out}, in {seconds:.0f} s; {where}"
    )
    if interrupted:
        code = EXIT_INTERRUPTED
    elif n_ok == len(selected):
        code = EXIT_OK
    else:
        code = EXIT_FAILED
    return BatchResult(planned, records, code, seconds)


def _write_batch_tables(out: Path, pairs, only, records: dict) -> int:
    """``summary.csv`` and ``failed.csv`` of the whole batch: with ``only``, the other
    pairs' rows come from their records on disk of the key the batch's plan holds for them
    (a row each, 'not run' without one; their inputs are not hashed again), so that a
    partial run does not drop them. Returns the number of flagged pairs."""
    pairs = list(pairs)
    if only is None:
        return write_tables(out, pairs, records)
    keys = read_plan(out) or {}
    kept = {}
    for pair in pairs:
        for status in ("done", "failed"):
            rec = read_record(record_path(out, pair, status))
            if rec is not None and keys.get(pair.pair_id) == rec.get("key"):
                kept[pair.pair_id] = rec
                break
    return write_tables(out, pairs, {**kept, **records})


def _collect_finished(out: Path, todo: list[Planned], records: dict) -> None:
    """Records on disk, of this run's key, of pairs the dispatcher did not collect (an
    interrupt came between a pair's end and its collection): the counts and tables then say
    what is on disk."""
    for p in todo:
        if p.pair.pair_id not in records:
            for status in ("done", "failed"):
                rec = read_record(record_path(out, p.pair, status))
                if rec is not None and rec.get("key") == p.key:
                    records[p.pair.pair_id] = rec
                    break


def _sweep_leftovers(out: Path, pairs: Iterable[Pair]) -> None:
    """Remove what killed processes left: the staging folders of pairs that no live process
    holds (no lock, or a stale one), and their stale locks. A worker orphaned by a killed
    batch can finish or die after the next run planned its pair; this catches its remains."""
    for pair in pairs:
        lock = lock_path(out, pair.pair_id)
        doc = read_lock(lock)
        if doc is not None and not is_stale(doc):
            continue  # a live process is working on it
        for staging in (out / pair.folder).glob(f"{STAGING_PREFIX}{pair.pair_id}-*"):
            shutil.rmtree(staging, ignore_errors=True)
        if doc is not None:
            lock.unlink(missing_ok=True)


def pair_spec(
    out: Path, p: Planned, batch_id: str, threads=None, timeout=None, device=None
) -> dict:
    """What a worker needs to run a planned pair (:func:`~otreg.batch.worker.run_pair`)."""
    return {
        "out": str(out.absolute()),
        "pair": asdict(p.pair) | {"options": dict(p.pair.options)},
        "options": p.options,
        "key": p.key,
        "key_parts": p.parts,
        "threads": threads,
        "timeout": timeout,
        "device": None if device is None else str(device),
        "batch_id": batch_id,
    }


def _preflight(
    out: Path, todo: list[Planned], workers: int, echo, memory_limit: str | int | None = None
) -> None:
    """Refuse a batch whose outputs cannot fit on the disk; warn when the workers' memory
    may not fit, or their ``memory_limit`` (a local cluster's, given) all together exceeds
    the machine's (numbers in each)."""
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
        p.record["peak_rss_mb"]
        for p in todo
        if p.record and p.record.get("status") == "done" and p.record.get("peak_rss_mb")
    ]
    per_pair = max(peaks) * 1.2 if peaks else MEMORY_PER_PAIR_MB
    if memory_limit not in (None, "auto"):
        limit = parse_bytes("memory_limit", memory_limit) / 2**20
        if workers * limit > total:
            echo(
                f"warning: {workers} workers x a memory limit of {limit:,.0f} MB exceeds this "
                f"machine's {total:,.0f} MB: the limit cannot hold, and the system may kill "
                "workers before it does; give a smaller --memory-limit, or leave it out"
            )
    if workers * per_pair > total:
        echo(
            f"warning: {workers} workers x about {per_pair:,.0f} MB a pair exceeds this "
            f"machine's {total:,.0f} MB; workers near their limit are restarted and their "
            "pairs fail 'out of memory': use fewer --workers"
        )
