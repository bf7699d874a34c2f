"""The stopping rule on the value and the gradient (``tol=otreg.Accuracy(...)``): its estimate
on sequences with a known limit, and the errors it delivers against converged float64
solutions."""

import math

import pytest
import torch

import otreg
from otreg.datasets import noisy_sphere
from otreg.ot.convergence import StoppingRule
from tests.conftest import clouds


def _run(rule, values, gradients, err=1e-2, dtype=torch.float64):
    """Feed the rule one iteration a step, the probe returning the k-th check's pair; the
    index of the iteration that stopped it (None if none did)."""
    every = rule.accuracy.every
    for it in range(len(values) * every):
        k = it // every

        def probe(k=k):
            return (
                torch.tensor([values[k]], dtype=dtype),
                torch.tensor([gradients[k]], dtype=dtype),
            )

        if rule.stop(err, floor=lambda: 1e-12, probe=probe):
            return it
    return None


def test_the_estimate_is_the_exact_error_of_a_geometric_sequence():
    # value_k = 1 + 0.1 r^k, gradient_k = (1, 0) + 0.1 r^k (0, 1): the tail d q / (1 - q)
    # of the changes is the distance to the limit, to rounding
    r = 0.5
    values = [1 + 0.1 * r**k for k in range(40)]
    grads = [[1.0, 0.1 * r**k] for k in range(40)]
    rule = StoppingRule(otreg.Accuracy(value=1e-6, gradient=1e-4, every=3))
    stopped = _run(rule, values, grads)
    k = stopped // 3
    assert rule.reason == "tol" and rule.converged
    true_grad = 0.1 * r**k / math.hypot(1.0, 0.1 * r**k)
    true_value = 0.1 * r**k / values[k]
    assert rule.estimates["gradient"] == pytest.approx(true_grad, rel=1e-6)
    assert rule.estimates["value"] == pytest.approx(true_value, rel=1e-4)  # (its scale moves)
    # the first check where both are within tolerance (the value's binds here), not before
    assert true_grad <= 1e-4 and true_value <= 1e-6 < 0.1 * r ** (k - 1) / values[k - 1]
    assert k >= StoppingRule.WINDOW


def test_changes_that_do_not_shrink_never_count_as_converged():
    # an oscillating gradient (changes 1e-5, 1e-3, 1e-5, ...) and a stagnating one
    wobbling = [[1.0, 1e-3 * (k % 2) + 1e-5 * k] for k in range(60)]
    rule = StoppingRule(otreg.Accuracy(value=1e-2, gradient=1e-2, every=1))
    assert _run(rule, [1.0] * 60, wobbling) is None
    assert rule.estimates["gradient"] == math.inf and rule.reason == "max_iter"
    slow = [[1.0, 1e-3 * k] for k in range(60)]  # steady changes: q = 1
    rule = StoppingRule(otreg.Accuracy(value=1e-2, gradient=1e-2, every=1))
    assert _run(rule, [1.0] * 60, slow) is None


def test_changes_at_rounding_count_as_converged_where_they_cannot_hide_an_error():
    # float32 changes of 1e-6 relative (rounding: below NOISE * 1.2e-7) with q = 1: as
    # close as float32 gets, but only once the marginal error is at its rounding floor
    # (1e-12 here), since a slow sequence could hide 1e-3 behind such changes
    grads = [[1.0, 1e-6 * (k % 2)] for k in range(20)]
    rule = StoppingRule(otreg.Accuracy(), value_floor=1.0)
    every = rule.accuracy.every
    assert _run(rule, [1.0] * 20, grads, err=1e-12, dtype=torch.float32) == 3 * every - 1
    assert rule.reason == "tol" and rule.estimates["gradient"] <= 2e-6
    rule = StoppingRule(otreg.Accuracy(), value_floor=1.0)  # marginal error far above it
    assert _run(rule, [1.0] * 20, grads, err=1e-3, dtype=torch.float32) is None
    # float64 rounding (1e-15) is a thousand times below the tolerance: converged anyway
    grads = [[1.0, 1e-15 * (k % 2)] for k in range(20)]
    rule = StoppingRule(otreg.Accuracy(), value_floor=1.0)
    assert _run(rule, [1.0] * 20, grads, err=1e-3) == 3 * every - 1


def _errors(res, ref, grad, grad_ref):
    value = float(
        (res.cost.detach() - ref.cost.detach()).abs().max() / ref.cost.detach().abs().min()
    )
    return value, float((grad - grad_ref).norm() / grad_ref.norm())


