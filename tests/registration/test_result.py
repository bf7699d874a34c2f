"""Registration results: transform, save and load (file formats unchanged)."""

import json
import shutil

import numpy as np
import pytest
import torch

from otreg import Shape
from otreg.registration import LDDMM, Affine, Registration, Rigid, Similarity
from otreg.registration.linear import rotation_matrix

pytest.importorskip("pyvista")

D = torch.float64


def tetrahedron():
    pts = torch.tensor([[0.0, 0, 0], [10, 0, 0], [0, 10, 0], [0, 0, 10]], dtype=D)
    faces = torch.tensor([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]])
    return Shape(pts, faces)


def result(linear_cls=Rigid, deformation=True):
    g = torch.Generator().manual_seed(0)
    source = tetrahedron()
    linear = None
    if linear_cls is not None:
        linear = linear_cls(source.points.mean(0)).double()
        A = rotation_matrix(torch.tensor([0.1, 0.2, -0.1], dtype=D))
        if linear_cls is not Rigid:
            A = A * 1.2
        linear.set_from(A, torch.tensor([1.0, -2.0, 0.5], dtype=D))
    lddmm = None
    if deformation:
        lddmm = LDDMM(
            10 * torch.rand(6, 3, generator=g, dtype=D),
            sigma=(5.0, 15.0),
            kernel_weights=(1.0, 0.5),
            n_steps=4,
            integrator="leapfrog",
        ).double()
        with torch.no_grad():
            lddmm.momenta.copy_(torch.randn(6, 3, generator=g, dtype=D))
    res = Registration(
        source,
        linear,
        lddmm,
        [{"level": 0, "loss": 1.0}],
        {"mean_mm": 0.5},
        {"model": "lddmm", "lddmm": {"sigma": (5.0, 15.0)}},
    )
    res.warped = res.transform(source)
    return res


@pytest.mark.parametrize(
    "linear_cls, deformation", [(Rigid, True), (Similarity, True), (Affine, False), (None, True)]
)
def test_save_load_round_trip(tmp_path, linear_cls, deformation):
    res = result(linear_cls, deformation)
    folder = res.save(tmp_path / "out")
    assert {p.name for p in folder.iterdir()} == {
        "warped.vtk",
        "parameters.npz",
        "registration.json",
    }
    back = Registration.load(folder)
    x = 10 * torch.rand(30, 3, generator=torch.Generator().manual_seed(3), dtype=D)
    assert torch.allclose(back.transform(x), res.transform(x), atol=1e-12)
    assert not torch.equal(res.transform(x), x)
    assert back.metrics == res.metrics and back.history == res.history
    assert back.options["lddmm"]["sigma"] == [5.0, 15.0]  # JSON: tuples come back as lists
    assert torch.allclose(back.warped.points.double(), res.warped.points, atol=1e-4)


def test_parameters_npz_keys_are_unchanged(tmp_path):  # but for the run id, added
    folder = result().save(tmp_path / "out")
    with np.load(folder / "parameters.npz", allow_pickle=False) as p:
        assert set(p.files) == {
            "linear_kind",
            "linear_matrix",
            "linear_translation",
            "linear_center",
            "control_points",
            "momenta",
            "sigma",
            "kernel_weights",
            "n_steps",
            "integrator",
            "run_id",
        }
        assert str(p["linear_kind"]) == "rigid" and str(p["integrator"]) == "leapfrog"
        assert p["sigma"].tolist() == [5.0, 15.0] and int(p["n_steps"]) == 4
        assert p["linear_matrix"].shape == (3, 3) and p["momenta"].shape == (6, 3)
    doc = json.loads((folder / "registration.json").read_text())
    assert set(doc) == {"options", "metrics", "history", "inputs", "run_id"}


