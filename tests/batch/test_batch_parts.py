"""The batch's parts in-process: manifests, resume keys, locks, the plan and the preflight."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from otreg.batch import Pair, all_pairs, pairs_to_template, read_manifest, write_manifest
from otreg.batch import engine as engine_mod
from otreg.batch.engine import plan_batch, run_batch
from otreg.batch.keys import effective_options, file_digest, pair_key
from otreg.batch.locks import STALE_AFTER, LockedError, PairLock, is_stale
from otreg.batch.manifest import check_pair_id


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------- manifests


def test_a_manifest_resolves_relative_paths_from_its_folder(tmp_path):
    m = write(
        tmp_path / "study" / "pairs.csv",
        "pair_id,source,target,label,hemisphere,options\n"
        'a,sub/a.nii.gz,/abs/t.vtk,17,lh,"{""sigma"": 10}"\n'
        "\n"
        "b,b.vtk,t.vtk,,,\n",
    )
    a, b = read_manifest(m)
    assert a.source == str(tmp_path / "study" / "sub" / "a.nii.gz")
    assert a.target == "/abs/t.vtk" and a.label == 17.0 and a.hemisphere == "L"
    assert a.options == {"sigma": 10} and a.folder == "pairs/a"
    assert b.label is None and b.options == {}


@pytest.mark.parametrize(
    "text, message",
    [
        ("pair_id,source\na,x\n", "missing column(s) target"),
        ("pair_id,source,target,colour\na,x,y,red\n", "unknown column(s) colour"),
        ("pair_id,source,target\na,x,y\na,x,z\n", "appears twice (also on line 2)"),
        ("pair_id,source,target\na,,y\n", "line 2: source is empty"),
        ("pair_id,source,target\n../a,x,y\n", "line 2: pair_id '../a' is not allowed"),
        ("pair_id,source,target,label\na,x,y,seventeen\n", "label must be a number"),
        ("pair_id,source,target,hemisphere\na,x,y,up\n", "hemisphere must be L or R"),
        ("pair_id,source,target,options\na,x,y,{bad\n", "options is not JSON"),
        (
            'pair_id,source,target,options\na,x,y,{"model": "rigid", "points": 500}\n',
            "5 fields where the header has 4; a field that holds commas (options' JSON) must",
        ),
        ("pair_id,source,target\na,x,y,extra\n", "line 2: 4 fields where the header has 3"),
        (  # one comma short: its last value would land in the wrong column
            "pair_id,source,target,source_values,target_values\na,x,y,m.gii\n",
            "line 2: 4 fields where the header has 5",
        ),
        ('pair_id,source,target,options\na,x,y,"{""speed"": 1}"\n', "unknown option 'speed'"),
        ('pair_id,source,target,options\na,x,y,"{""sigma"": ""big""}"\n', "sigma must be"),
        ("pair_id,source,target\n", "has no pairs"),
        (
            'pair_id,source,target,options\na,x,y,\nb,x,y,"{""max_iter"": 0}"\n',
            "line 3: pair b: options: max_iter is 0; it must be >= 1",
        ),
        (
            "pair_id,source,target,label\na,x.vtk,y.gii,17\n",
            "line 2: pair a: label applies to volumes (.nii, .nii.gz, .mgz), and neither",
        ),
        ("pair_id,source,target,label,level\na,x.nii,y.gii,17,0.5\n", "not both"),
    ],
)
def test_bad_manifests_name_the_line_and_the_problem(tmp_path, text, message):
    with pytest.raises(ValueError, match=None) as err:
        read_manifest(write(tmp_path / "m.csv", text))
    assert message in str(err.value)


def test_a_binary_file_given_as_the_manifest_is_named_as_such(tmp_path):
    (tmp_path / "lh.pial").write_bytes(b"\xff\xff\xfe" + bytes(range(256)))
    with pytest.raises(ValueError, match="manifest .*lh.pial is not a text file .*not a surface"):
        read_manifest(tmp_path / "lh.pial")


def test_a_missing_manifest_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        read_manifest(tmp_path / "nope.csv")


@pytest.mark.parametrize("bad", ["", "..", "a/b", "/a", ".a", "a..b", "a b", "a;b", "x" * 129])
def test_pair_ids_that_are_not_safe_folder_names_are_refused(bad):
    with pytest.raises(ValueError, match="not allowed"):
        check_pair_id(bad)


def test_a_pair_takes_paths_as_strings_and_refuses_what_is_not_a_path():
    pair = Pair("a", Path("sub-01.vtk"), Path("/t/tpl.vtk"))
    assert (pair.source, pair.target) == ("sub-01.vtk", "/t/tpl.vtk")
    with pytest.raises(TypeError, match=r"pair a: target must be a file path .* got int"):
        Pair("a", "sub-01.vtk", 3)


def test_manifests_round_trip_and_the_helpers_pair_subjects(tmp_path):
    subjects = {"s1": "a.vtk", "s2": "b.vtk", "s3": "c.vtk"}
    pairs = all_pairs(subjects, options={"max_iter": 5})
    assert [p.pair_id for p in pairs] == ["s1_to_s2", "s1_to_s3", "s2_to_s3"]
    assert len(all_pairs(subjects, symmetric=True)) == 6
    back = read_manifest(write_manifest(pairs, tmp_path / "m.csv"))
    assert back == pairs
    to = pairs_to_template(subjects, "t.vtk", "fsavg", hemisphere="L")
    assert [p.pair_id for p in to] == ["s1_to_fsavg", "s2_to_fsavg", "s3_to_fsavg"]
    assert {p.target_subject for p in to} == {"fsavg"} and to[0].hemisphere == "L"
    # without the column, each subject's file name gives its hemisphere where it can
    named = {"s1": "sub-01_hemi-R_pial.vtk", "s2": "lh.pial", "s3": "s3.vtk"}
    assert [p.hemisphere for p in pairs_to_template(named, "t.vtk")] == ["R", "L", None]
    with pytest.raises(ValueError, match="at least 2"):
        all_pairs({"s1": "a.vtk"})
    with pytest.raises(ValueError, match="not allowed"):
        all_pairs({"../s1": "a.vtk", "s2": "b.vtk"})
    with pytest.raises(TypeError, match="Pair objects"):
        write_manifest(["a"], tmp_path / "x.csv")


# ----------------------------------------------------------------------------- keys


def test_the_key_follows_content_and_options_not_paths(tmp_path):
    a = write(tmp_path / "a.vtk", "mesh a")
    b = write(tmp_path / "b.vtk", "mesh b")
    moved = write(tmp_path / "elsewhere" / "a.vtk", "mesh a")
    pair = Pair("p", str(a), str(b))
    opts = effective_options({"max_iter": 5}, pair)
    key, parts = pair_key(file_digest(a), file_digest(b), opts)
    assert file_digest(moved) == file_digest(a)  # same content, another path
    assert pair_key(file_digest(moved), file_digest(b), opts)[0] == key
    other = effective_options({"max_iter": 6}, pair)
    assert pair_key(file_digest(a), file_digest(b), other)[0] != key
    row = Pair("p", str(a), str(b), options={"max_iter": 6})  # the row wins over the batch
    assert effective_options({"max_iter": 5}, row)["max_iter"] == 6
    from otreg import LBFGSOptions  # neither sets it: the library's default

    assert effective_options({}, pair)["max_iter"] == LBFGSOptions().max_iter
    write(b, "mesh b, edited")
    assert pair_key(file_digest(a), file_digest(b), opts)[0] != key
    assert set(parts) == {"source", "target", "options", "format"}
    with pytest.raises(FileNotFoundError, match="nope"):
        file_digest(tmp_path / "nope")


# ----------------------------------------------------------------------------- locks


def test_a_live_lock_blocks_and_a_released_one_does_not(tmp_path):
    with PairLock(tmp_path, "p") as lock:
        doc = json.loads(lock.path.read_text())
        assert doc["pid"] == os.getpid() and doc["host"] == socket.gethostname()
        with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
            PairLock(tmp_path, "p").acquire()
    assert not lock.path.exists()
    with PairLock(tmp_path, "p"):
        pass


def test_stale_locks_are_broken(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # killed and not yet reaped by its parent (this process): a zombie holds its pid
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie.kill()
    wait_until = time.time() + 10
    while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.time() < wait_until
        time.sleep(0.05)
    path = tmp_path / ".locks" / "p.lock"
    path.parent.mkdir()
    cases = [
        {"host": socket.gethostname(), "pid": dead.pid, "heartbeat": time.time()},
        {"host": socket.gethostname(), "pid": zombie.pid, "heartbeat": time.time()},
        {"host": "another-node", "pid": 1, "heartbeat": time.time() - STALE_AFTER - 1},
    ]
    for doc in cases:
        assert is_stale(doc)
        path.write_text(json.dumps(doc))
        with PairLock(tmp_path, "p") as lock:
            assert lock.broke["pid"] == doc["pid"]
    zombie.wait()
    fresh = {"host": "another-node", "pid": 1, "heartbeat": time.time()}
    assert not is_stale(fresh)
    path.write_text(json.dumps(fresh))
    with pytest.raises(LockedError, match="another-node"):
        PairLock(tmp_path, "p").acquire()


def test_the_heartbeat_is_rewritten(tmp_path, monkeypatch):
    from otreg.batch import locks

    monkeypatch.setattr(locks, "HEARTBEAT", 0.05)
    with PairLock(tmp_path, "p") as lock:
        first = json.loads(lock.path.read_text())["heartbeat"]
        time.sleep(0.3)
        assert json.loads(lock.path.read_text())["heartbeat"] > first


# ----------------------------------------------------------------------------- plan


def test_the_plan_says_what_runs_and_why(tmp_path):
    a, b = write(tmp_path / "a.vtk", "a"), write(tmp_path / "b.vtk", "b")
    pairs = [Pair("new", str(a), str(b)), Pair("gone", str(tmp_path / "x.vtk"), str(b))]
    new, gone = plan_batch(pairs, tmp_path / "out")
    assert (new.state, gone.state) == ("run", "missing input")
    assert "x.vtk" in gone.why
    partial = tmp_path / "out" / "pairs" / "new" / ".partial-new-1234"
    partial.mkdir(parents=True)
    assert plan_batch(pairs[:1], tmp_path / "out")[0].why == "partial output of an interrupted run"
    with PairLock(tmp_path / "out", "new"):  # a live process works on it (a cluster's worker)
        held = plan_batch(pairs[:1], tmp_path / "out")[0]
        assert held.state == "run" and held.why.startswith("running now (locked by host")
        assert f"pid {os.getpid()}" in held.why
    with pytest.raises(ValueError, match="no pair has the id"):
        plan_batch(pairs, tmp_path / "out", only=["zzz"])
    assert [p.pair.pair_id for p in plan_batch(pairs, tmp_path / "out", only=["gone"])] == ["gone"]


def test_a_batch_into_a_folder_of_other_pairs_says_they_are_left_out(tmp_path):
    """A second batch of other pairs in the same folder: a note names the earlier pairs
    that summary.csv and the group page leave out."""
    out, lines = tmp_path / "out", []
    run_batch([Pair("a", str(tmp_path / "gone.vtk"), str(tmp_path / "t.vtk"))], out,
              echo=lines.append)  # fmt: skip
    assert not any(line.startswith("note:") for line in lines)
    lines.clear()
    run_batch([Pair("b", str(tmp_path / "gone.vtk"), str(tmp_path / "t.vtk"))], out,
              echo=lines.append)  # fmt: skip
    note = [line for line in lines if line.startswith("note:")]
    assert len(note) == 1 and "1 pair(s) not in this batch (a)" in note[0]
    summary = (out / "summary.csv").read_text()
    assert "\nb," in summary and "\na," not in summary
    assert 'data-pair="a"' not in (out / "index.html").read_text()


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    a = write(tmp_path / "a.vtk", "a")
    pairs = [Pair("p", str(a), str(a))]
    for kwargs, message in [
        ({"workers": 0}, "workers"),
        ({"threads": -1}, "threads"),
        ({"timeout": 0}, "timeout"),
        ({"scheduler": "tcp://x:1", "scheduler_file": "f"}, "not both"),
    ]:
        with pytest.raises(ValueError, match=message):
            run_batch(pairs, tmp_path / "out", **kwargs)
    with pytest.raises(ValueError, match="no pairs"):
        run_batch([], tmp_path / "out")
    with pytest.raises(TypeError, match="Pair"):
        run_batch(["p"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_preflight_refuses_a_disk_too_small_for_the_outputs(tmp_path, monkeypatch):
    a = write(tmp_path / "a.vtk", "x" * 10_000)
    pairs = [Pair(f"p{i}", str(a), str(a)) for i in range(3)]

    class Usage:
        free = 3 * 2**20  # 3 MB: less than 3 pairs x 2 MB

    monkeypatch.setattr(engine_mod.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(OSError, match=r"3 MB free but the 3 pairs to run need about 6 MB"):
        run_batch(pairs, tmp_path / "out", echo=lambda line: None)


def test_the_preflight_warns_of_memory_limits_beyond_the_machine(tmp_path):
    """Workers x --memory-limit above the machine's memory: a warning with the numbers; an
    existing cluster's (no limit of ours) and auto: none."""
    import psutil

    a = write(tmp_path / "a.vtk", "x" * 100)
    todo = plan_batch([Pair("p", str(a), str(a))], tmp_path / "out")
    (tmp_path / "out").mkdir()
    total_gb = psutil.virtual_memory().total / 1e9
    lines: list[str] = []
    engine_mod._preflight(tmp_path / "out", todo, 2, lines.append, f"{total_gb:.0f}GB")
    assert any("2 workers x a memory limit of" in line for line in lines), lines
    for limit in (None, "auto", "1GB"):
        lines.clear()
        engine_mod._preflight(tmp_path / "out", todo, 2, lines.append, limit)
        assert not any("memory limit" in line for line in lines), (limit, lines)


