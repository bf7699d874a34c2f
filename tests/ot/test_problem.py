"""The Sinkhorn option objects: defaults written once, impossible combinations refused."""

import dataclasses
import inspect
import warnings

import pytest
import torch

import otreg
from otreg import Implicit, Multiscale, SinkhornOptions, Unroll
from tests.conftest import clouds


def test_the_signatures_defaults_are_the_options_defaults():
    signature = inspect.signature(otreg.sinkhorn).parameters
    for f in dataclasses.fields(SinkhornOptions):
        default = signature[f.name].default  # shown as the value, told apart from it
        assert default.value == f.default and repr(default) == repr(f.default), f.name
    assert otreg.SinkhornLoss().options == SinkhornOptions()


def test_sinkhorn_takes_options_as_the_divergence_does():
    """sinkhorn(options=...) was a TypeError while sinkhorn_divergence and SinkhornLoss
    took it; a keyword given replaces the option's."""
    x, y, _, _ = clouds(n=30, m=40, d=2, seed=0)
    options = SinkhornOptions(blur=0.2, tol=1e-8)
    res = otreg.sinkhorn(x, y, options=options)
    same = otreg.sinkhorn(x, y, blur=0.2, tol=1e-8)
    assert torch.equal(res.f, same.f) and res.marginal_error < 1e-8
    other = otreg.sinkhorn(x, y, options=options, blur=0.3)
    assert torch.equal(other.f, otreg.sinkhorn(x, y, blur=0.3, tol=1e-8).f)
    with pytest.raises(TypeError, match="options must be an otreg.SinkhornOptions"):
        otreg.sinkhorn(x, y, options={"blur": 0.2})


def test_a_keyword_given_replaces_options_even_at_its_default_value():
    """sinkhorn once dropped a keyword equal to its default (blur=0.05, reach=None) next
    to options= while sinkhorn_divergence and SinkhornLoss kept it; SinkhornLoss could not
    make unbalanced options balanced."""
    x, y, _, _ = clouds(n=30, m=40, d=2, seed=0)
    options = SinkhornOptions(blur=0.2, reach=1.0)
    assert otreg.sinkhorn(x, y, options=options, blur=0.05).options.blur == 0.05
    assert otreg.sinkhorn(x, y, options=options, reach=None).options.reach is None
    assert otreg.sinkhorn(x, y, options=options).options == options  # keywords left out
    assert otreg.SinkhornLoss(options=options, reach=None).options.reach is None
    assert otreg.SinkhornLoss(options=options).options == options
    value = otreg.sinkhorn_divergence(x, y, options=options, blur=0.05, reach=None)
    assert torch.equal(value, otreg.sinkhorn_divergence(x, y, blur=0.05))


