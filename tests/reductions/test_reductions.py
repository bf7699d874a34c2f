"""Every backend of every reduction against a naive broadcast reference, with gradients."""

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import otreg
from otreg import _info as info_module
from otreg import reductions
from otreg.costs import get_cost
from otreg.reductions import _compiled, _dense, _keops

SQ = get_cost("sqeuclidean")


def naive(kind, x, y, h, v, eps, cost):
    """Reference by explicit broadcasting of x_i - y_j (no matrix-product expansion)."""
    sq = ((x[:, :, None, :] - y[:, None, :, :]) ** 2).sum(-1)
    C = sq / 2 if cost.p == 2 else torch.sqrt(sq + 1e-20)
    s = h[:, None, :] - C / eps
    if kind == "softmin":
        return -eps * torch.logsumexp(s, dim=2)
    if kind == "kernel_product":
        return torch.einsum("bnm,bme->bne", torch.exp(-C / eps), v)
    return torch.einsum("bnm,bme->bne", torch.softmax(s, dim=2), v)


def call(kind, backend, x, y, h, v, eps, cost):
    if kind == "softmin":
        return reductions.softmin(x, y, h, eps, cost, backend)
    if kind == "kernel_product":
        return reductions.kernel_product(x, y, v, eps, cost, backend)
    return reductions.softmax_average(x, y, h, v, eps, cost, backend)


def data(dtype=torch.float64, B=2, N=37, M=29, D=3, E=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, N, D, generator=g, dtype=dtype).requires_grad_()
    y = torch.rand(B, M, D, generator=g, dtype=dtype).requires_grad_()
    h = torch.randn(B, M, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(B, M, E, generator=g, dtype=dtype).requires_grad_()
    return x, y, h, v


def check_against_naive(kind, backend, cost, dtype=torch.float64, tol=1e-10):
    x, y, h, v = data(dtype)
    eps = 0.05
    out = call(kind, backend, x, y, h, v, eps, cost)
    ref = naive(kind, x, y, h, v, eps, cost)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, rtol=tol, atol=tol)
    w = torch.randn_like(ref)
    grads = torch.autograd.grad((out * w).sum(), (x, y, h, v), allow_unused=True)
    refs = torch.autograd.grad((ref * w).sum(), (x, y, h, v), allow_unused=True)
    for got, want in zip(grads, refs):
        if want is None:
            assert got is None or float(got.abs().max()) == 0
        else:
            assert torch.allclose(got, want, rtol=tol * 10, atol=tol * 10)


