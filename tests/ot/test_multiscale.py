"""Multiscale Sinkhorn: block-sparse reductions, the truncation bound, agreement with the
dense solver."""

import math
import warnings

import numpy as np
import pytest
import torch

import otreg
from otreg.costs import diameter, get_cost
from otreg.datasets import noisy_sphere
from otreg.ot import multiscale, problem
from otreg.ot.kernels import make_kernel
from otreg.ot.loop import _anneal, solve
from otreg.ot.problem import Multiscale, Problem, SinkhornOptions
from otreg.reductions import _dense, sparse
from otreg.reductions.sparse import (
    BlockFactors,
    BlockSparse,
    PairList,
    close_pairs,
    grid_clusters,
)

SQ = get_cost("sqeuclidean")


def spheres(n=1500, dtype=torch.float64):
    x = noisy_sphere(n, seed=1, dtype=dtype)
    y = noisy_sphere(n + 100, radius=0.8, center=(0.3, 0.0, 0.0), seed=2, dtype=dtype)
    return x, y


def all_pairs(cx, cy):
    I, J = torch.meshgrid(torch.arange(cx.n_clusters), torch.arange(cy.n_clusters), indexing="ij")
    return I.flatten(), J.flatten()


def test_grid_clusters_partition_the_cloud():
    x, _ = spheres(800)
    a = torch.rand(800, dtype=x.dtype) + 0.1
    c = grid_clusters(x, a, 0.3)
    assert torch.equal(torch.sort(c.order).values, torch.arange(800))
    assert int(c.sizes.sum()) == 800 and bool((c.sizes > 0).all())
    assert torch.equal(c.points, x[c.order])
    dist = (c.points - c.centres[c.labels]).norm(dim=1)
    assert bool((dist <= c.radii[c.labels] + 1e-12).all())
    k = int(c.labels[0])  # the first cluster's centroid is its mass-weighted mean
    members = c.order[c.labels == k]
    expected = (x[members] * a[members, None]).sum(0) / a[members].sum()
    torch.testing.assert_close(c.centres[k], expected)
    assert float(c.radii.max()) <= 0.3 * 3**0.5 + 1e-12  # within a cell's diagonal


def test_block_sparse_softmin_with_every_pair_equals_the_dense_one():
    x, y = spheres(300)
    h = torch.randn(y.shape[0], dtype=x.dtype)
    cx = grid_clusters(x, torch.ones(300, dtype=x.dtype), 0.4)
    cy = grid_clusters(y, torch.ones(y.shape[0], dtype=x.dtype), 0.4)
    kernel = BlockSparse(cx, cy, *all_pairs(cx, cy), block_elements=5000)  # many chunks
    assert len(kernel.chunks) > 3
    got = kernel.softmin(cx.points, cy.points, h[cy.order], 0.01)
    dense = _dense.softmin(cx.points[None], cy.points[None], h[cy.order][None], 0.01, SQ)[0]
    torch.testing.assert_close(got, dense, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_softmin_by_columns_equals_the_transposed_patterns_softmin(dtype):
    """Summed over this pattern's chunks by columns, the softmin of each column over its
    kept rows is the transposed pattern's own softmin (half the cluster pairs kept, every
    cluster keeping some; rows of weight zero, h = -inf, included)."""
    x, y = spheres(300, dtype=dtype)
    cx = grid_clusters(x, torch.ones(300, dtype=dtype), 0.4)
    cy = grid_clusters(y, torch.ones(y.shape[0], dtype=dtype), 0.4)
    I, J = all_pairs(cx, cy)
    keep = ((I + J) % 2 == 0) | (J == 0) | (I == 0)
    I, J = I[keep], J[keep]
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(300, generator=gen, dtype=torch.float64).to(dtype)
    h[::7] = -torch.inf
    xy = BlockSparse(cx, cy, I, J, block_elements=5000)
    yx = BlockSparse(cy, cx, J, I, block_elements=5000)
    assert len(xy.chunks) > 3
    for eps in (0.01, 1.0):
        got = xy.softmin_columns(cx.points, cy.points, h, eps)
        expected = yx.softmin(cy.points, cx.points, h, eps)
        tol = 1e-12 if dtype == torch.float64 else 2e-6
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol * eps)


def test_multiscale_softmins_go_by_columns_only_where_the_other_cells_are_larger():
    """Tight clusters against a uniform ball: the ball's small cells' softmins sum the
    clusters' chunks by columns (the same potentials as the ball's own chunks give); the
    clusters' softmins and any softmin whose gradient is wanted keep their own chunks."""
    g = torch.Generator().manual_seed(3)
    centres = torch.randn(4, 3, generator=g, dtype=torch.float64)
    x = centres[torch.arange(1200) % 4] + 0.02 * torch.randn(1200, 3, generator=g).double()
    y = torch.rand(1300, 3, generator=g, dtype=torch.float64) * 2 - 1
    opts = SinkhornOptions(blur=0.05, multiscale=Multiscale(cluster_scale=0.2))
    p = Problem.build("t", x, y, None, None, opts)
    kernel = make_kernel(p, p.x, p.a, p.y, p.b)
    _anneal(p, kernel, None)
    assert not kernel._by_columns(torch.zeros(1200, dtype=x.dtype), transpose=False)
    f = torch.zeros(1200, dtype=x.dtype)
    assert kernel._by_columns(f, transpose=True)
    got = kernel._block_softmin(0.01, f, transpose=True)
    multiscale.COLUMNS_RATIO, ratio = math.inf, multiscale.COLUMNS_RATIO
    try:
        expected = kernel._block_softmin(0.01, f, transpose=True)
    finally:
        multiscale.COLUMNS_RATIO = ratio
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    assert not kernel._by_columns(f.clone().requires_grad_(True), transpose=True)


@pytest.mark.parametrize("cache_bytes", [0, 6000, 1 << 28])
def test_block_sparse_softmin_is_the_same_whatever_its_cache_holds(cache_bytes):
    """Column indices are kept first, the centred coordinates in what is left; a chunk
    beyond the budget rebuilds them at each call, with the same result."""
    x, y = spheres(300)
    h = torch.randn(y.shape[0], dtype=x.dtype)
    cx = grid_clusters(x, torch.ones(300, dtype=x.dtype), 0.4)
    cy = grid_clusters(y, torch.ones(y.shape[0], dtype=x.dtype), 0.4)
    pairs = all_pairs(cx, cy)
    kernel = BlockSparse(cx, cy, *pairs, block_elements=5000, cache_bytes=cache_bytes)
    reference = BlockSparse(cx, cy, *pairs, block_elements=5000)
    for _ in range(2):  # the second call reads what the first one cached
        got = kernel.softmin(cx.points, cy.points, h[cy.order], 0.01)
        torch.testing.assert_close(
            got, reference.softmin(cx.points, cy.points, h[cy.order], 0.01), rtol=1e-12, atol=0
        )
    stored = sum(chunk[2] is not None for chunk in kernel.chunks)
    cached = len(kernel._geometry_cache)
    if cache_bytes == 0:
        assert stored == cached == 0
    elif cache_bytes == 6000:  # the indices of some chunks, the coordinates of fewer
        assert 0 < stored < len(kernel.chunks) and cached < stored
    else:
        assert stored == cached == len(kernel.chunks)