def test_options_are_frozen_and_replace_checks_names_and_values():
    o = SinkhornOptions(blur=0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.blur = 0.2
    assert o.replace(tol=1e-6) == SinkhornOptions(blur=0.1, tol=1e-6)
    with pytest.raises(TypeError, match="unknown option.*bleur"):
        o.replace(bleur=1.0)
    with pytest.raises(ValueError, match="SinkhornOptions: blur is -1"):
        o.replace(blur=-1)
    assert dataclasses.asdict(o)["blur"] == 0.1


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(blur=0), ValueError, "SinkhornOptions: blur is 0"),
        (dict(scaling=1.0), ValueError, "scaling is 1.0"),
        (dict(cost="cosine"), ValueError, "cost is 'cosine'"),
        (dict(form="linear"), ValueError, "form is 'linear'"),
        (dict(backend="cuda"), ValueError, "backend is 'cuda'"),
        (dict(max_iter=0), ValueError, "max_iter is 0"),
        (dict(relaxation=2.0), ValueError, "relaxation is 2.0"),
        (dict(backward="adjoint"), ValueError, "backward is 'adjoint'"),
        (dict(multiscale="yes"), ValueError, "multiscale is 'yes'"),
        # impossible combinations cannot be written
        (
            dict(multiscale=Multiscale(), backward=Unroll()),
            ValueError,
            "multiscale=Multiscale.*backward is 'unroll'",
        ),
        (dict(multiscale=True, cost="euclidean"), ValueError, "multiscale=True but the cost"),
    ],
)
def test_bad_options_raise_naming_them(options, error, match):
    with pytest.raises(error, match=match):
        SinkhornOptions(**options)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Implicit(tol=0), "Implicit: tol is 0"),
        (lambda: Implicit(max_iter=0), "Implicit: max_iter is 0"),
        (lambda: Unroll(strategy="remember"), "Unroll: strategy is 'remember'"),
        (lambda: Unroll(memory="lots"), "Unroll: memory is 'lots'"),
        (
            lambda: Unroll(strategy="reversible"),
            "Unroll: strategy is .reversible.; choose one of .store., .checkpoint., .offload.$",
        ),
    ],
)
def test_bad_strategy_settings_raise_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_errors_name_the_function_called():
    x, y, _, _ = clouds()
    with pytest.raises(ValueError, match="^sinkhorn: blur is -1"):
        otreg.sinkhorn(x, y, blur=-1)
    with pytest.raises(ValueError, match="^sinkhorn_divergence: tol is -1"):
        otreg.sinkhorn_divergence(x, y, tol=-1)
    with pytest.raises(TypeError, match="^SinkhornLoss: options must be an otreg.Sinkhorn"):
        otreg.SinkhornLoss(options={"blur": 1})


def test_option_objects_give_the_same_results_as_keywords():
    x, y, a, b = clouds()
    o = SinkhornOptions(blur=0.2, tol=1e-9, max_iter=5000)
    d1 = otreg.sinkhorn_divergence(x, y, a, b, options=o)
    d2 = otreg.sinkhorn_divergence(x, y, a, b, blur=0.2, tol=1e-9, max_iter=5000)
    d3 = otreg.SinkhornLoss(options=o.replace(blur=1.0), blur=0.2)(a, x, b, y)
    assert torch.equal(d1, d2) and torch.equal(d1, d3)
    res = otreg.sinkhorn(x, y, a, b, blur=0.2, tol=1e-9, max_iter=5000)
    assert res.options == o


def test_implicit_and_unroll_objects_match_their_strings():
    x, y, a, b = clouds(12, 15)
    x = x.requires_grad_()
    grads = []
    for backward in ("implicit", Implicit(tol=1e-12), Unroll("checkpoint", memory="1MB")):
        res = otreg.sinkhorn(x, y, a, b, blur=0.3, tol=1e-10, backward=backward)
        grads.append(torch.autograd.grad(res.f.sum(), x)[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grads[2], grads[0], rtol=1e-4, atol=1e-6)


def test_removed_keywords_are_unknown():
    """No deprecated spelling remains: the unrolled loop's and the multiscale solver's
    settings exist only inside Unroll and Multiscale."""
    x, y, _, _ = clouds()
    for keyword in ("strategy", "memory", "truncate", "cluster_scale"):
        with pytest.raises(TypeError, match=keyword):
            otreg.sinkhorn(x, y, **{keyword: None})
        with pytest.raises(TypeError, match=f"unknown option\\(s\\) {keyword}"):
            otreg.sinkhorn_divergence(x, y, **{keyword: None})


def test_sinkhorn_flags_the_default_blur_on_data_in_mm_as_the_divergence_does():
    x, y, _, _ = clouds(n=30, m=40, d=3, seed=0)
    with pytest.warns(UserWarning, match="sinkhorn: blur is the default 0.05"):
        otreg.sinkhorn(100 * x, 100 * y, max_iter=5000)
    with warnings.catch_warnings(record=True) as caught:  # a blur the caller chose
        warnings.simplefilter("always")
        otreg.sinkhorn(100 * x, 100 * y, blur=2.0)
        otreg.sinkhorn(100 * x, 100 * y, blur=0.05, max_iter=50)  # even the default's value
        otreg.sinkhorn(100 * x, 100 * y, options=otreg.SinkhornOptions(blur=2.0))
    assert not [w for w in caught if "blur is the default" in str(w.message)]
