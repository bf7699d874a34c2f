"""Every strategy of otreg.loops.iterate gives the gradients of plain autograd."""

import functools

import pytest
import torch
from torch import nn

from otreg.loops import iterate, min_recomputations, profile

D = torch.float64


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(4, 6, generator=g, dtype=D, requires_grad=True)
    W = (0.3 * torch.randn(6, 6, generator=g, dtype=D)).requires_grad_()
    return x0, W


def noisy_step(x, W):
    return torch.tanh(x @ W) + 0.05 * torch.randn_like(x)  # random: RNG must be replayed


def grads(strategy, n=40, step=noisy_step, **kw):
    x0, W = make()
    torch.manual_seed(123)
    report = {}
    y = iterate(step, x0, n, (W,), strategy=strategy, report=report, **kw)
    return torch.autograd.grad((y**2).sum(), (x0, W)), report


def close(g1, g2, rtol):
    return all(
        torch.allclose(a, b, rtol=rtol, atol=rtol * float(b.abs().max())) for a, b in zip(g1, g2)
    )


@pytest.mark.parametrize("snapshots", [1, 2, 3, 7, 40, 100])
def test_checkpoint_equals_store_and_counts_recomputations(snapshots):
    ref, _ = grads("store")
    got, report = grads("checkpoint", snapshots=snapshots)
    assert close(got, ref, 1e-10)
    s = min(snapshots, 40)
    assert report["untaped_evaluations"] == min_recomputations(40, s) + 1
    assert report["max_stored"] <= s


def test_checkpoint_memory_budget_counts_the_measured_step():
    """The budget pays for the measured fixed cost of checkpointing (a short loop that
    stores only its input), then as many more states as fit; the same budget in other
    units is the same."""
    ref, _ = grads("store")
    state = 4 * 6 * 8  # bytes of one float64 (4, 6) state
    _, probe = grads("checkpoint", memory="10MB")
    working = probe["working_bytes"]
    assert working >= 2 * state  # a step's temporaries and gradients, at least
    budget = working + 2 * state  # the input and two more
    got, report = grads("checkpoint", memory=f"{budget}B")
    assert report["working_bytes"] == working  # measured once per step function and shapes
    assert report["snapshots"] == 3 and close(got, ref, 1e-10)
    got, report = grads("checkpoint", memory=f"{budget / 1000}KB")
    assert report["snapshots"] == 3
    # the unit follows the measured size: 384 bytes in one CI run, over 1 kB in others,
    # 0.1 MB in another (the allocator's pools)
    needs = r"below what checkpointing this loop needs: [\d.]+ (bytes|kB|MB)"
    with pytest.raises(ValueError, match=needs):
        grads("checkpoint", memory=f"{working - 1}B")


def test_offload_equals_store():
    ref, _ = grads("store")
    got, _ = grads("offload")
    assert close(got, ref, 1e-10)


def test_reversible_rebuilds_states_and_reports_drift():
    def step(state, W):  # additive coupling: exactly invertible
        a, b = state
        a = a + torch.tanh(b @ W)
        return a, b + torch.sin(a @ W)

    def inverse(state, W):
        a, b = state
        b = b - torch.sin(a @ W)
        return a - torch.tanh(b @ W), b

    x0, W = make()
    b0 = x0.detach().flip(0).clone().requires_grad_()
    out = {}
    for strategy in ("store", "reversible"):
        report = {}
        kw = {"inverse": inverse} if strategy == "reversible" else {}
        a, b = iterate(step, (x0, b0), 30, (W,), strategy=strategy, report=report, **kw)
        out[strategy] = torch.autograd.grad((a * b).sum(), (x0, b0, W)), report
    drift = out["reversible"][1]["drift"]
    assert 0 <= drift < 1e-10
    assert close(out["reversible"][0], out["store"][0], 1e-8)
    # an inverse that does not undo the step: the gradients are wrong, and it says so
    report = {}
    a, b = iterate(step, (x0, b0), 30, (W,), strategy="reversible", report=report,
                   inverse=lambda s, W: (s[0] - 0.1, s[1]))  # fmt: skip
    with pytest.warns(UserWarning, match="rebuilt x_0 from the output with a relative error"):
        torch.autograd.grad((a * b).sum(), (x0, b0, W))
    assert report["drift"] > 1e-3


