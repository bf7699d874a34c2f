"""``otreg batch`` through the real command line (subprocesses), on small synthetic subjects:
failures isolated and reported, resume without redoing work, interrupts and kills, stale
locks, timeouts, crashing workers and an existing Dask cluster losing a worker."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pv = pytest.importorskip("pyvista")
pytest.importorskip("distributed")

from click.testing import CliRunner  # noqa: E402

from otreg.batch import find_records  # noqa: E402
from otreg.batch.records import read_plan  # noqa: E402
from otreg.cli import main  # noqa: E402
from otreg.registration import Registration  # noqa: E402

OTREG = [sys.executable, "-m", "otreg"]
FAST = ["--max-iter", "2", "--no-picture"]


def sphere(path: Path, radius: float, res: int, shift: float = 0.0) -> Path:
    m = pv.Sphere(radius=radius, theta_resolution=res, phi_resolution=res).triangulate()
    m.points[:, 0] += shift
    m.save(str(path))
    return path


@pytest.fixture
def subjects(tmp_path) -> Path:
    """s0 (the template) and s1..s4: spheres of 200 to 300 vertices, a few mm apart."""
    d = tmp_path / "subjects"
    d.mkdir()
    for i, (r, s) in enumerate([(40, 0), (42, 3), (38, -2), (41, 1), (39, 2)]):
        sphere(d / f"s{i}.vtk", r, 14 + i, s)
    return d


def manifest(path: Path, rows: list[tuple]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["pair_id", "source", "target", "options"])
        for row in rows:
            w.writerow(list(row) + [""] * (4 - len(row)))
    return path


def run(*args, env=None, timeout=300, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*OTREG, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def run_here(*args) -> subprocess.CompletedProcess:
    """The command in this process (click's runner), as :func:`run`'s result: for commands
    that end before any work (usage errors, manifests, dry runs)."""
    r = CliRunner().invoke(main, [str(a) for a in args])
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


def records(out: Path) -> dict[str, dict]:
    return {doc["pair_id"]: doc for _, doc in find_records(out)}


def leftovers(out: Path) -> list[Path]:
    """Temporary or partial files anywhere in a batch folder."""
    return [
        p
        for p in out.rglob("*")
        if p.name.startswith(".partial-") or ".tmp" in p.name or p.name.startswith(".otreg-")
    ]


def test_failures_are_isolated_reported_and_a_rerun_does_nothing(subjects, tmp_path):
    import numpy as np

    (subjects / "corrupt.vtk").write_text("this is not a mesh")
    np.save(subjects / "cloud.npy", np.random.default_rng(0).normal(size=(100, 3)) * 40)
    (subjects / "a_folder.vtk").mkdir()
    shutil.copy(subjects / "s1.vtk", subjects / "s1_copy.vtk")
    m = manifest(
        tmp_path / "pairs.csv",
        [
            ("a", "subjects/s1.vtk", "subjects/s0.vtk"),
            ("corrupt", "subjects/corrupt.vtk", "subjects/s0.vtk"),
            ("missing", "subjects/nowhere.vtk", "subjects/s0.vtk"),
            ("cloud", "subjects/cloud.npy", "subjects/s0.vtk"),
            ("folder", "subjects/a_folder.vtk", "subjects/s0.vtk"),
            ("b", "subjects/s2.vtk", "subjects/s0.vtk"),
            ("copy", "subjects/s1_copy.vtk", "subjects/s0.vtk"),
        ],
    )
    out = tmp_path / "out"
    r = run("batch", m, "-o", out, *FAST)
    assert r.returncode == 3, r.stderr
    assert "3 done (2 flagged" in r.stderr
    recs = records(out)
    assert {k: v["status"] for k, v in recs.items()} == {
        "a": "done",
        "b": "done",
        "copy": "done",
        "corrupt": "failed",
        "missing": "failed",
        "cloud": "failed",
        "folder": "failed",
    }
    assert recs["corrupt"]["error"]["class"] == "bad input"
    assert "corrupt.vtk" in recs["corrupt"]["error"]["reason"]
    assert recs["missing"]["error"]["class"] == "missing input"
    assert recs["cloud"]["error"]["class"] == "bad input"  # a point cloud: not a surface
    assert "cloud.npy has no triangles" in recs["cloud"]["error"]["reason"]
    assert recs["folder"]["error"]["class"] == "missing input"
    assert "a_folder.vtk is a folder" in recs["folder"]["error"]["reason"]
    failed = list(csv.DictReader(open(out / "failed.csv")))
    assert {(row["pair_id"], row["class"]) for row in failed} == {
        ("corrupt", "bad input"),
        ("missing", "missing input"),
        ("cloud", "bad input"),
        ("folder", "missing input"),
    }
    summary = {row["pair_id"]: row for row in csv.DictReader(open(out / "summary.csv"))}
    assert "its source file has the same content as " in summary["a"]["flags"]
    assert "s1_copy.vtk" in summary["a"]["flags"]
    assert summary["b"]["flags"] == ""
    assert summary["a"]["status"] == "done" and float(summary["a"]["mean_mm"]) < float(
        summary["a"]["before_mean_mm"]
    )
    assert float(summary["a"]["peak_rss_mb"]) > 50 and summary["a"]["host"]
    for pid in ("a", "b"):  # complete, loadable results
        Registration.load(out / "pairs" / pid)
        assert (out / "pairs" / pid / "log.txt").stat().st_size > 0
    assert not leftovers(out)
    assert (out / "index.html").exists()

    # a rerun registers nothing: the done pairs' records are untouched
    before = {pid: (out / "pairs" / pid / "metrics.json").read_bytes() for pid in ("a", "b")}
    r2 = run("batch", m, "-o", out, *FAST, "--workers", "2")  # worker count is not in the key
    assert r2.returncode == 3
    assert "0 to run" in r2.stderr
    for pid in ("a", "b"):
        assert (out / "pairs" / pid / "metrics.json").read_bytes() == before[pid]

    # moving the batch folder reruns nothing either
    moved = tmp_path / "moved"
    out.rename(moved)
    r3 = run_here("batch", m, "-o", moved, *FAST, "--dry-run")
    assert r3.returncode == 3  # as the run's: some failed before or will fail
    lines = dict(line.split(": ", 1) for line in r3.stdout.splitlines())
    assert lines["a"] == "done" and lines["b"] == "done"
    assert lines["corrupt"].startswith("failed")
    assert lines["missing"].startswith("will fail: missing input")
    assert (
        lines["folder"].startswith("will fail: missing input (")
        and "is a folder" in lines["folder"]
    )


@pytest.mark.slow  # 52 s (the default run stays under 20 minutes)
def test_a_changed_option_reruns_only_the_pairs_it_touches(subjects, tmp_path):
    rows = [
        ("a", "subjects/s1.vtk", "subjects/s0.vtk"),
        ("b", "subjects/s2.vtk", "subjects/s0.vtk"),
    ]
    m = manifest(tmp_path / "pairs.csv", rows)
    out = tmp_path / "out"
    assert run("batch", m, "-o", out, *FAST).returncode == 0
    first = records(out)
    rows[1] = (*rows[1], json.dumps({"sigma": 15.0}))
    manifest(m, rows)
    dry = run("batch", m, "-o", out, *FAST, "--dry-run")
    assert "a: done" in dry.stdout
    assert "b: will rerun (options changed: sigma None -> 15.0)" in dry.stdout
    assert run("batch", m, "-o", out, *FAST).returncode == 0
    second = records(out)
    assert second["a"]["finished"] == first["a"]["finished"]
    assert second["a"]["batch_id"] == first["a"]["batch_id"]
    assert second["b"]["batch_id"] != first["b"]["batch_id"]
    assert second["b"]["options"]["sigma"] == 15.0
    # the group page knows which records are of this plan; a run of one pair keeps the
    # other's key
    assert read_plan(out) == {pid: rec["key"] for pid, rec in second.items()}
    only = run("batch", m, "-o", out, *FAST, "--only", "a")
    assert only.returncode == 0 and "1 more in the manifest, not asked for" in only.stderr
    assert read_plan(out) == {pid: rec["key"] for pid, rec in second.items()}
    # a changed input's content (same path) reruns that pair only
    sphere(tmp_path / "subjects" / "s1.vtk", 43, 15, 2.0)
    dry = run("batch", m, "-o", out, *FAST, "--dry-run")
    assert "a: will rerun (source file content changed)" in dry.stdout
    assert "b: done" in dry.stdout


def wait_for(predicate, timeout: float, what: str) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_interrupt_then_kill_then_rerun_does_every_pair_exactly_once(subjects, tmp_path):
    rows = [(f"p{i}", f"subjects/s{i}.vtk", "subjects/s0.vtk") for i in range(1, 5)]
    rows.append(("p5", "subjects/s1.vtk", "subjects/s2.vtk"))
    m = manifest(tmp_path / "pairs.csv", rows)
    out = tmp_path / "out"
    cmd = [*OTREG, "batch", str(m), "-o", str(out), *FAST, "--workers", "1"]

    # Ctrl-C in a terminal: SIGINT to the whole process group, the workers included
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    wait_for(lambda: len(records(out)) >= 1, 120, "a first pair")
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err, err  # no worker's traceback
    assert not leftovers(out)
    after_int = records(out)
    assert all(r["status"] == "done" for r in after_int.values())
    assert f"otreg batch: {len(after_int)} done" in err  # the count is what is on disk
    assert f"the {5 - len(after_int)} pair(s) not finished run on the next call" in err

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(records(out)) > len(after_int), 120, "one more pair")
    proc.kill()
    proc.communicate(timeout=30)
    after_kill = records(out)

    r = run(*cmd[3:])
    assert r.returncode == 0, r.stderr
    final = records(out)
    assert sorted(final) == [f"p{i}" for i in range(1, 6)]
    for pid, rec in after_kill.items():  # finished before the kill: not run again
        assert final[pid]["batch_id"] == rec["batch_id"]
    for pid in final:  # one complete result a pair, nothing partial anywhere
        folder = out / "pairs" / pid
        Registration.load(folder)
        assert sorted(p.name for p in folder.iterdir()) == [
            "log.txt",
            "metrics.json",
            "parameters.npz",
            "registration.json",
            "warped.vtk",
        ]
    assert not leftovers(out)
    assert not list((out / ".locks").glob("*.lock"))


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_stale_lock_from_a_killed_run_is_broken(subjects, tmp_path):
    m = manifest(tmp_path / "pairs.csv", [("a", "subjects/s1.vtk", "subjects/s0.vtk")])
    out = tmp_path / "out"
    (out / ".locks").mkdir(parents=True)
    lock = {"host": socket.gethostname(), "pid": dead_pid(), "token": "x", "heartbeat": time.time()}
    (out / ".locks" / "a.lock").write_text(json.dumps(lock))
    r = run("batch", m, "-o", out, *FAST)
    assert r.returncode == 0, r.stderr
    assert records(out)["a"]["status"] == "done"
    assert not (out / ".locks" / "a.lock").exists()


def test_a_pair_over_the_timeout_fails_alone(subjects, tmp_path):
    """The slow pair is slow by construction (its worker sleeps when it loads the file), so
    the outcome does not hang on the machine's speed: the other pair, 5 s of work on two
    cores (its worker's first pair: the imports included), has three times that before the
    same timeout."""
    shutil.copy(subjects / "s2.vtk", subjects / "slow-me.vtk")
    env = hook_on_load(tmp_path, "slow-me.vtk", "time.sleep(600)")
    m = manifest(
        tmp_path / "pairs.csv",
        [
            ("slow", "subjects/slow-me.vtk", "subjects/s0.vtk"),
            ("small", "subjects/s1.vtk", "subjects/s0.vtk"),
        ],
    )
    out = tmp_path / "out"
    start = time.time()
    r = run("batch", m, "-o", out, *FAST, "--workers", "1", "--timeout", "15", env=env)
    assert r.returncode == 3, r.stderr
    assert time.time() - start < 240
    recs = records(out)
    assert recs["slow"]["error"]["class"] == "timeout"
    assert recs["small"]["status"] == "done", recs["small"].get("error")


def hook_on_load(tmp_path: Path, trigger: str, action: str) -> dict:
    """An environment whose Python, in a worker process, runs ``action`` when otreg.io's
    load_input is asked for a file named ``trigger`` (a sitecustomize import hook)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    code = textwrap.dedent(
        """
        import importlib.abc, importlib.util, multiprocessing, os, signal, sys, time

        class OnLoad(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name != "otreg.io":
                    return None
                sys.meta_path.remove(self)
                spec = importlib.util.find_spec(name)
                run = spec.loader.exec_module

                def exec_module(module):
                    run(module)
                    load = module.load_input

                    def load_input(path, *args, **kwargs):
                        worker = multiprocessing.current_process().name != "MainProcess"
                        if worker and str(path).endswith(TRIGGER):
                            ACTION
                        return load(path, *args, **kwargs)

                    module.load_input = load_input

                spec.loader.exec_module = exec_module
                return spec

        sys.meta_path.insert(0, OnLoad())
        """
    )
    code = code.replace("TRIGGER", repr(trigger)).replace("ACTION", action)
    (hooks / "sitecustomize.py").write_text(code)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), *sys.path])}


