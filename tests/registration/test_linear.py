"""Linear maps and their least-squares fits against known transforms."""

import math

import pytest
import torch

from otreg.registration import Affine, Rigid, Similarity
from otreg.registration.linear import fit_linear, rotation_matrix

D = torch.float64


def test_linear_models_and_fits():
    w = torch.tensor([0.1, -0.2, 0.3], dtype=D)
    R = rotation_matrix(w)
    assert torch.allclose(R @ R.T, torch.eye(3, dtype=D), atol=1e-14)
    assert float(torch.linalg.det(R)) == pytest.approx(1.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, generator=g, dtype=D)
    center = x.mean(0)
    t = torch.tensor([1.0, 2.0, -3.0], dtype=D)
    for kind, cls, A in [
        ("rigid", Rigid, R),
        ("similarity", Similarity, 1.3 * R),
        ("affine", Affine, R @ torch.diag(torch.tensor([1.0, 2.0, 0.5], dtype=D))),
    ]:
        y = (x - center) @ A.T + center + t
        A_fit, t_fit = fit_linear(kind, x, y, torch.ones(50, dtype=D), center)
        assert torch.allclose(A_fit, A, atol=1e-10) and torch.allclose(t_fit, t, atol=1e-10)
        m = cls(center).double()
        m.set_from(A_fit, t_fit)
        assert torch.allclose(m(x), y, atol=1e-10)
        assert torch.allclose(m.inverse(m(x)), x, atol=1e-10)
    assert math.isclose(float(Rigid(center).double().matrix().detach().trace()), 3.0)
