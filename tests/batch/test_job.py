"""One registration job: JobOptions checked when built (a bad manifest row stops a batch
before it starts), and ``otreg register`` as a batch of one (the same files and numbers)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from otreg import LBFGSOptions, LDDMMOptions, Shape, load_shape, save_shape
from otreg.batch import JobOptions, read_manifest, run_job
from otreg.batch.engine import run_batch
from otreg.cli import main
from otreg.registration import Registration

pv = pytest.importorskip("pyvista")


@pytest.mark.parametrize(
    "values, error, match",
    [
        ({"model": "no-such-model"}, ValueError, "row: model is 'no-such-model'; choose one of"),
        ({"prealign": "bspline"}, ValueError, "row: prealign is 'bspline'"),
        ({"loss": "landmarks"}, ValueError, "row: loss is 'landmarks'"),
        ({"sigma": -2}, ValueError, "row: sigma is -2"),
        ({"sigma": "wide"}, TypeError, "row: sigma must be a number"),
        ({"points": 50}, ValueError, "row: points is 50; it must be >= 100"),
        ({"max_iter": 2.5}, TypeError, "row: max_iter must be an integer"),
        ({"picture": "yes"}, TypeError, "row: picture must be true or false"),
        ({"blur": 2}, ValueError, "row: unknown option 'blur'; allowed: model"),
        ([1, 2], TypeError, "row must be a JSON object, got list"),
    ],
)
def test_job_options_name_the_field_and_the_value(values, error, match):
    with pytest.raises(error, match=match):
        JobOptions.from_mapping(values, "row")


def test_job_options_mean_the_library_objects():
    base = JobOptions.from_mapping({"max_iter": 4}, "batch")
    row = JobOptions.from_mapping({"sigma": 9, "model": "lddmm"}, "row", base)
    assert (row.max_iter, row.sigma, row.model) == (4, 9.0, "lddmm")
    kw = row.register_options()
    assert kw["model"] == LDDMMOptions(sigma=9.0) and kw["optimizer"] == LBFGSOptions(max_iter=4)
    assert JobOptions("affine").register_options()["model"] == "affine"
    assert JobOptions().record()["max_iter"] == LBFGSOptions().max_iter
    with pytest.raises(ValueError, match="JobOptions: model is 'tps'"):
        JobOptions("tps")


@pytest.mark.parametrize(
    "column, value",
    [("model", "no-such-model"), ("loss", "l2"), ("prealign", "bspline")],
)
def test_a_bad_manifest_row_is_refused_when_read_before_any_worker(
    tmp_path, monkeypatch, column, value
):
    for name in ("a.vtk", "b.vtk"):
        (tmp_path / name).write_text("not read")
    options = json.dumps({column: value}).replace('"', '""')
    (tmp_path / "pairs.csv").write_text(
        f'pair_id,source,target,options\nok,a.vtk,b.vtk,\nbad,a.vtk,b.vtk,"{options}"\n'
    )
    with pytest.raises(ValueError, match=f"line 3: pair bad: options: {column} is '{value}'"):
        read_manifest(tmp_path / "pairs.csv")

    def no_cluster(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr("otreg.batch.engine.Cluster", no_cluster)
    start = time.perf_counter()
    args = ["batch", str(tmp_path / "pairs.csv"), "-o", str(tmp_path / "out")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert f"line 3: pair bad: options: {column} is '{value}'" in result.output
    assert time.perf_counter() - start < 30 and not (tmp_path / "out").exists()


def _sphere(path: Path, radius: float, shift: float) -> str:
    mesh = pv.Sphere(radius=radius, theta_resolution=16, phi_resolution=16)
    shape = Shape.from_pyvista(mesh)
    return str(
        save_shape(shape.with_points(shape.points * torch.tensor([1.0, 1.1, 0.9]) + shift), path)
    )


def test_register_is_a_batch_of_one(tmp_path):
    """``otreg register`` and a one-row batch run the same job: the same files, the same
    numbers (the batch adds its record and log)."""
    pytest.importorskip("distributed")
    src = _sphere(tmp_path / "src.vtk", 20.0, 0.0)
    tgt = _sphere(tmp_path / "tgt.vtk", 22.0, 1.5)
    flags = ["--max-iter", "3", "--points", "200"]
    result = CliRunner().invoke(main, ["register", src, tgt, "-o", str(tmp_path / "one"), *flags])
    assert result.exit_code == 0, result.output
    (tmp_path / "pairs.csv").write_text(f"pair_id,source,target\np,{src},{tgt}\n")
    batch = run_batch(
        read_manifest(tmp_path / "pairs.csv"),
        tmp_path / "many",
        {"max_iter": 3, "points": 200},
        workers=1,
        threads=torch.get_num_threads(),
        report=False,
    )
    assert batch.exit_code == 0, batch.records
    one, many = tmp_path / "one", tmp_path / "many" / "pairs" / "p"
    assert sorted(p.name for p in one.iterdir()) == sorted(
        p.name for p in many.iterdir() if p.name not in ("metrics.json", "log.txt")
    )
    a, b = Registration.load(one), Registration.load(many)
    assert a.options == b.options
    timing = {"seconds", "prealign_seconds", "fit_seconds", "metrics_seconds"}
    for key, value in a.metrics.items():
        if key in timing or not isinstance(value, float):
            assert key in timing or value == b.metrics[key], key
            continue
        assert math.isclose(value, b.metrics[key], rel_tol=1e-6, abs_tol=1e-9), key
    np.testing.assert_allclose(a.warped.points, b.warped.points, rtol=1e-6, atol=1e-6)
    full = load_shape(src)  # --points 200 registers decimated copies; the whole source is saved
    assert a.warped.n_points == b.warped.n_points == full.n_points > 200
    assert torch.equal(a.warped.faces, full.faces)


def test_run_job_refuses_what_is_not_a_surface(tmp_path):
    cloud = tmp_path / "cloud.npy"
    np.save(cloud, np.random.default_rng(0).normal(size=(50, 3)))
    mesh = _sphere(tmp_path / "s.vtk", 20.0, 0.0)
    with pytest.raises(ValueError, match="cloud.npy has no triangles \\(a point cloud\\)"):
        run_job(cloud, mesh, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="source .* is a folder, not a file"):
        run_job(tmp_path, mesh, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="target .*nope.vtk does not exist"):
        run_job(mesh, tmp_path / "nope.vtk", tmp_path / "out")
    with pytest.raises(TypeError, match="options must be a JobOptions, got dict"):
        run_job(mesh, mesh, tmp_path / "out", {"model": "rigid"})