@pytest.mark.slow  # 32 s (the default run stays under 20 minutes)
def test_a_pair_that_kills_its_worker_fails_alone(subjects, tmp_path):
    """A worker process dying on a pair (a segfault, the kernel's OOM killer) is restarted;
    after ALLOWED_FAILURES + 1 deaths the pair is recorded as a crash, the rest go on."""
    env = hook_on_load(tmp_path, "crash-me.vtk", "os.kill(os.getpid(), signal.SIGKILL)")
    (subjects / "crash-me.vtk").write_bytes((subjects / "s1.vtk").read_bytes())
    m = manifest(
        tmp_path / "pairs.csv",
        [
            ("crash", "subjects/crash-me.vtk", "subjects/s0.vtk"),
            ("fine", "subjects/s2.vtk", "subjects/s0.vtk"),
        ],
    )
    r = run("batch", m, "-o", tmp_path / "out", *FAST, "--workers", "1", env=env)
    assert r.returncode == 3, r.stderr
    recs = records(tmp_path / "out")
    assert recs["crash"]["error"]["class"] == "crash"
    assert "died 3 times" in recs["crash"]["error"]["reason"]
    assert recs["fine"]["status"] == "done", recs["fine"]


def test_a_pair_over_the_memory_limit_fails_out_of_memory_alone(subjects, tmp_path):
    """A pair whose worker grows past --memory-limit (50 MB more every 50 ms, as a
    registration too large for the machine does) is killed by the worker's nanny, three
    times, and recorded 'out of memory' with the last reading; the other pair is done."""
    # at most 3 GB (twice the limit), then wait: a slow nanny still finds it over the limit,
    # and --timeout bounds the test if it never does
    grow = "[b'x' * 50_000_000 for _ in range(60) if time.sleep(0.05) is None]; time.sleep(600)"
    env = hook_on_load(tmp_path, "hog-me.vtk", grow)
    (subjects / "hog-me.vtk").write_bytes((subjects / "s1.vtk").read_bytes())
    m = manifest(
        tmp_path / "pairs.csv",
        [
            ("hog", "subjects/hog-me.vtk", "subjects/s0.vtk"),
            ("fine", "subjects/s2.vtk", "subjects/s0.vtk"),
        ],
    )
    out = tmp_path / "out"
    limit = ["--memory-limit", "1.5GB", "--timeout", "120"]
    r = run("batch", m, "-o", out, *FAST, "--workers", "1", *limit, env=env)
    assert r.returncode == 3, r.stderr
    recs = records(out)
    error = recs["hog"]["error"]
    assert error["class"] == "out of memory", error
    assert "of a 1,500 MB limit" in error["reason"]
    assert 0.7 * 1431 < recs["hog"]["peak_rss_mb"] < 1431
    assert recs["fine"]["status"] == "done", recs["fine"]
    failed = list(csv.DictReader(open(out / "failed.csv")))
    assert [(row["pair_id"], row["class"]) for row in failed] == [("hog", "out of memory")]


