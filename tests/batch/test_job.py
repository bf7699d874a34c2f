"""One registration job: JobOptions checked when built (a bad manifest row stops a batch
before it starts), and ``otreg register`` as a batch of one (the same files and numbers)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from otreg import LBFGSOptions, LDDMMOptions, Shape, load_shape, save_shape
from otreg.batch import JobOptions, Pair, plan_batch, read_manifest, run_job, write_manifest
from otreg.batch.engine import run_batch
from otreg.cli import main
from otreg.io import VertexValues, load_values, save_values, unlabelled
from otreg.registration import Registration
from otreg.registration.result import OUTPUTS

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
        ({"smooth": -1}, ValueError, "row: smooth is -1; it must be >= 0"),
        ({"smooth": True}, TypeError, "row: smooth must be an integer"),
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


def test_the_smooth_option_reaches_the_inputs_of_a_job(tmp_path):
    """A label volume's surface is smoothed by default; ``smooth=0`` keeps its voxel steps
    (vertices on the half-voxel lattice), in JobOptions (a manifest row's options) and on
    the command line (``--smooth 0``: the target's area is the staircase's)."""
    nib = pytest.importorskip("nibabel")
    g = np.mgrid[:24, :24, :24]
    data = (((g - 11.5) / np.array([7.0, 5.0, 4.0])[:, None, None, None]) ** 2).sum(0) <= 1
    nib.save(nib.Nifti1Image(data.astype(np.int16) * 17, np.eye(4)), str(tmp_path / "a.nii.gz"))

    def on_lattice(shape):  # marching cubes puts each vertex halfway along a voxel edge
        twice = 2 * shape.points.double()
        return bool(torch.all((twice - twice.round()).abs() < 1e-4))

    vol = tmp_path / "a.nii.gz"
    steps_only = JobOptions("rigid", prealign="none", picture=False, smooth=0)
    assert on_lattice(run_job(vol, vol, tmp_path / "d", steps_only, label=17).full_source)
    default = JobOptions("rigid", prealign="none", picture=False)
    smoothed = run_job(vol, vol, tmp_path / "e", default, label=17)
    assert not on_lattice(smoothed.full_source)
    args = ["register", str(tmp_path / "a.nii.gz"), str(tmp_path / "a.nii.gz"), "--label", "17"]
    args += ["--smooth", "0", "--model", "rigid", "--no-picture", "-o", str(tmp_path / "f")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    area = json.loads((tmp_path / "f" / "registration.json").read_text())["target_surface"]
    steps = load_shape(tmp_path / "a.nii.gz", label=17, smooth=0)  # the staircase's area
    assert area["area_mm2"] == pytest.approx(float(steps.area), rel=1e-5)
    assert float(smoothed.full_source.area) < 0.95 * float(steps.area)
    ball = Shape.from_pyvista(pv.Sphere(radius=20))
    once = run_job(ball, ball, tmp_path / "g", JobOptions("rigid", picture=False, smooth=5))
    assert not torch.equal(once.full_source.points, ball.points)  # a Shape is smoothed too


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
    assert sorted(p.name for p in one.iterdir() if p.name != ".otreg-outputs") == sorted(
        p.name for p in many.iterdir() if p.name not in ("metrics.json", "log.txt")
    )
    a, b = Registration.load(one), Registration.load(many)
    assert a.options == b.options
    timing = {"seconds", "prealign_seconds", "fit_seconds", "metrics_seconds", "read_seconds"}
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


def _values(tmp_path: Path, shape_file: str, stem: str) -> tuple[str, str]:
    """A map (the height z, .func.gii) and labels (the upper half, .label.gii with a table)
    at the vertices of a saved surface."""
    z = load_shape(shape_file).points[:, 2]
    table = {1: ("lower", (0.0, 0.0, 1.0, 1.0)), 2: ("upper", (1.0, 0.0, 0.0, 1.0))}
    height = save_values(z, tmp_path / f"{stem}_height.func.gii")
    labels = save_values(VertexValues((z > 0).long() + 1, table), tmp_path / f"{stem}.label.gii")
    return str(height), str(labels)


def test_a_job_carries_values_both_ways(tmp_path):
    """Values on the source land on the target and the target's on the source: a map close
    to the same function there, labels with their table and a confidence."""
    src = _sphere(tmp_path / "src.vtk", 20.0, 0.0)
    tgt = _sphere(tmp_path / "tgt.vtk", 20.0, 1.0)
    src_values = _values(tmp_path, src, "sub-01_hemi-L")
    tgt_values = _values(tmp_path, tgt, "atlas")
    out = run_job(
        src,
        tgt,
        tmp_path / "out",
        JobOptions("rigid", picture=False),
        source_values=src_values,
        target_values=tgt_values[1:],
    )
    assert out.files["to-target:height.func.gii"] == "to-target_height.func.gii"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [
            *OUTPUTS.values(),
            "to-target_height.func.gii",
            "to-target_sub-01_hemi-L.label.gii",
            "to-target_sub-01_hemi-L_confidence.npy",
            "to-source_atlas.label.gii",
            "to-source_atlas_confidence.npy",
        ]
    )
    target_z = load_shape(tgt).points[:, 2]
    height = load_values(tmp_path / "out" / "to-target_height.func.gii")
    assert height.n_vertices == target_z.numel()
    assert float((height.values - (target_z - 1.0)).abs().max()) < 1.0  # shifted by 1 mm
    labels = load_values(tmp_path / "out" / "to-source_atlas.label.gii")
    assert labels.label_table[2][0] == "upper" and labels.n_vertices == load_shape(src).n_points
    source_z = load_shape(src).points[:, 2]
    agree = (labels.values == (source_z + 1.0 > 0).long() + 1).float().mean()
    assert float(agree) > 0.97
    confidence = np.load(tmp_path / "out" / "to-source_atlas_confidence.npy")
    assert confidence.min() >= 1 / 3 - 1e-6 and confidence.max() <= 1 + 1e-6


def test_freesurfer_files_are_carried_as_gifti_under_their_bids_names(tmp_path):
    """surf/lh.thickness and label/lh.aparc.annot landed as to-target_lh.thickness (no
    extension, the source's hemisphere on the target: no BIDS name); now as GIFTI, the
    labels with their table."""
    src = _sphere(tmp_path / "src.vtk", 20.0, 0.0)
    tgt = _sphere(tmp_path / "tgt.vtk", 20.0, 1.0)
    z = load_shape(src).points[:, 2]
    table = {0: ("lower", (0.0, 0.0, 1.0, 1.0)), 1: ("upper", (1.0, 0.0, 0.0, 1.0))}
    thickness = save_values(z + 30.0, tmp_path / "lh.thickness")
    aparc = save_values(VertexValues((z > 0).long(), table), tmp_path / "lh.aparc.annot")
    options = JobOptions("rigid", picture=False)
    out = run_job(src, tgt, tmp_path / "out", options, source_values=[thickness, aparc])
    assert out.files["to-target:thickness.shape.gii"] == "to-target_thickness.shape.gii"
    assert out.files["to-target:aparc.label.gii"] == "to-target_aparc.label.gii"
    moved = load_values(tmp_path / "out" / "to-target_thickness.shape.gii")
    target_z = load_shape(tgt).points[:, 2]
    assert float((moved.values - (target_z + 29.0)).abs().max()) < 1.0
    labels = load_values(tmp_path / "out" / "to-target_aparc.label.gii")
    assert labels.label_table[1][0] == "upper" and labels.n_vertices == target_z.numel()
    assert float((labels.values == (target_z - 1.0 > 0).long()).float().mean()) > 0.97
    assert (tmp_path / "out" / "to-target_aparc_confidence.npy").is_file()


def test_a_confidence_file_is_named_after_its_values_less_their_extension():
    """Gzipped GIFTI too: to-target_atlas.label.gii.gz's confidence was
    to-target_atlas.label.gii.gz_confidence.npy."""
    from otreg.io import values_stem

    for name, stem in [("atlas.label.gii.gz", "atlas"), ("atlas.label.gii", "atlas"),
                       ("thick.func.gii.gz", "thick"), ("lh.aparc.annot", "lh.aparc"),
                       ("x.mgz", "x"), ("lh.thickness", "lh.thickness")]:  # fmt: skip
        assert values_stem(name) == stem


def test_labels_carried_both_ways_under_one_name_are_scored_before_and_after(tmp_path):
    """A source's and a target's labels files of one name (their BIDS entities aside): the
    job records their overlap on the target, before and after, in the result's metrics."""
    src = _sphere(tmp_path / "src.vtk", 20.0, 0.0)
    tgt = _sphere(tmp_path / "tgt.vtk", 20.0, 6.0)  # 6 mm off: the halves overlap less before
    _, mine = _values(tmp_path, src, "sub-01_hemi-L_dseg")
    theirs = shutil.copy(mine, tmp_path / "tpl-x_dseg.label.gii")  # the same vertices' labels
    _, other = _values(tmp_path, tgt, "tpl-x_atlas")  # another name: carried, not scored
    out = run_job(src, tgt, tmp_path / "out", JobOptions("rigid", picture=False),
                  source_values=(mine,), target_values=(theirs, other))  # fmt: skip
    metrics = out.registration.metrics
    assert sorted(k for k in metrics if k.endswith("_dice")) == ["before_dseg_dice", "dseg_dice"]
    assert metrics["dseg_dice"] > 0.97 > 0.9 > metrics["before_dseg_dice"]
    saved = json.loads((tmp_path / "out" / "registration.json").read_text())["metrics"]
    assert saved["dseg_dice"] == metrics["dseg_dice"]
    # a table's "no label" entry (the HCP's ???) is left out of the mean, as label_overlap's
    # ignore does it
    z = load_shape(src).points[:, 2]
    table = {0: ("???", (0.0, 0.0, 0.0, 0.0)), 1: ("lower", (0.0, 0.0, 1.0, 1.0)),
             2: ("upper", (1.0, 0.0, 0.0, 1.0))}  # fmt: skip
    capped = torch.where(z > 15, 0, (z > 0).long() + 1)  # a cap without a label
    walled = save_values(VertexValues(capped, table), tmp_path / "sub-01_hemi-L_wall.label.gii")
    theirs = shutil.copy(walled, tmp_path / "tpl-x_wall.label.gii")
    out = run_job(src, tgt, tmp_path / "out3", JobOptions("rigid", picture=False),
                  source_values=(walled,), target_values=(theirs,))  # fmt: skip
    res, source = out.registration, load_shape(src)
    target = load_shape(tgt)
    left_out = res.label_overlap(capped, capped, source=source, target=target, ignore=(0,))
    every = res.label_overlap(capped, capped, source=source, target=target)
    assert abs(res.metrics["before_wall_dice"] - left_out["before_dice"]) < 1e-12
    assert abs(every["before_dice"] - left_out["before_dice"]) > 1e-3
    wall = VertexValues(capped, {**table, 7: ("Medial_Wall", (0.0, 0.0, 0.0, 1.0))})
    assert unlabelled(wall, load_values(theirs)) == (-1, 0, 7)  # -1: an annot's unassigned
    short = save_values(torch.ones(5, dtype=torch.long), tmp_path / "tpl-y_dseg.label.gii")
    # refused before the fit, naming the file
    with pytest.raises(ValueError, match=r"target values .*tpl-y_dseg.label.gii: .*the target has"):
        run_job(src, tgt, tmp_path / "out2", JobOptions("rigid", picture=False),
                source_values=(mine,), target_values=(short,))  # fmt: skip


def test_a_batch_of_two_pairs_writes_the_carried_values_under_its_names(tmp_path):
    """A manifest's values columns: each pair writes its carried files beside its warped
    surface, with the pair's prefix (BIDS derivative names), listed in its record."""
    pytest.importorskip("distributed")
    tgt = _sphere(tmp_path / "tpl.vtk", 21.0, 0.5)
    (atlas,) = _values(tmp_path, tgt, "tpl")[1:]
    pairs = []
    for sub, shift in (("01", 0.0), ("02", 1.0)):
        src = _sphere(tmp_path / f"sub-{sub}.vtk", 20.0, shift)
        height, _ = _values(tmp_path, src, f"sub-{sub}_hemi-L")
        prefix = f"sub-{sub}_hemi-L_space-tpl_desc-otreg_"
        pair = Pair(f"sub-{sub}_hemi-L", src, tgt, folder=f"sub-{sub}/anat", prefix=prefix)
        pairs.append(dataclasses.replace(pair, source_values=(height,), target_values=(atlas,)))
    write_manifest(pairs, tmp_path / "pairs.csv")
    back = read_manifest(tmp_path / "pairs.csv")
    assert [p.source_values for p in back] == [p.source_values for p in pairs]
    batch = run_batch(
        pairs,
        tmp_path / "out",
        {"model": "rigid", "picture": False},
        workers=1,
        threads=torch.get_num_threads(),
        report=False,
    )
    assert batch.exit_code == 0, batch.records
    for sub in ("01", "02"):
        folder = tmp_path / "out" / f"sub-{sub}" / "anat"
        prefix = f"sub-{sub}_hemi-L_space-tpl_desc-otreg_"
        record = json.loads((folder / f"{prefix}metrics.json").read_text())
        assert record["files"]["to-target:height.func.gii"] == f"{prefix}to-target_height.func.gii"
        for name in ("to-target_height.func.gii", "to-source_tpl.label.gii"):
            assert (folder / f"{prefix}{name}").is_file(), name
        assert load_values(folder / f"{prefix}to-source_tpl.label.gii").label_table[1][0] == "lower"
    again = plan_batch(pairs, tmp_path / "out", {"model": "rigid", "picture": False})
    assert [p.state for p in again] == ["done", "done"]
    save_values(torch.zeros(load_shape(tgt).n_points), atlas.replace(".label.gii", ".npy"))
    other = (atlas.replace(".label.gii", ".npy"),)
    changed = [dataclasses.replace(p, target_values=other) for p in pairs]
    again = plan_batch(changed, tmp_path / "out", {"model": "rigid", "picture": False})
    assert [p.state for p in again] == ["rerun", "rerun"]
    assert "the values to carry changed" in again[0].why


def test_a_partial_rerun_keeps_the_other_pairs_rows_and_a_failed_rerun_the_earlier_result(
    tmp_path,
):
    """``only`` one pair, whose carried map now holds a NaN: it fails before registering.
    Its earlier result stays (a rerun failing on a values file had deleted it), and
    summary.csv and failed.csv still hold the other pair (they held the selected one only,
    while index.html said otherwise)."""
    pytest.importorskip("distributed")
    tgt = _sphere(tmp_path / "tpl.vtk", 21.0, 0.5)
    pairs = []
    for sub, shift in (("01", 0.0), ("02", 1.0)):
        src = _sphere(tmp_path / f"sub-{sub}.vtk", 20.0, shift)
        height, _ = _values(tmp_path, src, f"sub-{sub}")
        pairs.append(Pair(f"sub-{sub}", src, tgt, folder=f"sub-{sub}", source_values=(height,)))
    options = {"model": "rigid", "picture": False}
    run = dict(workers=1, threads=torch.get_num_threads(), report=False, echo=lambda line: None)
    assert run_batch(pairs, tmp_path / "out", options, **run).exit_code == 0
    folder = tmp_path / "out" / "sub-02"
    before = sorted(p.name for p in folder.iterdir())
    z = load_values(pairs[1].source_values[0]).values.clone()
    z[3] = float("nan")
    save_values(z, pairs[1].source_values[0])
    batch = run_batch(pairs, tmp_path / "out", options, only=["sub-02"], **run)
    assert batch.records["sub-02"]["status"] == "failed"
    assert "NaN" in batch.records["sub-02"]["error"]["reason"]
    assert batch.records["sub-02"]["earlier_result_kept"] == "metrics.json"
    after = sorted(p.name for p in folder.iterdir())
    assert set(before) <= set(after) and "error.json" in after
    rows = list(csv.DictReader((tmp_path / "out" / "summary.csv").open()))
    assert [(r["pair_id"], r["status"]) for r in rows] == [("sub-01", "done"), ("sub-02", "failed")]
    failed = list(csv.DictReader((tmp_path / "out" / "failed.csv").open()))
    assert [r["pair_id"] for r in failed] == ["sub-02"]


@pytest.mark.parametrize(
    "cell, match",
    [
        ("lh.pial.vtk", "source_values .*lh.pial.vtk is a surface or a volume"),
        ("aseg.nii.gz", "source_values .*aseg.nii.gz is a surface or a volume"),
        (
            "sub-01_thick.func.gii;sub-02_thick.func.gii",
            "source_values has .* which would both be written as thick.func.gii",
        ),
        (  # labels' confidence and a map of that name
            "dk.npy;dk_confidence.npy",
            "source_values has .*dk.npy and .*dk_confidence.npy, which would both be "
            "written as dk_confidence.npy",
        ),
        (  # two formats of one stem: their confidences would share a name
            "dk.label.gii;dk.npy",
            "source_values has .*dk.label.gii and .*dk.npy, which would both be written as "
            "dk_confidence.npy .a labels file's confidence",
        ),
    ],
)
def test_a_bad_values_cell_is_refused_when_the_manifest_is_read(tmp_path, cell, match):
    (tmp_path / "pairs.csv").write_text(
        f"pair_id,source,target,source_values\nok,a.vtk,b.vtk,\nbad,a.vtk,b.vtk,{cell}\n"
    )
    with pytest.raises(ValueError, match=f"line 3: pair bad: {match}"):
        read_manifest(tmp_path / "pairs.csv")


def test_carried_files_that_would_share_an_output_are_refused_before_the_work(tmp_path):
    """`otreg register` wrote a map over its labels' confidence file and said nothing;
    `run_job` checks too, before the fit."""
    src = _sphere(tmp_path / "src.vtk", 20.0, 0.0)
    tgt = _sphere(tmp_path / "tgt.vtk", 20.0, 1.0)
    n = load_shape(src).n_points
    labels = save_values(torch.zeros(n, dtype=torch.long), tmp_path / "dk.npy")
    conf = save_values(torch.zeros(n), tmp_path / "dk_confidence.npy")
    args = ["register", src, tgt, "-o", str(tmp_path / "o"), "--model", "rigid", "--no-picture"]
    result = CliRunner().invoke(
        main, [*args, "--source-values", str(labels), "--source-values", str(conf)]
    )
    assert result.exit_code == 1 and "would both be written as dk_confidence.npy" in result.output
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="run_job: target_values has"):
        run_job(src, tgt, tmp_path / "p", JobOptions("rigid", picture=False),
                target_values=[labels, conf])  # fmt: skip


def test_a_pair_whose_outputs_cannot_be_put_in_place_leaves_none_of_them(tmp_path, monkeypatch):
    """A failure while its files were moved into place left a loadable result beside the
    failure record."""
    from otreg.batch import worker

    src = _sphere(tmp_path / "src.vtk", 20.0, 0.0)
    tgt = _sphere(tmp_path / "tgt.vtk", 20.0, 1.0)
    real, moved = worker.os.replace, []

    def replace(a, b):
        if moved and Path(b).name.endswith("registration.json"):
            raise OSError("disk full")
        real(a, b)
        moved.append(b)

    monkeypatch.setattr(worker.os, "replace", replace)
    from otreg.batch.engine import pair_spec

    out = tmp_path / "out"
    out.mkdir()
    planned = plan_batch([Pair("p1", src, tgt)], out, {"model": "rigid", "picture": False})
    record = worker.run_pair(pair_spec(out, planned[0], "b1"))
    assert record["status"] == "failed" and "disk full" in record["error"]["reason"]
    assert record["error"]["traceback"] and "OSError" in record["error"]["traceback"]
    left = sorted(p.name for p in out.rglob("*") if p.is_file() and "lock" not in p.name)
    assert left == ["error.json"], left


def test_register_carries_values_and_refuses_bad_ones(tmp_path):
    src = _sphere(tmp_path / "src.vtk", 20.0, 0.0)
    tgt = _sphere(tmp_path / "tgt.vtk", 20.0, 1.0)
    height, _ = _values(tmp_path, src, "src")
    args = ["register", src, tgt, "-o", str(tmp_path / "o"), "--model", "rigid", "--no-picture"]
    result = CliRunner().invoke(main, [*args, "--source-values", height])
    assert result.exit_code == 0, result.output
    assert "to-target_src_height.func.gii" in result.output
    result = CliRunner().invoke(main, [*args, "--target-values", tgt])
    assert result.exit_code == 1 and "is a surface or a volume" in result.output
    short = save_values(torch.zeros(5), tmp_path / "short.npy")
    result = CliRunner().invoke(main, [*args, "--target-values", str(short)])
    assert result.exit_code == 1 and f"target values {short}" in result.output
    assert "5" in result.output
