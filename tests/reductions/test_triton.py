"""The GPU kernels (``backend="triton"``) against the dense reductions, values and gradients
in x, y, h and v. Where there is no GPU, Triton's interpreter runs the same kernels on the
CPU (tests/conftest.py sets TRITON_INTERPRET=1 before triton is first imported); on a GPU,
tests/test_cuda.py runs them compiled."""

from __future__ import annotations

import pytest
import torch

import otreg
from otreg.costs import get_cost
from otreg.reductions import _dense, _triton, kernel_product, softmax_average, softmin

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is here: the compiled kernels are tested on it"
)


def inputs(B, N, M, D, E, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_(True)  # noqa: E731
    return make(B, N, D), make(B, M, D), make(B, M), make(B, M, E)


CASES = [  # (B, N, M, D, E): a batch; edge sizes (1 point, sizes not multiples of a tile)
    (2, 37, 70, 3, 4),
    (1, 1, 1, 3, 1),
    (1, 65, 33, 2, 12),
    (1, 70, 100, 3, 3),  # several tiles of rows and columns (float64), loops split
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
@pytest.mark.parametrize("kind", ["softmin", "kernel_product", "softmax_average"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_values_and_gradients_equal_the_dense_ones(kind, cost, dtype, case):
    B, N, M, D, E = case
    x, y, h, v = inputs(B, N, M, D, E, dtype)
    rest = {"softmin": (h,), "kernel_product": (v,), "softmax_average": (h, v)}[kind]
    c = get_cost(cost)
    public = {"softmin": softmin, "kernel_product": kernel_product,
              "softmax_average": softmax_average}[kind]  # fmt: skip
    ours = public(x, y, *rest, 0.3, c, backend="triton")
    wrt = (x, y, *rest)
    exact = [t.detach().double().requires_grad_(True) for t in wrt]  # the float64 truth
    ref = getattr(_dense, kind)(*exact[:2], *exact[2:], 0.3, c)
    g = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    got = torch.autograd.grad(ours, wrt, g.to(dtype))
    want = torch.autograd.grad(ref, exact, g)
    names = ("x", "y", "v") if kind == "kernel_product" else ("x", "y", "h", "v")
    tol = 1e-10 if dtype == torch.float64 else 2e-5  # relative to the largest entry
    for name, a, b in zip(("value", *names), (ours, *got), (ref, *want)):
        err = float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))
        assert err <= tol, (name, err)


@pytest.mark.parametrize("kind", ["softmin", "kernel_product", "softmax_average"])
def test_loops_split_into_many_parts_add_up(kind, monkeypatch):
    """Every tile of columns its own split (and of rows, for the column pass): the partial
    sums and log-sum-exps combined afterwards equal the dense reduction."""
    monkeypatch.setattr(_triton, "_programs_wanted", lambda device: 10_000)
    x, y, h, v = inputs(1, 40, 130, 3, 2, torch.float64, seed=3)
    rest = {"softmin": (h,), "kernel_product": (v,), "softmax_average": (h, v)}[kind]
    c = get_cost("sqeuclidean")
    ours = _triton.triton_reduction(kind, x, y, *rest, eps=0.1, cost=c)
    ref = getattr(_dense, kind)(x, y, *rest, 0.1, c)
    torch.testing.assert_close(ours.reshape(ref.shape), ref, rtol=1e-11, atol=1e-12)
    got = torch.autograd.grad(ours.sum(), (x, y, *rest))
    want = torch.autograd.grad(ref.sum(), (x, y, *rest))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


def test_a_second_derivative_goes_through_the_dense_formulas():
    x, y, h, _ = inputs(1, 20, 30, 3, 1, torch.float64, seed=1)
    c = get_cost("sqeuclidean")
    w = torch.randn(1, 20, 3, dtype=torch.float64)
    hvp = []
    for backend in ("triton", "tensorized"):
        (gx,) = torch.autograd.grad(softmin(x, y, h, 0.3, c, backend).sum(), x, create_graph=True)
        hvp.append(torch.autograd.grad((gx * w).sum(), (x, y, h)))
    for a, b in zip(*hvp):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_sinkhorn_on_the_triton_backend_reports_it_and_agrees():
    g = torch.Generator().manual_seed(2)
    x = torch.rand(60, 3, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.rand(70, 3, generator=g, dtype=torch.float64)
    ours = otreg.sinkhorn(x, y, blur=0.2, backend="triton")
    ref = otreg.sinkhorn(x, y, blur=0.2, backend="tensorized")
    assert ours.backend == ours.gradient_backend == "triton"
    torch.testing.assert_close(ours.cost, ref.cost, rtol=1e-10, atol=1e-12)
    (ga,) = torch.autograd.grad(ours.cost, x)
    (gb,) = torch.autograd.grad(ref.cost, x)
    torch.testing.assert_close(ga, gb, rtol=1e-9, atol=1e-12)


def test_what_the_kernels_cannot_take_is_named(monkeypatch):
    x = torch.rand(1, 5, 3)
    c = get_cost("sqeuclidean")
    with pytest.raises(TypeError, match="backend='triton' computes in float32 or float64"):
        softmin(x.half(), x.half(), torch.zeros(1, 5).half(), 0.1, c, "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="backend='triton' runs on CUDA tensors; these are on cpu"):
        softmin(x, x, torch.zeros(1, 5), 0.1, c, "triton")
    monkeypatch.setattr(_triton, "unavailable", lambda: "triton cannot be imported (no)")
    with pytest.raises(otreg.KeOpsUnavailable, match="triton cannot be imported"):
        softmin(x, x, torch.zeros(1, 5), 0.1, c, "triton")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_block_sparse_softmin_equals_the_torch_one(dtype, monkeypatch):
    """The multiscale solver's truncated softmin (a pattern of kept cluster pairs) and its
    gradients in x, y and h by the Triton kernels, against the chunked torch products on
    the same pattern; small tiles, so that clusters span several tasks and runs of
    consecutive clusters merge."""
    from otreg.reductions import sparse

    monkeypatch.setattr(_triton, "BLOCKS", {torch.float64: (8, 8), torch.float32: (16, 8)})
    g = torch.Generator().manual_seed(4)
    x, y = torch.rand(70, 3, generator=g, dtype=dtype), torch.rand(50, 3, generator=g, dtype=dtype)
    cx = sparse.grid_clusters(x, torch.full((70,), 1 / 70, dtype=dtype), 0.5)
    cy = sparse.grid_clusters(y, torch.full((50,), 1 / 50, dtype=dtype), 0.5)
    I, J = (torch.cdist(cx.centres, cy.centres) < 0.7).nonzero(as_tuple=True)
    assert len(I) < cx.n_clusters * cy.n_clusters  # a truncated pattern
    assert int(cx.sizes.max()) > 8  # a cluster over one task
    h = torch.randn(50, generator=g, dtype=dtype)
    w = torch.linspace(-1, 2, 70, dtype=dtype)
    results = []
    for backend in ("torch", "triton"):
        kernel = sparse.BlockSparse(cx, cy, I, J, backend=backend)
        inputs = [t.clone().requires_grad_(True) for t in (cx.points, cy.points, h)]
        out = kernel.softmin(*inputs, 0.05)
        results.append((out, *torch.autograd.grad((out * w).sum(), inputs)))
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for name, ours, ref in zip(("value", "x", "y", "h"), results[1], results[0]):
        err = float((ours - ref).detach().abs().max() / ref.detach().abs().max())
        assert err <= tol, (name, err)