@pytest.mark.parametrize(
    "pair_id", ["../escape", "/abs", "a/b", "x;rm -rf", ".hidden", "a..b"], ids=str
)
def test_pair_ids_that_could_escape_the_folder_are_refused_before_any_work(
    subjects, tmp_path, pair_id
):
    m = manifest(tmp_path / "pairs.csv", [(pair_id, "subjects/s1.vtk", "subjects/s0.vtk")])
    r = run_here("batch", m, "-o", tmp_path / "out", *FAST)
    assert r.returncode == 1
    assert "pair_id" in r.stderr and "line 2" in r.stderr
    assert not (tmp_path / "out").exists()


def test_usage_errors_exit_1_and_name_the_problem(subjects, tmp_path):
    m = manifest(tmp_path / "pairs.csv", [("a", "subjects/s1.vtk", "subjects/s0.vtk")])
    cases = [
        (["batch", tmp_path / "nope.csv", "-o", tmp_path / "o"], "nope.csv does not exist"),
        (["batch", m, "-o", tmp_path / "o", "--workers", "0"], "--workers"),
        (["batch", m, "-o", tmp_path / "o", "--only", "zzz"], "zzz"),
        (["batch", m, "-o", tmp_path / "o", "--memory-limit", "lots"], "a size like"),
        (["batch", m, "-o", tmp_path / "o", "--memory-limit", "lots", "--dry-run"], "a size"),
        (["batch", m, "-o", tmp_path / "o", "--memory-limit", "4"], "'4' without a unit"),
        (["batch", m, "-o", tmp_path / "o", "--memory-limit", "100MB"], "at least 600MB"),
        (["batch", m, "-o", m], "is a file"),
        (["batch", m, "-o", m / "sub"], "lies under"),
        (["batch", m, "-o", tmp_path / "o", "--bogus"], "No such option"),
    ]
    import torch

    if not torch.cuda.is_available():  # a dry run checks the device as the run would
        cases.append(
            (["batch", m, "-o", tmp_path / "o", "--device", "cuda", "--dry-run"], "no CUDA")
        )
    bad = tmp_path / "bad.csv"
    bad.write_text("pair_id,source\na,x.vtk\n")
    cases.append((["batch", bad, "-o", tmp_path / "o"], "missing column(s) target"))
    # in this process: 10 interpreters, each importing torch, took 58 s of the default run
    for args, expected in cases:
        r = run_here(*args)
        assert r.returncode == 1, (args, r.stderr)
        assert expected in r.stderr, (args, r.stderr)
    assert not (tmp_path / "o").exists()