def test_module_parameters_receive_gradients():
    torch.manual_seed(0)
    net = nn.Linear(6, 6).double()
    x0 = torch.randn(3, 6, dtype=D)
    y_ref = x0
    for _ in range(20):
        y_ref = torch.tanh(net(y_ref))
    ref = torch.autograd.grad(y_ref.sum(), list(net.parameters()))
    y = iterate(lambda x: torch.tanh(net(x)), x0, 20, net, strategy="checkpoint", snapshots=3)
    got = torch.autograd.grad(y.sum(), list(net.parameters()))
    assert close(got, ref, 1e-10)


def test_rng_is_not_disturbed_by_backward():
    _, _ = grads("checkpoint", snapshots=2)
    state = torch.get_rng_state()
    x0, W = make()
    torch.set_rng_state(state)
    y = iterate(noisy_step, x0, 10, (W,), strategy="checkpoint", snapshots=2)
    after_forward = torch.get_rng_state()
    y.sum().backward()
    assert torch.equal(torch.get_rng_state(), after_forward)


def test_profile_table():
    x0, W = make()
    rows = profile(
        lambda x, W: torch.tanh(x @ W),
        x0,
        20,
        (W,),
        snapshots=3,
        strategies=("store", "checkpoint", "offload"),
    )
    assert [r["strategy"] for r in rows] == ["store", "checkpoint", "offload"]
    assert all(r["grad_diff"] < 1e-12 and r["seconds"] > 0 for r in rows)
    assert rows[1]["recomputations"] == min_recomputations(20, 3) + 1 - 20
    assert "checkpoint" in str(rows)


