"""SinkhornResult: what the solve reports of itself."""

import torch

import otreg


def test_the_result_names_the_backends_that_ran(monkeypatch):
    """Where ``auto`` solves on the dense path (nothing recorded) and carries the gradient
    on the blocked one (autograd records it), as on a GPU between 250,000 and 4e6 pairs,
    the result says what ran, as the reductions recorded it, not a prediction."""
    from otreg.reductions import _blocked, _dense

    calls = {"tensorized": 0, "blocked": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    import otreg.reductions as red

    monkeypatch.setitem(
        red._IMPLEMENTATIONS,
        "softmin",
        (counting("tensorized", _dense.softmin), red._IMPLEMENTATIONS["softmin"][1]),
    )
    monkeypatch.setattr(red, "blocked_reduction", counting("blocked", _blocked.blocked_reduction))
    monkeypatch.setattr(red, "TENSORIZED_MAX_PAIRS", red.TENSORIZED_MAX_PAIRS_GPU)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(700, 3, generator=g, requires_grad=True)  # 490,000 pairs
    y = torch.rand(700, 3, generator=g)
    res = otreg.sinkhorn(x, y, blur=0.3)
    solved = dict(calls)
    res.cost.backward()
    assert solved["tensorized"] > 0 and solved["blocked"] == 1  # one differentiable step
    assert (res.backend, res.gradient_backend) == ("tensorized", "blocked")
    assert res.plan.backend == "auto"
    small = otreg.sinkhorn(x[:50], y[:60], blur=0.3)
    assert small.backend == small.gradient_backend == "tensorized"
