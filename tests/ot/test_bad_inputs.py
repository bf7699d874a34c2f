"""Every bad input raises a clear error that names the argument."""

import warnings

import pytest
import torch

import otreg
from tests.conftest import clouds

x, y, a, b = clouds(n=5, m=6)


def nan_at(t, idx=0):
    t = t.clone()
    t.view(-1)[idx] = float("nan")
    return t


CASES = [
    # (description, args, kwargs, error, message fragment)
    ("x not a tensor", (x.numpy(), y), {}, TypeError, "x must be a torch.Tensor"),
    # an array is described, not printed
    ("x an array", (x.numpy(), y), {}, TypeError, "got a NumPy array of shape (5, 2) and"),
    ("integer points", (x.long(), y), {}, TypeError, "floating point"),
    ("1-D points", (x[:, 0], y), {}, ValueError, r"x has shape .*looks like weights"),
    ("mismatched dims", (x, y[:, :1]), {}, ValueError, "dimension 2"),
    ("NaN in x", (nan_at(x), y), {}, ValueError, "x has 1 NaN"),
    ("Inf in y", (x, y.clone().fill_(float("inf"))), {}, ValueError, "y has 0 NaN and 12"),
    ("empty x", (x[:0], y), {}, ValueError, "x is empty"),
    ("empty y", (x, y[:0]), {}, ValueError, "y is empty"),
    ("mixed dtypes", (x, y.float()), {}, TypeError, "y has dtype torch.float32"),
    ("negative weights", (x, y, a - 0.5, b), {}, ValueError, "a has 5 negative entries"),
    ("zero-mass weights", (x, y, torch.zeros_like(a), b), {}, ValueError, "a has zero total mass"),
    ("NaN weights", (x, y, a, nan_at(b)), {}, ValueError, "b has 1 NaN"),
    ("wrong weight length", (x, y, a[:3], b), {}, ValueError, "a has shape (3,)"),
    ("weight dtype", (x, y, a.float(), b), {}, TypeError, "a has dtype torch.float32"),
    ("unequal masses", (x, y, a, 2 * b), {}, ValueError, "balanced OT"),
    ("blur zero", (x, y), {"blur": 0.0}, ValueError, "blur is 0.0"),
    ("blur negative", (x, y), {"blur": -1}, ValueError, "blur is -1"),
    ("blur NaN", (x, y), {"blur": float("nan")}, ValueError, "blur is nan"),
    ("blur string", (x, y), {"blur": "0.1"}, TypeError, "blur must be a number"),
    (
        "blur a tensor that requires grad",  # float() would cut it from the graph silently
        (x, y),
        {"blur": torch.tensor(0.1, requires_grad=True)},
        TypeError,
        "blur is a tensor that requires grad; no gradient flows to blur",
    ),
    ("half against float64", (x.half(), y), {}, TypeError, "y has dtype torch.float64 but x"),
    ("reach zero", (x, y), {"reach": 0}, ValueError, "reach is 0"),
    ("scaling one", (x, y), {"scaling": 1.0}, ValueError, "scaling is 1.0"),
    ("scaling zero", (x, y), {"scaling": 0.0}, ValueError, "scaling is 0.0; it must be in"),
    ("unknown cost", (x, y), {"cost": "cosine"}, ValueError, "cost is 'cosine'"),
    ("unknown form", (x, y), {"form": "fast"}, ValueError, "form is 'fast'"),
    ("unknown backend", (x, y), {"backend": "cuda"}, ValueError, "backend is 'cuda'"),
    ("unknown backward", (x, y), {"backward": "magic"}, ValueError, "backward is 'magic'"),
    ("max_iter zero", (x, y), {"max_iter": 0}, ValueError, "max_iter is 0"),
    ("max_iter float", (x, y), {"max_iter": 10.0}, TypeError, "max_iter must be an integer"),
    (
        "max_iter below schedule",
        (x, y),
        {"max_iter": 3, "blur": 0.01},
        ValueError,
        "schedule alone",
    ),
    ("negative tol", (x, y), {"tol": -1.0}, ValueError, "tol is -1.0"),
    ("batched and not", (x[None], y), {}, ValueError, "batched"),
    (
        "batch of unequal sizes",
        (torch.stack([x, x]), torch.stack([y, y, y])),
        {},
        ValueError,
        "batch size 2 but y has 3",
    ),
]