KINDS = ["softmin", "kernel_product", "softmax_average"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
def test_tensorized(kind, cost):
    check_against_naive(kind, "tensorized", get_cost(cost))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("narrow", [0, 11])
def test_blocked_with_many_blocks(kind, narrow, monkeypatch):
    # narrow 0: every product with the values as it is; 11: transposed (_dense.times)
    monkeypatch.setattr(reductions, "BLOCK_ELEMENTS", 2 * 29 * 5)  # blocks of 5 rows
    monkeypatch.setattr(_dense, "NARROW_COLUMNS", narrow)
    check_against_naive(kind, "blocked", SQ)


def test_float32():
    check_against_naive("softmin", "tensorized", SQ, dtype=torch.float32, tol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("offset", [0.0, 3.0, 60.0, -60.0, 1e4, -1e4, math.nan])
def test_blocked_softmin_is_the_same_whatever_its_estimate(dtype, offset, monkeypatch):
    """An estimate of the result shifts the rows instead of their maxima: near the result,
    or far enough that a row's exponentials overflow or vanish (then summed again from the
    maximum), or NaN, the softmin equals the naive one. Its gradient's rows are shifted by
    the exact result."""
    monkeypatch.setattr(reductions, "TENSORIZED_MAX_PAIRS", 0)
    monkeypatch.setattr(reductions, "BLOCK_ELEMENTS", 2 * 29 * 5)  # blocks of 5 rows
    x, y, h, _ = (t.detach().to(dtype) for t in data(seed=4))
    x, y = 3 * x, 3 * y  # costs / eps up to about 500
    eps = 0.05
    ref = naive("softmin", x.double(), y.double(), h.double(), None, eps, SQ)
    noise = torch.randn(ref.shape, dtype=ref.dtype, generator=torch.Generator().manual_seed(2))
    estimate = (ref + offset * eps * noise).to(dtype)
    out = reductions.softmin(x, y, h, eps, SQ, "blocked", estimate=estimate)
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    assert torch.allclose(out.double(), ref, rtol=tol, atol=tol * eps)


def test_softmin_names_an_estimate_of_the_wrong_shape():
    x = torch.zeros(1, 5, 3)
    with pytest.raises(ValueError, match=re.escape("estimate must be (B, N) = (1, 5), got (5,)")):
        reductions.softmin(x, x, torch.zeros(1, 5), 0.1, SQ, estimate=torch.zeros(5))


@pytest.mark.keops
@pytest.mark.parametrize("kind", KINDS)
def test_keops(kind):
    check_against_naive(kind, "keops", SQ)


@pytest.mark.keops
def test_keops_solver_matches_tensorized(monkeypatch):
    from otreg.ot import newton

    # the updates on both kernels, iteration for iteration (Newton's dense solves, which
    # small problems go to, would not compare the kernels)
    monkeypatch.setattr(newton, "check_at", lambda p: math.inf)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(200, 3, generator=g, dtype=torch.float64)
    y = torch.rand(150, 3, generator=g, dtype=torch.float64)
    r_k = otreg.sinkhorn(x, y, blur=0.1, backend="keops", tol=1e-10)
    r_t = otreg.sinkhorn(x, y, blur=0.1, backend="tensorized", tol=1e-10)
    assert r_k.backend == "keops" and r_k.n_iter == r_t.n_iter
    assert torch.allclose(r_k.cost, r_t.cost, rtol=1e-12)
    assert torch.allclose(r_k.plan.barycentric_map(), r_t.plan.barycentric_map(), atol=1e-12)


def test_solver_is_the_same_on_every_torch_backend(monkeypatch):
    monkeypatch.setattr(reductions, "BLOCK_ELEMENTS", 200)
    g = torch.Generator().manual_seed(2)
    x = torch.rand(40, 3, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.rand(50, 3, generator=g, dtype=torch.float64)
    values, grads = [], []
    for backend in ("tensorized", "blocked"):
        d = otreg.sinkhorn_divergence(x, y, blur=0.1, tol=1e-10, backend=backend)
        values.append(d)
        grads.append(torch.autograd.grad(d, x)[0])
    assert torch.allclose(values[0], values[1], rtol=1e-12)
    assert torch.allclose(grads[0], grads[1], atol=1e-14)


@pytest.fixture
def broken_keops(monkeypatch):
    """KeOps that fails to compile, as it does without a compiler."""

    def fail(*args):
        raise RuntimeError("[KeOps] Error: compilation failed (g++ not found)")

    table = dict(reductions._IMPLEMENTATIONS)
    for kind, (dense, _) in table.items():
        table[kind] = (dense, fail)
    monkeypatch.setattr(reductions, "_IMPLEMENTATIONS", table)
    monkeypatch.setattr(_keops, "_failure", None)
    monkeypatch.setattr(reductions, "_keops_warned", False)
    monkeypatch.setattr(
        _keops, "status", lambda: (_keops._failure is None, _keops._failure or "ok")
    )
    monkeypatch.setattr(reductions, "TENSORIZED_MAX_PAIRS", 0)
    monkeypatch.setattr(reductions, "TENSORIZED_MAX_PAIRS_RECORDED", 0)
    monkeypatch.setattr(reductions, "KEOPS_ON_CPU", True)  # as on a GPU, where auto prefers keops


def test_auto_falls_back_to_blocked_with_one_warning(broken_keops):
    x, y, h, v = data()
    with pytest.warns(RuntimeWarning, match="g\\+\\+ not found.*blocked.*pykeops.clean_pykeops"):
        out = reductions.softmin(x, y, h, 0.05, SQ, "auto")
    assert torch.allclose(out, naive("softmin", x, y, h, v, 0.05, SQ), atol=1e-10)
    res = otreg.sinkhorn(x[0].detach(), y[0].detach(), blur=0.2)  # no second warning
    assert res.backend == "blocked"


def test_explicit_keops_raises_the_compile_error(broken_keops):
    x, y, h, _ = data()
    with pytest.raises(otreg.KeOpsUnavailable, match="g\\+\\+ not found.*python3-dev"):
        reductions.softmin(x, y, h, 0.05, SQ, "keops")


def test_auto_picks_by_size():
    cpu = torch.device("cpu")
    assert reductions.resolve_backend("auto", 1000, cpu) == "tensorized"
    assert reductions.resolve_backend("auto", reductions.TENSORIZED_MAX_PAIRS + 1, cpu) == "blocked"
    assert reductions.resolve_backend("blocked", 10, cpu) == "blocked"
    # a call autograd records keeps dense matrices until backward: blocked from there
    pairs = reductions.TENSORIZED_MAX_PAIRS_RECORDED + 1
    assert reductions.resolve_backend("auto", pairs, cpu, recorded=True) == "blocked"


def test_recorded_calls_keep_no_dense_matrix(monkeypatch):
    # the saved tensors of a recorded blocked call are its inputs and output, O(N + M)
    monkeypatch.setattr(reductions, "TENSORIZED_MAX_PAIRS_RECORDED", 100)
    x, y, _, v = data(torch.float64, B=1, N=60, M=50)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.numel()) or t, lambda t: t
    ):
        out = reductions.kernel_product(x, y, v, 0.1, SQ, "auto")
    assert max(saved) < 60 * 50
    with torch.no_grad():
        assert torch.allclose(out, reductions.kernel_product(x, y, v, 0.1, SQ, "tensorized"))


def test_info_reports_versions_and_backends(capsys):
    report = otreg.info(check_keops=False)
    out = capsys.readouterr().out
    assert report["otreg"] == otreg.__version__ and "torch" in report
    assert report["backends"]["tensorized"] == "ok"
    assert "backends:" in out and "keops" in out


def test_otreg_sets_the_openmp_spin_count_only_before_torch_and_where_none_was_chosen():
    # libgomp reads GOMP_SPINCOUNT when torch loads it: otreg imported first sets 10,000
    # (docs/performance.md, "Threads"); a user's own setting, or torch loaded first, wins
    def spin(code, **env):
        chosen = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
        environ = {k: v for k, v in os.environ.items() if k not in chosen} | env
        code += "; import os; print(os.environ.get('GOMP_SPINCOUNT'))"
        done = subprocess.run(
            [sys.executable, "-c", code], env=environ, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip().splitlines()[-1]

    assert spin("import otreg") == "10000"
    assert spin("import otreg", GOMP_SPINCOUNT="500") == "500"
    assert spin("import otreg", OMP_WAIT_POLICY="PASSIVE") == "None"
    assert spin("import torch, otreg") == "None"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
def test_blocked_gradients_pass_gradcheck_including_second_order(kind, cost, monkeypatch):
    monkeypatch.setattr(reductions, "BLOCK_ELEMENTS", 2 * 6 * 3)  # blocks of 3 rows
    x, y, h, v = data(N=7, M=6, D=2)

    def fn(x, y, h, v):
        return call(kind, "blocked", x, y, h, v, 0.3, get_cost(cost))

    assert torch.autograd.gradcheck(fn, (x, y, h, v))
    assert torch.autograd.gradgradcheck(fn, (x, y, h, v))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
def test_blocked_gradient_in_one_input_at_a_time(kind, cost, monkeypatch):
    # the backward computes only the gradients of the inputs that require one (an LDDMM
    # step: the momenta v alone): each alone equals the naive one
    monkeypatch.setattr(reductions, "BLOCK_ELEMENTS", 2 * 29 * 5)
    used = {"softmin": (0, 1, 2), "kernel_product": (0, 1, 3), "softmax_average": (0, 1, 2, 3)}
    channels = (2, 20) if kind == "kernel_product" else (2,)  # 20: the backward through W
    for E, k in [(E, k) for E in channels for k in used[kind]]:
        inputs = [t.detach() for t in data(E=E)]
        args = [t.requires_grad_(i == k) for i, t in enumerate(inputs)]
        w = torch.randn_like(naive(kind, *args, 0.05, get_cost(cost)))
        got = call(kind, "blocked", *args[:2], *args[2:], 0.05, get_cost(cost))
        want = naive(kind, *args, 0.05, get_cost(cost))
        (g,) = torch.autograd.grad((got * w).sum(), args[k])
        (r,) = torch.autograd.grad((want * w).sum(), args[k])
        assert torch.allclose(g, r, rtol=1e-9, atol=1e-9), (kind, k)


@pytest.mark.parametrize("kind", ["softmin", "kernel_product"])
@pytest.mark.parametrize("scale", [1.0, 1e-30])
def test_blocked_gradient_with_tiny_and_spread_out_weights(kind, scale, monkeypatch):
    # Incoming gradients spanning 40 orders of magnitude (scaled to 1e-30 too): the blocked
    # backward rescales them to keep its products normal numbers; the result must not change.
    monkeypatch.setattr(reductions, "BLOCK_ELEMENTS", 2 * 29 * 5)
    x, y, h, v = data(torch.float32)
    eps = 0.002 if kind == "softmin" else 0.02  # most kernel entries at the exp floor
    w = scale * 10.0 ** -torch.linspace(0, 40, 37).repeat(2, 1)
    if kind == "kernel_product":
        w = w[..., None]
    inputs = (x, y, h) if kind == "softmin" else (x, y, v)
    out = call(kind, "blocked", x, y, h, v, eps, SQ)
    ref = naive(kind, x.double(), y.double(), h.double(), v.double(), eps, SQ)
    got = torch.autograd.grad((out * w).sum(), inputs)
    want = torch.autograd.grad((ref * w.double()).sum(), inputs)
    for g, r in zip(got, want):
        assert torch.allclose(g, r, rtol=1e-3, atol=1e-6 * float(r.abs().max()))


@pytest.fixture
def fused_now(monkeypatch):
    """The fused loops of otreg.reductions._compiled on every call, however small."""

    monkeypatch.setattr(_compiled, "MIN_PAIRS", 0)
    monkeypatch.setattr(_compiled, "TIER_UP_SECONDS", 0.0)
    return _compiled


@pytest.mark.parametrize("kind", ["softmin", "kernel_product"])
def test_fused_loops_and_their_gradients_equal_the_naive_formulas(kind, fused_now):
    # float64, a batch of two, gradients in x, y and h or v through the compiled sweeps
    x, y, h, v = data(torch.float64, N=300, M=170, E=3)
    out = call(kind, "blocked", x, y, h, v, 0.01, SQ)
    ref = naive(kind, x, y, h, v, 0.01, SQ)
    assert fused_now.failure() is None
    assert ("_lse_rows" if kind == "softmin" else "_kp_rows") in fused_now._kernels
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    inputs = (x, y, h) if kind == "softmin" else (x, y, v)
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)
    got = torch.autograd.grad((out * w).sum(), inputs)
    want = torch.autograd.grad((ref * w).sum(), inputs)
    assert {"_softmin_grad_rows", "_softmin_grad_cols"} <= set(fused_now._kernels) or {
        "_kp_grad_rows",
        "_kp_grad_cols",
    } <= set(fused_now._kernels)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11 * float(r.abs().max()))