def test_profile_runs_checkpoint_once_per_budget():
    x0, W = make()
    rows = profile(
        lambda x, W: torch.tanh(x @ W),
        x0,
        20,
        (W,),
        memory=["4MB", "64MB"],
        strategies=("store", "checkpoint"),
    )
    assert [(r["strategy"], r["memory"]) for r in rows] == [
        ("store", None),
        ("checkpoint", "4MB"),
        ("checkpoint", "64MB"),
    ]
    assert rows[1]["snapshots"] <= rows[2]["snapshots"]
    assert all(r["grad_diff"] < 1e-12 for r in rows)
    assert "64MB" in str(rows).splitlines()[-1]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(n_steps=0), ValueError, "n_steps is 0"),
        (dict(strategy="revolve"), ValueError, "strategy is 'revolve'"),
        (dict(strategy="checkpoint", memory="1B"), ValueError, "below what checkpointing"),
        (dict(strategy="checkpoint", memory="lots"), ValueError, "memory is 'lots'"),
        (dict(strategy="checkpoint", memory="1MB", snapshots=2), ValueError, "not both"),
        (dict(strategy="store", snapshots=2), ValueError, "checkpoint' only"),
        (dict(strategy="store", memory="1B"), ValueError, "below what strategy='store' needs"),
        (dict(strategy="offload", memory="lots"), ValueError, "memory is 'lots'"),
        (dict(strategy="reversible"), ValueError, "needs inverse="),
        (dict(step=lambda x, W: x[:2]), ValueError, "step changed the state from"),
        (dict(step=3), TypeError, "step must be callable"),
        (dict(step=lambda x, W: None), TypeError, "step returned NoneType; a step returns"),
        (dict(step=lambda x, W: (x @ W).detach().numpy()), TypeError, "step returned ndarray"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    x0, W = make()
    args = dict(step=lambda x, W: x @ W, n_steps=5, strategy="store")
    args.update(kwargs)
    step = args.pop("step")
    n = args.pop("n_steps")
    with pytest.raises(error, match=match):
        y = iterate(step, x0, n, (W,), **args)
        y.sum().backward()


def test_snapshots_are_copied_into_rows_of_one_pool_and_rows_are_reused():
    from otreg.loops.tape import Snapshots

    x0 = (torch.zeros(3), torch.zeros(2, 2))
    slots = Snapshots(x0, None, rows=2)
    a = (torch.full((3,), 1.0), torch.full((2, 2), 1.0))
    slots.store(5, a, None)
    a[0].add_(10)  # the stored copy does not follow the caller's tensor
    assert slots[5][0][0].tolist() == [1.0, 1.0, 1.0]
    assert slots[5][0][0].data_ptr() == slots.pool[0][slots.row_of[5]].data_ptr()
    slots.store(7, (torch.full((3,), 2.0), torch.full((2, 2), 2.0)), None)
    slots.store(9, (torch.full((3,), 3.0), torch.full((2, 2), 3.0)), None)  # past the rows
    assert 9 not in slots.row_of and slots[9][0][0].tolist() == [3.0] * 3
    row = slots.row_of[5]
    slots.drop(5)
    slots.store(11, (torch.full((3,), 4.0), torch.full((2, 2), 4.0)), None)
    assert slots.row_of[11] == row and slots[7][0][0].tolist() == [2.0] * 3
    assert slots[0][0] is x0  # the input is kept as given


def test_a_step_that_draws_nothing_shares_one_rng_state():
    from otreg.loops.tape import Step

    run = Step(lambda x: x + 1, (), False, True, (torch.zeros(2),))
    first = run.rng_state()
    assert run.rng_state() is first  # nothing drew: the same object, not a copy per call
    torch.rand(1)
    assert run.rng_state() is not first


CAPTURED = torch.ones(6, dtype=torch.float64, requires_grad=True)  # a module global a step may name


@pytest.mark.parametrize("strategy", ["checkpoint", "reversible"])
def test_a_tensor_the_step_captures_instead_of_receiving_is_refused(strategy):
    """A closure's tensor, a global's, a module's parameters: under checkpointing they got
    no gradient (store gave them one), silently; these strategies now refuse them, naming
    them, and accept them through params."""
    x0, W = make()
    net = nn.Linear(6, 6).double()

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.W = nn.Parameter(torch.eye(6, dtype=torch.float64))

        def step(self, x):
            return x @ self.W

    class Holder:
        def __init__(self):
            self.M = W

        def __call__(self, x):
            return x @ self.M

    def keyword(x, *, M=W):
        return x @ M

    Ws = [W]
    for step, name in [
        (lambda x: x @ W, "W"),
        (lambda x: x * CAPTURED, "CAPTURED"),
        (lambda x: net(x), "net"),
        (Layer().step, "self.W"),
        (lambda x, M=W: x @ M, "M"),  # a default argument
        (keyword, "M"),
        (functools.partial(lambda x, M: x @ M, M=W), "M"),
        (net, "the parameters of the module given as step"),  # (it said "uses step")
        (Holder(), "self.M"),
        (lambda x: x @ Ws[0], "Ws"),
    ]:
        with pytest.raises(ValueError, match=f"step uses {name}, which requires a gradient"):
            iterate(step, x0, 5, strategy=strategy, inverse=lambda x: x)
    with torch.no_grad():  # no gradient is taken: nothing to refuse
        iterate(lambda x: x @ W, x0, 5, strategy="checkpoint")
    y = iterate(lambda x: torch.tanh(net(x)), x0, 5, net, strategy="checkpoint", snapshots=2)
    y.sum().backward()
    assert net.weight.grad is not None
    stored = iterate(lambda x: x @ W, x0, 5)  # autograd's record: a closure is fine
    stored.sum().backward()
    assert W.grad is not None


def test_params_name_the_element_that_is_not_a_tensor():
    x0, W = make()
    with pytest.raises(TypeError, match=r"params\[1\] is float; params must be tensors"):
        iterate(lambda x, W, c: x @ W * c, x0, 5, (W, 0.1))
