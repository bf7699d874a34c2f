"""Registration on anatomy: defaults from the shapes' size, data terms that match a
per-vertex signal, and correspondence metrics (curvature correlation, label Dice)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from otreg import LBFGSOptions, datasets, register
from otreg.registration import defaults, metrics
from otreg.registration.losses import SIGNAL, make_loss
from otreg.shapes import Shape

pv = pytest.importorskip("pyvista")
pytest.importorskip("nilearn")


def scaled(shape: Shape, factor: float) -> Shape:
    return shape.with_points(shape.points * factor)


@pytest.fixture(scope="module")
def hemisphere_pair():
    base = datasets.fsaverage5("pial", "left").to(torch.float64).decimate(1500)
    (subject,) = datasets.synthetic_subjects(base, n=1, seed=3)
    return base, subject.shape.to(torch.float64)


def test_defaults_follow_the_size_of_the_shapes(hemisphere_pair):
    base, _ = hemisphere_pair
    big, small = defaults.shape_scale(base), defaults.shape_scale(scaled(base, 0.2))
    assert small.size_mm == pytest.approx(0.2 * big.size_mm)
    assert small.area_mm2 == pytest.approx(0.04 * big.area_mm2)
    for s_small, s_big in zip(defaults.default_sigma(small), defaults.default_sigma(big)):
        assert s_small == pytest.approx(0.2 * s_big, rel=0.01)
    # the same shape at another size: the same number of points a level, scales x 0.2
    for (n_big, s_big), (n_small, s_small) in zip(
        defaults.default_levels(big), defaults.default_levels(small)
    ):
        assert n_small == n_big and s_small == pytest.approx(0.2 * s_big, rel=0.01)
    n_small = defaults.default_control_points(small, defaults.default_sigma(small)[0])
    n_big = defaults.default_control_points(big, defaults.default_sigma(big)[0])
    assert abs(n_small - n_big) <= 1  # sigma is rounded to 0.01 mm


@pytest.mark.slow  # 38 s (the default run stays under 20 minutes)
def test_one_call_registers_a_hemisphere_and_a_small_structure(hemisphere_pair):
    """A synthetic deformation of a hemisphere (200 mm) and of the same shape at a fifth of
    its size (a 45 mm structure): the same call recovers both, to the same fraction of
    their size, and records the derived options."""
    base, subject = hemisphere_pair
    results = {}
    for factor in (1.0, 0.2):
        src, tgt = scaled(base, factor), scaled(subject, factor)
        res = register(src, tgt, truth=tgt.points, progress=False)
        results[factor] = res
        m = res.metrics
        moved = float((tgt.points - src.points).norm(dim=1).mean())  # 6.5 and 1.3 mm
        assert m["vertex_error_mean_mm"] < 0.05 * moved, m  # measured: 2% and 0.7%
        assert m["mean_mm"] < 0.35 * m["before_mean_mm"], m
        assert m["jacobian_negative_fraction"] == 0.0 and m["jacobian_points"] == src.n_points
        size = defaults.shape_scale(tgt).size_mm
        assert res.options["scale"]["size_mm"] == pytest.approx(size)
        assert res.options["lddmm"]["sigma"] == pytest.approx((size / 10, size / 27), rel=0.01)
        assert res.options["levels"][-1]["scale"] == pytest.approx(size / 50, rel=0.01)
    # at least as close, relative to its size (the deformation energy's weight is not
    # scaled with the size, so the small one is the less regularised)
    ratio = results[0.2].metrics["mean_mm"] / results[1.0].metrics["mean_mm"]
    assert ratio < 0.3


def test_explicit_options_are_kept():
    sphere = Shape.from_pyvista(pv.Sphere(radius=20, theta_resolution=16, phi_resolution=16))
    moved = sphere.with_points(sphere.points * 1.05)
    res = register(
        sphere,
        moved,
        model="lddmm",
        levels=((200, 3.0),),
        varifold_sigma=2.5,
        progress=False,
    )
    assert res.options["levels"] == [{"points": 200, "scale": 3.0, "loss": {"sinkhorn": 1.0}}]
    assert res.options["varifold_sigma"] == 2.5 and res.options["dtype"] == "float32"
    double = register(sphere, moved, levels=((200, 3.0),), dtype=torch.float64, progress=False)
    assert double.options["dtype"] == "float64" and double.momenta.dtype == torch.float64
    assert double.metrics["mean_mm"] < 0.5 * double.metrics["before_mean_mm"]
    with pytest.raises(TypeError, match="dtype is torch.float16"):
        register(sphere, moved, dtype=torch.float16, progress=False)


def small_shapes(seed: int = 0):
    """Two bumpy spheres (float64) with a signal on their vertices, a few mm apart."""
    m = pv.Sphere(radius=10, theta_resolution=10, phi_resolution=10).triangulate()
    g = torch.Generator().manual_seed(seed)
    shapes = []
    for k in range(2):
        p = torch.as_tensor(m.points, dtype=torch.float64)
        p = p * (1 + 0.05 * torch.randn(p.shape[0], 1, generator=g, dtype=torch.float64))
        p = p + 0.5 * k
        faces = torch.as_tensor(np.array(m.faces.reshape(-1, 4)[:, 1:]))
        signal = torch.randn(p.shape[0], generator=g, dtype=torch.float64)
        shapes.append(Shape(p, faces, data={SIGNAL: signal}))
    return shapes


@pytest.mark.parametrize("name", ["varifold", "currents"])
def test_signal_terms_gradient_matches_finite_differences(name):
    a, b = small_shapes()
    term = make_loss(name, sigma=3.0, signal=2.0, dtype=None)  # float64 for gradcheck
    term.prepare(a, b)

    def value(points):
        return term(a.with_points(points), b)

    x = a.points.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(value, (x,), eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name", ["varifold", "currents", "sinkhorn"])
def test_terms_in_float32_agree_with_float64(name):
    a, b = small_shapes()
    exact = make_loss(name, sigma=3.0, blur=3.0, dtype=None)
    fast = make_loss(name, sigma=3.0, blur=3.0)  # float32 kernel sums by default
    values, grads = [], []
    for term in (exact, fast):
        term.prepare(a, b)
        x = a.points.clone().requires_grad_(True)
        value = term(a.with_points(x), b)
        assert value.dtype == torch.float64  # returned in the points' dtype
        (grad,) = torch.autograd.grad(value, x)
        values.append(float(value))
        grads.append(grad)
    assert values[1] == pytest.approx(values[0], rel=1e-4, abs=1e-6)
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 1e-3


def test_term_dtype_is_checked():
    with pytest.raises(TypeError, match="dtype is torch.int64"):
        make_loss("varifold", sigma=3.0, dtype=torch.int64)


def test_sinkhorn_signal_term_gradient_matches_finite_differences():
    from otreg.ot.problem import SinkhornOptions

    a, b = small_shapes(1)
    options = SinkhornOptions(scaling=0.5, tol=1e-9, max_iter=5000)
    term = make_loss("sinkhorn", blur=3.0, sinkhorn=options, dtype=None, signal=2.0)
    term.prepare(a, b)
    x = a.points.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(term(a.with_points(x), b), x)
    direction = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=x.dtype)
    h = 1e-4
    with torch.no_grad():
        up = term(a.with_points(x + h * direction), b)
        down = term(a.with_points(x - h * direction), b)
    assert float((grad * direction).sum()) == pytest.approx(float(up - down) / (2 * h), rel=1e-4)


def test_the_signal_changes_the_term():
    """The same positions, the signal of one shape shuffled: the term sees the mismatch."""
    a, b = small_shapes(2)
    same = b.with_points(a.points)
    same.data = {SIGNAL: a.data[SIGNAL]}
    shuffled = b.with_points(a.points)
    shuffled.data = {SIGNAL: a.data[SIGNAL].flip(0)}
    for name in ("varifold", "sinkhorn"):
        plain = make_loss(name, sigma=3.0, blur=3.0)
        with_signal = make_loss(name, sigma=3.0, blur=3.0, signal=3.0)
        assert float(plain(a, same)) == pytest.approx(float(plain(a, shuffled)), abs=1e-6)
        assert float(with_signal(a, same)) < 1e-4
        assert float(with_signal(a, shuffled)) > 100 * max(float(with_signal(a, same)), 1e-6)


def test_register_with_a_signal_and_its_errors(pial_small):
    curv = pial_small.mean_curvature()
    src = Shape(pial_small.points, pial_small.faces, data={"depth": curv})
    tgt = src.with_points(src.points + torch.tensor([1.0, -0.5, 0.5], dtype=torch.float64))
    small = dict(levels=((300, 4.0),), progress=False)
    res = register(src, tgt, signal="depth", **small)
    assert res.options["signal"] == "depth" and res.metrics["depth_correlation"] > 0.95
    res = register(src, tgt, signal="curvature", **small)
    assert res.metrics["curvature_correlation"] > 0.9
    with pytest.raises(ValueError, match="the target has no data\\['depth'\\]"):
        register(src, Shape(tgt.points, tgt.faces), signal="depth", **small)
    with pytest.raises(ValueError, match="must be one float per vertex"):
        bad = Shape(src.points, src.faces, data={"depth": torch.zeros(src.n_points, 2)})
        register(bad, tgt, signal="depth", **small)
    with pytest.raises(TypeError, match="signal must be a str"):
        register(src, tgt, signal=3, **small)
    with pytest.raises(ValueError, match="signal_weight is 0"):
        register(src, tgt, signal="depth", signal_weight=0, **small)


def test_signals_of_opposite_signs_warn(pial_small):
    """A map negated on one side (the HCP's sulc against FreeSurfer's) and a target whose
    triangles wind the other way (its curvature negated) warn before the fit; the same
    signs do not."""
    import warnings

    curv = pial_small.mean_curvature()
    src = Shape(pial_small.points, pial_small.faces, data={"depth": curv})
    tgt = src.with_points(src.points + torch.tensor([1.0, -0.5, 0.5], dtype=torch.float64))
    small = dict(levels=((300, 4.0),), optimizer=LBFGSOptions(max_iter=1), progress=False)
    flipped = tgt.with_data(depth=-curv)
    with pytest.warns(UserWarning, match="'depth' of the source and the target are anti-corr"):
        register(src, flipped, signal="depth", **small)
    inside_out = Shape(tgt.points, tgt.faces[:, [0, 2, 1]])
    with pytest.warns(UserWarning, match="wind its triangles the other way"):
        register(src, inside_out, signal="curvature", **small)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*anti-correlated", category=UserWarning)
        register(src, tgt, signal="depth", **small)
        register(src, tgt, signal="curvature", **small)


def test_mean_curvature_of_a_sphere_is_one_over_its_radius():
    for radius in (5.0, 20.0):
        sphere = Shape.from_pyvista(
            pv.Sphere(radius=radius, theta_resolution=40, phi_resolution=40)
        )
        curv = sphere.mean_curvature().numpy()
        assert np.median(curv) == pytest.approx(1 / radius, rel=0.02)
    with pytest.raises(ValueError, match="smooth is -1"):
        sphere.mean_curvature(smooth=-1)


def test_correlation_and_dice_against_brute_force():
    rng = np.random.default_rng(0)
    src = rng.normal(size=50)
    tgt = rng.normal(size=30)
    nearest = rng.integers(0, 30, size=50)
    b = tgt[nearest]
    brute = np.sum((src - src.mean()) * (b - b.mean())) / np.sqrt(
        np.sum((src - src.mean()) ** 2) * np.sum((b - b.mean()) ** 2)
    )
    assert metrics.signal_correlation(src, tgt, nearest) == pytest.approx(brute)
    la = rng.integers(0, 4, size=50)
    lb = rng.integers(0, 4, size=30)
    dices = []
    for lab in (1, 2, 3):  # 0 is ignored
        x, y = la == lab, lb[nearest] == lab
        dices.append(2 * np.sum(x & y) / (np.sum(x) + np.sum(y)))
    assert metrics.label_dice(la, lb, nearest) == pytest.approx(np.mean(dices))
    assert metrics.label_dice(la, la, np.arange(50)) == 1.0


def test_correspondence_reports_signals_and_labels(pial_small):
    labels = (pial_small.points[:, 1] > 0).long() + 1  # anterior / posterior halves
    src = Shape(pial_small.points, pial_small.faces, data={"parcel": labels})
    out = metrics.correspondence(src, src, src)
    assert out["curvature_correlation"] == pytest.approx(1.0)
    assert out["parcel_dice"] == 1.0 and out["before_parcel_dice"] == 1.0
    shifted = src.with_points(src.points + torch.tensor([0.0, 30.0, 0.0], dtype=torch.float64))
    out = metrics.correspondence(src, src, shifted)  # the target moved 30 mm forward
    assert out["parcel_dice"] < 0.95 and out["curvature_correlation"] < 0.5


def test_a_folding_deformation_warns(pial_small, monkeypatch):
    """Where the Jacobian determinant is not positive at some vertex, register warns with
    the fraction and the minimum (the Jacobians are faked here: the fit itself does not
    fold)."""
    import importlib

    import otreg

    register_module = importlib.import_module("otreg.registration.register")

    real = register_module.transform_with_jacobians

    def folded(linear, deformation, points):
        moved, jac = real(linear, deformation, points)
        jac[:3] = torch.diag(torch.tensor([-0.5, 1.0, 1.0], dtype=jac.dtype))
        return moved, jac

    monkeypatch.setattr(register_module, "transform_with_jacobians", folded)
    tgt = pial_small.with_points(pial_small.points + 0.5)
    with pytest.warns(
        otreg.FoldWarning, match=r"<= 0 at 0\.\d+% of the source vertices \(min -0.5\)"
    ):
        res = register(pial_small, tgt, levels=((200, 4.0),), progress=False)
    assert res.metrics["jacobian_min"] == -0.5
