"""The truncated Gaussian kernel product (block-sparse over grid cells) against brute force."""

import math

import pytest
import torch

from otreg.reductions import sparse, track
from otreg.registration.kernels import GaussianKernel

D = torch.float64


def sheet(n: int, seed: int) -> torch.Tensor:
    """A wavy sheet 150 mm wide: a narrow kernel reaches a small part of it."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, 2, generator=g, dtype=D) * 150
    return torch.cat([u, 10 * torch.sin(u[:, :1] / 7) * torch.cos(u[:, 1:] / 9)], 1)


def brute(x, y, v, sigma):
    return torch.exp(-(torch.cdist(x, y) ** 2) / (2 * sigma**2)) @ v


def test_values_and_gradients_equal_brute_force_where_few_pairs_are_kept():
    x, y = sheet(1500, 0).requires_grad_(), sheet(900, 1).requires_grad_()
    v = torch.randn(900, 9, dtype=D, generator=torch.Generator().manual_seed(2))
    v.requires_grad_()
    kernel, _, _ = sparse.truncated_gaussian(x, y, 2.0)
    assert kernel.n_pairs < 0.25 * 1500 * 900  # truncation drops most pairs here
    out, ref = sparse.gaussian_product(x, y, v, 2.0), brute(x, y, v, 2.0)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12 * float(ref.abs().max()))
    G = torch.randn_like(ref)
    for a, b in zip(
        torch.autograd.grad((out * G).sum(), (x, y, v)),
        torch.autograd.grad((ref * G).sum(), (x, y, v)),
    ):
        assert torch.allclose(a, b, rtol=0, atol=1e-11 * float(b.abs().max()))


def test_gradcheck(monkeypatch):
    monkeypatch.setattr(sparse, "MAX_KEPT_FRACTION", 1.0)
    x = (sheet(40, 3) / 5).requires_grad_()
    y = (sheet(30, 4) / 5).requires_grad_()
    v = torch.randn(30, 2, dtype=D, requires_grad=True)
    assert sparse.truncated_gaussian(x, y, 0.5, max_fraction=1.0) is not None
    assert torch.autograd.gradcheck(
        lambda a, b, c: sparse.gaussian_product(a, b, c, 0.5), (x, y, v)
    )


def test_a_wide_kernel_goes_over_all_pairs():
    x, y = sheet(300, 5), sheet(200, 6)
    assert sparse.gaussian_product(x, y, torch.ones(200, 1, dtype=D), 40.0) is None
    assert sparse.gaussian_product(x[:0], y, torch.ones(200, 1, dtype=D), 2.0) is None


def test_a_sample_of_the_pairs_decides_before_the_pattern_is_built(monkeypatch):
    # the pairs within reach, estimated on a strided sample, are already above the largest
    # kept fraction at 8 mm on the 150 mm sheet (0.37): no grid is built; at 2 mm it is
    x, y = sheet(3000, 9), sheet(2000, 10)
    within = float((torch.cdist(x, y) <= sparse.TRUNCATION_SIGMAS * 8.0).double().mean())
    assert within > sparse.MAX_KEPT_FRACTION  # what the sample estimates
    built = []
    grid = sparse.grid_clusters
    monkeypatch.setattr(sparse, "grid_clusters", lambda *a: built.append(1) or grid(*a))
    assert sparse.truncated_gaussian(x, y, 8.0) is None and not built
    assert sparse.truncated_gaussian(x, y, 2.0) is not None and len(built) == 2


@pytest.mark.parametrize("sigma, truncated", [(2.0, True), (40.0, False)])
def test_the_deformation_kernel_truncates_narrow_widths_only(sigma, truncated):
    v = torch.randn(1000, 3, dtype=D, generator=torch.Generator().manual_seed(3))
    x, y = sheet(1200, 7), sheet(1000, 8)
    kernel = GaussianKernel([sigma, 2 * sigma], weights=[1.0, 0.5])
    with track() as backends:
        out, deriv = kernel.with_derivative(x, y, v)
    assert ("truncated" in backends) == truncated
    # each term left out is below exp(-TRUNCATION_SIGMAS^2 / 2) |v_j| (times its weight,
    # and 1 / sigma^2 in the derivative); the rounding: 1e-14 of the largest
    dropped = math.exp(-(sparse.TRUNCATION_SIGMAS**2) / 2) * float(v.abs().sum(0).max())
    ref = brute(x, y, v, sigma) + 0.5 * brute(x, y, v, 2 * sigma)
    tol = 1.5 * dropped + 1e-14 * float(ref.abs().max())
    assert torch.allclose(out, ref, rtol=0, atol=tol)
    ref_d = brute(x, y, v, sigma) / sigma**2 + 0.5 * brute(x, y, v, 2 * sigma) / (2 * sigma) ** 2
    tol = (1 / sigma**2 + 0.5 / (2 * sigma) ** 2) * dropped + 1e-14 * float(ref_d.abs().max())
    assert torch.allclose(deriv, ref_d, rtol=0, atol=tol)
