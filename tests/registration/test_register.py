"""otreg.register on real surfaces with known ground truth."""

import math

import pytest
import torch

from otreg import Shape, datasets
from otreg.registration import Registration, prealign, register
from otreg.registration.deformations import rotation_matrix

pytest.importorskip("nilearn")
pytest.importorskip("pyvista")


@pytest.fixture(scope="module")
def pial_small():
    return datasets.fsaverage5("pial", "left").to(torch.float64).decimate(800)


def test_rigid_prealignment_recovers_a_known_rotation(pial_small):
    R = rotation_matrix(torch.tensor([0.05, -0.12, 0.08], dtype=torch.float64))  # 8.7 degrees
    t = torch.tensor([4.0, -6.0, 3.0], dtype=torch.float64)
    c = pial_small.points.mean(0)
    moved = pial_small.with_points((pial_small.points - c) @ R.T + c + t)
    fit = prealign(pial_small, moved, "rigid", n_iter=10)
    error = fit.matrix().detach() @ R.T
    angle = math.degrees(math.acos(min(1.0, (float(torch.trace(error)) - 1) / 2)))
    assert angle < 0.5
    assert float((fit(pial_small.points) - moved.points).norm(dim=1).mean()) < 0.5  # mm


def test_register_small_saves_loads_and_reports(pial_small, tmp_path):
    (subject,) = datasets.synthetic_subjects(pial_small, n=1, magnitude=3.0, max_angle=3.0,
                                             max_shift=3.0, sigma=30.0, n_controls=20, seed=1)
    before = float((subject.shape.points - pial_small.points).norm(dim=1).mean())
    res = register(pial_small, subject.shape, control_points=200, sigma=25.0, n_steps=5,
                   levels=((400, 6.0),), max_iter=10, truth=subject.shape.points,
                   progress=False)
    assert isinstance(res, Registration) and res.warped.n_points == pial_small.n_points
    assert res.metrics["vertex_error_mean_mm"] < before
    assert res.metrics["jacobian_min"] > 0
    assert res.history and res.history[-1]["loss"] <= res.history[0]["loss"]
    folder = res.save(tmp_path / "out")
    assert {p.name for p in folder.iterdir()} == {"warped.vtk", "parameters.npz",
                                                 "registration.json"}
    back = Registration.load(folder)
    x = pial_small.points[:50]
    assert torch.allclose(back.transform(x), res.transform(x), atol=1e-9)
    assert torch.allclose(torch.as_tensor(res.transform(x.numpy())), res.transform(x))
    with pytest.raises(TypeError, match="got list"):
        res.transform([[0.0, 0.0, 0.0]])
    moved = res.transform(pial_small)
    assert isinstance(moved, Shape) and torch.allclose(moved.points, res.warped.points,
                                                       atol=1e-9)


def test_lddmm_recovers_a_synthetic_subject_of_fsaverage5():
    # the full surface (10,242 vertices), default options: about 45 s on two cores
    base = datasets.fsaverage5("pial", "left")
    (subject,) = datasets.synthetic_subjects(base, n=1, seed=0)
    before = float((subject.shape.points - base.points).norm(dim=1).mean())
    res = register(base, subject.shape, truth=subject.shape.points, progress=False)
    assert before > 4.0
    assert res.metrics["vertex_error_mean_mm"] < 1.0
    assert res.metrics["jacobian_negative_fraction"] == 0.0
    assert [h["level"] for h in res.history][-1] == 1  # both levels ran
    assert "sinkhorn" in res.history[0] and "varifold" in res.history[-1]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(model="bspline"), ValueError, "model is 'bspline'"),
    (dict(prealign="magic"), ValueError, "prealign is 'magic'"),
    (dict(loss="l2"), ValueError, "loss is 'l2'"),
    (dict(loss={"sinkhorn": -1.0}), ValueError, "weight of sinkhorn is -1.0"),
    (dict(sigma=-5.0), ValueError, "sigma is -5.0"),
    (dict(n_steps=0), ValueError, "n_steps is 0"),
    (dict(levels=()), ValueError, "levels is empty"),
    (dict(levels=((500, 6.0, "l2"),)), ValueError, "loss is 'l2'"),
    (dict(levels=((500, 6.0, {}),)), ValueError, "the loss of level 1 is \\{\\}"),
    (dict(levels=((500,),)), ValueError, "each level is \\(points, scale_mm\\)"),
    (dict(varifold_sigma=0.0), ValueError, "varifold_sigma is 0.0"),
    (dict(truth=torch.zeros(5, 3)), ValueError, "truth has shape \\(5, 3\\)"),
    (dict(loss={"landmarks": 1.0}), ValueError, "landmarks= is None"),
])
def test_bad_options(pial_small, kwargs, error, match):
    with pytest.raises(error, match=match):
        register(pial_small, pial_small, progress=False, **kwargs)


def test_bad_shapes(pial_small):
    with pytest.raises(TypeError, match="source must be an otreg Shape"):
        register(pial_small.points, pial_small)
    with pytest.raises(ValueError, match="target has no triangles"):
        register(pial_small, Shape(pial_small.points))
    flat = Shape(pial_small.points[:, :2])
    with pytest.raises(ValueError, match="2-D points"):
        register(flat, pial_small)
    cm = Shape(pial_small.points, pial_small.faces, unit="cm")
    with pytest.raises(ValueError, match="source is in mm but target in cm"):
        register(pial_small, cm)
