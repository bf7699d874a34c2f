"""Real brain data from nilearn's wheel and synthetic subjects with ground truth."""

import json

import numpy as np
import pytest
import torch

from otreg import datasets, load_shape

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
