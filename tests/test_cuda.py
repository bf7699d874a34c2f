"""On a GPU (skipped without CUDA): every backend and dtype against a float64 CPU
reference, the compiled Triton kernels, register on CUDA shapes, SinkhornLoss under
autocast, a budgeted loop's peak. These ran only where a GPU was lent (see the notes in
docs/benchmarks.md, "otreg on a GPU")."""

from __future__ import annotations

import pytest
import torch

import otreg
from otreg.costs import get_cost
from otreg.reductions import _dense, kernel_product, softmax_average, softmin
from tests.conftest import clusters

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("backend", ["tensorized", "blocked", "triton", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["softmin", "kernel_product", "softmax_average"])
def test_every_backend_on_cuda_equals_a_float64_cpu_reference(backend, dtype, kind):
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 300, 3, generator=g), torch.randn(2, 500, 3, generator=g)
    h, v = torch.randn(2, 500, generator=g), torch.randn(2, 500, 4, generator=g)
    rest = {"softmin": (h,), "kernel_product": (v,), "softmax_average": (h, v)}[kind]
    fn = {"softmin": softmin, "kernel_product": kernel_product,
          "softmax_average": softmax_average}[kind]  # fmt: skip
    cost = get_cost("sqeuclidean")
    inputs = [t.to("cuda", dtype).requires_grad_(True) for t in (x, y, *rest)]
    out = fn(*inputs, 0.5, cost, backend)
    exact = [t.double().requires_grad_(True) for t in (x, y, *rest)]
    ref = getattr(_dense, kind)(*exact, 0.5, cost)
    w = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(out, inputs, w.to("cuda", dtype))
    want = torch.autograd.grad(ref, exact, w)
    tol = 1e-9 if dtype == torch.float64 else 5e-5
    for a, b in zip((out, *got), (ref, *want)):
        assert float((a.double().cpu() - b).abs().max() / b.abs().max()) < tol


def test_auto_on_cuda_runs_the_gpu_kernels():
    pytest.importorskip("triton")
    x = torch.rand(3000, 3, device="cuda", requires_grad=True)
    y = torch.rand(3000, 3, device="cuda")
    res = otreg.sinkhorn(x, y, blur=0.3, multiscale=False)
    assert res.backend == res.gradient_backend == "triton"
    res.cost.backward()
    assert x.grad.device.type == "cuda" and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_block_sparse_kernels_on_cuda_equal_the_torch_ones(dtype):
    pytest.importorskip("triton")
    from otreg.reductions import sparse

    g = torch.Generator().manual_seed(5)
    x = torch.rand(4000, 3, generator=g, dtype=dtype).cuda()
    y = torch.rand(3000, 3, generator=g, dtype=dtype).cuda()
    cx = sparse.grid_clusters(x, torch.full((4000,), 1 / 4000, dtype=dtype, device="cuda"), 0.1)
    cy = sparse.grid_clusters(y, torch.full((3000,), 1 / 3000, dtype=dtype, device="cuda"), 0.1)
    I, J = (torch.cdist(cx.centres, cy.centres) < 0.25).nonzero(as_tuple=True)
    h = torch.randn(3000, generator=g, dtype=dtype).cuda()
    w = torch.randn(4000, generator=g, dtype=dtype).cuda()
    results = []
    for backend in ("torch", "auto"):
        kernel = sparse.BlockSparse(cx, cy, I, J, backend=backend)
        assert kernel.uses_triton(x) == (backend == "auto")
        inputs = [t.clone().requires_grad_(True) for t in (cx.points, cy.points, h)]
        out = kernel.softmin(*inputs, 0.01)
        results.append((out, *torch.autograd.grad((out * w).sum(), inputs)))
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for ours, ref in zip(results[1], results[0]):
        assert float((ours - ref).detach().abs().max() / ref.detach().abs().max()) < tol


def test_a_multiscale_divergence_on_cuda_equals_the_cpu_one():
    pytest.importorskip("triton")
    x = otreg.datasets.noisy_sphere(20000, seed=1)
    y = otreg.datasets.noisy_sphere(20000, radius=0.8, center=(0.3, 0, 0), seed=2)
    out = []
    for device in ("cpu", "cuda"):
        xd = x.detach().to(device).requires_grad_(True)
        value = otreg.sinkhorn_divergence(xd, y.to(device), blur=0.01, multiscale=True)
        (grad,) = torch.autograd.grad(value, xd)
        out.append((value.double().cpu(), grad.double().cpu()))
    (v_cpu, g_cpu), (v_gpu, g_gpu) = out
    assert abs(float(v_gpu - v_cpu)) < 1e-4 * abs(float(v_cpu))
    assert float((g_gpu - g_cpu).norm() / g_cpu.norm()) < 1e-2