def test_report_refuses_a_folder_that_holds_no_batch(tmp_path):
    (tmp_path / "notes").mkdir()
    r = run_here("report", tmp_path / "notes")
    assert r.returncode == 1 and "holds no batch records" in r.stderr
    assert not (tmp_path / "notes" / "index.html").exists()


def test_manifest_helpers_write_what_batch_reads(subjects, tmp_path):
    run = run_here  # (7 interpreters, each importing torch, took 41 s of the default run)
    files = sorted(str(p) for p in subjects.glob("s[1-4].vtk"))
    r = run("manifest", "to-template", subjects / "s0.vtk", *files, "-o", tmp_path / "t.csv")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(tmp_path / "t.csv")))
    assert [row["pair_id"] for row in rows] == [f"s{i}_to_template" for i in range(1, 5)]
    r = run("manifest", "all-pairs", *files, "-o", tmp_path / "a.csv")
    rows = list(csv.DictReader(open(tmp_path / "a.csv")))
    assert len(rows) == 6 and rows[0]["source_subject"] == "s1"
    dry = run("batch", tmp_path / "a.csv", "-o", tmp_path / "o", "--dry-run")
    assert dry.returncode == 0 and dry.stdout.count("will run") == 6
    clash = run("manifest", "all-pairs", files[0], files[0], "-o", tmp_path / "c.csv")
    assert clash.returncode == 1 and "subject id" in clash.stderr
    before = (tmp_path / "t.csv").read_text()  # an existing manifest: replaced only if asked
    again = run("manifest", "all-pairs", *files[:2], "-o", tmp_path / "t.csv")
    assert again.returncode == 1 and "t.csv exists; give --overwrite" in again.stderr
    assert (tmp_path / "t.csv").read_text() == before
    again = run("manifest", "all-pairs", *files[:2], "-o", tmp_path / "t.csv", "--overwrite")
    assert again.returncode == 0 and len(list(csv.DictReader(open(tmp_path / "t.csv")))) == 1
    onto = run("manifest", "all-pairs", *files[:2], "-o", files[0], "--overwrite")
    assert onto.returncode == 1 and "is one of the inputs" in onto.stderr
    odd = shutil.copy(files[0], tmp_path / "sub 01(a).vtk")  # a name that is no pair id
    named = run("manifest", "all-pairs", odd, files[1], "-o", tmp_path / "n.csv")
    assert named.returncode == 1 and "Invalid value for FILES" in named.stderr
    assert "'sub 01(a)'" in named.stderr and "rename the file" in named.stderr
    itself = run("manifest", "to-template", subjects / "s0.vtk", subjects / "s0.vtk", files[0],
                 "-o", tmp_path / "i.csv")  # fmt: skip
    assert itself.returncode == 0, itself.stderr
    assert "warning: pairs_to_template: s0 is the template itself" in itself.stderr
    assert "UserWarning" not in itself.stderr
    sided = run("manifest", "to-template", subjects / "s0.vtk", *files, "--hemisphere", "L",
                "-o", tmp_path / "h.csv")  # fmt: skip
    assert sided.returncode == 0, sided.stderr
    assert {row["hemisphere"] for row in csv.DictReader(open(tmp_path / "h.csv"))} == {"L"}


