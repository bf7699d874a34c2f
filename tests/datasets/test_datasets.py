"""Real brain data from nilearn's wheel and synthetic subjects with ground truth."""

import json

import numpy as np
import pytest
import torch

from otreg import datasets, load_shape
from tests.conftest import hide_module

pytest.importorskip("nilearn")


def edge_counts(faces):
    f = faces.numpy()
    edges = np.sort(np.concatenate([f[:, [0, 1]], f[:, [1, 2]], f[:, [2, 0]]]), axis=1)
    _, counts = np.unique(edges, axis=0, return_counts=True)
    return counts


def test_fsaverage5_pial_left():
    pial = datasets.fsaverage5("pial", "left")
    assert pial.n_points == 10242 and pial.n_faces == 20480
    assert (edge_counts(pial.faces) == 2).all()  # closed
    assert float(pial.volume) > 0  # outward normals
    right = datasets.fsaverage5("white", "right")
    assert float(right.points[:, 0].mean()) > 0 > float(pial.points[:, 0].mean())


def test_mni_white_matter_gives_a_closed_surface():
    import warnings

    with warnings.catch_warnings():  # marching cubes' fins are removed: no duplicate to warn of
        warnings.simplefilter("error")
        wm = datasets.mni152_surface("wm", threshold=0.5)
    assert wm.n_points > 10000
    counts = edge_counts(wm.faces)
    assert (counts % 2 == 0).all()  # no boundary edge: closed (watertight)
    assert (counts == 2).mean() > 0.999  # a few edges where voxels touch along an edge
    assert float(wm.volume) > 3e5  # mm^3: adult white matter is about 0.4-0.5 litres
    lo, hi = wm.points.min(0).values, wm.points.max(0).values
    assert float(hi[0] - lo[0]) > 100  # mm, left-right extent of the brain


def test_synthetic_subjects_carry_their_ground_truth(tmp_path):
    base = datasets.fsaverage5("pial", "left")
    subjects = datasets.synthetic_subjects(
        base, n=2, magnitude=5.0, max_angle=8.0, out_dir=tmp_path, seed=3
    )
    for s in subjects:
        truth = s.transform(base.points.double())
        assert torch.allclose(s.shape.points.double(), truth, atol=1e-3)
        back = s.inverse_transform(s.shape.points.double())
        assert float((back - base.points.double()).norm(dim=1).max()) < 1e-3
        nonrigid = (s.flow(base.points.double()) - base.points.double()).norm(dim=1)
        assert 2.0 < float(nonrigid.max()) < 6.0
        assert s.rigid.angle_degrees <= 8.0
        loaded = load_shape(s.files["surface"])
        assert torch.allclose(loaded.points, s.shape.points, atol=1e-4)
        npz = np.load(s.files["truth"])
        assert np.allclose(npz["points"], s.shape.points.numpy(), atol=1e-4)
        meta = json.loads(s.files["meta"].read_text())
        assert meta["rotation_degrees"] == pytest.approx(s.rigid.angle_degrees)
    a, b = (datasets.synthetic_subjects(base, n=1, seed=7)[0].shape.points for _ in range(2))
    assert torch.equal(a, b)  # reproducible


@pytest.mark.slow
def test_synthetic_volume_moves_with_the_surface(tmp_path):
    import nibabel as nib

    base = datasets.fsaverage5("pial", "left")
    (s,) = datasets.synthetic_subjects(base, n=1, out_dir=tmp_path, volume="wm", seed=1)
    src = nib.load(str(datasets.mni152("wm")))
    dst = nib.load(str(s.files["volume"]))
    data_src, data_dst = np.asanyarray(src.dataobj), np.asanyarray(dst.dataobj)
    rng = np.random.default_rng(0)
    vox = np.argwhere(data_src > 200)[rng.choice((data_src > 200).sum(), 500)]
    world = nib.affines.apply_affine(src.affine, vox)
    moved = s.transform(torch.as_tensor(world)).numpy()
    vox_dst = np.rint(nib.affines.apply_affine(np.linalg.inv(dst.affine), moved)).astype(int)
    values = data_dst[tuple(vox_dst.T)]
    assert np.mean(values > 100) > 0.95


def test_bad_dataset_arguments():
    with pytest.raises(ValueError, match="surface is 'smooth'"):
        datasets.fsaverage5("smooth")
    with pytest.raises(ValueError, match="threshold is 1.5"):
        datasets.mni152_surface(threshold=1.5)
    with pytest.raises(ValueError, match="sigma is -1"):
        datasets.synthetic_subjects(n=1, sigma=-1)


def test_fsaverage5_midthickness_and_maps():
    mid = datasets.fsaverage5("midthickness", "left")
    pial, white = datasets.fsaverage5("pial", "left"), datasets.fsaverage5("white", "left")
    assert mid.n_points == 10242 and torch.equal(mid.faces, pial.faces)
    assert torch.allclose(mid.points, (pial.points + white.points) / 2, atol=1e-5)
    assert float(white.area) < float(mid.area) < float(pial.area)
    sulc, curv = datasets.fsaverage5_map("sulc"), datasets.fsaverage5_map("curv", "right")
    assert sulc.shape == (10242,) and curv.shape == (10242,)
    # FreeSurfer's sulcal depth and curvature agree in sign on most of the cortex
    assert np.corrcoef(sulc, datasets.fsaverage5_map("curv"))[0, 1] > 0.3
    # our mesh curvature is positive on crowns, FreeSurfer's curv positive in sulci
    ours = white.mean_curvature().numpy()
    assert np.corrcoef(ours, datasets.fsaverage5_map("curv"))[0, 1] < -0.5


def test_conte69_loads_in_mm_with_its_medial_wall():
    pytest.importorskip("brainspace")
    left = datasets.conte69("left")
    assert left.n_points == 32492 and left.n_faces == 64980 and left.unit == "mm"
    assert (edge_counts(left.faces) == 2).all()  # closed
    assert float(left.volume) > 0  # outward normals
    extent = (left.points.max(0).values - left.points.min(0).values).numpy()
    assert 60 < extent[0] < 80 and 160 < extent[1] < 180  # a hemisphere, in mm
    right = datasets.conte69("right")
    assert float(right.points[:, 0].mean()) > 0 > float(left.points[:, 0].mean())
    cortex = left.data["cortex"]
    assert cortex.shape == (32492,) and 0.85 < float(cortex.float().mean()) < 0.95
    labels = datasets.conte69_parcellation("schaefer_100", "right")
    assert labels.shape == (32492,) and set(np.unique(labels)) == {0, *range(51, 101)}
    sphere = datasets.conte69("left", "sphere")
    assert torch.equal(sphere.faces, left.faces)


def test_conte69_without_brainspace_says_how_to_install(monkeypatch):
    hide_module(monkeypatch, "brainspace")
    with pytest.raises(ImportError, match=r"pip install 'otreg\[data\]'"):
        datasets.conte69()


def test_bad_conte69_and_map_arguments():
    with pytest.raises(ValueError, match="hemi is 'middle'"):
        datasets.conte69("middle")
    with pytest.raises(ValueError, match="surface is 'pial'"):
        datasets.conte69("left", "pial")
    with pytest.raises(ValueError, match="name is 'depth'"):
        datasets.fsaverage5_map("depth")
    with pytest.raises(ValueError, match="name is 'aal'"):
        datasets.conte69_parcellation("aal")
    with pytest.raises(ValueError, match="no midthickness file"):
        datasets.fsaverage5_path("midthickness")
