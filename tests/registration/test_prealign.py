"""OT pre-alignment: known rigid motions recovered; options as an object or keywords."""

import math

import pytest
import torch

from otreg.registration import PrealignOptions, Rigid, Similarity, prealign
from otreg.registration.linear import rotation_matrix

R = rotation_matrix(torch.tensor([0.05, -0.12, 0.08], dtype=torch.float64))  # 8.7 degrees
T = torch.tensor([4.0, -6.0, 3.0], dtype=torch.float64)


@pytest.fixture(scope="module")
def moved(pial_small):
    c = pial_small.points.mean(0)
    return pial_small.with_points((pial_small.points - c) @ R.T + c + T)


def angle_degrees(fit):
    error = fit.matrix().detach() @ R.T
    return math.degrees(math.acos(min(1.0, (float(torch.trace(error)) - 1) / 2)))


def test_rigid_prealignment_recovers_a_known_rotation(pial_small, moved):
    fit = prealign(pial_small, moved, "rigid", n_iter=10)
    assert isinstance(fit, Rigid)
    assert angle_degrees(fit) < 0.5
    assert float((fit(pial_small.points).detach() - moved.points).norm(dim=1).mean()) < 0.5  # mm


@pytest.mark.parametrize("degrees", [150.0, 180.0])
def test_a_surface_turned_upside_down_is_found(pial_small, degrees):
    """From the identity alone, the rounds ended 180 degrees off (vertices 61 mm from
    their place, and LDDMM then bent the surface onto the target without a warning); the
    rotations between the two surfaces' principal axes are tried as starts too."""
    axis = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64) / math.sqrt(2)
    turn = rotation_matrix(axis * math.radians(degrees))
    target = pial_small.with_points(
        pial_small.points @ turn.T + torch.tensor([30.0, 0, 0]).double()
    )
    fit = prealign(pial_small, target, "rigid")
    error = (fit(pial_small.points).detach() - target.points).norm(dim=1)
    assert float(error.max()) < 0.5, float(error.max())


def test_a_half_turn_survives_the_rotation_parameters():
    """A rotation matrix of 180 degrees was read back as the identity (its axis taken from
    the antisymmetric part, which vanishes there)."""
    fit = Rigid(torch.zeros(3, dtype=torch.float64)).double()
    for rotvec in ([math.pi, 0, 0], [0, 0, math.pi], [math.pi / math.sqrt(2)] * 2 + [0]):
        half = rotation_matrix(torch.tensor(rotvec, dtype=torch.float64))
        fit.set_from(half, torch.zeros(3, dtype=torch.float64))
        torch.testing.assert_close(fit.matrix().detach(), half, atol=1e-12, rtol=0)


def test_closest_points_fit_a_surface_that_lacks_a_part(pial_small, moved):
    """A source cut short (its front 30% of vertices gone) against the whole moved target:
    OT must match all of the target's area with the source's, which drags the fit off by
    centimetres; trimmed symmetric closest points then recover the motion."""
    from otreg import Shape

    front = float(pial_small.points[:, 1].quantile(0.7))
    mesh = pial_small.to_pyvista().clip(normal="y", origin=(0, front, 0), invert=True)
    cut = Shape.from_pyvista(mesh.triangulate().clean(), torch.float64)
    c = pial_small.points.mean(0)
    truth = (cut.points - c) @ R.T + c + T

    def error(fit):
        return float((fit(cut.points).detach() - truth).norm(dim=1).mean())

    assert error(prealign(cut, moved, "rigid", closest_point_iter=0)) > 10  # mm
    fit = prealign(cut, moved, "rigid")
    assert error(fit) < 0.3 and angle_degrees(fit) < 0.2


def test_closest_points_on_a_coarse_mesh_keep_the_ot_fit():
    """Two concentric spheres 2 mm apart whose vertices are 18 mm apart: nearest vertices
    alone would pull the fit off; pairs aimed at the target's tangent planes do not."""
    import pyvista as pv

    from otreg import Shape

    def sphere(radius, resolution, shift):
        mesh = pv.Sphere(radius=radius, theta_resolution=resolution, phi_resolution=resolution)
        return Shape.from_pyvista(mesh.triangulate().translate((shift, 0, 0)), torch.float64)

    source, target = sphere(42, 15, 3.0), sphere(40, 14, 0.0)
    for fit in (prealign(source, target, closest_point_iter=0), prealign(source, target)):
        centre = fit(torch.tensor([[3.0, 0, 0]], dtype=torch.float64)).detach()
        assert float(centre.norm()) < 0.3  # mm: the source's centre onto the target's


def test_options_object_equals_the_keywords(pial_small, moved):
    a = prealign(pial_small, moved, kind="similarity", n_iter=3, max_points=500)
    b = prealign(pial_small, moved, PrealignOptions("similarity", n_iter=3, max_points=500))
    assert isinstance(b, Similarity)
    assert torch.equal(a.matrix().detach(), b.matrix().detach())
    # keywords replace the object's fields
    c = prealign(
        pial_small, moved, PrealignOptions("similarity", n_iter=8), n_iter=3, max_points=500
    )
    assert torch.equal(a.matrix().detach(), c.matrix().detach())


def test_bad_prealign_options(pial_small):
    with pytest.raises(ValueError, match="kind is 'none'"):
        prealign(pial_small, pial_small, "none")
    with pytest.raises(ValueError, match="kind is 'magic'"):
        prealign(pial_small, pial_small, "magic")
    with pytest.raises(ValueError, match="n_iter is 0"):
        prealign(pial_small, pial_small, n_iter=0)


def tetra(scale=1.0):
    from otreg import Shape

    pts = torch.tensor([[0.0, 0, 0], [10, 0, 0], [0, 10, 0], [0, 0, 10]], dtype=torch.float64)
    return Shape(pts * scale, torch.tensor([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]]))


def test_a_deformable_fit_between_two_units_under_a_rigid_prealignment_is_refused():
    """Metres against millimetres before LDDMM with a pre-alignment that keeps sizes: a
    ValueError naming the sizes and the way out, before any fit (that fit ran for minutes);
    with a similarity, which can scale the source, a warning as for a linear model."""
    from otreg import register

    with pytest.raises(ValueError, match=r"register: target is 1000 times larger.*'similarity'"):
        register(tetra(0.001), tetra(), progress=False)
    with pytest.raises(ValueError, match=r"prealign='none' keeps sizes"):
        register(tetra(), tetra(0.001), prealign="none", progress=False)


def test_register_warns_when_the_sizes_suggest_metres_and_millimetres():
    import warnings

    from otreg import register

    with pytest.warns(
        UserWarning, match=r"register: target is 1000 times larger than source.*metres"
    ):
        register(tetra(0.001), tetra(), model="rigid", progress=False)
    with pytest.warns(UserWarning, match=r"source is 25 times larger than target"):
        register(tetra(25.0), tetra(), model="rigid", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # shapes of one unit, 15 times apart: no warning
        register(tetra(15.0), tetra(), model="similarity", progress=False)