def test_chunks_cover_the_clusters_once_and_pad_within_the_slack():
    from otreg.reductions import sparse

    g = torch.Generator().manual_seed(1)
    heights = torch.randint(1, 50, (300,), generator=g).sort().values.tolist()
    widths = torch.randint(100, 400, (300,), generator=g).tolist()
    chunks = sparse._greedy_chunks(heights, widths, 1 << 22)
    assert [c.start for c in chunks[1:]] == [c.stop for c in chunks[:-1]]
    assert chunks[0].start == 0 and chunks[-1].stop == 300
    held = padded = small = 0
    for c in chunks:
        h, w = heights[c], widths[c]
        size = len(h) * max(h) * max(w)
        assert size <= 1 << 22
        inside = sum(a * b for a, b in zip(h, w))
        if c.stop < 300:  # cut only where the next cluster would break a rule
            k = c.stop
            grown = (len(h) + 1) * max(*h, heights[k]) * max(*w, widths[k])
            too_padded = grown > sparse.MIN_CHUNK and grown > sparse.SLACK * (
                inside + heights[k] * widths[k]
            )
            assert grown > 1 << 22 or too_padded
        held, padded = held + inside, padded + size
        small += size <= sparse.MIN_CHUNK
        assert size <= sparse.MIN_CHUNK or size <= sparse.SLACK * inside
    assert padded <= sparse.SLACK * held + small * sparse.MIN_CHUNK
    everything = 300 * max(heights) * max(widths)
    assert padded < 0.6 * everything  # one chunk of all the clusters pads 3.4x here
    assert len(sparse._greedy_chunks(heights, widths, 1 << 40)) < 20


def test_block_sparse_softmin_gradients_pass_gradcheck():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(25, 3, generator=g, dtype=torch.float64)
    y = torch.rand(30, 3, generator=g, dtype=torch.float64)
    cx = grid_clusters(x, torch.ones(25, dtype=x.dtype), 0.5)
    cy = grid_clusters(y, torch.ones(30, dtype=x.dtype), 0.5)
    kernel = BlockSparse(cx, cy, *all_pairs(cx, cy), block_elements=200)
    xs = cx.points.clone().requires_grad_()
    ys = cy.points.clone().requires_grad_()
    h = torch.randn(30, generator=g, dtype=x.dtype, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: kernel.softmin(a, b, c, 0.05), (xs, ys, h))


def test_second_derivatives_are_refused_clearly():
    x = torch.rand(20, 3, dtype=torch.float64, requires_grad=True)
    c = grid_clusters(x.detach(), torch.ones(20, dtype=x.dtype), 0.5)
    kernel = BlockSparse(c, c, *all_pairs(c, c))
    out = kernel.softmin(x[c.order], x[c.order].detach(), torch.zeros(20, dtype=x.dtype), 0.1)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


@pytest.mark.parametrize("hierarchy", [False, True])
def test_truncation_drops_only_negligible_terms(hierarchy, monkeypatch):
    """After a multiscale solve, no pair whose slack is within truncate * eps is dropped
    (also when the first patterns are screened through coarser clusters)."""
    if hierarchy:
        monkeypatch.setattr(multiscale, "HIERARCHY_MIN_PAIRS", 50)
    x, y = spheres(1500, torch.float32)
    options = SinkhornOptions(blur=0.02, scaling=0.8, multiscale=True)
    p = Problem.build("t", x, y, None, None, options)
    sol = solve(p, p.x, p.a, p.y, p.b)
    f, g, ms = sol.f, sol.g, sol.kernel
    fs, gs = f[0][ms.cx.order], g[0][ms.cy.order]
    I, J = ms.kernels.pairs
    kept = torch.zeros(ms.cx.n_clusters, ms.cy.n_clusters, dtype=torch.bool)
    kept[I, J] = True
    kept = kept[ms.cx.labels][:, ms.cy.labels]
    slack = ((ms.cx.points[:, None] - ms.cy.points[None]) ** 2).sum(-1) / 2 - fs[:, None] - gs[None]
    needed = slack <= ms.truncate * p.eps
    assert int((needed & ~kept).sum()) == 0
    assert int(needed.sum()) > 5 * needed.shape[0]  # rows with several pairs to keep
    assert float(kept.float().mean()) < 0.5  # and it does truncate
    # a solved problem keeps only what its gradient needs: the x -> y kernel, no geometry
    assert ms.kernels.yx is None and not ms.kernels.xy._geometry_cache


def _divergence(x, y, a=None, b=None, **options):
    x = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error", otreg.ConvergenceWarning)
        value = otreg.sinkhorn_divergence(x, y, a, b, **options)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach(), grad