@pytest.mark.parametrize("kind", ["softmin", "kernel_product"])
def test_fused_gradients_for_one_input_at_a_time(kind, fused_now):
    x, y, h, v = (t.detach() for t in data(torch.float64, N=300, M=170, E=3))
    for k in range(3):
        inputs = [x, y, h] if kind == "softmin" else [x, y, v]
        inputs = [t.clone().requires_grad_(j == k) for j, t in enumerate(inputs)]
        a, b, w = inputs
        hw, vw = (w, v) if kind == "softmin" else (h, w)
        out = call(kind, "blocked", a, b, hw, vw, 0.01, SQ)
        ref = naive(kind, a, b, hw, vw, 0.01, SQ)
        (got,) = torch.autograd.grad(out.sum(), inputs[k])
        (want,) = torch.autograd.grad(ref.sum(), inputs[k])
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11 * float(want.abs().max()))


@pytest.mark.parametrize("kind", ["softmin", "kernel_product"])
def test_fused_float32_gradients_far_from_the_origin(kind, fused_now, monkeypatch):
    # the gradients subtract coordinates: the clouds are centred first, as the blocked path does
    x, y, h, v = (t.detach() for t in data(torch.float64, N=300, M=170, E=3))
    x, y = x + 1000.0, y + 1000.0
    inputs = [t.float().requires_grad_() for t in ((x, y, h) if kind == "softmin" else (x, y, v))]
    a, b, w = inputs
    out = call(kind, "blocked", a, b, w, w, 0.01, SQ)
    got = torch.autograd.grad((out**2).sum(), inputs)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    ref = naive(
        kind, ref_in[0], ref_in[1], ref_in[2] if kind == "softmin" else h, ref_in[2], 0.01, SQ
    )
    want = torch.autograd.grad((ref**2).sum(), ref_in)
    for g, r in zip(got, want):
        assert float((g.double() - r).abs().max()) < 1e-4 * float(r.abs().max())