PROBLEMS = {
    "balanced": dict(blur=0.05),
    "unbalanced": dict(blur=0.05, reach=0.3),
    "every pair, over-relaxed": dict(blur=0.05, relaxation="auto"),
    "multiscale": dict(blur=0.02, multiscale=otreg.Multiscale(auto=False)),
}


@pytest.mark.parametrize("name", PROBLEMS)
def test_the_value_and_gradient_are_as_accurate_as_asked(name):
    opts = PROBLEMS[name]
    n = 2500 if "multiscale" in opts else 400
    x = noisy_sphere(n, seed=1, dtype=torch.float64)
    y = noisy_sphere(n + 50, radius=0.8, center=(0.3, 0.0, 0.0), seed=2, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    ref = otreg.sinkhorn(xr, y, tol=1e-11, max_iter=20000, **opts)
    assert ref.converged
    (grad_ref,) = torch.autograd.grad(ref.cost, xr)
    iterations = []
    for accuracy in (otreg.Accuracy(value=1e-5, gradient=1e-3), otreg.Accuracy(1e-8, 1e-6)):
        xr = x.clone().requires_grad_(True)
        res = otreg.sinkhorn(xr, y, tol=accuracy, max_iter=20000, **opts)
        assert res.converged and res.stopped == "tol"
        assert set(res.estimated_error) == {"value", "gradient"}
        assert res.estimated_error["gradient"] <= accuracy.gradient
        (grad,) = torch.autograd.grad(res.cost, xr)
        value_err, grad_err = _errors(res, ref, grad, grad_ref)
        # an estimate, not a bound: within a factor of 3 of what was asked
        assert grad_err <= 3 * accuracy.gradient, (grad_err, res.estimated_error)
        assert value_err <= 3 * accuracy.value, (value_err, res.estimated_error)
        iterations.append(res.n_iter)
    assert iterations[0] <= iterations[1]  # (equal when both stop at the first window)


def test_a_batch_stops_when_every_problem_is_accurate():
    x, y, a, b = clouds(60, 70, d=3, batch=3)
    y = y.clone()
    y[1] = y[1] * 3  # one problem of the batch converges more slowly
    ref = otreg.sinkhorn(x, y, a, b, blur=0.05, tol=1e-12, max_iter=20000)
    res = otreg.sinkhorn(x, y, a, b, blur=0.05, tol=otreg.Accuracy(1e-7, 1e-5))
    assert res.converged
    rel = (res.cost - ref.cost).abs() / ref.cost.abs()
    assert float(rel.max()) <= 3e-7


def test_the_divergence_takes_an_accuracy_for_each_of_its_terms():
    x = noisy_sphere(300, seed=1, dtype=torch.float64).requires_grad_(True)
    y = noisy_sphere(300, radius=0.8, center=(0.3, 0.0, 0.0), seed=2, dtype=torch.float64)
    ref = otreg.sinkhorn_divergence(x, y, blur=0.05, tol=1e-11, max_iter=20000)
    (g_ref,) = torch.autograd.grad(ref, x)
    d = otreg.sinkhorn_divergence(x, y, blur=0.05, tol=otreg.Accuracy(1e-6, 1e-4))
    (g,) = torch.autograd.grad(d, x)
    assert float((g - g_ref).norm() / g_ref.norm()) <= 3e-4
    assert float(abs(d.detach() / ref.detach() - 1)) <= 3e-6


def test_running_out_of_iterations_warns_with_the_estimates():
    x, y, _, _ = clouds(200, 200, d=2)
    with pytest.warns(otreg.ConvergenceWarning, match="estimated errors"):
        res = otreg.sinkhorn(x, y, blur=0.01, tol=otreg.Accuracy(1e-12, 1e-12), max_iter=60)
    assert not res.converged and res.stopped == "max_iter"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(value=0.0), ValueError, "value is 0.0"),
        (dict(gradient=-1e-3), ValueError, "gradient is -0.001"),
        (dict(gradient=float("nan")), ValueError, "gradient is nan"),
        (dict(every=0), ValueError, "every is 0"),
        (dict(every=2.5), TypeError, "every must be an integer"),
        (dict(value="small"), TypeError, "value must be a number"),
    ],
)
def test_bad_accuracies_raise_naming_the_field(kwargs, error, match):
    with pytest.raises(error, match=f"Accuracy: {match}"):
        otreg.Accuracy(**kwargs)


def test_a_tol_that_is_neither_a_number_nor_an_accuracy_raises():
    x, y, _, _ = clouds()
    with pytest.raises(TypeError, match="tol must be a number .* or an otreg.Accuracy"):
        otreg.sinkhorn(x, y, tol="1e-3")
    with pytest.raises(TypeError, match="tol must be a number"):
        otreg.SinkhornOptions(tol={"gradient": 1e-3})
