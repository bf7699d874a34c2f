"""otreg register and otreg demo: outputs, output folders refused before any work, choices."""

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from otreg.cli import main
from tests.cli.conftest import run
from tests.conftest import hide_module


@pytest.mark.parametrize("pair", ["templates", "hemispheres", "synthetic"])
def test_demo_registers_two_brain_surfaces_and_writes_everything(pair, tmp_path):
    pytest.importorskip("nilearn")
    pytest.importorskip("pyvista")
    if pair == "templates":
        pytest.importorskip("brainspace")
    out = tmp_path / "demo"
    result = run("demo", "-o", str(out), "--pair", pair, "--points", "400", "--no-progress")
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {
        "source.vtk",
        "target.vtk",
        "warped.vtk",
        "parameters.npz",
        "registration.json",
        "picture.png",
        "history.png",
        ".otreg-outputs",
    }
    doc = json.loads((out / "registration.json").read_text())
    m = doc["metrics"]
    assert m["jacobian_negative_fraction"] == 0.0
    import pyvista as pv

    assert m["jacobian_points"] == pv.read(out / "source.vtk").n_points  # every vertex
    assert m["mean_mm"] < m["before_mean_mm"]
    assert -1 <= m["curvature_correlation"] <= 1
    line = next(t for t in result.output.splitlines() if "mean surface distance" in t)
    assert f"{m['before_mean_mm']:.3f} mm before" in line and f"{m['mean_mm']:.3f} mm after" in line
    both = next(t for t in result.output.splitlines() if "both ways" in t)
    assert f"{m['mean_ab_mm']:.3f} mm source to target" in both
    assert f"{m['mean_ba_mm']:.3f} mm target to source" in both
    # reading (and meshing) the inputs is reported beside the registration's own time
    timing = next(t for t in result.output.splitlines() if t.strip().startswith("time"))
    assert m["read_seconds"] > 0 and f"reading the inputs {m['read_seconds']:.1f} s" in timing
    if pair == "synthetic":
        assert "vertex error" in result.output and m["vertex_error_mean_mm"] < 2.0
    # the surfaces written are recorded as the inputs: otreg transfer finds the target
    where = out.resolve()
    assert doc["inputs"] == {role: str(where / f"{role}.vtk") for role in ("source", "target")}
    values = tmp_path / "x.npy"
    np.save(values, pv.read(out / "source.vtk").points[:, 0].astype(np.float64))
    carried = run("transfer", str(out), str(values), "-o", str(tmp_path / "x_on_target.npy"))
    assert carried.exit_code == 0, carried.output
    assert np.load(tmp_path / "x_on_target.npy").shape == (pv.read(out / "target.vtk").n_points,)


