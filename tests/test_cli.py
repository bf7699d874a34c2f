"""The otreg command line."""

import json
import re

import pytest
import torch
from click.testing import CliRunner

from otreg import Shape, save_shape
from otreg.cli import main
from tests.conftest import hide_module


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_info():
    result = run("info", "--no-keops")
    assert result.exit_code == 0 and "backends:" in result.output and "tensorized" in result.output


def test_circles_fixed_iterations_json():
    result = run("circles", "--n", "300", "--iters", "20", "--json")
    assert result.exit_code == 0
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["iterations"] == 20 and out["grad_norm"] > 0 and out["ot_value"] > 0


@pytest.fixture
def two_meshes(tmp_path):
    pts = torch.tensor([[0.0, 0, 0], [10, 0, 0], [0, 10, 0], [0, 0, 10]])
    faces = torch.tensor([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]])
    a = save_shape(Shape(pts, faces), tmp_path / "a.vtk")
    b = save_shape(Shape(pts + torch.tensor([3.0, 0, 0]), faces), tmp_path / "b.ply")
    return str(a), str(b)


def test_distance_between_a_mesh_and_its_translate(two_meshes):
    result = run(
        "distance", *two_meshes, "--blur", "0.5", "--tol", "1e-4", "--max-iter", "2000", "--json"
    )
    assert result.exit_code == 0
    out = json.loads(result.output)
    assert out["converged"]
    assert out["sqrt_2d_mm"] == pytest.approx(3.0, rel=1e-3)  # a translation by 3 mm


def test_distance_says_why_it_did_not_converge(two_meshes):
    args = ("distance", *two_meshes, "--blur", "0.05", "--tol", "1e-9", "--max-iter")
    refused = CliRunner().invoke(main, [*args, "1"])
    steps = re.search(r"schedule alone has (\d+) steps", refused.output).group(1)
    short = run(*args, steps)  # every iteration spent on the eps-scaling
    assert short.exit_code == 0
    assert "eps-scaling used all of --max-iter" in short.output and "nan" not in short.output
    cut = run("distance", *two_meshes, "--blur", "0.5", "--tol", "1e-9", "--max-iter", "40")
    assert re.search(r"not converged: marginal error \S+ >= tol 1e-09", cut.output), cut.output


def test_distance_reports_bad_files(two_meshes, tmp_path):
    result = CliRunner().invoke(main, ["distance", two_meshes[0], str(tmp_path / "none.vtk")])
    assert result.exit_code != 0 and "does not exist" in result.output
    result = CliRunner().invoke(main, ["distance", *two_meshes, "--blur", "-1"])
    assert result.exit_code != 0 and "--blur" in result.output
    for bad in ("2", "fast"):
        result = CliRunner().invoke(main, ["distance", *two_meshes, "--relaxation", bad])
        assert (
            result.exit_code != 0
            and "neither 'anderson', 'auto' nor a number in [1, 2)" in result.output
        )


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
    if pair == "synthetic":
        assert "vertex error" in result.output and m["vertex_error_mean_mm"] < 2.0


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
        assert result.exit_code == 2, result.output
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
    assert result.exit_code == 2 and "ro" in result.output and "ermission" in result.output


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
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"cannot write into the folder {tmp_path / 'out'}: Permission denied" in result.output


# ----------------------------------------------------------------------------- hygiene
def test_label_or_level_for_meshes_only_is_a_usage_error(two_meshes, tmp_path, no_work):
    for option in ("--label", "--level"):
        result = CliRunner().invoke(
            main, ["register", *two_meshes, "-o", str(tmp_path / "out"), option, "3"]
        )
        assert result.exit_code == 2, result.output
        assert f"{option} applies to volumes" in result.output
        assert "a.vtk" in result.output and "b.ply" in result.output
        result = CliRunner().invoke(main, ["distance", *two_meshes, option, "3"])
        assert result.exit_code == 2 and f"{option} applies to volumes" in result.output
    assert not (tmp_path / "out").exists()


def test_register_progress_is_off_without_a_terminal_unless_asked(
    two_meshes, tmp_path, monkeypatch
):
    import otreg

    real, seen = otreg.register, []

    def register(*args, progress=True, **kwargs):
        seen.append(progress)
        return real(*args, progress=progress, **kwargs)

    monkeypatch.setattr(otreg, "register", register)
    for flag, expected in (([], False), (["--progress"], True), (["--no-progress"], False)):
        out = str(tmp_path / f"out{len(seen)}")
        args = ["register", *two_meshes, "-o", out, "--model", "rigid", "--no-picture", *flag]
        result = CliRunner().invoke(main, args)  # CliRunner's stderr is not a terminal
        assert result.exit_code == 0, result.output
        assert seen[-1] is expected


def noisy(monkeypatch, module, name):
    """Make module.name print to stdout, from Python and from C (file descriptor 1)."""
    import os

    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        print("[KeOps] Compiling a formula ...")
        os.write(1, b"C-level noise\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


def test_json_output_is_one_json_line_even_when_libraries_print(two_meshes, monkeypatch, capfd):
    import otreg
    from otreg.ot import divergence

    noisy(monkeypatch, divergence, "divergence")
    noisy(monkeypatch, otreg, "sinkhorn")
    for args in (
        ["distance", *two_meshes, "--blur", "0.5", "--json"],
        ["circles", "--n", "200", "--iters", "5", "--json"],
    ):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert len(result.stdout.splitlines()) == 1
        assert isinstance(json.loads(result.stdout), dict)
        assert "[KeOps] Compiling" in result.stderr
        fd = capfd.readouterr()
        assert "C-level noise" not in fd.out and "C-level noise" in fd.err
    result = CliRunner().invoke(main, ["distance", *two_meshes, "--blur", "0.5"])
    assert "[KeOps] Compiling" in result.stdout  # without --json, nothing is redirected


def test_cli_errors_name_the_file_or_option(two_meshes, tmp_path):
    import numpy as np

    cloud = tmp_path / "cloud.npy"
    np.save(cloud, np.random.default_rng(0).random((50, 3)))
    result = CliRunner().invoke(
        main, ["register", str(cloud), two_meshes[1], "-o", str(tmp_path / "o")]
    )
    assert (
        result.exit_code == 1 and "cloud.npy" in result.output and "no triangles" in result.output
    )
    seg = tmp_path / "seg.nii.gz"
    seg.write_bytes(b"x")
    result = CliRunner().invoke(
        main, ["distance", str(seg), two_meshes[1], "--label", "1", "--level", "0.5"]
    )
    assert result.exit_code == 2 and "--level (a threshold" in result.output
    assert "not both" in result.output


def test_distance_warns_when_the_sizes_suggest_metres_and_millimetres(two_meshes, tmp_path):
    from otreg import load_shape

    mesh = load_shape(two_meshes[0])
    metres = save_shape(mesh.with_points(mesh.points / 1000), tmp_path / "in_metres.vtk")
    result = CliRunner().invoke(main, ["distance", two_meshes[0], str(metres), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["sqrt_2d_mm"] > 1
    assert re.search(
        r"^warning: otreg distance: .*a.vtk is 1000 times larger than .*in_metres.vtk .*"
        r"metres and millimetres",
        result.stderr,
        re.M,
    )
    src = save_shape(mesh.with_points(mesh.points * 1000), tmp_path / "in_um.vtk")
    args = ["register", str(src), two_meshes[1], "-o", str(tmp_path / "o"), "--model", "rigid"]
    result = CliRunner().invoke(main, [*args, "--no-picture"])
    assert result.exit_code == 0, result.output
    assert re.search(r"^warning: register: source is 1000 times larger", result.stderr, re.M)