def test_fused_kernel_product_keeps_tiny_kernel_values(fused_now):
    # exp(-60.5): far below the gradients' clamp at e^-50, but the value is the answer here
    x, y = torch.zeros(1, 1, 3), torch.tensor([[[1.1, 0.0, 0.0]]])
    out = reductions.kernel_product(x, y, torch.ones(1, 1, 1), 0.01, SQ, "blocked")
    assert float(out) == pytest.approx(math.exp(-60.5), rel=1e-4)


def test_fused_softmin_in_float32(fused_now):
    x, y, h = (t.detach() for t in data(torch.float32, N=300, M=170)[:3])
    ref = naive("softmin", x.double(), y.double(), h.double(), None, 0.01, SQ)
    out = reductions.softmin(x, y, h, 0.01, SQ, "blocked")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_fused_loops_wait_until_the_blocked_path_has_taken_long_enough(monkeypatch):

    monkeypatch.setattr(_compiled, "MIN_PAIRS", 0)
    monkeypatch.setattr(_compiled, "TIER_UP_SECONDS", 1e9)
    monkeypatch.setattr(_compiled, "_seconds", {})
    monkeypatch.setattr(_compiled, "_fused", set())
    x, y, h, _ = data(torch.float64, N=40, M=30)
    reductions.softmin(x, y, h, 0.1, SQ, "blocked").sum().backward()
    key = _compiled.signature("softmin", "forward", x, y, h)
    back = _compiled.signature("softmin", "backward", x, y, h)
    assert set(_compiled._seconds) == {key, back}  # timed per kind, direction and sizes
    assert _compiled._seconds[key] > 0 and not _compiled.ready(key)
    monkeypatch.setattr(_compiled, "TIER_UP_SECONDS", _compiled._seconds[key])
    assert _compiled.ready(key)
    # other costs and the softmax average never count: they have no fused loop
    reductions.softmin(x, y, h, 0.1, get_cost("euclidean", "t"), "blocked")
    reductions.softmax_average(x, y, h, h[..., None], 0.1, SQ, "blocked")
    assert set(_compiled._seconds) == {key, back}
    # at most MAX_SHAPES reductions go fused in a process
    monkeypatch.setattr(_compiled, "MAX_SHAPES", 1)
    monkeypatch.setattr(_compiled, "TIER_UP_SECONDS", 0.0)
    assert _compiled.ready(key) and not _compiled.ready(back)