def test_demo_without_its_data_names_one_install_command(tmp_path, monkeypatch):
    hide_module(monkeypatch, "brainspace")
    out = tmp_path / "demo"
    result = CliRunner().invoke(main, ["demo", "-o", str(out), "--no-progress"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.count("pip install 'otreg[data]'") == 1, result.output
    assert not out.exists()  # nothing left behind


def test_register_refuses_an_output_folder_that_would_replace_an_input(two_meshes, tmp_path):
    src, tgt = two_meshes
    inside = tmp_path / "warped.vtk"
    inside.write_bytes(open(src, "rb").read())
    before = inside.read_bytes()
    result = CliRunner().invoke(main, ["register", str(inside), tgt, "-o", str(tmp_path)])
    assert result.exit_code != 0 and "would replace the input" in result.output
    assert inside.read_bytes() == before
    result = CliRunner().invoke(main, ["register", src, tgt, "-o", src])
    assert result.exit_code != 0 and "is a file" in result.output
    result = CliRunner().invoke(main, ["register", src, tgt, "-o", "/dev/null"])
    assert result.exit_code != 0 and "is not a folder" in result.output


def test_register_choices_come_from_the_library():
    from otreg.registration import LOSSES, MODELS, PREALIGNS

    params = {p.name: p for p in main.commands["register"].params}
    assert tuple(params["model"].type.choices) == MODELS
    assert tuple(params["prealign"].type.choices) == PREALIGNS
    assert tuple(params["loss"].type.choices) == tuple(n for n in LOSSES if n != "landmarks")


def test_register_a_linear_model_writes_its_options(two_meshes, tmp_path):
    pytest.importorskip("pyvista")
    out = tmp_path / "out"
    result = run(
        "register",
        *two_meshes,
        "-o",
        str(out),
        "--model",
        "rigid",
        "--max-iter",
        "7",
        "--no-picture",
    )
    assert result.exit_code == 0, result.output
    options = json.loads((out / "registration.json").read_text())["options"]
    assert options["model"] == "rigid" and options["lddmm"] is None
    assert options["prealign"]["kind"] == "rigid" and options["optimizer"]["max_iter"] == 7


@pytest.fixture
def no_work(monkeypatch):
    """Make any loading or registering fail loudly: the command must stop before."""
    import otreg
    from otreg import datasets

    def work(*args, **kwargs):
        raise AssertionError("the command did work before checking its output folder")

    for module, name in ((otreg, "load_shape"), (otreg, "register"), (datasets, "fsaverage5")):
        monkeypatch.setattr(module, name, work)


def test_an_unwritable_output_folder_is_refused_before_any_work(two_meshes, tmp_path, no_work):
    (tmp_path / "afile").write_text("x")
    bad = str(tmp_path / "afile" / "out")
    for args in (["register", *two_meshes, "-o", bad], ["demo", "-o", bad, "--points", "400"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1, result.output
        assert "afile" in result.output and "is a file" in result.output
        assert "Traceback" not in result.output and result.exception is not None
        assert not isinstance(result.exception, AssertionError)


@pytest.mark.skipif(
    hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0,
    reason="root writes into read-only folders",
)
def test_a_read_only_output_folder_is_refused_before_any_work(two_meshes, tmp_path, no_work):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        result = CliRunner().invoke(main, ["register", *two_meshes, "-o", str(ro)])
    finally:
        ro.chmod(0o700)
    assert result.exit_code == 1 and "ro" in result.output and "ermission" in result.output


def test_a_failed_run_leaves_no_output_folder_it_created(two_meshes, tmp_path):
    out = tmp_path / "new" / "deep"
    result = CliRunner().invoke(
        main, ["register", str(tmp_path / "none.vtk"), two_meshes[1], "-o", str(out)]
    )
    assert result.exit_code == 1 and "does not exist" in result.output
    assert not (tmp_path / "new").exists()


def test_a_folder_without_write_permission_is_refused_before_any_work(
    two_meshes, tmp_path, no_work, monkeypatch
):
    import errno
    import tempfile

    def denied(*args, dir=None, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(dir))

    monkeypatch.setattr(tempfile, "mkstemp", denied)  # what a read-only folder does, even to root
    result = CliRunner().invoke(main, ["register", *two_meshes, "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"cannot write into the folder {tmp_path / 'out'}: Permission denied" in result.output


# ----------------------------------------------------------------------------- hygiene
def test_label_or_level_for_meshes_only_is_a_usage_error(two_meshes, tmp_path, no_work):
    for option in ("--label", "--level"):
        result = CliRunner().invoke(
            main, ["register", *two_meshes, "-o", str(tmp_path / "out"), option, "3"]
        )
        assert result.exit_code == 1, result.output
        assert f"{option} applies to volumes" in result.output
        assert "a.vtk" in result.output and "b.ply" in result.output
        result = CliRunner().invoke(main, ["distance", *two_meshes, option, "3"])
        assert result.exit_code == 1 and f"{option} applies to volumes" in result.output
    assert not (tmp_path / "out").exists()


def test_register_progress_is_off_without_a_terminal_unless_asked(
    two_meshes, tmp_path, monkeypatch
):
    from otreg.batch import job

    real, seen = job.register, []

    def register(*args, progress=True, **kwargs):
        seen.append(progress)
        return real(*args, progress=progress, **kwargs)

    monkeypatch.setattr(job, "register", register)
    for flag, expected in (([], False), (["--progress"], True), (["--no-progress"], False)):
        out = str(tmp_path / f"out{len(seen)}")
        args = ["register", *two_meshes, "-o", out, "--model", "rigid", "--no-picture", *flag]
        result = CliRunner().invoke(main, args)  # CliRunner's stderr is not a terminal
        assert result.exit_code == 0, result.output
        assert seen[-1] is expected


def test_a_second_run_without_pictures_leaves_none_of_the_first(two_meshes, tmp_path, monkeypatch):
    import torch

    from otreg.batch import job

    out = str(tmp_path / "out")
    base = ["register", *two_meshes, "-o", out, "--model", "rigid"]
    assert run(*base).exit_code == 0
    assert (tmp_path / "out" / "picture.png").is_file()
    threads = []
    real = job.register

    def register(*args, **kwargs):
        threads.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(job, "register", register)
    before = torch.get_num_threads()
    try:
        assert run(*base, "--no-picture", "--threads", "1").exit_code == 0
    finally:
        torch.set_num_threads(before)
    assert threads == [1]
    assert not (tmp_path / "out" / "picture.png").exists()  # not the first run's, stale
    assert not (tmp_path / "out" / "history.png").exists()


def registered_ball(tmp_path):
    """A 20 mm sphere (842 vertices) in tmp_path / "src.vtk", registered rigidly by the CLI
    onto its copy moved by 1 mm (tmp_path / "tgt.vtk"), the result in tmp_path / "r":
    ``(the sphere, the target's path)``."""
    import pyvista as pv

    from otreg import Shape, save_shape

    ball = Shape.from_pyvista(pv.Sphere(radius=20))
    src = save_shape(ball, tmp_path / "src.vtk")
    tgt = save_shape(ball.with_points(ball.points + 1.0), tmp_path / "tgt.vtk")
    assert run("register", str(src), str(tgt), "-o", str(tmp_path / "r"), "--model",
               "rigid", "--no-picture").exit_code == 0  # fmt: skip
    return ball, tgt


def test_transfer_carries_a_label_file_through_a_saved_registration(tmp_path):

    from otreg.io import VertexValues, load_values, save_values

    ball, tgt = registered_ball(tmp_path)
    labels = (ball.points[:, 2] > 0).long() + 1
    table = {1: ("south", (0.0, 0.0, 1.0, 1.0)), 2: ("north", (1.0, 0.0, 0.0, 1.0))}
    save_values(VertexValues(labels, table), tmp_path / "src.label.gii")
    out = tmp_path / "on-target.label.gii"
    r = run("transfer", str(tmp_path / "r"), str(tmp_path / "src.label.gii"), "-o", str(out))
    assert r.exit_code == 0, r.output
    assert f"labels at {ball.n_points:,} target vertices" in r.output
    back = load_values(out)
    assert back.label_table[2][0] == "north"
    assert float((back.values == labels).double().mean()) > 0.95  # a 1 mm shift
    r = run("transfer", str(tmp_path / "r"), str(tmp_path / "src.label.gii"), "-o",
            str(tmp_path / "src.label.gii"))  # fmt: skip
    assert r.exit_code == 1 and "never overwrites" in r.output
    r = run("transfer", str(tmp_path / "r"), str(tmp_path / "nope.func.gii"), "-o", str(out))
    assert r.exit_code == 1 and "nope.func.gii does not exist" in r.output
    # OUTPUT's folder is made; a file where it goes is named as such ('File exists')
    deep = tmp_path / "new" / "sub" / "on-target.label.gii"
    r = run("transfer", str(tmp_path / "r"), str(tmp_path / "src.label.gii"), "-o", str(deep))
    assert r.exit_code == 0 and deep.is_file(), r.output
    for below in ("", "deeper"):
        inside = tmp_path / "src.label.gii" / below / "out.label.gii"
        r = run("transfer", str(tmp_path / "r"), str(tmp_path / "src.label.gii"), "-o",
                str(inside))  # fmt: skip
        assert r.exit_code == 1 and "src.label.gii is a file, not a folder" in r.output, r.output


def test_transfer_writes_the_confidence_and_follows_the_output_name(tmp_path):
    """Labels' confidence goes beside the output (register and batch wrote it, transfer
    only counted it); labels stored as floats, asked for as a .label.gii, are carried as
    labels (they were carried as a map, then refused as 'holds labels but the values are
    float32'); a failed batch pair's folder is named as such (not 'parameters.npz is
    missing')."""
    import numpy as np

    from otreg.io import load_values, save_values

    ball, tgt = registered_ball(tmp_path)
    halves = ((ball.points[:, 2] > 0).float() + 1).numpy()
    np.save(tmp_path / "halves.npy", halves)  # whole-number floats
    out = tmp_path / "on-target.label.gii"
    r = run("transfer", str(tmp_path / "r"), str(tmp_path / "halves.npy"), "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "labels at" in r.output and "on-target_confidence.npy" in r.output
    confidence = np.load(tmp_path / "on-target_confidence.npy")
    assert confidence.shape == (ball.n_points,) and 0 <= confidence.min() <= 1
    assert load_values(out).is_labels
    as_map = tmp_path / "z.func.gii"
    save_values(ball.points[:, 2].clone(), tmp_path / "z_src.func.gii")
    assert run("transfer", str(tmp_path / "r"), str(tmp_path / "z_src.func.gii"), "-o",
               str(as_map)).exit_code == 0  # fmt: skip
    assert not (tmp_path / "z_confidence.npy").exists()  # a map has none
    failed = tmp_path / "failed-pair"
    failed.mkdir()
    (failed / "sub-01_error.json").write_text(json.dumps({
        "format": 1, "pair_id": "sub-01", "status": "failed",
        "error": {"class": "bad input", "reason": "values hold 1 NaN"}}))  # fmt: skip
    r = run("transfer", str(failed), str(tmp_path / "z_src.func.gii"), "-o", str(as_map))
    assert r.exit_code == 1 and "holds no registration: its pair failed" in r.output, r.output
    assert "values hold 1 NaN" in r.output


def test_transfer_keeps_labels_labels_and_writes_their_files_both_or_neither(tmp_path):
    """A label file written to a .func.gii stays labels (it was averaged into fractions of
    label ids, silently); a map carried from labels has no table (it kept it, and a label
    warning followed); a map written where labels were removes their stale confidence;
    where the confidence cannot be written, neither file is (a traceback, and the labels
    left without it); the errors name OUTPUT's name and VALUES' file, not the API's words."""
    import numpy as np

    from otreg import Registration
    from otreg.io import VertexValues, load_values, save_values

    ball, tgt = registered_ball(tmp_path)
    labels = (ball.points[:, 2] > 0).long() * 10 + 1  # 1 and 11: averages would show
    table = {1: ("south", (0.0, 0.0, 1.0, 1.0)), 11: ("north", (1.0, 0.0, 0.0, 1.0))}
    values = save_values(VertexValues(labels, table), tmp_path / "src.label.gii")

    def transfer(*args):
        return run("transfer", str(tmp_path / "r"), *map(str, args))

    r = transfer(values, "-o", tmp_path / "l.func.gii")
    assert r.exit_code == 0 and "labels at" in r.output, r.output
    assert "without their table" in r.output  # the format's loss, said
    assert set(np.unique(load_values(tmp_path / "l.func.gii").values.numpy())) <= {1, 11}
    carried = Registration.load(tmp_path / "r").transfer(values, kind="map")
    assert carried.label_table is None and not carried.is_labels
    r = transfer(values, "--kind", "map", "-o", tmp_path / "m.npy")
    assert r.exit_code == 0 and "warning" not in r.output, r.output
    assert transfer(values, "-o", tmp_path / "z.npy").exit_code == 0
    assert (tmp_path / "z_confidence.npy").is_file()
    r = transfer(values, "--kind", "map", "-o", tmp_path / "z.npy")
    assert r.exit_code == 0 and "removed" in r.output, r.output
    assert not (tmp_path / "z_confidence.npy").exists()
    (tmp_path / "c_confidence.npy").mkdir()  # the confidence cannot be written
    r = transfer(values, "-o", tmp_path / "c.label.gii")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "cannot write" in r.output and "c_confidence.npy" in r.output
    assert not (tmp_path / "c.label.gii").exists()
    save_values(ball.points[:, 2].clone(), tmp_path / "z_src.func.gii")
    r = transfer(tmp_path / "z_src.func.gii", "-o", tmp_path / "q.annot")
    assert r.exit_code == 1 and "OUTPUT's name (q.annot) asks for labels" in r.output, r.output
    np.save(tmp_path / "short.npy", np.zeros(7))
    r = transfer(tmp_path / "short.npy", "-o", tmp_path / "s.func.gii")
    assert r.exit_code == 1 and "short.npy: values have shape (7,)" in r.output, r.output
    (tmp_path / "empty").mkdir()
    r = run("transfer", str(tmp_path / "empty"), str(values), "-o", str(tmp_path / "e.npy"))
    assert r.exit_code == 1 and "is not a registration's folder or file" in r.output, r.output
    for name in ("c.label.gii", "q.annot", "s.func.gii", "e.npy"):  # the refused outputs
        assert not (tmp_path / name).exists(), name
    assert not list(tmp_path.glob(".*tmp*"))  # nor their temporary files


def test_values_of_another_hemisphere_are_refused(tmp_path):
    """A values file whose GIFTI says CortexRight, carried from a surface whose GIFTI says
    CortexLeft (same vertex count): refused naming both (it was carried silently); so is a
    FreeSurfer rh.*.annot (its name is all that says its side)."""
    import nibabel as nib
    import pyvista as pv

    from otreg import Shape, save_shape
    from otreg.io import VertexValues, gifti_structure, load_values, save_values

    ball = Shape.from_pyvista(pv.Sphere(radius=20))
    src = save_shape(ball, tmp_path / "src.surf.gii")
    img = nib.load(src)
    img.meta["AnatomicalStructurePrimary"] = "CortexLeft"
    nib.save(img, src)
    assert gifti_structure(src) == "CortexLeft"
    tgt = save_shape(ball.with_points(ball.points + 1.0), tmp_path / "tgt.vtk")
    assert run("register", str(src), str(tgt), "-o", str(tmp_path / "r"), "--model",
               "rigid", "--no-picture").exit_code == 0  # fmt: skip
    # a GIFTI says its structure; FreeSurfer's .annot (and morphometry) files by name alone
    halves = VertexValues(
        (ball.points[:, 2] > 0).long(), {0: ("s", (0, 0, 1, 1)), 1: ("n", (1, 0, 0, 1))}
    )
    for side, ok in (("CortexRight", False), ("CortexLeft", True)):
        values = save_values(ball.points[:, 2].clone(), tmp_path / f"{side}.func.gii")
        img = nib.load(values)
        img.meta["AnatomicalStructurePrimary"] = side
        nib.save(img, values)
        annot = save_values(halves, tmp_path / f"{'lh' if ok else 'rh'}.halves.annot")
        for given, why in ((values, "AnatomicalStructurePrimary"), (annot, "lh./rh. name")):
            assert load_values(given).structure == side
            out = tmp_path / f"on-target-{given.name}"
            r = run("transfer", str(tmp_path / "r"), str(given), "-o", str(out))
            if ok:
                assert r.exit_code == 0, r.output
            else:
                assert r.exit_code == 1 and "belong to CortexRight" in r.output, r.output
                assert why in r.output and "src.surf.gii) to CortexLeft" in r.output
                assert not out.exists()
    # values carried onto the source say its structure in the GIFTI file written
    on_target = save_values(ball.points[:, 0].clone(), tmp_path / "x.func.gii")
    back = tmp_path / "x_on_source.func.gii"
    r = run("transfer", str(tmp_path / "r"), str(on_target), "-o", str(back), "--to", "source")
    assert r.exit_code == 0, r.output
    assert gifti_structure(back) == "CortexLeft" and gifti_structure(on_target) is None


def test_device_is_checked_before_any_work(two_meshes, tmp_path, no_work):
    """--device: a name that is no device is a usage error; CUDA where torch sees none says
    so (the same for a batch run locally); cpu runs as without it."""
    import torch

    base = ["register", *two_meshes, "-o", str(tmp_path / "out"), "--model", "rigid"]
    result = CliRunner().invoke(main, [*base, "--device", "tpu"])
    assert result.exit_code == 1 and "'tpu'; give cpu, cuda or cuda:N" in result.output
    if not torch.cuda.is_available():
        result = CliRunner().invoke(main, [*base, "--device", "cuda"])
        assert result.exit_code == 1 and "sees no CUDA device here" in result.output
        assert "Invalid value for '--device'" in result.output  # the option, not a function
        assert not (tmp_path / "out").exists()
        rows = tmp_path / "pairs.csv"
        rows.write_text(f"pair_id,source,target\np1,{two_meshes[0]},{two_meshes[1]}\n")
        result = CliRunner().invoke(main, ["batch", str(rows), "-o", str(tmp_path / "b"),
                                           "--device", "cuda"])  # fmt: skip
        assert result.exit_code == 1 and "sees no CUDA device here" in result.output


def test_register_on_the_cpu_device_writes_its_record(two_meshes, tmp_path):
    out = tmp_path / "out"
    args = ["register", *two_meshes, "-o", str(out), "--model", "rigid", "--no-picture"]
    assert run(*args, "--device", "cpu").exit_code == 0
    assert json.loads((out / "registration.json").read_text())["metrics"]["mean_mm"] >= 0


def test_no_refine_reaches_register(two_meshes, tmp_path):
    pytest.importorskip("pyvista")
    from otreg.batch import JobOptions

    out = tmp_path / "out"
    args = ["register", *two_meshes, "-o", str(out), "--max-iter", "2", "--no-picture"]
    result = run(*args, "--no-refine")
    assert result.exit_code == 0, result.output
    options = json.loads((out / "registration.json").read_text())["options"]
    assert options["model"] == "lddmm" and options["refine"] is None
    assert JobOptions().register_options()["refine"] is True
    with pytest.raises(TypeError, match="row 3: refine must be true or false, got 'yes'"):
        JobOptions.from_mapping({"refine": "yes"}, "row 3")


def _a_run_carrying_a_map(tmp_path):
    """A rigid registration of two balls into ``tmp_path/r`` that carries a map onto the
    target (to-target_z.func.gii): ``(the command without the map, the folder)``."""
    import pyvista as pv

    from otreg import Shape, save_shape
    from otreg.io import save_values

    ball = Shape.from_pyvista(pv.Sphere(radius=20))
    src = save_shape(ball, tmp_path / "src.vtk")
    tgt = save_shape(ball.with_points(ball.points + 1.0), tmp_path / "tgt.vtk")
    save_values(ball.points[:, 2].clone(), tmp_path / "z.func.gii")
    out = tmp_path / "r"
    base = ["register", str(src), str(tgt), "-o", str(out), "--model", "rigid", "--no-picture"]
    first = run(*base, "--source-values", str(tmp_path / "z.func.gii"))
    assert first.exit_code == 0 and "to-target_z.func.gii" in first.output
    return base, out


def test_a_second_run_replaces_the_first_runs_carried_files_and_names_only_its_own(tmp_path):
    """The first run carries a map; the second, into the same folder, carries none: the
    first's to-target file goes, and the 'wrote' line lists what the second wrote."""
    base, out = _a_run_carrying_a_map(tmp_path)
    (out / "notes.txt").write_text("mine")  # not a job's file: kept
    second = run(*base)
    assert second.exit_code == 0
    assert "to-target_z.func.gii" not in second.output
    assert sorted(p.name for p in out.iterdir()) == [
        ".otreg-outputs",
        "notes.txt",
        "parameters.npz",
        "registration.json",
        "warped.vtk",
    ]


def test_a_users_file_with_a_jobs_name_is_never_removed(two_meshes, tmp_path):
    """A picture.png and a metrics file the user put in the folder before any otreg run
    there are kept by a run that writes no picture: only what an earlier run recorded
    writing goes."""
    src, tgt = two_meshes
    out = tmp_path / "r"
    out.mkdir()
    (out / "picture.png").write_text("my photo")
    (out / "history.png").write_text("my plot")
    base = ["register", str(src), str(tgt), "-o", str(out), "--model", "rigid", "--no-picture"]
    assert run(*base).exit_code == 0
    assert (out / "picture.png").read_text() == "my photo"
    assert (out / "history.png").read_text() == "my plot"
    written = (out / ".otreg-outputs").read_text().split()
    assert "warped.vtk" in written and "picture.png" not in written


def test_values_are_checked_before_the_fit(tmp_path, monkeypatch):
    """A values file of the wrong length or holding NaN fails before register runs,
    naming the file (and, for the other side's count, saying so), and writes nothing."""
    import pyvista as pv
    import torch

    from otreg import Shape, save_shape
    from otreg.batch import job
    from otreg.io import save_values

    ball = Shape.from_pyvista(pv.Sphere(radius=20))
    small = Shape.from_pyvista(pv.Sphere(radius=20, theta_resolution=10, phi_resolution=10))
    src = save_shape(ball, tmp_path / "src.vtk")
    tgt = save_shape(small, tmp_path / "tgt.vtk")
    save_values(torch.zeros(100), tmp_path / "short.func.gii")
    save_values(torch.zeros(small.n_points), tmp_path / "theirs.func.gii")
    nan = torch.zeros(ball.n_points)
    nan[3] = float("nan")
    save_values(nan, tmp_path / "nan.func.gii")
    monkeypatch.setattr(job, "register", lambda *a, **k: pytest.fail("the fit ran"))
    out = tmp_path / "r"
    for name, says in [
        ("short", "values have shape (100,); the source has"),
        ("theirs", "the target's vertex count: are these target values?"),
        ("nan", "1 NaN or infinite entries"),
    ]:
        given = str(tmp_path / f"{name}.func.gii")
        args = ["register", str(src), str(tgt), "-o", str(out), "--source-values", given]
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1, r.output
        assert f"source values {tmp_path / name}.func.gii" in r.output and says in r.output
        assert not out.exists()


def test_transfer_refuses_a_target_that_was_not_registered_onto(tmp_path):
    """--target of another surface (fewer vertices; the same vertices moved and scaled)
    is refused, naming what differs; the recorded target's file replaced likewise."""
    import pyvista as pv

    from otreg import Shape, save_shape
    from otreg.io import save_values

    ball, tgt = registered_ball(tmp_path)
    save_values(ball.points[:, 2].clone(), tmp_path / "z.func.gii")
    other = Shape.from_pyvista(pv.Sphere(radius=20, theta_resolution=10, phi_resolution=10))
    save_shape(other, tmp_path / "other.vtk")
    save_shape(ball.with_points(ball.points * 1.1), tmp_path / "bigger.vtk")
    base = ["transfer", str(tmp_path / "r"), str(tmp_path / "z.func.gii"), "-o"]
    for name, says in [("other", "vertices, the registered target"), ("bigger", "an area of")]:
        r = run(*base, str(tmp_path / "out.func.gii"), "--target", str(tmp_path / f"{name}.vtk"))
        assert r.exit_code == 1 and "is not the surface this registration" in r.output
        assert says in r.output and not (tmp_path / "out.func.gii").exists()
    save_shape(ball.with_points(ball.points + 5.0), tgt)  # the recorded file, replaced
    r = run(*base, str(tmp_path / "out.func.gii"))
    assert r.exit_code == 1 and "centroid" in r.output
    save_shape(ball.with_points(ball.points + 1.0), tgt)
    assert run(*base, str(tmp_path / "out.func.gii")).exit_code == 0


def test_sigterm_during_register_leaves_no_output(two_meshes, tmp_path):
    """A scheduler's kill (SIGTERM) mid-run: exit by interrupt, no folder left behind."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    code = (
        "import os, signal, sys; from otreg.batch import job; from otreg.cli import main\n"
        "def slow(*a, **k):\n    print('fitting', flush=True); import time; time.sleep(60)\n"
        "job.register = slow\n"
        f"sys.argv = ['otreg', 'register', *{list(two_meshes)!r}, '-o', {str(out)!r}]\n"
        "main()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "fitting"
        assert out.is_dir()  # the staging folder is in it
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130  # as a shell's Ctrl-C, and as otreg batch exits
    deadline = time.monotonic() + 5
    while out.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not out.exists()


def test_transfer_of_values_of_the_other_side_says_which_way(tmp_path):
    import pyvista as pv

    from otreg import Shape, save_shape
    from otreg.io import save_values

    fine = Shape.from_pyvista(pv.Sphere(radius=20))
    coarse = Shape.from_pyvista(pv.Sphere(radius=20, theta_resolution=12, phi_resolution=12))
    src, tgt = save_shape(fine, tmp_path / "src.vtk"), save_shape(coarse, tmp_path / "tgt.vtk")
    assert run("register", str(src), str(tgt), "-o", str(tmp_path / "r"), "--model",
               "rigid", "--no-picture").exit_code == 0  # fmt: skip
    on_source = save_values(fine.points[:, 2].clone(), tmp_path / "s.func.gii")
    on_target = save_values(coarse.points[:, 2].clone(), tmp_path / "t.func.gii")
    for values, to, says in [
        (on_source, "source", "give --to target"),
        (on_target, "target", "give --to source"),
    ]:
        r = run("transfer", str(tmp_path / "r"), str(values), "-o", str(tmp_path / "o.func.gii"),
                "--to", to)  # fmt: skip
        assert r.exit_code == 1 and says in r.output, r.output
        assert r.output.count("--to") == 1 and "to='" not in r.output  # said once, as options
        assert not (tmp_path / "o.func.gii").exists()
    gone = tmp_path / "moved.vtk"
    tgt.rename(gone)
    r = run("transfer", str(tmp_path / "r"), str(on_source), "-o", str(tmp_path / "o.func.gii"))
    assert r.exit_code == 1 and "give --target (" in r.output


def test_an_interrupt_while_the_files_move_in_waits_until_they_all_have(tmp_path, monkeypatch):
    """SIGTERM arriving between two of the moves: every file of the new run is in place and
    the earlier run's carried file is gone (no mix of two runs), then the command stops as
    interrupted."""
    import os
    import signal
    from pathlib import Path

    from otreg.cli import _common

    base, out = _a_run_carrying_a_map(tmp_path)
    first = (out / "registration.json").read_text()
    real, moves = os.replace, []

    def replace(a, b):
        real(a, b)
        if Path(b).parent == out:  # a move into the folder (not a save into the staging)
            moves.append(b)
            if len(moves) == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(_common.os, "replace", replace)
    result = run(*base)
    assert result.exit_code == 130 and "interrupted" in result.output
    assert len(moves) == 4  # all three and the record moved after the signal came
    assert sorted(p.name for p in out.iterdir()) == [
        ".otreg-outputs",
        "parameters.npz",
        "registration.json",
        "warped.vtk",
    ]
    assert (out / "registration.json").read_text() != first


def test_transfer_keeps_the_confidence_of_other_labels_that_share_its_name(tmp_path):
    """A map written as atlas.func.gii beside labels written as atlas.label.gii left those
    labels without their confidence (atlas_confidence.npy, removed as 'stale'); labels
    whose confidence would replace another label file's are refused, naming it."""
    import numpy as np

    from otreg.io import VertexValues, save_values

    ball, tgt = registered_ball(tmp_path)
    labels = (ball.points[:, 2] > 0).long() + 1
    table = {1: ("south", (0.0, 0.0, 1.0, 1.0)), 2: ("north", (1.0, 0.0, 0.0, 1.0))}
    values = save_values(VertexValues(labels, table), tmp_path / "src.label.gii")
    thickness = save_values(ball.points[:, 0].clone(), tmp_path / "thick.func.gii")
    out = tmp_path / "out"
    out.mkdir()

    def transfer(given, name):
        return run("transfer", str(tmp_path / "r"), str(given), "-o", str(out / name))

    assert transfer(values, "atlas.label.gii").exit_code == 0
    confidence = (out / "atlas_confidence.npy").read_bytes()
    r = transfer(thickness, "atlas.func.gii")
    assert r.exit_code == 0 and "removed" not in r.output, r.output
    assert (out / "atlas_confidence.npy").read_bytes() == confidence  # kept, untouched
    r = transfer(values, "atlas.annot")  # its confidence would replace atlas.label.gii's
    assert r.exit_code == 1 and "is the confidence of atlas.label.gii" in r.output, r.output
    assert not (out / "atlas.annot").exists()
    assert (out / "atlas_confidence.npy").read_bytes() == confidence
    assert transfer(values, "atlas.label.gii").exit_code == 0  # (its own: written again)
    np.save(out / "z.func.npy", np.zeros(3))  # a map of a like name owns no confidence
    assert transfer(values, "z.npy").exit_code == 0  # labels, then a map in their place:
    assert np.load(out / "z.npy").dtype.kind == "i"
    r = transfer(thickness, "z.npy")  # their confidence is stale
    assert "removed" in r.output and not (out / "z_confidence.npy").exists(), r.output


def test_the_summary_prints_the_label_overlap_before_and_after(capsys):
    from otreg.cli.register import _print_outputs

    metrics = {"before_mean_mm": 3.0, "mean_mm": 0.5, "mean_ab_mm": 0.5, "mean_ba_mm": 0.6,
               "before_hausdorff_mm": 9.0, "hausdorff_mm": 2.0, "seconds": 1.0,
               "prealign_seconds": 0.1, "fit_seconds": 0.8, "metrics_seconds": 0.1,
               "dseg_dice": 0.912, "before_dseg_dice": 0.801}  # fmt: skip
    _print_outputs(metrics, "out", ["registration.json"])
    assert re.search(r"\n  dseg Dice +0\.801 before, 0\.912 after\n", capsys.readouterr().out)