def test_model_arrays_round_trip():
    res = result(Similarity)
    lin = Rigid.from_arrays(res.linear.to_arrays())
    assert torch.allclose(lin.matrix(), res.linear.matrix(), atol=1e-14)
    d = LDDMM.from_arrays(res.deformation.to_arrays())
    assert d.kernel.sigmas == [5.0, 15.0] and d.kernel.weights == [1.0, 0.5]
    assert d.n_steps == 4 and d.integrator == "leapfrog"
    assert torch.equal(d.momenta.detach(), res.deformation.momenta.detach())


def test_transform_checks_its_input(tmp_path):
    res = result()
    x = torch.rand(5, 3, dtype=D)
    assert np.allclose(res.transform(x.numpy()), res.transform(x).numpy())
    assert res.transform(x.float()).dtype == torch.float32
    with pytest.raises(TypeError, match="got list"):
        res.transform([[0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="they must be \\(N, 3\\)"):
        res.transform(torch.zeros(4, 2))
    with pytest.raises(FileNotFoundError, match="is not a registration's folder or file"):
        Registration.load(tmp_path)  # empty: none of the files
    (tmp_path / "registration.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="parameters.npz is missing"):
        Registration.load(tmp_path)  # one of them


# ----------------------------------------------------------------------------- inputs
def rigid_run(source_path, target_path):
    from otreg import load_shape, register

    return register(load_shape(source_path), load_shape(target_path), model="rigid", progress=False)


def test_register_records_its_inputs_and_save_never_replaces_one(tmp_path, monkeypatch):
    from otreg import save_shape

    d = tmp_path / "d"
    src = save_shape(tetrahedron(), d / "warped.vtk")
    tgt = save_shape(tetrahedron().with_points(tetrahedron().points + 1), d / "target.vtk")
    res = rigid_run(src, tgt)
    assert res.inputs == {"source": str(src.absolute()), "target": str(tgt.absolute())}
    before = src.read_bytes()
    with pytest.raises(ValueError, match=r"warped\.vtk.*is the source"):
        res.save(d)
    (tmp_path / "alias").symlink_to(d)  # the same folder through a symlink
    with pytest.raises(ValueError, match="warped.vtk"):
        res.save(tmp_path / "alias")
    monkeypatch.chdir(tmp_path)  # and through a relative path
    with pytest.raises(ValueError, match="warped.vtk"):
        res.save("d")
    assert src.read_bytes() == before
    assert {p.name for p in d.iterdir()} == {"warped.vtk", "target.vtk"}
    folder = res.save(tmp_path / "out")
    back = Registration.load(folder)
    assert back.inputs == res.inputs


def test_save_refuses_a_target_named_like_an_output(tmp_path):
    from otreg import save_shape

    src = save_shape(tetrahedron(), tmp_path / "s.vtk")
    tgt = save_shape(
        tetrahedron().with_points(tetrahedron().points + 1), tmp_path / "o" / "warped.vtk"
    )
    res = rigid_run(src, tgt)
    with pytest.raises(ValueError, match="is the target"):
        res.save(tmp_path / "o")


# ----------------------------------------------------------------------------- all or nothing
def run_ids(folder):
    import pyvista as pv

    with np.load(folder / "parameters.npz", allow_pickle=False) as p:
        npz = str(p["run_id"]) if "run_id" in p.files else None
    doc = json.loads((folder / "registration.json").read_text()).get("run_id")
    field_data = pv.read(str(folder / "warped.vtk")).field_data
    vtk = str(field_data["run_id"][0]) if "run_id" in field_data.keys() else None
    return vtk, npz, doc


def other_result():
    res = result(Similarity)
    res.warped = res.transform(tetrahedron())
    return res


def test_save_writes_one_run_id_into_the_three_files(tmp_path):
    a = run_ids(result().save(tmp_path / "a"))
    b = run_ids(result().save(tmp_path / "b"))
    assert len(set(a)) == 1 and len(a[0]) == 32 and int(a[0], 16) >= 0
    assert a[0] != b[0]


def test_save_into_a_command_s_folder_removes_that_run_s_other_files_only(tmp_path):
    """A folder an otreg command wrote (its record lists a picture and carried values
    besides the three files) loses that run's other files when another result is saved
    there; the user's own file and an input of the saved run stay, and the record then
    lists the save's files."""
    from otreg.io import OUTPUTS_RECORD, replace_recorded_outputs

    folder = tmp_path / "run"
    result().save(folder)
    for name in ("picture.png", "to-target_lab.label.gii", "notes.txt"):
        (folder / name).write_text(name)
    earlier = ["parameters.npz", "picture.png", "registration.json", "to-target_lab.label.gii",
               "warped.vtk"]  # fmt: skip
    replace_recorded_outputs(folder, earlier, [])
    again = result()
    again.inputs = {"source": str(folder / "to-target_lab.label.gii"), "target": None}
    again.save(folder)
    left = sorted(p.name for p in folder.iterdir())
    assert left == [OUTPUTS_RECORD, "notes.txt", "parameters.npz", "registration.json",
                    "to-target_lab.label.gii", "warped.vtk"]  # fmt: skip
    assert (folder / OUTPUTS_RECORD).read_text().split() == [
        "parameters.npz", "registration.json", "warped.vtk"]  # fmt: skip
    Registration.load(folder)
    plain = tmp_path / "plain"  # a folder no command wrote: nothing removed, no record
    plain.mkdir()
    (plain / "picture.png").write_text("mine")
    result().save(plain)
    assert sorted(p.name for p in plain.iterdir()) == [
        "parameters.npz", "picture.png", "registration.json", "warped.vtk"]  # fmt: skip


def test_an_interrupted_save_leaves_no_temporary_and_a_folder_load_refuses(tmp_path, monkeypatch):
    import os

    first = result()
    folder = first.save(tmp_path / "out")
    replace, calls = os.replace, []

    def killed_at_the_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_at_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        other_result().save(folder)
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["warped.vtk", "parameters.npz", "registration.json"]
    )  # no temporary file left behind
    with pytest.raises(ValueError, match="mixes files of two runs.*rerun") as err:
        Registration.load(folder)
    assert "warped.vtk" in str(err.value) and "parameters.npz" in str(err.value)
    other_result().save(folder)  # a rerun repairs it
    x = torch.rand(5, 3, dtype=D)
    assert torch.allclose(Registration.load(folder).transform(x), other_result().transform(x))


def test_a_file_copied_from_another_run_is_refused(tmp_path):
    a = result().save(tmp_path / "a")
    b = other_result().save(tmp_path / "b")
    (a / "parameters.npz").write_bytes((b / "parameters.npz").read_bytes())
    with pytest.raises(ValueError, match="parameters.npz"):
        Registration.load(a)


def strip_run_id(folder, name):
    import pyvista as pv

    path = folder / name
    if name == "parameters.npz":
        with np.load(path, allow_pickle=False) as p:
            arrays = {k: p[k] for k in p.files if k != "run_id"}
        np.savez(path, **arrays)
    elif name == "registration.json":
        doc = json.loads(path.read_text())
        del doc["run_id"]
        path.write_text(json.dumps(doc))
    else:
        mesh = pv.read(str(path))
        mesh.field_data.clear()
        mesh.save(str(path))


def test_results_saved_without_run_ids_still_load_but_a_partial_set_is_refused(tmp_path):
    names = ("warped.vtk", "parameters.npz", "registration.json")
    legacy = result().save(tmp_path / "legacy")
    for name in names:
        strip_run_id(legacy, name)
    assert run_ids(legacy) == (None, None, None)
    x = torch.rand(5, 3, dtype=D)
    assert torch.allclose(Registration.load(legacy).transform(x), result().transform(x))
    for name in names:
        folder = result().save(tmp_path / name)
        strip_run_id(folder, name)
        with pytest.raises(ValueError, match=f"mixes files of two runs.*{name}"):
            Registration.load(folder)


def test_save_removes_stale_temporaries_of_its_own_files_only(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    stale = [
        ".warped.k2j_9x0a.tmp.vtk",
        ".parameters.abcdefgh.tmp.npz",
        ".registration.z8y7x6w5.tmp.json",
    ]
    kept = [
        ".source.k2j_9x0a.tmp.vtk",  # another program's file
        ".warped.k2j_9x0a.tmp.vtk.bak",
        "warped.k2j_9x0a.tmp.vtk",
        ".warped.tmp.vtk",
        "notes.txt",
    ]
    for name in stale + kept:
        (folder / name).write_text("x")
    result().save(folder)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        kept + ["warped.vtk", "parameters.npz", "registration.json"]
    )


# ----------------------------------------------------------------------------- unwritable
def test_save_into_a_folder_that_cannot_be_one_names_it(tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    with pytest.raises(ValueError, match=r"cannot write into .*afile/out: .*afile is a file"):
        result().save(tmp_path / "afile" / "out")
    with pytest.raises(ValueError, match=r"afile is a file"):
        result().save(tmp_path / "afile")


@pytest.mark.skipif(
    hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0,
    reason="root writes into read-only folders",
)
def test_save_into_a_read_only_folder_names_it(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match=r"cannot write into .*ro"):
            result().save(folder)
    finally:
        folder.chmod(0o700)


def test_save_reports_a_permission_error_naming_the_folder(tmp_path, monkeypatch):
    import errno
    import tempfile

    def denied(*args, dir=None, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(dir))

    monkeypatch.setattr(tempfile, "mkstemp", denied)  # what a read-only folder does, even to root
    with pytest.raises(
        PermissionError,
        match=r"Registration.save: cannot write into the folder .*out: Permission denied",
    ):
        result().save(tmp_path / "out")
    assert not (tmp_path / "out").exists()  # the folder it created is gone again


def test_transform_of_integer_points_is_not_truncated():
    res = result()
    exact = res.transform(torch.tensor([[1.0, 2.0, 3.0]], dtype=D))
    assert not torch.equal(exact, exact.round())  # the transform moves by fractions of mm
    as_tensor = res.transform(torch.tensor([[1, 2, 3]]))
    as_array = res.transform(np.array([[1, 2, 3]], dtype=np.int32))
    assert as_tensor.is_floating_point() and torch.allclose(as_tensor.double(), exact)
    assert as_array.dtype.kind == "f" and np.allclose(as_array, exact.numpy())


@pytest.mark.parametrize("name", ["parameters.npz", "registration.json"])
def test_load_names_a_corrupt_file(tmp_path, name):
    folder = result().save(tmp_path / "out")
    data = (folder / name).read_bytes()
    (folder / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"Registration.load: .*{name} could not be read"):
        Registration.load(folder)


def test_load_reads_a_batchs_bids_derivative_names(tmp_path):
    """A BIDS participant run names its files sub-01_hemi-L_space-tpl_desc-otreg_*: load
    takes one of those files, or their folder when it holds one set."""
    res = result()
    saved = res.save(tmp_path / "plain")
    anat = tmp_path / "sub-01" / "anat"
    anat.mkdir(parents=True)
    prefix = "sub-01_hemi-L_space-tpl_desc-otreg_"
    for p in saved.iterdir():
        shutil.copy(p, anat / f"{prefix}{p.name}")
    x = torch.rand(6, 3, dtype=D)
    for given in (anat / f"{prefix}parameters.npz", anat / f"{prefix}warped.vtk", anat):
        assert torch.allclose(Registration.load(given).transform(x), res.transform(x))
    for p in saved.iterdir():
        shutil.copy(p, anat / f"sub-01_hemi-R_space-tpl_desc-otreg_{p.name}")
    with pytest.raises(ValueError, match="holds 2 saved registrations .*give the file"):
        Registration.load(anat)
    (anat / "notes.txt").write_text("a file of another kind")
    with pytest.raises(ValueError, match="neither a folder nor a saved registration"):
        Registration.load(anat / "notes.txt")
    with pytest.raises(FileNotFoundError, match="missing.txt does not exist"):
        Registration.load(anat / "missing.txt")