def _fresh_process(monkeypatch, verdicts=None):
    """The tier-up's state as in a new process (the verdicts file kept)."""
    fresh = {"_seconds": {}, "_calls": {}, "_fused": set(), "_fused_times": {}, "_slower": set()}
    for name, value in {**fresh, "_verdicts": None, "TIER_UP_SECONDS": 1.0}.items():
        monkeypatch.setattr(_compiled, name, value)
    if verdicts is not None:
        monkeypatch.setattr(_compiled, "VERDICT_PATH", str(verdicts))


def _key(n, direction="forward"):
    x, w = torch.zeros(1, n, 3), torch.zeros(1, n)
    return _compiled.signature("softmin", direction, x, x, w)


def _measure(key, fused_seconds):
    """Blocked calls of 0.5 s past the tier-up, the compiling call, then the timed calls."""
    for _ in range(4):
        _compiled.spent(key, 0.5)
    assert _compiled.ready(key)
    _compiled.judged(key, 9.0)  # the compiling call: not judged
    for _ in range(_compiled.TIMED_CALLS):
        assert _compiled.ready(key)
        _compiled.judged(key, fused_seconds)


def test_a_fused_loop_not_faster_than_the_blocked_path_goes_back_to_it(monkeypatch):
    """The switch is measured: after its compiling call and TIMED_CALLS more, a reduction
    whose fastest fused call is not faster than the blocked path's mean call runs blocked
    for good (on a 2-core Intel Xeon the fused loops ran at half the blocked path's
    speed); a faster one stays fused."""
    _fresh_process(monkeypatch)
    slow, fast = _key(1000), _key(4000)
    _measure(slow, 0.6)
    _measure(fast, 0.2)
    assert not _compiled.ready(slow) and _compiled.ready(fast)
    calls = []
    out = _compiled.tiered(slow, lambda: calls.append("fused"), lambda: calls.append("blocked"))
    assert calls == ["blocked"] and out is None


