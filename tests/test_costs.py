import math

import pytest
import torch

from otreg.costs import diameter, epsilon_schedule, get_cost


@pytest.mark.parametrize(
    "p, diam, blur, scaling", [(2, 3.0, 0.01, 0.5), (1, 5.0, 0.1, 0.7), (2, 2.0, 0.05, 0.9)]
)
def test_epsilon_schedule_follows_the_documented_rule(p, diam, blur, scaling):
    eps = epsilon_schedule(p, diam, blur, scaling)
    assert eps[0] == pytest.approx(diam**p) and eps[1] == pytest.approx(diam**p)
    assert eps[-1] == pytest.approx(blur**p)
    ratios = [b / a for a, b in zip(eps[1:-2], eps[2:-1])]
    assert all(r == pytest.approx(scaling**p) for r in ratios)
    assert eps[-2] > blur**p >= eps[-2] * scaling**p
    assert len(eps) == 2 + math.ceil(p * math.log(blur / diam) / (p * math.log(scaling)))


def test_costs_closed_forms():
    x = torch.tensor([[[0.0, 0.0], [1.0, 1.0]]], dtype=torch.float64)
    y = torch.tensor([[[3.0, 4.0]]], dtype=torch.float64)
    assert torch.allclose(
        get_cost("sqeuclidean").dense(x, y)[0, :, 0], torch.tensor([12.5, 6.5], dtype=torch.float64)
    )
    assert torch.allclose(
        get_cost("euclidean").dense(x, y)[0, :, 0],
        torch.tensor([5.0, 13**0.5], dtype=torch.float64),
    )
    assert diameter(x, y) == pytest.approx(5.0)


def test_euclidean_gradient_is_finite_at_zero_distance():
    x = torch.zeros(1, 1, 3, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(get_cost("euclidean").dense(x, x.detach()).sum(), x)
    assert torch.isfinite(g).all()


def test_euclidean_costs_are_exact_near_coincident_points_in_float32():
    """From the coordinates' differences: a matrix product's rounding under the root made
    coincident float32 points about 3e-4 apart; now the cost and its gradient match float64
    to float32's precision, on clouds 5 units from the origin and 1e-3 from each other."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 50, 3, generator=gen, dtype=torch.float64) + 5.0
    y = torch.cat([x + 1e-3 * torch.randn(x.shape, generator=gen, dtype=x.dtype), x], 1)
    cost = get_cost("euclidean")
    exact = ((x[:, :, None] - y[:, None]) ** 2).sum(-1).sqrt()
    x32 = x.float().requires_grad_(True)
    got = cost.dense(x32, y.float())
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)
    (g,) = torch.autograd.grad(got[..., :50].sum(), x32)  # the near pairs' unit vectors
    x64 = x.clone().requires_grad_(True)
    (g64,) = torch.autograd.grad(cost.dense(x64, y)[..., :50].sum(), x64)
    torch.testing.assert_close(g.double(), g64, rtol=1e-3, atol=1e-3)


def test_euclidean_distances_pass_gradcheck_and_gradgradcheck():
    """Their gradient is a hand-written Function (the distances kept, not D matrices of
    differences): first and second derivatives against finite differences in float64."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    cost = get_cost("euclidean")
    assert torch.autograd.gradcheck(cost.dense, (x, y))
    assert torch.autograd.gradgradcheck(cost.dense, (x, y))
