"""``otreg bids`` through the real command line: participant and group levels on fMRIPrep
derivatives and on a FreeSurfer SUBJECTS_DIR."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

pv = pytest.importorskip("pyvista")
pytest.importorskip("distributed")

from tests.cli.test_batch import FAST, records, run, run_here  # noqa: E402


def gifti_sphere(path: Path, radius: float, res: int, shift: float = 0.0) -> Path:
    import nibabel as nib
    import numpy as np

    m = pv.Sphere(radius=radius, theta_resolution=res, phi_resolution=res).triangulate()
    points = np.asarray(m.points, dtype=np.float32) + np.float32([shift, 0, 0])
    faces = m.faces.reshape(-1, 4)[:, 1:].astype(np.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = [
        nib.gifti.GiftiDataArray(points, intent="NIFTI_INTENT_POINTSET"),
        nib.gifti.GiftiDataArray(faces, intent="NIFTI_INTENT_TRIANGLE"),
    ]
    nib.save(nib.GiftiImage(darrays=arrays), str(path))
    return path


@pytest.mark.slow  # 51 s (the default run stays under 20 minutes)
def test_bids_participant_then_group_on_fmriprep_derivatives(tmp_path):
    root = tmp_path / "derivatives" / "fmriprep"
    root.mkdir(parents=True)
    (root / "dataset_description.json").write_text(
        json.dumps({"Name": "x", "BIDSVersion": "1.8.0", "DatasetType": "derivative"})
    )
    for k, sub in enumerate(("01", "02", "03")):
        gifti_sphere(root / f"sub-{sub}" / "anat" / f"sub-{sub}_hemi-L_pial.surf.gii", 40 + k, 14)
    tpl = gifti_sphere(tmp_path / "tpl_hemi-L.surf.gii", 41, 16, 1.0)
    out = tmp_path / "otreg"
    common = ["--hemi", "L", "--template-left", tpl, "--template-id", "tpl", *FAST]
    r = run("bids", root, out, "participant", "--participant-label", "sub-01,02,07", *common)
    assert r.returncode == 0, r.stderr
    assert "07" in r.stderr  # the missing participant is named in a warning
    anat = out / "sub-01" / "anat"
    prefix = "sub-01_hemi-L_space-tpl_desc-otreg_"
    for name in ("warped.vtk", "parameters.npz", "registration.json", "metrics.json", "log.txt"):
        assert (anat / f"{prefix}{name}").is_file(), name
    assert (out / "sub-02" / "anat" / "sub-02_hemi-L_space-tpl_desc-otreg_metrics.json").is_file()
    assert not (out / "sub-03").exists()
    desc = json.loads((out / "dataset_description.json").read_text())
    assert desc["DatasetType"] == "derivative" and desc["GeneratedBy"][0]["Name"] == "otreg"
    # a second participant job (another subject) into the same folder, then the group level
    r = run("bids", root, out, "participant", "--participant-label", "03", *common)
    assert r.returncode == 0, r.stderr
    r = run("bids", root, out, "group")
    assert r.returncode == 0, r.stderr
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert sorted(row["pair_id"] for row in rows) == [f"sub-0{i}_hemi-L" for i in (1, 2, 3)]
    assert all(row["status"] == "done" for row in rows)
    assert (out / "index.html").read_text().count('class="pair') == 3
    none = run("bids", root, out, "participant", "--participant-label", "99", *common)
    assert none.returncode == 1 and "99" in none.stderr
    (tmp_path / "empty").mkdir()
    empty = run("bids", root, tmp_path / "empty", "group")
    assert empty.returncode == 1 and "holds no pair records" in empty.stderr
    assert not (tmp_path / "empty" / "summary.csv").exists()


def freesurfer_sphere(path: Path, radius: float, res: int, cras) -> Path:
    """A FreeSurfer surface (``lh.pial``) in tkr coordinates, with c_ras in its volume info."""
    nib = pytest.importorskip("nibabel")
    m = pv.Sphere(radius=radius, theta_resolution=res, phi_resolution=res).triangulate()
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {
        "head": [2, 0, 20],
        "valid": "1  # volume info valid",
        "filename": "T1.mgz",
        "volume": [256, 256, 256],
        "voxelsize": [1.0, 1.0, 1.0],
        "xras": [-1.0, 0.0, 0.0],
        "yras": [0.0, 0.0, -1.0],
        "zras": [0.0, 1.0, 0.0],
        "cras": list(cras),
    }
    faces = m.faces.reshape(-1, 4)[:, 1:]
    nib.freesurfer.write_geometry(str(path), m.points.astype(float), faces, volume_info=info)
    return path


def test_bids_participant_on_a_freesurfer_subjects_dir(tmp_path):
    """A FreeSurfer SUBJECTS_DIR: subjects' lh.pial in scanner millimetres (tkr + c_ras),
    fsaverage skipped, outputs named as BIDS derivatives (a non-BIDS subject id cleaned)."""
    root = tmp_path / "subjects"
    for k, sub in enumerate(("01", "OAS1_0002", "fsaverage")):
        freesurfer_sphere(root / sub / "surf" / "lh.pial", 40 + k, 14, (12.0, -8.0, 9.0))
    tpl = gifti_sphere(tmp_path / "tpl_hemi-L.surf.gii", 41, 16, 0.0)
    out = tmp_path / "otreg"
    common = ["--hemi", "L", "--template-left", tpl, "--template-id", "tpl", *FAST]
    r = run("bids", root, out, "participant", *common)
    assert r.returncode == 0, r.stderr
    assert "OAS1_0002" in r.stderr  # the renamed subject is named in a warning
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("sub-")) == [
        "sub-01",
        "sub-OAS10002",
    ]
    recs = records(out)
    assert sorted(recs) == ["sub-01_hemi-L", "sub-OAS10002_hemi-L"]
    for pid, rec in recs.items():
        sub = pid.split("_")[0]
        assert rec["status"] == "done"
        assert rec["source"].endswith(f"{rec['source_subject']}/surf/lh.pial")
        # read at c_ras = (12, -8, 9), 16.8 mm off the template: about 8 mm apart on
        # average before registration (about 1 mm if c_ras were ignored)
        assert rec["metrics"]["before_mean_mm"] > 5, rec["metrics"]
        warped = out / sub / "anat" / f"{sub}_hemi-L_space-tpl_desc-otreg_warped.vtk"
        assert warped.is_file()


def test_output_dir_equal_to_bids_dir_is_refused_before_any_work(tmp_path):
    root = tmp_path / "derivatives" / "fmriprep"
    root.mkdir(parents=True)
    (root / "dataset_description.json").write_text(
        json.dumps({"Name": "x", "BIDSVersion": "1.8.0", "DatasetType": "derivative"})
    )
    gifti_sphere(root / "sub-01" / "anat" / "sub-01_hemi-L_pial.surf.gii", 40, 14)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    for extra in ([], ["--dry-run"]):
        r = run_here("bids", root, root, "participant", "--hemi", "L", *extra)
        assert r.returncode == 1, r.stderr
        assert "is BIDS_DIR itself" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_bids_carries_a_subjects_map_and_a_templates_labels(tmp_path):
    """--carry and --template-values: the subject's thickness onto the template and the
    template's labels onto the subject, written as BIDS derivatives beside the warped surface."""
    import nibabel as nib
    import numpy as np

    from otreg import load_shape
    from otreg.io import VertexValues, load_values, save_values

    root = tmp_path / "fmriprep"
    root.mkdir()
    (root / "dataset_description.json").write_text(
        json.dumps({"Name": "x", "BIDSVersion": "1.8.0", "DatasetType": "derivative"})
    )
    surface = gifti_sphere(root / "sub-01" / "anat" / "sub-01_hemi-L_pial.surf.gii", 40, 14)
    n = load_shape(surface).n_points
    thickness = np.linspace(1.0, 4.0, n, dtype=np.float32)
    image = nib.GiftiImage(darrays=[nib.gifti.GiftiDataArray(thickness)])
    nib.save(image, str(surface.parent / "sub-01_hemi-L_thickness.shape.gii"))
    tpl = gifti_sphere(tmp_path / "tpl_hemi-L.surf.gii", 41, 16, 1.0)
    z = load_shape(tpl).points[:, 2]
    table = {0: ("inferior", (0.0, 0.0, 1.0, 1.0)), 1: ("superior", (1.0, 0.0, 0.0, 1.0))}
    atlas = save_values(VertexValues((z > 0).long(), table), tmp_path / "atlas.label.gii")
    out = tmp_path / "otreg"
    r = run(
        "bids", root, out, "participant", "--hemi", "L", "--template-left", tpl,
        "--template-id", "tpl", "--carry", "thickness", "--template-values", atlas,
        "--model", "rigid", *FAST,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    prefix = out / "sub-01" / "anat" / "sub-01_hemi-L_space-tpl_desc-otreg_"
    moved = load_values(f"{prefix}to-target_thickness.shape.gii")
    assert moved.n_vertices == load_shape(tpl).n_points
    assert 1.0 - 1e-5 <= float(moved.values.min()) and float(moved.values.max()) <= 4.0 + 1e-5
    labels = load_values(f"{prefix}to-source_atlas.label.gii")
    assert labels.n_vertices == n and labels.label_table[1][0] == "superior"
    assert Path(f"{prefix}to-source_atlas_confidence.npy").is_file()
    rows = list(csv.DictReader(open(out / "sub-01" / "sub-01_desc-otreg_pairs.csv")))
    assert rows[0]["target_values"] == str(atlas) and rows[0]["source_values"].endswith(
        "sub-01_hemi-L_thickness.shape.gii"
    )


def test_group_lists_the_pairs_a_participant_job_planned_but_never_recorded(tmp_path):
    """Two subjects' manifests (written by their participant jobs), a record for one pair
    only (the other job killed before it wrote any): the group level lists both, the
    second as not run, in summary.csv and on the page."""
    from otreg.batch import FORMAT, Pair, write_manifest

    out = tmp_path / "out"
    for sub in ("sub-01", "sub-02"):
        pair = Pair(f"{sub}_hemi-L", f"/d/{sub}.gii", "/d/tpl.gii", hemisphere="L",
                    folder=f"{sub}/anat", prefix=f"{sub}_hemi-L_desc-otreg_")  # fmt: skip
        (out / sub).mkdir(parents=True)
        write_manifest([pair], out / sub / f"{sub}_desc-otreg_pairs.csv")
    done = {"format": FORMAT, "pair_id": "sub-01_hemi-L", "status": "done", "key": "k1",
            "source": "/d/sub-01.gii", "target": "/d/tpl.gii", "metrics": {"mean_mm": 0.5},
            "finished": "2025-01-01T00:01:00+00:00"}  # fmt: skip
    (out / "sub-01" / "anat").mkdir()
    (out / "sub-01" / "anat" / "sub-01_hemi-L_desc-otreg_metrics.json").write_text(json.dumps(done))
    r = run_here("bids", tmp_path, out, "group")
    assert r.returncode == 0, r.stderr
    rows = {row["pair_id"]: row["status"] for row in csv.DictReader(open(out / "summary.csv"))}
    assert rows == {"sub-01_hemi-L": "done", "sub-02_hemi-L": "not run"}
    page = (out / "index.html").read_text()
    assert '<span id="n-done">1</span>' in page and '<span id="n-not-run">1</span>' in page
