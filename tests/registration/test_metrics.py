"""Registration metrics against closed forms."""

import pytest
import torch

from otreg import Shape
from otreg.registration import metrics as M

pv = pytest.importorskip("pyvista")


def sphere(radius=1.0):
    mesh = pv.Sphere(radius=radius, theta_resolution=40, phi_resolution=40)
    return Shape.from_pyvista(mesh, dtype=torch.float64)


def test_distances_between_concentric_spheres():
    inner, outer = sphere(1.0), sphere(1.1)
    d = M.surface_distances(inner, outer)
    assert d["distance_to"] == "surface"
    # outer vertices lie 0.1 from the inner sphere, minus the chord sag of its triangles
    assert d["mean_ba_mm"] == pytest.approx(0.1, abs=3e-3)
    assert d["mean_ab_mm"] == pytest.approx(0.1, abs=3e-3)
    assert d["hausdorff_mm"] == pytest.approx(0.1, abs=5e-3)
    # to vertices: never less than to the surface
    v = M.surface_distances(inner, outer, to="vertices")
    assert v["distance_to"] == "vertices" and v["mean_ab_mm"] >= d["mean_ab_mm"] - 1e-12
    with pytest.raises(ValueError, match="to is 'faces'"):
        M.surface_distances(inner, outer, to="faces")


def test_point_to_surface_distances_equal_vtks_closest_cells():
    """libigl's distances are those of VTK's closest-cell search (an independent oracle),
    for points inside, outside, far and on vertices."""
    import numpy as np

    s = sphere(1.0)
    g = np.random.default_rng(0)
    points = np.concatenate([g.normal(size=(3000, 3)) * 0.8, s.points.numpy()[:50], [[5.0, 0, 0]]])
    ours = M.point_to_surface_distances(points, s)
    _, closest = s.to_pyvista().find_closest_cell(points, return_closest_point=True)
    np.testing.assert_allclose(ours, np.linalg.norm(points - closest, axis=1), atol=1e-12)
    assert ours[3000:3050].max() < 1e-12 and abs(ours[-1] - 4.0) < 1e-3
    cloud = Shape(s.points)
    with pytest.raises(ValueError, match="no triangles"):
        M.point_to_surface_distances(points, cloud)
    with pytest.raises(ValueError, match=r"points has shape \(4, 2\); it must be \(N, 3\)"):
        M.closest_surface_points(points[:4, :2], s)


def test_jacobian_of_a_linear_map_and_vertex_error():
    A = torch.tensor([[2.0, 0.1, 0], [0, 1.5, 0], [0, 0, 0.5]], dtype=torch.float64)
    x = torch.rand(20, 3, dtype=torch.float64)
    jac = M.jacobian_determinants(lambda p: p @ A.T, x)
    assert torch.allclose(jac, torch.full((20,), 1.5, dtype=torch.float64))
    err = M.vertex_error(x + torch.tensor([3.0, 4.0, 0.0], dtype=torch.float64), x)
    assert err["vertex_error_mean_mm"] == pytest.approx(5.0)


def test_the_varifold_metric_is_never_below_zero(monkeypatch):
    """A squared norm: a surface against itself is 0 to the sums' float32 rounding (about
    1e-6), and a rounding below 0 (-3e-6 was reported) comes out as 0."""
    ball = sphere(20.0)
    same = M.summary(ball, ball, sigma=5.0)["varifold"]
    assert 0.0 <= same < 1e-5

    def rounded_below(*args, **kwargs):
        return lambda warped, target: torch.tensor(-3e-6)

    monkeypatch.setattr(M, "make_loss", rounded_below)
    assert M.summary(ball, ball, sigma=5.0)["varifold"] == 0.0