@pytest.mark.parametrize("fn", [otreg.sinkhorn, otreg.sinkhorn_divergence])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_argument(fn, case):
    _, args, kwargs, error, fragment = case
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        fn(*args, **kwargs)


def test_unknown_option_is_named():
    with pytest.raises(TypeError, match="unknown option.*blurr"):
        otreg.sinkhorn_divergence(x, y, blurr=0.1)


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: otreg.SinkhornLoss("sinkhorn", p=2, blur=0.05), "loss name 'sinkhorn' where"),
        (lambda: otreg.SinkhornLoss("sinkhorn"), r"SamplesLoss\('sinkhorn', p=2, blur=b\) is"),
        (lambda: otreg.SinkhornLoss(blur=0.05, p=2), "p=2 is cost='sqeuclidean'"),
        (lambda: otreg.SinkhornLoss(truncate=3), r"multiscale=otreg.Multiscale\(truncate"),
    ],
)
def test_geomloss_style_calls_are_pointed_to_otregs_names(make, fragment):
    """GeomLoss's SamplesLoss("sinkhorn", p=2, blur=b) raised Python's bare "got multiple
    values for argument 'blur'"; its option names now say what otreg calls them."""
    with pytest.raises(TypeError, match=fragment):
        make()


def test_inputs_are_not_modified():
    xs, ys, as_, bs = (t.clone() for t in (x, y, a, b))
    otreg.sinkhorn_divergence(x, y, a, b, blur=0.1)
    for before, after in zip((xs, ys, as_, bs), (x, y, a, b)):
        assert torch.equal(before, after)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_mixed_devices():
    with pytest.raises(ValueError, match="on cuda"):
        otreg.sinkhorn(x, y.cuda())


def test_mixed_devices_message_without_a_gpu():
    from otreg._checks import check_same_device_dtype

    meta = torch.empty(3, 2, dtype=torch.float64, device="meta")
    with pytest.raises(ValueError, match="y is on meta but x is on cpu"):
        check_same_device_dtype("sinkhorn", {"x": x, "y": meta})


def test_a_meta_tensor_is_named_not_read():
    x = torch.rand(5, 3)
    with pytest.raises(ValueError, match="y is on the meta device"):
        otreg.sinkhorn(x, torch.empty(4, 3, device="meta"))


def test_sinkhorn_loss_rejects_bad_options_at_construction():
    with pytest.raises(ValueError, match="SinkhornLoss: blur is -0.1"):
        otreg.SinkhornLoss(blur=-0.1)
    with pytest.raises(TypeError, match="loss\\(x, y\\) or loss\\(a, x, b, y\\)"):
        otreg.SinkhornLoss()(x)


def test_sinkhorn_loss_names_weights_given_after_their_points():
    a, b = torch.full((20,), 1 / 20), torch.full((30,), 1 / 30)
    x, y = torch.rand(20, 3), torch.rand(30, 3)
    with pytest.raises(TypeError, match=r"weights before its points; got shapes \(20, 3\)"):
        otreg.SinkhornLoss()(x, a, y, b)
    with pytest.raises(ValueError, match=r"SinkhornLoss takes loss\(x, y\) or loss\(a, x"):
        otreg.SinkhornLoss()(x, y, a, b)  # the hint said points come before their weights
    assert torch.isfinite(otreg.SinkhornLoss(blur=0.1)(a, x, b, y))


