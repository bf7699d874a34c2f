"""LDDMM shooting against Hamiltonian mechanics and finite differences."""

import dataclasses

import pytest
import torch

from otreg import LDDMMOptions
from otreg.registration import LDDMM

D = torch.float64


def model(integrator="rk4", n_steps=20, sigma=15.0, seed=0, n=40):
    g = torch.Generator().manual_seed(seed)
    q = 20 * torch.randn(n, 3, generator=g, dtype=D)
    m = LDDMM(q, sigma=sigma, n_steps=n_steps, integrator=integrator).double()
    with torch.no_grad():
        m.momenta.copy_(2 * torch.randn(n, 3, generator=g, dtype=D))
    return m


@pytest.mark.parametrize("integrator, rtol", [("rk4", 1e-6), ("leapfrog", 1e-3), ("euler", 5e-2)])
def test_shooting_conserves_the_hamiltonian(integrator, rtol):
    m = model(integrator)
    q1, p1, _ = m.shoot()
    h0, h1 = float(m.energy().detach()), float(m.hamiltonian(q1, p1).detach())
    assert abs(h1 - h0) <= rtol * h0


@pytest.mark.parametrize("integrator", ["euler", "leapfrog", "rk4"])
@pytest.mark.parametrize("path", ["dense", "reductions"])
def test_jacobians_carried_along_the_flow_equal_autograds(integrator, path, monkeypatch):
    from otreg.registration import kernels

    if path == "reductions":  # every kernel sum through otreg.reductions
        monkeypatch.setattr(kernels, "DENSE_MAX_PAIRS", 0)
    m = model(integrator, n_steps=5, sigma=[15.0, 6.0])
    g = torch.Generator().manual_seed(3)
    x = (25 * torch.randn(200, 3, generator=g, dtype=D)).requires_grad_()
    y = m(x)
    rows = [torch.autograd.grad(y[:, k].sum(), x, retain_graph=True)[0] for k in range(3)]
    J = m.jacobians(x)
    assert J.shape == (200, 3, 3) and not J.requires_grad
    assert torch.allclose(J, torch.stack(rows, 1), rtol=0, atol=1e-11)
    assert float((J - torch.eye(3, dtype=D)).abs().max()) > 0.05  # the flow is not ~identity


def test_momentum_equation_is_minus_dH_dq():
    m = model()
    q = m.control_points.clone().requires_grad_()
    (g,) = torch.autograd.grad(m.hamiltonian(q, m.momenta.detach()), q)
    _, dp, _ = m._velocities(m.control_points, m.momenta.detach(), q[:0])
    assert torch.allclose(dp, -g, atol=1e-12)


def test_multiscale_kernel_conserves_too():
    g = torch.Generator().manual_seed(1)
    q = 20 * torch.randn(30, 3, generator=g, dtype=D)
    m = LDDMM(
        q, sigma=(10.0, 30.0), kernel_weights=(1.0, 0.5), n_steps=20, integrator="rk4"
    ).double()
    with torch.no_grad():
        m.momenta.copy_(torch.randn(30, 3, generator=g, dtype=D))
    with torch.no_grad():
        q1, p1, _ = m.shoot()
        assert float(m.hamiltonian(q1, p1)) == pytest.approx(float(m.energy()), rel=1e-6)


@pytest.mark.parametrize("strategy", ["store", "checkpoint"])
def test_gradient_through_shooting_matches_finite_differences(strategy):
    m = model(n_steps=8, n=15)
    m.strategy = strategy
    x = 20 * torch.randn(10, 3, generator=torch.Generator().manual_seed(2), dtype=D)

    def loss():
        return (m(x) ** 2).sum() + m.energy()

    (grad,) = torch.autograd.grad(loss(), m.momenta)
    v = torch.randn_like(grad)
    h = 1e-6
    with torch.no_grad():
        m.momenta.add_(h * v)
        up = float(loss())
        m.momenta.sub_(2 * h * v)
        down = float(loss())
        m.momenta.add_(h * v)
    assert float((grad * v).sum()) == pytest.approx((up - down) / (2 * h), rel=1e-6)


def test_zero_momenta_is_the_identity_and_flow_is_invertible_in_practice():
    m = model()
    x = 10 * torch.randn(20, 3, dtype=D)
    with torch.no_grad():
        m.momenta.zero_()
        assert torch.equal(m(x), x)


def test_float64_points_through_a_float32_flow_keep_their_digits_on_both_paths():
    """``forward`` and ``forward_with_jacobians`` (what the metrics and the warped vertices
    use) add the float32 flow's displacement to float64 points in float64: the same
    positions on both paths to float32's rounding of the displacement, and a zero flow is
    exactly the identity."""
    m = model().float()
    x = 10 * torch.randn(20, 3, dtype=torch.float64)
    with torch.no_grad():
        moved, _ = m.forward_with_jacobians(x)
        step = float((moved - x).abs().max())
        assert moved.dtype == torch.float64 and step > 0.1  # the flow moves them
        assert float((moved - m(x)).abs().max()) < 1e-5 * step
        m.momenta.zero_()
        assert torch.equal(m.forward_with_jacobians(x)[0], x) and torch.equal(m(x), x)