def test_a_slower_fused_loop_is_not_compiled_again_in_a_later_process(monkeypatch, tmp_path):
    """The verdict is kept on disk: a later process on the same machine keeps that reduction
    on the blocked path without compiling it; the faster one and other machines measure."""
    verdicts = tmp_path / "cache" / "verdicts.json"
    _fresh_process(monkeypatch, verdicts)
    slow, fast = _key(1000), _key(4000)
    _measure(slow, 0.6)
    _measure(fast, 0.2)
    kept = json.loads(verdicts.read_text())
    assert kept == {_compiled.verdict_key(slow): "blocked", _compiled.verdict_key(fast): "fused"}
    assert "|softmin|forward|float32|3|()|20" in _compiled.verdict_key(slow)  # 1000^2 ~ 2^20

    _fresh_process(monkeypatch, verdicts)  # a new process
    for key in (slow, _key(1100)):  # 1100^2: the same size class
        for _ in range(4):
            _compiled.spent(key, 0.5)
        assert not _compiled.ready(key) and key not in _compiled._fused
    _measure(fast, 0.2)  # measured again, still fused
    _measure(_key(1000, "backward"), 0.2)  # another reduction: measured
    monkeypatch.setattr(_compiled, "_processor", lambda: "another CPU")
    _fresh_process(monkeypatch, verdicts)
    _measure(slow, 0.2)  # another machine measures for itself


def test_fused_verdicts_survive_a_damaged_or_unwritable_file(monkeypatch, tmp_path):
    verdicts = tmp_path / "verdicts.json"
    verdicts.write_text("{not json")
    _fresh_process(monkeypatch, verdicts)
    _measure(_key(1000), 0.6)  # the damaged file is read as no verdicts, then replaced
    assert json.loads(verdicts.read_text()) == {_compiled.verdict_key(_key(1000)): "blocked"}
    blocked_folder = tmp_path / "a file"
    blocked_folder.write_text("")
    _fresh_process(monkeypatch, blocked_folder / "verdicts.json")
    _measure(_key(1000), 0.6)  # cannot be written: this process still goes back
    assert not _compiled.ready(_key(1000))
    assert sorted(tmp_path.iterdir()) == sorted([verdicts, blocked_folder])  # no temporary left


def test_fused_loops_fall_back_to_the_blocked_path_with_one_warning(fused_now, monkeypatch):
    def broken(fn):
        def run(*args):
            raise RuntimeError("no C++ compiler")

        return run

    monkeypatch.setattr(fused_now, "_compile", broken)
    monkeypatch.setattr(fused_now, "_kernels", {})
    monkeypatch.setattr(fused_now, "_failure", None)
    x, y, h, _ = data(torch.float64, N=40, M=30)
    with pytest.warns(RuntimeWarning, match="fused CPU reductions are off.*no C\\+\\+ compiler"):
        out = reductions.softmin(x, y, h, 0.1, SQ, "blocked")
    assert "no C++ compiler" in fused_now.failure()
    (gx,) = torch.autograd.grad(out.sum(), x)  # the blocked backward, without a warning
    monkeypatch.setattr(reductions, "COMPILED", False)
    ref = reductions.softmin(x, y, h, 0.1, SQ, "blocked")
    assert torch.equal(out, ref)
    assert torch.equal(gx, torch.autograd.grad(ref.sum(), x)[0])