def test_a_half_precision_model_output_against_a_float32_target():
    """Under CPU autocast a Linear's output is bfloat16 and the target float32: both are
    computed in float32 (they raised a dtype mismatch), the value in the output's dtype,
    the gradient reaching the model."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(200, 3, generator=g), torch.rand(250, 3, generator=g)
    lin = torch.nn.Linear(3, 3)
    loss = otreg.SinkhornLoss(blur=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(x)
        value = loss(out, y)
    assert out.dtype == value.dtype == torch.bfloat16
    value.backward()
    assert lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()
    ref = loss(out.detach().float(), y)
    assert float(value) == pytest.approx(float(ref), rel=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_points_are_computed_in_float32(dtype):
    """An autocast model's points: computed in float32 (8 or 11 bits of mantissa cannot
    resolve the scores), the value and the gradient returned in their dtype."""
    g = torch.Generator().manual_seed(0)
    x32, y32 = torch.rand(300, 3, generator=g), torch.rand(200, 3, generator=g) + 0.1
    x = x32.to(dtype).requires_grad_(True)
    value = otreg.sinkhorn_divergence(x, y32.to(dtype), blur=0.1)
    value.backward()
    ref = otreg.sinkhorn_divergence(x.detach().float(), y32.to(dtype).float(), blur=0.1)
    assert value.dtype == dtype and x.grad.dtype == dtype
    assert float(value) == pytest.approx(float(ref), rel=1e-2)
    res = otreg.sinkhorn(x.detach(), y32.to(dtype), blur=0.1)
    assert res.cost.dtype == res.f.dtype == dtype and res.converged
    again = otreg.sinkhorn(x.detach(), y32.to(dtype), blur=0.1, init=(res.f, res.g))
    assert again.converged  # its own half potentials as a warm start
    if torch.cuda.is_available():  # under autocast, the reductions stay in float32
        xc, yc = x32.cuda(), y32.cuda()
        with torch.autocast("cuda", dtype=torch.float16):
            inside = otreg.sinkhorn_divergence(xc, yc, blur=0.1)
        assert float(inside) == pytest.approx(float(otreg.sinkhorn_divergence(xc, yc, blur=0.1)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_normalised_half_precision_weights_are_balanced(dtype):
    """1/700 rounds to 8 bits of mantissa: the weights sum to 1 within their rounding, which
    is what a normalised weight vector of that dtype can do."""
    x, y = torch.rand(1000, 3).to(dtype), torch.rand(700, 3).to(dtype)
    a, b = torch.full((1000,), 1 / 1000).to(dtype), torch.full((700,), 1 / 700).to(dtype)
    assert abs(float(b.double().sum()) - 1) > 1e-5  # more than float32's tolerance
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", otreg.ConvergenceWarning)
        assert torch.isfinite(otreg.sinkhorn_divergence(x, y, a, b, blur=0.1))
    with pytest.raises(ValueError, match="needs equal masses"):
        otreg.sinkhorn_divergence(x, y, a, 1.05 * b, blur=0.1)


@pytest.mark.parametrize("gap", [1e-9, 1e-7, 5e-6])
def test_masses_equal_within_the_tolerance_are_made_equal(gap):
    """Masses 1e-9 to 5e-6 apart (float32-normalised weights cast to float64) pass the
    check; solved as given, the potentials drifted without bound below that tol (a cost of
    0.09996 for 0.10886 at 1e-9, -1522 at 1e-6, with converged=True): b is scaled to a's
    mass, and the cost is that of the exactly balanced weights."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(5, 2, generator=gen, dtype=torch.float64)
    y = torch.rand(6, 2, generator=gen, dtype=torch.float64)
    a, b = torch.full((5,), 0.2, dtype=torch.float64), torch.full((6,), 1 / 6, dtype=torch.float64)
    exact = otreg.sinkhorn(x, y, a, b, blur=0.5, tol=1e-12)
    off = a.clone()
    off[0] += gap
    res = otreg.sinkhorn(x, y, off, b, blur=0.5, tol=1e-12)
    assert res.converged and float(res.f.abs().max()) < 1
    assert float(res.cost) == pytest.approx(float(exact.cost), rel=10 * gap)