def test_whitened_momenta_map_to_the_same_deformation():
    """Inside ``whitened``: p = L^{-T} u with L L^T the kernel matrix (a brute-force one
    here), the energy is |u|^2 / 2, gradients reach u by the chain rule; on leaving,
    the momenta are a plain parameter holding the value u gave."""
    m = model(n_steps=4, sigma=(15.0, 6.0))
    p0 = m.momenta.detach().clone()
    q = m.control_points
    d2 = ((q[:, None, :] - q[None, :, :]) ** 2).sum(-1)
    K = torch.exp(-d2 / (2 * 15.0**2)) + torch.exp(-d2 / (2 * 6.0**2))
    L = m.kernel_factor()
    assert torch.allclose(L @ L.T, K, atol=1e-5 * float(K.diagonal().mean()))
    x = 10 * torch.randn(7, 3, generator=torch.Generator().manual_seed(2), dtype=D)
    target = m(x).detach() + 1.0
    with m.whitened() as u:
        assert torch.allclose(m.momenta, p0, atol=1e-10)  # the same deformation
        assert torch.allclose(u, L.T @ p0, atol=1e-10)
        energy = float(m.energy().detach())
        assert energy == pytest.approx(0.5 * float((u * u).sum().detach()), rel=1e-4)
        loss = ((m(x) - target) ** 2).sum()
        (grad_u,) = torch.autograd.grad(loss, u)
        with torch.no_grad():
            u.add_(0.01 * grad_u)
        moved = m.momenta.detach().clone()
    m2 = model(n_steps=4, sigma=(15.0, 6.0))
    with torch.no_grad():
        m2.momenta.copy_(p0)
    (grad_p,) = torch.autograd.grad(((m2(x) - target) ** 2).sum(), m2.momenta)
    assert torch.allclose(grad_u, L.T.inverse().T @ grad_p, rtol=1e-6, atol=1e-9)  # L^-1 g
    assert isinstance(m.momenta, torch.nn.Parameter) and "parametrizations" not in dir(m)
    assert torch.equal(m.momenta.detach(), moved)
    assert not torch.allclose(moved, p0)


def test_whitened_momenta_under_checkpointing_get_the_stored_gradient():
    """A fit with a memory budget checkpoints the shooting while u, not the momenta, is
    the parameter (the loop's check of captured tensors must not take the module's u for
    a tensor the step uses)."""
    x = 10 * torch.randn(7, 3, generator=torch.Generator().manual_seed(2), dtype=D)
    grads = []
    for strategy in ("store", "checkpoint"):
        m = model(n_steps=4, sigma=(15.0, 6.0))
        m.strategy = strategy
        with m.whitened() as u:
            (g,) = torch.autograd.grad((m(x) ** 2).sum(), u)
        grads.append(g)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sigma=-1.0), "sigma is -1.0"),
        (dict(sigma=[]), "sigma is empty"),
        (dict(n_steps=0), "n_steps is 0"),
        (dict(integrator="verlet"), "integrator is 'verlet'"),
        (dict(sigma=(1.0, 2.0), kernel_weights=(1.0,)), "1 weights for 2 widths"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LDDMM(torch.zeros(5, 3), **{"sigma": 5.0, **kwargs})


def test_defaults_are_the_options_objects():
    """One place for LDDMM's defaults: LDDMMOptions; from_options builds what they say."""
    import inspect

    params = inspect.signature(LDDMM).parameters
    options = LDDMMOptions(sigma=7.0)
    for field in ("n_steps", "integrator", "memory"):
        assert params[field].default == getattr(LDDMMOptions(), field), field
    made = LDDMM(torch.zeros(5, 3), sigma=7.0)
    assert made.strategy == options.strategy and made.memory == options.memory
    made = LDDMM.from_options(torch.zeros(5, 3), dataclasses.replace(options, n_steps=3))
    assert (made.n_steps, made.integrator, list(made.kernel.sigmas)) == (3, "leapfrog", [7.0])
    with pytest.raises(ValueError, match="options.sigma is None"):
        LDDMM.from_options(torch.zeros(5, 3), LDDMMOptions())


def test_small_kernel_sums_match_the_reductions(monkeypatch):
    """Small kernel sums form their matrices once for all widths; the values and gradients
    are those of the lazy reductions."""
    from otreg.registration import kernels
    from otreg.registration.kernels import GaussianKernel

    g = torch.Generator().manual_seed(4)
    x = (10 * torch.randn(30, 3, generator=g, dtype=D)).requires_grad_(True)
    y = (10 * torch.randn(20, 3, generator=g, dtype=D)).requires_grad_(True)
    v = torch.randn(20, 5, generator=g, dtype=D).requires_grad_(True)
    k = GaussianKernel((8.0, 3.0), (1.0, 0.5))
    outs = {}
    for limit in (kernels.DENSE_MAX_PAIRS, 0):
        monkeypatch.setattr(kernels, "DENSE_MAX_PAIRS", limit)
        a, b = k.with_derivative(x, y, v)
        c = k(x, y, v)
        grads = torch.autograd.grad((a**2).sum() + (b**3).sum() + c.sum(), (x, y, v))
        outs[limit] = (a, b, c, *grads)
    for dense, lazy in zip(*outs.values()):
        assert torch.allclose(dense, lazy, rtol=1e-10, atol=1e-12)