@pytest.mark.parametrize("reach, relaxation", [(None, "anderson"), (0.5, 1.5)])
def test_multiscale_divergence_equals_the_dense_one(reach, relaxation):
    x, y = spheres(1000)
    g = torch.Generator().manual_seed(3)
    a = torch.rand(x.shape[0], generator=g, dtype=x.dtype) + 0.5
    b = torch.rand(y.shape[0], generator=g, dtype=x.dtype) + 0.5
    a, b = a / a.sum(), b / b.sum()
    options = dict(
        blur=0.03, scaling=0.8, reach=reach, tol=1e-9, max_iter=3000, relaxation=relaxation
    )
    v_dense, g_dense = _divergence(x, y, a, b, multiscale=False, **options)
    v_ms, g_ms = _divergence(x, y, a, b, multiscale=Multiscale(cluster_scale=0.2), **options)
    torch.testing.assert_close(v_ms, v_dense, rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(g_ms, g_dense, rtol=1e-5, atol=1e-9)


def test_multiscale_sinkhorn_reports_itself_and_supports_warm_starts():
    x, y = spheres(1000, torch.float32)
    options = dict(blur=0.03, scaling=0.8, tol=1e-3, max_iter=2000, multiscale=True)
    res = otreg.sinkhorn(x, y, **options)
    assert res.backend == "multiscale" and res.converged
    dense = otreg.sinkhorn(x, y, **{**options, "multiscale": False})
    torch.testing.assert_close(res.cost, dense.cost, rtol=1e-3, atol=0)
    warm = otreg.sinkhorn(x + 0.001, y, init=(res.f, res.g), **options)
    cold = otreg.sinkhorn(x + 0.001, y, **options)
    assert warm.converged and warm.n_iter < cold.n_iter
    torch.testing.assert_close(warm.cost, cold.cost, rtol=1e-3, atol=0)


def test_auto_turns_multiscale_on_for_large_problems_only(monkeypatch):
    x, y = spheres(600, torch.float32)
    assert otreg.sinkhorn(x, y, blur=0.02).backend != "multiscale"
    monkeypatch.setattr(multiscale, "MIN_PAIRS", 10_000)
    assert otreg.sinkhorn(x, y, blur=0.02).backend == "multiscale"
    # not when the blur is as large as the clusters, nor for other costs or batches
    assert otreg.sinkhorn(x, y, blur=0.5).backend != "multiscale"
    assert otreg.sinkhorn(x, y, blur=0.02, cost="euclidean").backend != "multiscale"
    assert (
        otreg.sinkhorn(
            torch.stack([x, x]),
            torch.stack([y, y]),
            blur=0.02,
            max_iter=50,
        ).backend
        != "multiscale"
    )


def test_auto_sums_every_pair_where_a_few_far_points_set_the_span(monkeypatch):
    """A cloud whose bounding box is many times its bulk's: multiscale="auto" sums every
    pair (the far points would set the cells); the same bulk without them is truncated."""
    monkeypatch.setattr(multiscale, "MIN_PAIRS", 10_000)
    x, y = spheres(600, torch.float32)
    far = x.clone()
    far[:3] = torch.tensor([[30.0, 0, 0], [0, -25.0, 0], [0, 0, 40.0]])
    assert problem.bulk_diameter(far[None], y[None]) < 4 < 20 < diameter(far[None], y[None])
    assert otreg.sinkhorn(x, y, blur=0.02, max_iter=30).backend == "multiscale"
    assert otreg.sinkhorn(far, y, blur=0.02, max_iter=30).backend != "multiscale"
    # asked for by name, it still runs
    assert otreg.sinkhorn(far, y, blur=0.02, max_iter=30, multiscale=True).backend == "multiscale"


def test_bulk_diameter_is_the_quantile_box_diagonal():
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(1, 3000, 3, generator=g), torch.rand(1, 1000, 3, generator=g) * 2
    both = torch.cat([x[0], y[0]]).double()
    q = problem.BULK_QUANTILE
    low, high = both.quantile(q, dim=0), both.quantile(1 - q, dim=0)
    assert problem.bulk_diameter(x, y) == pytest.approx(float((high - low).norm()), rel=1e-9)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(multiscale="yes"), "multiscale is 'yes'"),
        (dict(multiscale=True, cost="euclidean"), "multiscale=True but the cost is 'euclidean'"),
        (dict(multiscale=True, form="scaling"), "form is 'scaling'"),
        (dict(multiscale=True, backward="implicit"), "backward is 'implicit'"),
        (dict(multiscale=Multiscale(), backward="implicit"), "backward is 'implicit'"),
    ],
)
def test_bad_multiscale_options_raise_naming_them(options, match):
    x, y = spheres(100, torch.float32)
    with pytest.raises(ValueError, match=match):
        otreg.sinkhorn(x, y, **options)


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(truncate=0.0), "Multiscale: truncate is 0.0"),
        (dict(cluster_scale=-1.0), "Multiscale: cluster_scale is -1.0"),
        (dict(auto="yes"), "Multiscale: auto must be True or False"),
    ],
)
def test_bad_multiscale_settings_raise_naming_them(settings, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Multiscale(**settings)


def test_multiscale_refuses_a_batch():
    x, y = spheres(100, torch.float32)
    with pytest.raises(ValueError, match="batch of 2"):
        otreg.sinkhorn(torch.stack([x, x]), torch.stack([y, y]), multiscale=True)


def test_pattern_search_gives_the_same_pairs_in_any_chunking(monkeypatch):
    """Candidates screened in small chunks, or through coarser clusters, keep the pairs the
    one-pass search keeps (up to the always-kept best pairs)."""
    x, y = spheres(400)
    cx = grid_clusters(x, torch.ones(x.shape[0], dtype=x.dtype), 0.25)
    cy = grid_clusters(y, torch.ones(y.shape[0], dtype=y.dtype), 0.25)
    f = torch.zeros(x.shape[0], dtype=x.dtype)
    g = torch.zeros(y.shape[0], dtype=y.dtype)
    dx = torch.zeros(cx.n_clusters, 3, dtype=x.dtype)
    dy = torch.zeros(cy.n_clusters, 3, dtype=y.dtype)
    whole = multiscale._pattern_pairs(cx, cy, f, g, dx, dy, 0.1)
    chunked = multiscale._pattern_pairs(cx, cy, f, g, dx, dy, 0.1, all_pairs(cx, cy), block=7)
    assert len(whole[0]) < cx.n_clusters * cy.n_clusters  # something is dropped
    torch.testing.assert_close(chunked, whole)
    monkeypatch.setattr(multiscale, "HIERARCHY_MIN_PAIRS", 50)
    coarse = multiscale._pattern_pairs(cx, cy, f, g, dx, dy, 0.1, scale=0.25, block=7)
    kept = set(zip(*(t.tolist() for t in whole)))
    assert len(set(zip(*(t.tolist() for t in coarse))) ^ kept) < 0.1 * len(kept)


def _brute_softmin(x, y, log_b, g, eps, keep):
    """-eps log sum over the kept j of b_j exp((g_j - |x_i - y_j|^2 / 2) / eps), float64."""
    scores = log_b + (g[None] - ((x[:, None] - y[None]) ** 2).sum(-1) / 2) / eps
    return -eps * torch.logsumexp(scores.masked_fill(~keep, -torch.inf), 1)


@pytest.mark.parametrize("spread", [0.5, 200.0])
def test_pair_list_softmins_equal_brute_force_over_its_pairs(spread):
    """Both ways, with potentials far from the reference ones (the scores' shift moves);
    with weights spread over e^200 each point's sum keeps its own shift (one shared shift
    would underflow the lightest points' sums in float32)."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(60, 3, generator=gen), torch.rand(70, 3, generator=gen)
    keep = torch.rand(60, 70, generator=gen) < 0.3
    keep[torch.arange(60), torch.arange(60)] = True  # every row and column has a pair
    keep[torch.arange(60) % 60, torch.arange(60, 70).repeat(6)[:60]] = True
    i, j = keep.nonzero(as_tuple=True)
    log_a = torch.rand(60, generator=gen) * spread
    log_b = torch.rand(70, generator=gen) * spread
    eps = 0.01
    f0 = torch.randn(60, generator=gen, dtype=torch.float64) * 0.05
    g0 = torch.randn(70, generator=gen, dtype=torch.float64) * 0.05
    pairs = PairList(x, y, i, j, log_a, log_b, f0, g0, eps)
    assert pairs.n_pairs == int(keep.sum())
    f = f0 + torch.randn(60, generator=gen, dtype=torch.float64) * 0.02
    g = g0 + torch.randn(70, generator=gen, dtype=torch.float64) * 0.02
    xd, yd = x.double(), y.double()
    rows = _brute_softmin(xd, yd, log_b.double(), g, eps, keep)
    cols = _brute_softmin(yd, xd, log_a.double(), f, eps, keep.T)
    got_rows, got_cols = pairs.softmin_rows(g), pairs.softmin_cols(f)
    assert got_rows.dtype == torch.float64
    # the sums run in float32: their rounding, times eps
    torch.testing.assert_close(got_rows, rows, rtol=0, atol=1e-5 * eps)
    torch.testing.assert_close(got_cols, cols, rtol=0, atol=1e-5 * eps)


def test_pairs_by_column_are_the_same_through_scipy_and_through_torch(monkeypatch):
    """A list's column side, ordered through scipy (large lists) or torch's stable sort:
    the same runs, counts and values, each column's pairs in the rows' order; brute force
    (a stable argsort in numpy) as the oracle."""
    gen = torch.Generator().manual_seed(3)
    counts = torch.randint(1, 40, (300,), generator=gen)
    j = torch.randint(0, 250, (int(counts.sum()),), generator=gen, dtype=torch.int32)
    values = torch.randn(len(j), generator=gen)
    order = np.argsort(j.numpy(), kind="stable")
    run = np.repeat(np.arange(300), counts.numpy())[order]
    results = {}
    for path, least in {"scipy": 1, "torch": 2**40}.items():
        monkeypatch.setattr(sparse, "SCIPY_PAIRS", least)
        results[path] = sparse._by_columns(counts, j, values.clone(), 250)
    for got_run, got_counts, got_values in results.values():
        assert np.array_equal(got_run.numpy(), run)
        assert np.array_equal(got_counts.numpy(), np.bincount(j.numpy(), minlength=250))
        assert np.array_equal(got_values.numpy(), values.numpy()[order])


def test_an_infinite_potential_leaves_the_other_rows_pairs_as_they_were():
    """One row's f is +inf (its slacks -inf): every other row of its cell keeps the pairs it
    has with that row's f finite."""
    x, y = spheres(300, dtype=torch.float32)
    cx = grid_clusters(x, torch.ones(300, dtype=x.dtype), 0.4)
    cy = grid_clusters(y, torch.ones(y.shape[0], dtype=x.dtype), 0.4)
    gen = torch.Generator().manual_seed(1)
    f = torch.randn(300, generator=gen, dtype=torch.float64) * 0.1
    g = torch.randn(y.shape[0], generator=gen, dtype=torch.float64) * 0.1
    kernel = BlockSparse(cx, cy, *all_pairs(cx, cy))
    i, j, slack = close_pairs(kernel, cx.points, cy.points, f, g, 0.05, 10**6)
    # a row of a cell that has another row with pairs: its potential infinite
    found = set(i.tolist())
    row = next(
        k for k in range(300) if any(int(cx.labels[r]) == int(cx.labels[k]) for r in found - {k})
    )
    cell = cx.labels[row]
    f_inf = f.clone()
    f_inf[row] = torch.inf
    i2, j2, slack2 = close_pairs(kernel, cx.points, cy.points, f_inf, g, 0.05, 10**6)
    others, others2 = i != row, i2 != row
    assert int((cx.labels[i[others]] == cell).sum()) > 0
    assert torch.equal(i[others], i2[others2]) and torch.equal(j[others], j2[others2])
    torch.testing.assert_close(slack[others], slack2[others2])


@pytest.mark.parametrize("offset", [0.0, 1000.0])
@pytest.mark.parametrize("piece", [1 << 20, 500])
def test_close_pairs_finds_exactly_the_pattern_pairs_within_the_threshold(
    offset, piece, monkeypatch
):
    """In float32 points too, with potentials of any size (``offset`` added to f and taken
    from g leaves every slack as it was): the slacks come out exact to 1e-6. Also where a
    chunk's slacks are computed a few rows at a time (``piece``: several pieces of several
    row clusters each), each row's pairs stay in one run."""
    monkeypatch.setattr(sparse, "SEARCH_PIECE", piece)
    x, y = spheres(300, dtype=torch.float32)
    cx = grid_clusters(x, torch.ones(300, dtype=x.dtype), 0.4)
    cy = grid_clusters(y, torch.ones(y.shape[0], dtype=x.dtype), 0.4)
    gen = torch.Generator().manual_seed(1)
    f = torch.randn(300, generator=gen, dtype=torch.float64) * 0.1 + offset
    g = torch.randn(y.shape[0], generator=gen, dtype=torch.float64) * 0.1 - offset
    I, J = all_pairs(cx, cy)
    half = torch.arange(len(I)) % 2 == 0  # a pattern of half the cluster pairs
    kernel = BlockSparse(cx, cy, I[half], J[half], block_elements=5000)
    xd, yd = cx.points.double(), cy.points.double()
    slack = ((xd[:, None] - yd[None]) ** 2).sum(-1) / 2 - f[:, None] - g[None]
    in_pattern = torch.zeros(cx.n_clusters, cy.n_clusters, dtype=torch.bool)
    in_pattern[I[half], J[half]] = True
    expected = (slack <= 0.05) & in_pattern[cx.labels][:, cy.labels]
    dropped = []
    found = close_pairs(kernel, cx.points, cy.points, f, g, 0.05, 10**6, dropped=dropped)
    i, j, found_slack = found
    order = torch.argsort(i * len(g) + j)
    assert torch.equal(
        torch.stack([i[order], j[order]]), torch.stack(expected.nonzero(as_tuple=True))
    )
    # grouped by row, each row's columns ascending; the slacks exact to float32's rounding
    assert len(torch.unique_consecutive(i)) == len(torch.unique(i))
    assert bool((j[1:] > j[:-1])[i[1:] == i[:-1]].all())
    assert found_slack.dtype == torch.float64
    torch.testing.assert_close(found_slack, slack[i, j], rtol=0, atol=1e-6)
    assert 0 < len(i) < 0.5 * expected.numel()
    assert close_pairs(kernel, cx.points, cy.points, f, g, 0.05, limit=len(i) - 1) is None
    # each row's and column's smallest slack among the pattern's pairs left out (inf where
    # none), to float32's rounding of the potentials' size
    left_out = slack.masked_fill(~in_pattern[cx.labels][:, cy.labels] | expected, torch.inf)
    rows, cols = dropped
    assert rows.dtype == cols.dtype == torch.float64
    tol = 1e-6 + 1e-7 * offset
    torch.testing.assert_close(rows, left_out.amin(1), rtol=0, atol=tol)
    torch.testing.assert_close(cols, left_out.amin(0), rtol=0, atol=tol)


def test_solve_on_the_pair_list_equals_the_dense_solve_where_points_are_sparser_than_the_blur():
    """Points about 0.2 apart at blur 0.02: the final iterations run on the list of point
    pairs (a plan near a permutation), in float32, and end at the plan of the dense float64
    solver iterated to 1e-12 (POT's plain iterations need over 20,000 here; the dense
    solver equals POT where POT converges, test_solver.py)."""
    x = noisy_sphere(400, seed=1, dtype=torch.float32)
    y = noisy_sphere(450, radius=0.8, center=(0.5, 0.0, 0.0), seed=2, dtype=torch.float32)
    options = SinkhornOptions(blur=0.02, tol=1e-5, max_iter=5000, multiscale=True)
    p = Problem.build("t", x, y, None, None, options)
    sol = solve(p, p.x, p.a, p.y, p.b)
    assert sol.rule.converged and sol.kernel.list_pairs
    # a few pairs a point, a small part of the cell pattern's
    assert max(sol.kernel.list_pairs) < min(0.1 * sol.kernel.n_pairs[-1], 20 * 400)
    assert sol.f.dtype == torch.float32
    _assert_the_dense_plan(x, y, 0.02, sol)


def test_the_solve_does_not_stop_on_a_pattern_that_lost_pairs_that_matter():
    """Uniform clouds in a square, points about 0.022 apart at blur 0.008: the final
    potentials move by tens of eps, and the pattern, refreshed among its own pairs, lost
    pairs they made matter; the loop converged on it to a cost 1.6e-4 off without a
    warning (at blur 0.006 and 3,000 points: 3.9e-3). Searches of every cluster pair
    (now and then during the updates, and at the stop) find them, and the loop goes on."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2000, 2, generator=g, dtype=torch.float64)
    y = torch.rand(2100, 2, generator=g, dtype=torch.float64)
    # (every pair to tol 1e-5: 204 updates, the cost within 7e-9 of tol 1e-7's, 516 updates)
    exact = otreg.sinkhorn(x, y, blur=0.008, tol=1e-5, max_iter=5000, multiscale=False)
    p = Problem.build("t", x, y, None, None, SinkhornOptions(blur=0.008, multiscale=True))
    sol = solve(p, p.x, p.a, p.y, p.b)
    assert sol.rule.converged and sol.kernel.pairs_added  # it had lost some
    res = otreg.sinkhorn(x, y, blur=0.008, multiscale=True)
    # to the default tol's accuracy: every pair's default call is 3.4e-5 off here
    assert res.converged and float(res.cost) == pytest.approx(float(exact.cost), rel=1e-4)


def _assert_the_dense_plan(x, y, blur, sol):
    """The solve's plan (uniform weights) is that of the dense float64 solver iterated to
    1e-12, in total variation and in transport cost."""
    exact = otreg.sinkhorn(
        x.double(), y.double(), blur=blur, tol=1e-12, max_iter=20_000, multiscale=False
    )
    assert exact.converged
    C = ((x.double()[:, None] - y.double()[None]) ** 2).sum(-1) / 2
    P = exact.plan.dense()
    f, g = sol.f[0].double(), sol.g[0].double()
    ours = torch.exp((f[:, None] + g[None] - C) / blur**2) / (x.shape[0] * y.shape[0])
    assert float((ours - P).abs().sum()) < 5e-4  # in total variation, of mass 1
    assert float((ours * C).sum()) == pytest.approx(float((P * C).sum()), rel=1e-4)


def test_float32_potentials_far_from_zero_converge_without_stalling():
    """Clouds a diameter apart: potentials of size 2 at eps 1e-4, where float32 rounding of
    the potentials (u |f| / eps = 2.4e-3) stalled the loop above tol; the final iterations
    keep them in float64."""
    x = noisy_sphere(800, seed=1, dtype=torch.float32)
    y = noisy_sphere(800, center=(2.0, 0.0, 0.0), seed=2, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", otreg.ConvergenceWarning)
        res = otreg.sinkhorn(x, y, blur=0.01, multiscale=True, tol=1e-4, max_iter=3000)
    assert res.converged and res.marginal_error < 1e-4


def _annealed_kernel():
    """Two spheres' problem at blur 0.02, its kernel at the final eps after the annealing,
    and the annealing's g: ``(problem, kernel, g)``."""
    x = noisy_sphere(400, seed=1, dtype=torch.float32)
    y = noisy_sphere(450, radius=0.8, center=(0.5, 0.0, 0.0), seed=2, dtype=torch.float32)
    p = Problem.build("t", x, y, None, None, SinkhornOptions(blur=0.02, multiscale=True))
    kernel = make_kernel(p, p.x, p.a, p.y, p.b)
    f, g, _ = _anneal(p, kernel, None)
    kernel.refresh(f, g, p.eps)
    return p, kernel, g


def test_the_pair_list_falls_back_to_the_cell_pairs_when_the_potentials_move():
    """Potentials moved past the list's margin: the softmin is the cell pattern's (and the
    list is rebuilt from it); within the margin it is the list's, equal to it."""
    p, kernel, g = _annealed_kernel()
    first = kernel.softmin_xy(p.eps, g.double())  # on the cells, then a list is built
    assert kernel.list_builds == 1 and len(kernel.list_pairs) == 1
    blocks = kernel._block_softmin(p.eps, g[0], transpose=False).double()
    torch.testing.assert_close(first[0], blocks)
    nudge = 0.5 * multiscale.LIST_MARGIN * p.eps  # within the margin: the list's sums
    listed = kernel.softmin_xy(p.eps, g.double() + nudge)
    assert kernel.list_builds == 1
    torch.testing.assert_close(listed[0], blocks - nudge, rtol=0, atol=1e-3 * p.eps)
    moved = g.double() + 3 * multiscale.LIST_MARGIN * p.eps * (torch.arange(450) % 2)
    out = kernel.softmin_xy(p.eps, moved)  # past it: the cells' sums, and a new list
    assert kernel.list_builds == 2
    again = kernel._block_softmin(p.eps, moved[0], transpose=False).double()
    torch.testing.assert_close(out[0], again)


def test_a_list_that_no_longer_holds_is_made_again_from_its_own_softmin():
    """Potentials moved past the list's margin: the new list is searched at the old list's
    softmin (no softmin over the cell pattern), and the softmin over it equals the
    pattern's."""
    p, kernel, g = _annealed_kernel()
    kernel.softmin_xy(p.eps, g.double())
    summed_blocks = []
    blocks = kernel._block_softmin
    kernel._block_softmin = lambda *args: summed_blocks.append(1) or blocks(*args)
    moved = g.double().clone()
    moved[0, :40] += 1.5 * multiscale.LIST_MARGIN * p.eps  # (the first cells of y)
    out = kernel.softmin_xy(p.eps, moved)
    assert kernel.list_builds == 2 and not summed_blocks
    torch.testing.assert_close(out[0], blocks(p.eps, moved[0], False).double())
    f = out[0]
    out = kernel.softmin_yx(p.eps, f[None])  # the other way
    torch.testing.assert_close(out[0], blocks(p.eps, f, True).double())


def test_a_move_the_list_accepts_leaves_every_dropped_pair_below_the_truncation():
    """f rising in one cell of x and g in one cell of y, each by 3/4 of the margin, where no
    cell pair of the pattern joins them: the list stays (a global bound, the largest rise
    of f plus that of g, would have rebuilt it), and every pattern pair the list dropped
    still has a slack C - f - g above ``truncate`` eps (brute force)."""
    p, kernel, g = _annealed_kernel()
    kernel.softmin_xy(p.eps, g.double())  # on the cells; the list is built
    listed = kernel._list
    margin = kernel.list_margin * p.eps
    cx, cy = kernel.cx, kernel.cy
    I, J = kernel.kernels.pairs
    joined = set(zip(I.tolist(), J.tolist()))
    apart = next((a, b) for a in range(cx.n_clusters) for b in range(cy.n_clusters)
                 if (a, b) not in joined)  # fmt: skip
    df = 0.75 * margin * (cx.labels == apart[0]).double()
    dg = 0.75 * margin * (cy.labels == apart[1]).double()
    assert float(df.max() + dg.max()) > margin
    assert kernel._within(df, dg)
    xs, ys = cx.points.double(), cy.points.double()
    f1, g1 = listed.f0 + df, listed.g0 + dg
    starts_x, starts_y = kernel.cx.starts.tolist(), kernel.cy.starts.tolist()
    kept = set(zip(*(t.tolist() for t in _pair_indices(listed))))
    for ci, cj in joined:
        i = torch.arange(starts_x[ci], starts_x[ci + 1])
        j = torch.arange(starts_y[cj], starts_y[cj + 1])
        C = ((xs[i][:, None] - ys[j][None]) ** 2).sum(-1) / 2
        slack = C - f1[i][:, None] - g1[j][None]
        for a, b in (slack <= p.eps * kernel.truncate).nonzero().tolist():
            assert (int(i[a]), int(j[b])) in kept
    # a rise in cells the pattern joins, by more than the margin: rebuilt
    near = int(J[I == apart[0]][0])
    assert not kernel._within(df, 0.75 * margin * (cy.labels == near).double())


def test_a_point_that_rises_past_the_margin_keeps_the_list_while_its_dropped_pairs_are_far():
    """One point of x whose potential rises by more than the list's margin (an outlier):
    the list stays while each pair it dropped keeps a slack above ``truncate`` eps (its
    own smallest dropped slack, brute force), and is made again once one comes within."""
    p, kernel, g = _annealed_kernel()
    kernel.softmin_xy(p.eps, g.double())  # on the cells; the list is built
    listed, eps, truncate = kernel._list, p.eps, kernel.truncate
    xs, ys = kernel.cx.points.double(), kernel.cy.points.double()
    cost = ((xs[:, None] - ys[None]) ** 2).sum(-1) / 2
    kept = torch.zeros_like(cost, dtype=torch.bool)
    kept[_pair_indices(listed)] = True
    cells = kernel.cx.labels[:, None] * kernel.cy.n_clusters + kernel.cy.labels[None]
    I, J = kernel.kernels.pairs
    in_pattern = torch.isin(cells, I * kernel.cy.n_clusters + J)
    slack0 = cost - listed.f0[:, None] - listed.g0[None]
    dropped = slack0.masked_fill(kept | ~in_pattern, torch.inf).amin(1)
    assert bool((dropped >= (truncate + kernel.list_margin) * eps - 1e-6).all())
    far = int(dropped.masked_fill(torch.isinf(dropped), 0).argmax())
    room = float(dropped[far]) - truncate * eps  # how far the point may rise
    assert room > 2 * kernel.list_margin * eps
    for rise, keeps in ((room - eps, True), (room + eps, False)):
        df = torch.zeros_like(listed.f0)
        df[far] = rise
        assert kernel._within(df, torch.zeros_like(listed.g0)) is keeps
        worst = (slack0[far] - rise).masked_fill(kept[far] | ~in_pattern[far], torch.inf)
        assert (float(worst.min()) > truncate * eps) is keeps  # brute force agrees


def test_a_pair_list_softmin_stays_finite_when_one_point_rises_far():
    """One column's potential up by 110 eps: the rows without it keep finite sums equal to
    brute force (a shift by the largest rise alone pushed their float32 terms to 0)."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.rand(50, 3, generator=gen), torch.rand(60, 3, generator=gen)
    keep = torch.rand(50, 60, generator=gen) < 0.2
    keep[torch.arange(50), torch.arange(50)] = True
    keep[:, 0] = False
    keep[0, 0] = True  # column 0 in row 0 only
    i, j = keep.nonzero(as_tuple=True)
    eps = 0.01
    log_a, log_b = torch.full((50,), -math.log(50)), torch.full((60,), -math.log(60))
    xd, yd = x.double(), y.double()
    g0 = torch.zeros(60, dtype=torch.float64)
    # f0 the rows' softmin: every row's top term near 1
    f0 = _brute_softmin(xd, yd, log_b.double(), g0, eps, keep)
    pairs = PairList(x, y, i, j, log_a, log_b, f0, g0, eps)
    g = g0.clone()
    g[0] += 110 * eps
    rows = _brute_softmin(xd, yd, log_b.double(), g, eps, keep)
    got = pairs.softmin_rows(g)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, rows, rtol=0, atol=1e-5 * eps)


def _pair_indices(listed):
    """The (i, j) pairs of a PairList, from its rows' sparse matrix."""
    side = listed._rows
    return torch.repeat_interleave(side.points, side.counts), side.factors.col_indices()


def test_a_pair_list_that_would_not_pay_is_not_used(monkeypatch):
    monkeypatch.setattr(multiscale, "LIST_FRACTION", 1e-6)
    x = noisy_sphere(400, seed=1, dtype=torch.float32)
    y = noisy_sphere(450, radius=0.8, center=(0.5, 0.0, 0.0), seed=2, dtype=torch.float32)
    options = SinkhornOptions(blur=0.02, tol=1e-3, max_iter=5000, multiscale=True)
    p = Problem.build("t", x, y, None, None, options)
    sol = solve(p, p.x, p.a, p.y, p.b)
    # tried at 40 eps; the list found so far would not fit at 20 or 10 eps either
    assert sol.rule.converged and sol.kernel.list_builds == 1
    assert not sol.kernel.list_pairs and sol.kernel.list_margin == multiscale.LIST_MIN_MARGIN


def test_a_pair_list_over_the_limit_is_made_again_at_half_the_margin(monkeypatch):
    """At 40 eps the first list holds about 3,030 pairs, at 20 eps about 2,100: with a
    limit of 3,000 the lists are made at 20 eps, and the solve ends where the default's
    does."""
    x = noisy_sphere(400, seed=1, dtype=torch.float32)
    y = noisy_sphere(450, radius=0.8, center=(0.5, 0.0, 0.0), seed=2, dtype=torch.float32)
    options = SinkhornOptions(blur=0.02, tol=1e-4, max_iter=5000, multiscale=True)
    p = Problem.build("t", x, y, None, None, options)
    free = solve(p, p.x, p.a, p.y, p.b)
    assert free.kernel.list_margin == multiscale.LIST_MARGIN == 40
    assert free.kernel.list_pairs[0] > 3000
    monkeypatch.setattr(multiscale, "LIST_MAX_PAIRS", 3000)
    sol = solve(p, p.x, p.a, p.y, p.b)
    assert sol.rule.converged and sol.kernel.list_margin == 20
    assert sol.kernel.list_pairs and max(sol.kernel.list_pairs) <= 3000
    assert float(sol.f.mean() + sol.g.mean()) == pytest.approx(
        float(free.f.mean() + free.g.mean()), abs=1e-3 * p.eps
    )  # the dual value (uniform weights)


def test_stored_factors_equal_brute_force_over_the_pattern_both_ways():
    """The pattern's factors, stored for reference potentials (f0 the exact softmin of g0),
    give each softmin over the pattern's pairs for potentials moved within the spread, and
    refuse moves past it."""
    x, y = spheres(300, dtype=torch.float32)
    cx = grid_clusters(x, torch.ones(300), 0.4)
    cy = grid_clusters(y, torch.ones(y.shape[0]), 0.4)
    I, J = all_pairs(cx, cy)
    half = (I + J) % 2 == 0  # every row and every column cluster keeps pairs
    kernel = BlockSparse(cx, cy, I[half], J[half], block_elements=5000)
    keep = torch.zeros(cx.n_clusters, cy.n_clusters, dtype=torch.bool)
    keep[I[half], J[half]] = True
    keep = keep[cx.labels][:, cy.labels]
    gen = torch.Generator().manual_seed(2)
    eps, m = 0.01, y.shape[0]
    log_a, log_b = torch.full((300,), -math.log(300)), torch.full((m,), -math.log(m))
    xd, yd = cx.points.double(), cy.points.double()
    g0 = torch.zeros(m, dtype=torch.float64)
    for _ in range(20):  # near both marginals, as in a solve
        f0 = _brute_softmin(xd, yd, log_b.double(), g0, eps, keep)
        g0 = _brute_softmin(yd, xd, log_a.double(), f0, eps, keep.T)
    f0 = _brute_softmin(xd, yd, log_b.double(), g0, eps, keep)
    factors = BlockFactors(kernel, cx.points, cy.points, log_a, log_b, f0, g0, eps, spread=30)
    assert factors.trusted and factors.n_elements >= int(keep.sum())
    far = g0 + torch.randn(m, generator=gen, dtype=torch.float64) * 0.3  # 30 eps
    assert not BlockFactors(kernel, cx.points, cy.points, log_a, log_b, f0, far, eps, 30).trusted
    f = f0 + torch.randn(300, generator=gen, dtype=torch.float64) * 0.03
    g = g0 + torch.randn(m, generator=gen, dtype=torch.float64) * 0.03
    rows = _brute_softmin(xd, yd, log_b.double(), g, eps, keep)
    cols = _brute_softmin(yd, xd, log_a.double(), f, eps, keep.T)
    got_rows, got_cols = factors.softmin_rows(g), factors.softmin_cols(f)
    assert got_rows.dtype == got_cols.dtype == torch.float64
    # float32 factors and sums: their rounding, times eps
    torch.testing.assert_close(got_rows, rows, rtol=0, atol=1e-5 * eps)
    torch.testing.assert_close(got_cols, cols, rtol=0, atol=1e-5 * eps)
    assert factors.holds((f - f0).clamp(-0.1, 0.1) + 5.0, (g - g0).clamp(-0.1, 0.1) - 5.0)
    assert not factors.holds(f - f0, (g - g0).index_fill(0, torch.tensor([3]), 0.31))
    assert not factors.holds(f - f0, (g - g0).index_fill(0, torch.tensor([3]), math.nan))


def test_the_stored_factors_are_made_again_when_the_potentials_move_past_their_spread():
    """Where no pair list pays, the final eps's softmin is the cell pattern's, whose factors
    are then stored; within the spread the factors' sums equal the pattern's, past it the
    pattern's softmin runs again and new factors are made; a new pattern drops them."""
    p, kernel, g = _annealed_kernel()
    kernel._list, kernel._list_pays = None, False  # as once a list would not pay
    first = kernel.softmin_xy(p.eps, g.double())
    assert kernel.factor_builds == 1 and isinstance(kernel._list, BlockFactors)
    blocks = kernel._block_softmin(p.eps, g[0], transpose=False).double()
    torch.testing.assert_close(first[0], blocks)
    nudge = 0.5 * multiscale.FACTOR_SPREAD * p.eps * (torch.arange(450) % 2)
    stored = kernel.softmin_xy(p.eps, g.double() + nudge)
    assert kernel.factor_builds == 1
    # the pattern's float32 sums round the potentials (of size 1) at 1e-7 / eps
    direct = kernel._block_softmin(p.eps, (g.double() + nudge)[0], transpose=False).double()
    torch.testing.assert_close(stored[0], direct, rtol=0, atol=0.02 * p.eps)
    moved = g.double() + 2 * multiscale.FACTOR_SPREAD * p.eps * (torch.arange(450) % 2)
    out = kernel.softmin_xy(p.eps, moved)
    assert kernel.factor_builds == 2
    torch.testing.assert_close(
        out[0], kernel._block_softmin(p.eps, moved[0], transpose=False).double()
    )
    f = out.to(g.dtype)
    kernel.refresh(f, moved.to(g.dtype), p.eps, full=True)
    assert kernel._list is None


@pytest.mark.parametrize("stored", [True, False])
def test_solve_on_stored_factors_equals_the_dense_solve(monkeypatch, stored):
    """No pair list allowed: the final iterations sum the pattern's stored factors (or, where
    they would not fit, the pattern's softmins) and end at the plan of the dense float64
    solver iterated to 1e-12."""
    monkeypatch.setattr(multiscale, "LIST_FRACTION", 1e-6)
    if not stored:
        monkeypatch.setattr(multiscale, "FACTOR_MAX_BYTES", 0)
    x = noisy_sphere(400, seed=1, dtype=torch.float32)
    y = noisy_sphere(450, radius=0.8, center=(0.5, 0.0, 0.0), seed=2, dtype=torch.float32)
    options = SinkhornOptions(blur=0.05, tol=1e-5, max_iter=5000, multiscale=True)
    p = Problem.build("t", x, y, None, None, options)
    sol = solve(p, p.x, p.a, p.y, p.b)
    assert sol.rule.converged and not sol.kernel.list_pairs
    assert (sol.kernel.factor_builds > 0) == stored
    _assert_the_dense_plan(x, y, 0.05, sol)


def test_unbalanced_transport_on_stored_factors_equals_the_dense_solve(monkeypatch):
    """Unbalanced transport (reach 0.3) with no pair list: the final iterations sum the
    stored factors where their columns' totals are trusted (else the pattern's softmins),
    and end at the dense solver's potentials."""
    monkeypatch.setattr(multiscale, "LIST_FRACTION", 1e-6)
    x = noisy_sphere(400, seed=1, dtype=torch.float32)
    y = noisy_sphere(450, radius=0.8, center=(0.5, 0.0, 0.0), seed=2, dtype=torch.float32)
    options = SinkhornOptions(blur=0.05, reach=0.3, tol=1e-5, max_iter=5000, multiscale=True)
    p = Problem.build("t", x, y, None, None, options)
    sol = solve(p, p.x, p.a, p.y, p.b)
    assert sol.rule.converged and sol.kernel.factor_builds > 0
    exact = otreg.sinkhorn(
        x.double(), y.double(), blur=0.05, reach=0.3, tol=1e-12, max_iter=20_000, multiscale=False
    )
    torch.testing.assert_close(sol.f[0].double(), exact.f.double(), rtol=0, atol=1e-3 * p.eps)
    torch.testing.assert_close(sol.g[0].double(), exact.g.double(), rtol=0, atol=1e-3 * p.eps)


def test_untrusted_factors_leave_the_final_iterations_to_the_cell_pattern():
    """Factors whose columns' totals are off (potentials far from the columns' marginals)
    are not used, and no more are made: the softmins are the pattern's."""
    p, kernel, g = _annealed_kernel()
    kernel._list, kernel._list_pays = None, False
    far = g.double() + 40 * p.eps * (torch.arange(450) % 2)  # half the columns' totals e^-40
    f = kernel._block_softmin(p.eps, far[0], transpose=False).double()
    kernel._store_factors(f, far[0])
    assert kernel.factor_builds == 1 and kernel._list is None and not kernel._factors_pay
    out = kernel.softmin_xy(p.eps, far)
    torch.testing.assert_close(out[0], f)
    assert kernel.factor_builds == 1 and kernel._list is None


def test_stored_factors_keep_float64_accuracy_where_the_potentials_dwarf_eps():
    """Clouds 1.5 apart at eps 2.5e-4: potentials about 6,000 eps, where float32 scores
    round at 1e-3 eps (the pattern's own softmin); the factors' scores are float64 (as a
    pair list's), their softmin within 1e-5 eps of brute force."""
    x = noisy_sphere(300, seed=1, dtype=torch.float32)
    y = noisy_sphere(320, radius=0.8, center=(1.5, 0.0, 0.0), seed=2, dtype=torch.float32)
    cx, cy = grid_clusters(x, torch.ones(300), 0.4), grid_clusters(y, torch.ones(320), 0.4)
    kernel = BlockSparse(cx, cy, *all_pairs(cx, cy), block_elements=5000)
    keep = torch.ones(300, 320, dtype=torch.bool)
    eps = 2.5e-4
    log_a, log_b = torch.full((300,), -math.log(300)), torch.full((320,), -math.log(320))
    xd, yd = cx.points.double(), cy.points.double()
    g0 = torch.zeros(320, dtype=torch.float64)
    for _ in range(30):
        f0 = _brute_softmin(xd, yd, log_b.double(), g0, eps, keep)
        g0 = _brute_softmin(yd, xd, log_a.double(), f0, eps, keep.T)
    f0 = _brute_softmin(xd, yd, log_b.double(), g0, eps, keep)
    assert float(f0.abs().max()) > 1000 * eps
    factors = BlockFactors(kernel, cx.points, cy.points, log_a, log_b, f0, g0, eps, spread=30)
    assert factors.trusted
    g = g0 + eps * torch.randn(320, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    want = _brute_softmin(xd, yd, log_b.double(), g, eps, keep)
    torch.testing.assert_close(factors.softmin_rows(g), want, rtol=0, atol=1e-5 * eps)


def test_the_weights_gradient_of_a_finished_multiscale_solve_equals_the_dense_one(monkeypatch):
    """Weights requiring gradients on a multiscale solve between two clouds (the column
    softmin after the solve, whose reverse kernel the finished solve let go): the dense
    solver's gradients, and nothing kept for later softmins."""
    monkeypatch.setattr(multiscale, "LIST_FRACTION", 1e-6)  # the factors' path
    made = []
    monkeypatch.setattr(multiscale.TruncatedKernel, "finish", _recording(made))
    x = noisy_sphere(300, seed=1, dtype=torch.float64)
    y = noisy_sphere(320, radius=0.8, center=(0.5, 0.0, 0.0), seed=2, dtype=torch.float64)
    grads = []
    for ms in (True, False):
        a = torch.full((300,), 1 / 300, dtype=torch.float64, requires_grad=True)
        b = torch.full((320,), 1 / 320, dtype=torch.float64, requires_grad=True)
        res = otreg.sinkhorn(x, y, a, b, blur=0.05, tol=1e-9, max_iter=5000, multiscale=ms)
        grads.append(torch.autograd.grad(res.cost, (a, b)))
    assert made and all(k._list is None for k in made)
    shift = grads[0][0].mean() - grads[1][0].mean()  # potentials: up to (f + c, g - c)
    torch.testing.assert_close(grads[0][0] - shift, grads[1][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[0][1] + shift, grads[1][1], rtol=0, atol=1e-6)


def _recording(made):
    finish = multiscale.TruncatedKernel.finish

    def recorded(self, *args):
        made.append(self)
        return finish(self, *args)

    return recorded


@pytest.mark.parametrize("seed", range(4))
def test_gaussian_clouds_converge_to_the_solution_of_every_pair(seed):
    """Heavy-tailed clouds (2-D Gaussians, N = 300, blur 0.05): the pattern refreshed among
    its own pairs only lost pairs that the moving potentials brought back within reach,
    and the loop stalled on a wrong fixed point (costs 1.5 to 10 times too large, after
    2,000 updates). It now searches every cluster pair at the final eps now and then."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 2, generator=g, dtype=torch.float64)
    y = torch.randn(300, 2, generator=g, dtype=torch.float64) + 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error", otreg.ConvergenceWarning)
        res = otreg.sinkhorn(x, y, blur=0.05, multiscale=True, tol=1e-6)
    dense = otreg.sinkhorn(x, y, blur=0.05, multiscale=False, tol=1e-6)
    assert float(res.cost) == pytest.approx(float(dense.cost), rel=1e-7)
    # a pattern that gained pairs is a new map: the mixing starts again instead of
    # counting the jump as its failure (seed 3 then fell back to over-relaxation and
    # stalled at 5e-5 for 1,600 updates)
    assert res.acceleration == "anderson"


@pytest.mark.parametrize("offset", [-2.0, 0.0, 2.0])
def test_the_check_for_close_pairs_in_cell_pairs_equals_brute_force(offset):
    """Whether cell pairs hold a point pair within ``truncate + VERIFY_MARGIN`` eps
    (the search at the final eps acts only then), against every pair of every cell pair."""
    p, kernel, g = _annealed_kernel()
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(1, len(kernel.cx.points), generator=gen, dtype=torch.float64) * p.eps
    g = torch.randn(1, len(kernel.cy.points), generator=gen, dtype=torch.float64) * p.eps
    xs, ys = kernel.cx.points.double(), kernel.cy.points.double()
    C = ((xs[:, None] - ys[None]) ** 2).sum(-1) / 2
    slack = C - f[0][:, None] - g[0][None]
    threshold = (kernel.truncate + multiscale.VERIFY_MARGIN) * p.eps
    Kx, Ky = kernel.cx.n_clusters, kernel.cy.n_clusters
    I, J = (t.flatten() for t in torch.meshgrid(torch.arange(Kx), torch.arange(Ky), indexing="ij"))
    lx, ly = kernel.cx.labels, kernel.cy.labels
    least = torch.full((Kx, Ky), math.inf, dtype=torch.float64)
    for a in range(Kx):  # the least slack of each cell pair
        least[a] = torch.full((Ky,), math.inf, dtype=torch.float64).scatter_reduce(
            0, ly, slack[lx == a].min(0).values, "amin"
        )
    shift = offset * p.eps  # moves every slack across the threshold's neighbourhood
    near = least.flatten() - shift <= threshold
    assert 0 < int(near.sum()) < len(near)
    for pick in (near.nonzero()[:5, 0], (~near).nonzero()[:50, 0]):
        expected = bool(near[pick].any())
        assert kernel._hold_close_pairs(f + shift / 2, g + shift / 2, I[pick], J[pick]) is expected


def test_a_coarse_problem_in_one_cell_is_not_clustered_again():
    """20 and 25 points in 5-D: every cluster centroid in one cell of the coarse problem's
    own grid (a scale of 0) raised 'Multiscale: cluster_scale is 0.0', an option the
    caller never gave."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(20, 5, generator=g), torch.rand(25, 5, generator=g)
    value = otreg.sinkhorn_divergence(x, y, multiscale=True)
    assert float(value) == pytest.approx(float(otreg.sinkhorn_divergence(x, y)), rel=1e-4)


def test_float32_at_a_blur_below_its_costs_rounding_stops_diverged_at_once():
    """2,000 Gaussian points at blur 1e-4 (eps 1e-8, costs up to about 20 rounded by about
    1e-6 in float32): the truncated kernel's marginal errors (1e34 to 1e83, finite in
    float64) used to run all 2,000 iterations (93 s) and advise raising max_iter."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 3, generator=g)
    y = torch.randn(2000, 3, generator=g) * 0.5 + 1
    with pytest.warns(otreg.ConvergenceWarning, match="use float64 points or a larger blur"):
        res = otreg.sinkhorn(x, y, blur=1e-4, multiscale=True)
    assert res.backend == "multiscale" and res.stopped == "diverged" and res.n_iter < 100