def test_a_batch_with_no_worker_alive_ends_with_a_reason(tmp_path, monkeypatch):
    """The dispatcher never waits on nothing: with every worker gone and pairs waiting,
    they fail 'no worker' within a bounded time and the batch ends (exit 3)."""
    pytest.importorskip("distributed")
    pv = pytest.importorskip("pyvista")
    from otreg import Shape, save_shape
    from otreg.batch import dispatch, engine, run_batch

    ball = Shape.from_pyvista(pv.Sphere(radius=20))
    save_shape(ball, tmp_path / "a.vtk")
    save_shape(ball.with_points(ball.points + 1.0), tmp_path / "b.vtk")
    monkeypatch.setattr(dispatch, "NO_WORKER_SECONDS", {"local": 4.0, "existing": 4.0})
    monkeypatch.setattr(dispatch, "REPLACE_SECONDS", 1.0)
    real = engine.dispatch

    def without_workers(cl, *args):
        scale = cl.cluster.scale
        scale(0)  # every worker leaves, and none comes back when the dispatcher asks
        cl.cluster.scale = lambda n: scale(0)
        return real(cl, *args)

    monkeypatch.setattr(engine, "dispatch", without_workers)
    pairs = [Pair("p", str(tmp_path / "a.vtk"), str(tmp_path / "b.vtk"))]
    start = time.perf_counter()
    res = run_batch(pairs, tmp_path / "out", {"max_iter": 2}, workers=1, report=False)
    assert time.perf_counter() - start < 120
    assert res.exit_code == 3
    error = res.records["p"]["error"]
    assert error["class"] == "no worker"
    assert "no worker process was alive for 4 s" in error["reason"]