def test_compiling_a_fused_loop_raises_no_deprecation_warning(fused_now, monkeypatch):
    # torch's compiler calls its own deprecated torch.jit helpers: 14 warnings a formula
    # reached users, and under -W error they turned the fused loops off
    monkeypatch.setattr(fused_now, "_kernels", {})
    torch._dynamo.reset()
    x, y, h, v = (t.detach() for t in data(torch.float32, N=70, M=50, E=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        out = call("softmin", "blocked", x, y, h, v, 0.01, SQ)
    assert fused_now.failure() is None and "_lse_rows" in fused_now._kernels
    torch.testing.assert_close(out, naive("softmin", x, y, h, v, 0.01, SQ), rtol=1e-5, atol=1e-5)


FRESH_PROCESS = """
import json, time, torch
from otreg import reductions
from otreg.costs import get_cost
from otreg.reductions import _compiled
import torch._dynamo  # (as torch.optim does: it sets TORCHINDUCTOR_CACHE_DIR to /tmp's)
from torch._dynamo.utils import counters
_compiled.MIN_PAIRS, _compiled.TIER_UP_SECONDS = 0, 0.0
g = torch.Generator().manual_seed(0)
x, y = torch.rand(1, 300, 3, generator=g), torch.rand(1, 200, 3, generator=g)
start = time.perf_counter()
reductions.softmin(x, y, torch.zeros(1, 200), 0.01, get_cost("sqeuclidean"), "blocked")
import os
print(json.dumps({
    "env": os.environ["TORCHINDUCTOR_CACHE_DIR"],
    "seconds": time.perf_counter() - start,
    "hits": counters["inductor"]["fxgraph_cache_hit"],
    "misses": counters["inductor"]["fxgraph_cache_miss"],
    "failure": _compiled.failure(),
    "folder": _compiled.cache_folder(),
}))
"""


def _fresh(env):
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # fresh processes that compile, 51 to 56 s: the default run stays under 20 min
def test_compiled_loops_are_cached_on_disk_for_the_next_process(tmp_path):
    # a fresh process compiles the fused softmin into ~/.cache/otreg/torchinductor (not the
    # temporary folder, which reboots and cluster jobs empty); the next process loads it
    import os

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    first, second = _fresh(env), _fresh(env)
    folder = tmp_path / "otreg" / "torchinductor"
    assert first["failure"] is None and first["folder"] == first["env"] == str(folder)
    assert first["misses"] >= 1 and any(folder.iterdir())
    assert second["misses"] == 0 and second["hits"] >= 1
    # a folder the user chose is kept
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "mine")
    assert _fresh(env)["folder"] == str(tmp_path / "mine")
    assert any((tmp_path / "mine").iterdir())


@pytest.mark.parametrize(
    "x, y, w, needle",
    [
        ((5, 3), (4, 3), (4, 1), "x and y must be (B, N, D) and (B, M, D)"),
        ((1, 5, 3), (1, 4, 2), (1, 4, 1), "with the same B and D, got (1, 5, 3) and (1, 4, 2)"),
        ((1, 5, 3), (1, 4, 3), (1, 3, 1), "v must be (B, M) or (B, M, E) with y's B = 1"),
    ],
)
def test_a_reduction_names_shapes_it_cannot_take(x, y, w, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        reductions.kernel_product(
            torch.zeros(x), torch.zeros(y), torch.zeros(w), 0.1, get_cost("sqeuclidean")
        )
    with pytest.raises(TypeError, match="softmin: h must be a tensor, got list"):
        reductions.softmin(
            torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), [0.0, 0.0], 0.1, get_cost("sqeuclidean")
        )


def test_this_process_s_own_running_threads_are_not_counted_as_busy_elsewhere():
    """A thread of this process that computes (as torch's OpenMP threads spin right after
    an operation) is not another process: counted as one, it put every call after the
    first on one thread."""
    stop = threading.Event()

    def compute():
        a = torch.randn(300, 300, generator=torch.Generator().manual_seed(0))
        while not stop.is_set():
            a @ a  # (releases the GIL: runs beside the reads)

    worker = threading.Thread(target=compute, daemon=True)
    worker.start()
    try:
        deadline, counts = time.monotonic() + 10, []
        while time.monotonic() < deadline:  # (0 once no other process runs meanwhile)
            counts.append(info_module.busy_elsewhere())
            if counts[-1] == 0:
                break
            time.sleep(0.05)
        assert counts[-1] == 0, counts
        assert worker.is_alive()
    finally:
        stop.set()
        worker.join()


def test_otreg_counts_busy_processes_and_runs_its_calls_on_the_cores_they_leave(monkeypatch):
    # a process that computes is counted (the fewest of a few reads of the running threads)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 10
        while info_module.busy_elsewhere() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert info_module.busy_elsewhere() >= 1
    finally:
        busy.kill()
        busy.wait()
    # the threads a call runs on: torch's, less the other processes' running threads beyond
    # the free cores, at least one; counted again only after COUNT_EVERY seconds
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(info_module.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(info_module, "usable_cores", lambda: 4)
    monkeypatch.delenv("OTREG_SHARE_CORES", raising=False)
    for others, threads in [(0, 4), (1, 3), (3, 1), (9, 1)]:
        monkeypatch.setattr(info_module, "busy_elsewhere", lambda k=others: k)
        monkeypatch.setitem(info_module._counted, "at", -math.inf)
        assert info_module.threads_for_call() == threads
    monkeypatch.setattr(info_module, "busy_elsewhere", lambda: 0)
    assert info_module.threads_for_call() == 1  # (the count of a moment ago)
    monkeypatch.setitem(info_module._counted, "at", -math.inf)
    assert info_module.threads_for_call() == 4
    # not counted: told so, or a process given some of the machine's CPUs (a job's cpuset:
    # the running threads are the whole node's)
    monkeypatch.setattr(info_module, "busy_elsewhere", lambda: 3)
    monkeypatch.setenv("OTREG_SHARE_CORES", "0")
    assert info_module.threads_for_call() == 4
    monkeypatch.delenv("OTREG_SHARE_CORES")
    monkeypatch.setattr(info_module, "usable_cores", lambda: 2)
    monkeypatch.setitem(info_module._counted, "at", -math.inf)
    assert info_module.threads_for_call() == 2


def test_a_call_beside_busy_processes_runs_on_fewer_threads_and_restores_them(monkeypatch):
    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: nothing to give up")
    before = torch.get_num_threads()
    monkeypatch.delenv("OTREG_SHARE_CORES", raising=False)
    monkeypatch.setattr(info_module, "threads_for_call", lambda: 1)
    seen = []
    real = otreg.ot.divergence._divergence

    def spy(*args):
        seen.append(torch.get_num_threads())
        return real(*args)

    monkeypatch.setattr(otreg.ot.divergence, "_divergence", spy)
    x, y = torch.randn(50, 3), torch.randn(40, 3)
    value = otreg.sinkhorn_divergence(x, y, blur=0.1)
    assert seen == [1] and torch.get_num_threads() == before
    monkeypatch.setattr(info_module, "threads_for_call", lambda: before)
    assert torch.allclose(otreg.sinkhorn_divergence(x, y, blur=0.1), value, rtol=1e-5)
    # restored after an error too; a block within another keeps the outer's threads
    monkeypatch.setattr(info_module, "threads_for_call", lambda: 1)
    monkeypatch.setattr(otreg.ot.divergence, "_divergence", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        otreg.sinkhorn_divergence(x, y, blur=0.1)
    assert torch.get_num_threads() == before
    with info_module.sharing_cores() as outer:
        monkeypatch.setattr(info_module, "threads_for_call", lambda: before)
        with info_module.sharing_cores() as inner:
            assert outer == inner == torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_the_cpu_quota_of_a_cgroup_limits_the_usable_cores(tmp_path, monkeypatch):
    """A container's or a job's CPU quota, cgroup v2 or v1, at the process's own group or
    above it: the cores a batch or a call plans for."""
    v2 = tmp_path / "v2"
    (v2 / "job" / "step").mkdir(parents=True)
    (v2 / "cpu.max").write_text("max 100000\n")
    (v2 / "job" / "cpu.max").write_text("150000 100000\n")  # 1.5 cores, one level up
    membership = tmp_path / "cgroup"
    membership.write_text("0::/job/step\n")
    assert info_module.cgroup_quota(str(v2), str(membership)) == 1.5
    (v2 / "job" / "cpu.max").write_text("max 100000\n")
    assert info_module.cgroup_quota(str(v2), str(membership)) is None  # (no limit)
    v1 = tmp_path / "v1"
    (v1 / "cpu,cpuacct" / "slurm").mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu,cpuacct" / "slurm" / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu,cpuacct" / "slurm" / "cpu.cfs_period_us").write_text("100000\n")
    membership.write_text("5:memory:/x\n4:cpu,cpuacct:/slurm\n")
    assert info_module.cgroup_quota(str(v1), str(membership)) == 3.0
    assert info_module.cgroup_quota(str(tmp_path / "none"), str(tmp_path / "none")) is None
    # usable: the fewest of the machine's, the affinity's and the quota rounded up
    monkeypatch.setattr(info_module.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(
        info_module.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False
    )
    monkeypatch.setattr(info_module, "cgroup_quota", lambda: 2.5)
    assert info_module.usable_cores() == 3
    monkeypatch.setattr(info_module, "cgroup_quota", lambda: None)
    assert info_module.usable_cores() == 8
    monkeypatch.setattr(info_module, "cgroup_quota", lambda: 0.2)
    assert info_module.usable_cores() == 1
