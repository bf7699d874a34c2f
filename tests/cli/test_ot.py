"""otreg distance: values, convergence messages, bad files, --json."""

import json
import re

import pytest
from click.testing import CliRunner

from otreg import save_shape
from otreg.cli import main
from tests.cli.conftest import run


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
    assert short.exit_code == 3
    assert "eps-scaling used all of --max-iter" in short.output and "nan" not in short.output
    # (at 40 it converges now: float32 that crawls on its rounding floor goes on in float64)
    cut = run("distance", *two_meshes, "--blur", "0.5", "--tol", "1e-9", "--max-iter", "30")
    assert re.search(r"not converged: marginal error \S+ >= tol 1e-09", cut.output), cut.output
    assert cut.exit_code == 3
    as_json = run("distance", *two_meshes, "--blur", "0.5", "--tol", "1e-9", "--max-iter", "30",
                  "--json")  # fmt: skip
    assert as_json.exit_code == 3 and json.loads(as_json.stdout)["converged"] is False
    assert "warning: not converged" in as_json.stderr


def test_distance_with_tol_0_runs_a_fixed_count_and_exits_0(two_meshes):
    """--tol 0 asks for exactly --max-iter iterations, as tol=0 does in the library: no
    warning, exit 0, "stopped": "max_iter" in --json."""
    fixed = run("distance", *two_meshes, "--blur", "0.5", "--tol", "0", "--max-iter", "60",
                "--json")  # fmt: skip
    assert fixed.exit_code == 0, fixed.output
    out = json.loads(fixed.stdout)
    assert out["stopped"] == "max_iter" and out["iterations"] == 60
    assert "warning" not in fixed.stderr


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
    from otreg.cli import ot

    noisy(monkeypatch, ot, "divergence")
    for args in (["distance", *two_meshes, "--blur", "0.5", "--json"],):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert len(result.stdout.splitlines()) == 1
        assert isinstance(json.loads(result.stdout), dict)
        assert "[KeOps] Compiling" in result.stderr
        fd = capfd.readouterr()
        assert "C-level noise" not in fd.out and "C-level noise" in fd.err
    result = CliRunner().invoke(main, ["distance", *two_meshes, "--blur", "0.5"])
    assert "[KeOps] Compiling" in result.stdout  # without --json, nothing is redirected


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


def test_distance_smooth_sets_the_smoothing_of_a_volume(tmp_path):
    """A label volume against its own unsmoothed surface: the same with ``--smooth 0``,
    apart with the default smoothing; a negative count is refused."""
    nib = pytest.importorskip("nibabel")
    import numpy as np

    from otreg import load_shape

    g = np.mgrid[:20, :20, :20]
    data = (((g - 9.5) ** 2).sum(0) <= 36).astype(np.int16) * 5
    nib.save(nib.Nifti1Image(data, np.eye(4)), str(tmp_path / "v.nii.gz"))
    steps = save_shape(load_shape(tmp_path / "v.nii.gz", label=5, smooth=0), tmp_path / "s.vtk")
    args = ["distance", str(tmp_path / "v.nii.gz"), str(steps), "--label", "5", "--json"]
    same = json.loads(run(*args, "--smooth", "0").output)["sqrt_2d_mm"]
    apart = json.loads(run(*args).output)["sqrt_2d_mm"]
    assert same < 0.005 < 0.01 < apart, (same, apart)  # mm: 0.002 and 0.02
    refused = CliRunner().invoke(main, [*args, "--smooth", "-1"])
    assert refused.exit_code == 1 and "--smooth" in refused.output


def test_distance_defaults_are_the_library_defaults():
    """--max-iter's default was 1,000 where the library's is 2,000, --scaling's 0.7 where
    the library's is 0.5."""
    import otreg

    command = main.get_command(None, "distance")
    defaults = {p.name: p.default for p in command.params}
    options = otreg.SinkhornOptions(blur=1.0)
    assert defaults["max_iter"] == options.max_iter and defaults["tol"] == options.tol
    assert defaults["scaling"] == options.scaling and defaults["relaxation"] == options.relaxation