@pytest.mark.slow  # 25 s (the default run stays under 20 minutes)
def test_a_nanny_that_fails_to_restart_its_worker_is_replaced(tmp_path, monkeypatch):
    """Dask leaves a nanny whose worker failed to restart (its start timed out on a loaded
    machine) without a worker; the dispatcher starts the workers afresh and the pair runs."""
    pytest.importorskip("distributed")
    pv = pytest.importorskip("pyvista")
    from otreg import Shape, save_shape
    from otreg.batch import dispatch, engine, run_batch

    ball = Shape.from_pyvista(pv.Sphere(radius=20))
    save_shape(ball, tmp_path / "a.vtk")
    save_shape(ball.with_points(ball.points + 1.0), tmp_path / "b.vtk")
    monkeypatch.setattr(dispatch, "REPLACE_SECONDS", 2.0)
    real = engine.dispatch

    def with_a_broken_nanny(cl, *args):
        (nanny,) = cl.cluster.workers.values()

        async def fails():
            raise TimeoutError("the worker did not start in time")

        nanny.instantiate = fails
        os.kill(nanny.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while cl.client.scheduler_info()["workers"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not cl.client.scheduler_info()["workers"]
        return real(cl, *args)

    monkeypatch.setattr(engine, "dispatch", with_a_broken_nanny)
    pairs = [Pair("p", str(tmp_path / "a.vtk"), str(tmp_path / "b.vtk"))]
    start = time.perf_counter()
    res = run_batch(pairs, tmp_path / "out", {"max_iter": 2}, workers=1, report=False)
    assert res.records["p"]["status"] == "done", res.records["p"]
    assert time.perf_counter() - start < 100
    assert res.exit_code == 0


@pytest.mark.parametrize(
    "limit, match",
    [
        ("4", "'4' without a unit; give one, e.g. '4GB'"),
        ("100MB", "at least 600MB"),
        ("lots", "a size like '500MB'"),
    ],
)
def test_a_memory_limit_too_small_or_without_unit_is_refused(tmp_path, limit, match):
    from otreg.batch import run_batch

    with pytest.raises(ValueError, match=match):
        run_batch([Pair("p", "a.vtk", "b.vtk")], tmp_path, memory_limit=limit)


def test_the_least_memory_limit_is_in_the_units_the_user_writes():
    """MB as written (10^6 bytes, dask's): the least limit the message asks for is taken,
    and a smaller one is echoed in the same units."""
    from otreg.batch.engine import WORKER_MEMORY_MIN_MB, check_memory_limit

    assert check_memory_limit(f"{WORKER_MEMORY_MIN_MB}MB") == f"{WORKER_MEMORY_MIN_MB}MB"
    assert check_memory_limit("0.6GB") == "0.6GB"
    with pytest.raises(ValueError, match=r"'599MB' \(599 MB\)"):
        check_memory_limit("599MB")


def test_a_folder_given_as_an_input_is_named_as_a_folder(tmp_path):
    (tmp_path / "sub.vtk").mkdir()
    (tmp_path / "t.vtk").write_text("t")
    (p,) = plan_batch([Pair("p", str(tmp_path / "sub.vtk"), str(tmp_path / "t.vtk"))], tmp_path)
    assert p.state == "missing input" and p.why.endswith("sub.vtk is a folder")


def test_the_template_among_the_subjects_files_is_left_out(tmp_path):
    files = {s: write(tmp_path / f"{s}.vtk", s) for s in ("a", "b", "tpl")}
    with pytest.warns(UserWarning, match="tpl is the template itself"):
        pairs = pairs_to_template(files, files["tpl"], "tpl")
    assert [p.pair_id for p in pairs] == ["a_to_tpl", "b_to_tpl"]
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no subject left"):
        pairs_to_template({"tpl": files["tpl"]}, files["tpl"])


# ----------------------------------------------------------------------------- CPUs

CPUS = """
import io, json, os, torch
from otreg import info
from otreg._info import usable_cores
from otreg.cli._common import set_threads
before = torch.get_num_threads()  # torch counted the CPUs when it loaded
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # as in a job given one CPU
out = io.StringIO()
report = info(check_keops=False, file=out)
set_threads(None)
print(json.dumps({"before": before, "usable": usable_cores(), "report": report["usable CPUs"],
                  "printed": out.getvalue(), "cli": torch.get_num_threads()}))
"""


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity and two CPUs",
)
def test_the_cpus_a_process_may_use_size_its_threads():
    # a process held to one CPU after torch counted two (a job's cpuset or quota that torch
    # does not see): otreg counts one, `otreg info` says the threads outnumber the CPUs,
    # and the CLI's default threads come down to one
    done = subprocess.run([sys.executable, "-c", CPUS], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["before"] >= 2 and got["usable"] == got["report"] == 1, got
    assert "torch runs 2 threads on 1 usable CPUs" in got["printed"], got["printed"]
    assert "torch.set_num_threads(1)" in got["printed"]
    assert got["cli"] == 1, got


def test_a_local_batch_sizes_its_workers_and_threads_by_the_usable_cpus(tmp_path, monkeypatch):
    # the default workers (one per 2 usable CPUs) and threads (usable CPUs / workers): not
    # os.cpu_count(), the machine's, which a cluster job's share is a fraction of
    seen = {}

    class Stop(Exception):
        pass

    def cluster(out, workers, threads, *rest):
        seen.update(workers=workers, threads=threads)
        raise Stop

    monkeypatch.setattr(engine_mod, "usable_cores", lambda: 6)
    monkeypatch.setattr(engine_mod, "Cluster", cluster)
    monkeypatch.setattr(engine_mod, "_preflight", lambda *a: None)
    src = write(tmp_path / "a.vtk", "not read")
    with pytest.raises(Stop):
        run_batch([Pair("a", src, src)], tmp_path / "out", progress=False)
    assert seen == {"workers": 3, "threads": None}, seen