def test_cell_steps_on_cuda_give_the_cpu_plan():
    """The multiscale solver's cell steps (sparse products, a dense K x K solve) on a
    GPU: the clusters against a ball take steps and end at the CPU's cost."""
    x, y = clusters(1000)
    out = [otreg.sinkhorn(x.to(d), y.to(d), blur=0.01, multiscale=True) for d in ("cpu", "cuda")]
    assert all("cell step" in r.acceleration and r.converged for r in out)
    assert abs(float(out[1].cost.cpu()) - float(out[0].cost)) < 1e-5 * abs(float(out[0].cost))


def test_register_on_cuda_shapes():
    pv = pytest.importorskip("pyvista")
    ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
    egg = ball.with_points(ball.points * torch.tensor([1.2, 0.9, 1.0], dtype=torch.float64))
    res = otreg.register(ball.to("cuda"), egg.to("cuda"), progress=False)
    assert res.metrics["mean_mm"] < 0.3 * res.metrics["before_mean_mm"]
    moved = res.transform(ball.points)  # CPU points in, CPU points out
    assert moved.device.type == "cpu" and res.device.type == "cuda"


def sphere_from_arrays(n: int = 2000, radius: float = 20.0) -> otreg.Shape:
    """A triangulated sphere built without VTK (the GPU machine has none): the convex hull
    of a Fibonacci lattice, each triangle turned to face outwards."""
    from scipy.spatial import ConvexHull

    i = torch.arange(n, dtype=torch.float64) + 0.5
    z = 1 - 2 * i / n
    phi = i * torch.pi * (3 - 5**0.5)
    r = (1 - z**2).sqrt()
    points = radius * torch.stack([r * phi.cos(), r * phi.sin(), z], 1)
    faces = torch.as_tensor(ConvexHull(points.numpy()).simplices)
    a, b, c = (points[faces[:, k]] for k in range(3))
    inward = (torch.linalg.cross(b - a, c - a) * a).sum(1) < 0
    faces[inward] = faces[inward][:, [0, 2, 1]]
    return otreg.Shape(points, faces)


@pytest.mark.parametrize("prealign", ["affine", "none"])
def test_register_on_cuda_shapes_built_from_arrays(prealign):
    ball = sphere_from_arrays()
    egg = ball.with_points(ball.points * torch.tensor([1.2, 0.9, 1.0], dtype=torch.float64))
    res = otreg.register(ball.to("cuda"), egg.to("cuda"), prealign=prealign, progress=False)
    assert res.device.type == "cuda"
    moved = res.transform(ball.points)
    assert moved.device.type == "cpu" and torch.isfinite(moved).all()
    # distance to the ellipsoid, along the ray from its centre (the metrics' own distances
    # are vertex to vertex where VTK is missing, which a sliding vertex inflates)
    axes = torch.tensor([24.0, 18.0, 20.0], dtype=torch.float64)

    def off(p):
        return (p.norm(dim=1) * (1 - ((p / axes) ** 2).sum(1).rsqrt()).abs()).mean()

    assert off(moved) < 0.1 * off(ball.points)
    assert torch.linalg.det(res.jacobians(ball.points)).min() > 0


def test_a_job_on_cuda_writes_what_a_cpu_job_writes(tmp_path):
    """run_job(device="cuda"): the surfaces read on the CPU, registered on the card, the
    same files and close numbers."""
    pv = pytest.importorskip("pyvista")
    from otreg.batch import JobOptions, run_job

    ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20))
    src = otreg.save_shape(ball, tmp_path / "a.vtk")
    tgt = otreg.save_shape(ball.with_points(ball.points * 1.1 + 1.0), tmp_path / "b.vtk")
    options = JobOptions("affine", picture=False)
    gpu = run_job(src, tgt, tmp_path / "gpu", options, device="cuda")
    cpu = run_job(src, tgt, tmp_path / "cpu", options)
    assert gpu.registration.device.type == "cuda" and sorted(gpu.files) == sorted(cpu.files)
    assert abs(gpu.registration.metrics["mean_mm"] - cpu.registration.metrics["mean_mm"]) < 0.05


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sinkhorn_loss_in_an_autocast_model(dtype):
    model = torch.nn.Linear(3, 3).cuda()
    x = torch.rand(2000, 3, device="cuda")
    y = torch.rand(2000, 3, device="cuda") + 0.2
    loss = otreg.SinkhornLoss(blur=0.05)
    with torch.autocast("cuda", dtype=dtype):
        out = model(x)
        value = loss(out, y)
    value.backward()
    assert out.dtype == dtype and value.dtype == dtype
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_budgeted_loop_on_cuda_stays_within_its_budget():
    from otreg.loops import iterate

    w = torch.tensor(0.5, device="cuda", requires_grad=True)
    x0 = torch.ones(2_000_000, device="cuda")  # 8 MB a state

    def step(x, w):
        return x + 0.01 * torch.tanh(w * x)

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = iterate(step, x0, 200, (w,), strategy="checkpoint", memory="100MB")
    out.sum().backward()
    assert torch.cuda.max_memory_allocated() - base < 1.25 * 100e6 + 30e6