def test_an_existing_dask_cluster_losing_a_worker_completes_every_pair(subjects, tmp_path):
    """A scheduler and two workers on 127.0.0.1 (subprocesses); one worker is killed while
    the batch runs: its pair is rescheduled on the other, and every pair completes."""
    sched_file = tmp_path / "scheduler.json"
    procs = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "distributed.cli.dask_scheduler",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--dashboard-address",
                    ":0",
                    "--scheduler-file",
                    str(sched_file),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_for(sched_file.exists, 60, "the scheduler file")
        for _ in range(2):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "distributed.cli.dask_worker",
                        "--scheduler-file",
                        str(sched_file),
                        "--nthreads",
                        "1",
                        "--no-nanny",
                        "--host",
                        "127.0.0.1",
                        "--dashboard-address",
                        ":0",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        rows = [(f"p{i}", f"subjects/s{i}.vtk", "subjects/s0.vtk") for i in range(1, 5)]
        m = manifest(tmp_path / "pairs.csv", rows)
        out = tmp_path / "out"
        batch = subprocess.Popen(
            [*OTREG, "batch", str(m), "-o", str(out), *FAST, "--scheduler-file", str(sched_file)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for(lambda: len(records(out)) >= 1, 120, "a first pair")
        procs[1].kill()  # one worker dies mid-batch
        _, err = batch.communicate(timeout=240)
        assert batch.returncode == 0, err
        final = records(out)
        assert sorted(final) == sorted(r[0] for r in rows)
        assert all(r["status"] == "done" for r in final.values())
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def test_an_unreachable_scheduler_is_an_error_naming_the_option_without_usage_text(
    subjects, tmp_path, monkeypatch
):
    """--scheduler that cannot be reached (Dask's Client times out after 30 s: made to fail
    at once here): exit 1, the option and the address named, no usage text."""
    import distributed

    def refuse(*args, **kwargs):
        raise OSError("Timed out trying to connect to tcp://127.0.0.1:1 after 30 s")

    monkeypatch.setattr(distributed, "Client", refuse)
    m = manifest(tmp_path / "m.csv", [("p", subjects / "s1.vtk", subjects / "s0.vtk")])
    args = ["batch", str(m), "-o", str(tmp_path / "out"), "--scheduler", "tcp://127.0.0.1:1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "scheduler (--scheduler) tcp://127.0.0.1:1 cannot be reached" in result.output
    assert "Usage:" not in result.output and "Timed out trying to connect" in result.output