def test_unequal_masses_in_a_batch_name_the_problem():
    x, y = torch.rand(3, 10, 2), torch.rand(3, 12, 2)
    b = torch.full((3, 12), 1 / 12)
    b[1] *= 1.1
    with pytest.raises(ValueError, match=r"problem 1 of the batch"):
        otreg.sinkhorn(x, y, None, b, blur=0.5)
    b[1] = 0
    with pytest.raises(ValueError, match=r"zero total mass in problem 1 of the batch"):
        otreg.sinkhorn(x, y, None, b, blur=0.5)


def test_costs_or_eps_beyond_the_dtype_are_refused_naming_them():
    """float32 points near 1e20 (an OverflowError deep inside before), and a blur whose eps
    is below float32's smallest normal number (a RuntimeError before); float64 runs."""
    x, y = torch.rand(20, 3) * 1e20, torch.rand(30, 3) * 1e20
    with pytest.raises(ValueError, match="costs overflow, beyond torch.float32's largest"):
        otreg.sinkhorn(x, y, blur=1e18)
    x, y = torch.rand(20, 3) * 1e-20, torch.rand(30, 3) * 1e-20
    with pytest.raises(ValueError, match=r"eps = blur\^2 = 1e-42, below torch.float32's"):
        otreg.sinkhorn(x, y, blur=1e-21)
    assert otreg.sinkhorn(x.double(), y.double(), blur=1e-21).converged


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_raise_a_clear_error(transform):
    """torch.func.grad once failed inside torch ("must override the setup_context
    staticmethod"); the entry points now say what to use instead."""
    x, y = torch.rand(20, 3, dtype=torch.float64), torch.rand(25, 3, dtype=torch.float64)
    if transform == "grad":
        call = torch.func.grad(lambda p: otreg.sinkhorn_divergence(p, y, blur=0.5))
        args = (x,)
    else:
        call = torch.func.vmap(lambda p: otreg.sinkhorn(p, y, blur=0.5).cost)
        args = (x[None].repeat(2, 1, 1),)
    with pytest.raises(NotImplementedError, match="torch.func transforms .* not supported"):
        call(*args)


def test_numpy_scalars_are_numbers():
    """A blur or an iteration count read from a NumPy array (np.float32, np.int64) is a
    number: accepted, and stored in the options as a Python float or int."""
    import numpy as np

    res = otreg.sinkhorn(
        x, y, blur=np.float32(0.5), max_iter=np.int64(500), scaling=np.float32(0.5), tol=1e-6
    )
    same = otreg.sinkhorn(x, y, blur=0.5, max_iter=500, scaling=0.5, tol=1e-6)
    assert res.converged and torch.allclose(res.cost, same.cost)
    options = otreg.SinkhornOptions(blur=np.float32(0.25), max_iter=np.int32(7))
    assert type(options.blur) is float and type(options.max_iter) is int
    assert options.blur == 0.25 and options.max_iter == 7
    lddmm = otreg.registration.LDDMMOptions(sigma=np.float32(8.0), n_steps=np.int64(5))
    assert type(lddmm.sigma) is float and type(lddmm.n_steps) is int
    accuracy = otreg.Accuracy(np.float32(0.5), np.float64(0.25), np.int64(3))
    assert (type(accuracy.value), type(accuracy.every)) == (float, int)
    # a NumPy bool or a float where an integer goes is still refused, naming it
    with pytest.raises(TypeError, match="max_iter must be an integer"):
        otreg.sinkhorn(x, y, max_iter=np.float32(10))
    with pytest.raises(TypeError, match="max_iter must be an integer"):
        otreg.sinkhorn(x, y, max_iter=np.bool_(True))
