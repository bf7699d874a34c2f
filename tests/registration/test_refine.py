"""The refinement: a second, narrower LDDMM after the first, composed with it."""

import numpy as np
import pytest
import torch

import otreg
from otreg import datasets
from otreg.registration import LDDMM, ComposedLDDMM, RefineOptions, defaults, register

D = torch.float64


def flow(seed: int, sigma: float, n_steps: int, n: int = 40) -> LDDMM:
    g = torch.Generator().manual_seed(seed)
    m = LDDMM(20 * torch.randn(n, 3, generator=g, dtype=D), sigma=sigma, n_steps=n_steps)
    m = m.double()
    with torch.no_grad():
        m.momenta.copy_(2 * torch.randn(n, 3, generator=g, dtype=D))
    return m


def test_a_composition_maps_inverts_and_differentiates_as_its_stages():
    first, second = flow(0, 15.0, 5), flow(1, 6.0, 2, n=80)
    phi = ComposedLDDMM([first, second])
    x = 25 * torch.randn(150, 3, generator=torch.Generator().manual_seed(2), dtype=D)
    assert torch.equal(phi(x), second(first(x)))
    assert float((phi.inverse(phi(x)) - x).abs().max()) < 1e-8
    x.requires_grad_()
    y = phi(x)
    rows = [torch.autograd.grad(y[:, k].sum(), x, retain_graph=True)[0] for k in range(3)]
    moved, J = phi.forward_with_jacobians(x)
    assert torch.allclose(J, torch.stack(rows, 1), rtol=0, atol=1e-10)
    assert torch.allclose(moved, y.detach(), rtol=0, atol=1e-10)
    frames = phi.trajectory(x.detach())
    assert len(frames) == 5 + 2 + 1 and torch.allclose(frames[-1], y.detach(), atol=1e-10)
    assert float(phi.energy()) == pytest.approx(float(first.energy() + second.energy()))


def test_a_composition_round_trips_through_arrays():
    phi = ComposedLDDMM([flow(0, 15.0, 5), flow(1, 6.0, 2, n=80)])
    arrays = {k: np.asarray(v) for k, v in phi.to_arrays().items()}
    assert "momenta" in arrays and "stage2_momenta" in arrays
    back = ComposedLDDMM.from_arrays(arrays)
    assert isinstance(back, ComposedLDDMM) and len(back.stages) == 2
    x = torch.randn(30, 3, dtype=D) * 20
    assert torch.equal(back(x), phi(x))
    single = ComposedLDDMM.from_arrays(flow(0, 15.0, 5).to_arrays())
    assert isinstance(single, LDDMM)


def test_bad_compositions_and_options_raise_naming_them(pial_small):
    with pytest.raises(TypeError, match="ComposedLDDMM: stages must be"):
        ComposedLDDMM([])
    with pytest.raises(ValueError, match="RefineOptions: n_steps"):
        RefineOptions(n_steps=0)
    with pytest.raises(ValueError, match="RefineOptions: sigma"):
        RefineOptions(sigma=-1.0)
    with pytest.raises(TypeError, match="RefineOptions: levels must be"):
        RefineOptions(levels="fine")
    with pytest.raises(TypeError, match="register: refine must be True, False or a Refine"):
        register(pial_small, pial_small, refine="yes", progress=False)
    with pytest.raises(ValueError, match="refine is a RefineOptions but model is linear"):
        register(pial_small, pial_small, model="rigid", refine=RefineOptions(), progress=False)


@pytest.fixture(scope="module")
def bumpy(pial_small):
    """A subject of the small pial surface with folds-sized bumps (8 mm) on a smooth
    deformation: what a 25 mm kernel leaves."""
    (subject,) = datasets.synthetic_subjects(
        pial_small, n=1, magnitude=2.5, max_angle=2.0, max_shift=2.0, sigma=8.0,
        n_controls=80, seed=3,
    )  # fmt: skip
    return subject.shape


