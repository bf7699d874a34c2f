"""TransportPlan products against the dense plan."""

import pytest
import torch

import otreg
from tests.conftest import clouds

# each test runs on every reduction backend (tests/ot/conftest.py)
pytestmark = pytest.mark.usefixtures("each_backend")


@pytest.fixture
def solved(each_backend):
    x, y, a, b = clouds()
    return otreg.sinkhorn(x, y, a, b, blur=0.1, tol=1e-12, max_iter=10000), a, b, x, y


def test_products_equal_dense_products(solved):
    res, a, b, x, y = solved
    P = res.plan.dense()
    assert P.shape == (30, 40) == res.plan.shape
    v, w = torch.randn(40, dtype=P.dtype), torch.randn(30, 3, dtype=P.dtype)
    assert torch.allclose(res.plan.apply(v), P @ v, atol=1e-13)
    assert torch.allclose(res.plan.apply_t(w), P.T @ w, atol=1e-13)


def test_marginals_are_the_weights_at_convergence(solved):
    res, a, b, _, _ = solved
    row, col = res.plan.marginals()
    assert torch.allclose(row, a, atol=1e-11) and torch.allclose(col, b, atol=1e-11)


def test_barycentric_map(solved):
    res, _, _, x, y = solved
    P = res.plan.dense()
    expected = (P @ y) / P.sum(1, keepdim=True)
    assert torch.allclose(res.plan.barycentric_map(), expected, atol=1e-12)


def test_gradients_flow_to_the_applied_vector(solved):
    res, *_ = solved
    v = torch.randn(40, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(res.plan.apply(v).sum(), v)
    assert torch.allclose(grad, res.plan.dense().sum(0), atol=1e-13)


def test_batched_plan():
    x, y, a, b = clouds(batch=2)
    res = otreg.sinkhorn(x, y, a, b, blur=0.2, tol=1e-12, max_iter=10000)
    P = res.plan.dense()
    v = torch.randn(2, 40, dtype=x.dtype)
    assert P.shape == (2, 30, 40)
    assert torch.allclose(res.plan.apply(v), torch.einsum("bnm,bm->bn", P, v), atol=1e-13)


def test_dense_refuses_large_plans_and_bad_vectors(solved):
    res, *_ = solved
    with pytest.raises(ValueError, match="1,200 entries, more than max_entries=1,000"):
        res.plan.dense(max_entries=1000)
    with pytest.raises(ValueError, match=r"v has shape \(30,\)"):
        res.plan.apply(torch.zeros(30, dtype=torch.float64))
    with pytest.raises(TypeError, match="v has dtype torch.float32"):
        res.plan.apply(torch.zeros(40))
    assert "TransportPlan(shape=(30, 40)" in repr(res.plan)