def test_the_refinement_gets_closer_and_is_recorded(pial_small, bumpy, tmp_path):
    common = dict(
        model=otreg.LDDMMOptions(sigma=25.0, control_points=150),
        levels=((400, 5.0),),
        progress=False,
    )
    alone = register(pial_small, bumpy, refine=False, **common)
    refined = register(pial_small, bumpy, **common)
    assert isinstance(alone.deformation, LDDMM) and alone.options["refine"] is None
    assert isinstance(refined.deformation, ComposedLDDMM)
    m, m0 = refined.metrics, alone.metrics
    assert m["mean_mm"] < 0.7 * m0["mean_mm"], (m["mean_mm"], m0["mean_mm"])
    assert m["jacobian_negative_fraction"] == 0.0
    # the defaults, derived from the target, are recorded
    scale = defaults.shape_scale(bumpy)
    options = refined.options["refine"]
    # the small pial surface's edges (11 mm) make the width, not the size (a 54th: 4 mm)
    edge = defaults.mean_edge_mm(pial_small)
    assert options["sigma"] == round(defaults.REFINE_EDGE_SIGMAS * edge, 2) > 4 * 2
    assert options["sigma"] == defaults.default_refine_sigma(scale, edge, 25.0)
    assert options["n_steps"] == 2
    # control points by the area rule, but at most one for every two source vertices
    cps = defaults.default_refine_control_points(scale, options["sigma"], pial_small.n_points)
    assert options["control_points"] == cps <= max(100, pial_small.n_points // 2)
    assert [tuple(lv.values())[:2] for lv in options["levels"]] == [
        tuple(lv) for lv in defaults.default_refine_levels(scale, options["sigma"])
    ]
    assert all(lv["loss"] == {"varifold": 1.0} for lv in options["levels"])
    assert {h["level"] for h in refined.history} == {0, 1}  # the refinement's level follows
    back = otreg.Registration.load(refined.save(tmp_path / "out"))
    assert isinstance(back.deformation, ComposedLDDMM)
    x = pial_small.points[:40]  # float32 flows; the rigid map comes back as its matrix
    assert torch.allclose(back.transform(x), refined.transform(x), rtol=0, atol=1e-4)
    assert torch.allclose(refined.transform(pial_small.points), refined.warped.points, atol=1e-4)


def test_a_mesh_too_coarse_for_a_narrower_kernel_is_not_refined(pial_small):
    """The LDDMM's own narrowest width is already about the mesh's spacing: refine=True fits
    nothing more (a narrower kernel between the control points would fold the surface)."""
    res = register(
        pial_small,
        pial_small.with_points(pial_small.points * 1.03),
        model=otreg.LDDMMOptions(sigma=12.0, control_points=150),
        levels=((300, 5.0),),
        progress=False,
    )
    assert isinstance(res.deformation, LDDMM) and res.options["refine"] is None


def test_refine_options_are_kept(pial_small):
    res = register(
        pial_small,
        pial_small.with_points(pial_small.points * 1.03),
        levels=((300, 5.0),),
        refine=RefineOptions(sigma=5.0, control_points=200, n_steps=3, levels=((400, 3.0),)),
        progress=False,
    )
    stage = res.deformation.stages[1]
    assert stage.kernel.sigmas == [5.0] and stage.n_steps == 3
    assert stage.control_points.shape[0] == pytest.approx(200, abs=20)
    assert res.options["refine"]["levels"][0]["points"] == 400


def test_the_refinement_has_at_most_a_control_point_for_every_two_source_vertices():
    # a 3,001-vertex hippocampus at a 1.04 mm kernel: the area rule asks for the 3,000 of the
    # range's top, the source can pin down 1,500; a hemisphere keeps the area rule's count
    small = defaults.ShapeScale(size_mm=40.0, area_mm2=2500.0, vertices=3001)
    assert defaults.default_refine_control_points(small, 1.04, 3001) == 1500
    assert defaults.default_refine_control_points(small, 1.04, 100) == 100  # the range's floor
    hemisphere = defaults.ShapeScale(size_mm=210.0, area_mm2=70_000.0, vertices=10242)
    assert defaults.default_refine_control_points(hemisphere, 4.0, 10242) == 3000
    assert defaults.default_refine_control_points(hemisphere, 10.0, 10242) == 2800  # 4 A / s^2
