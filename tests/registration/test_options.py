"""The option objects of otreg.register: defaults, checks, frozen."""

import dataclasses
import inspect

import pytest

import otreg
from otreg.registration import (
    LBFGSOptions,
    LDDMMOptions,
    Level,
    PrealignOptions,
    prealign,
    register,
)
from otreg.registration.options import MODELS, PREALIGNS


def defaults(cls):
    return {f.name: f.default for f in dataclasses.fields(cls)}


def test_documented_defaults():
    assert defaults(LDDMMOptions) == dict(
        sigma=None,  # derived from the target's size (registration.defaults)
        control_points=None,
        n_steps=6,
        integrator="leapfrog",
        regularization=1e-4,
        strategy=None,  # "store", or "checkpoint" when a memory budget is given
        memory=None,
    )
    assert LDDMMOptions().strategy == "store"
    assert LDDMMOptions(memory="1GB").strategy == "checkpoint"
    assert defaults(PrealignOptions) == dict(
        kind="rigid", n_iter=8, blur=None, max_points=500, closest_point_iter=100
    )
    assert defaults(LBFGSOptions) == dict(max_iter=15, tol=1e-5, history_size=20, precondition=True)
    assert MODELS == ("lddmm", "rigid", "similarity", "affine")
    assert PREALIGNS == ("rigid", "similarity", "affine", "none")
    assert otreg.LDDMMOptions is LDDMMOptions and otreg.Level is Level


def test_prealign_defaults_are_the_options_objects():
    p = inspect.signature(prealign).parameters
    assert p["kind"].default == PrealignOptions().kind


@pytest.mark.parametrize(
    "cls, kwargs, error, match",
    [
        (LDDMMOptions, dict(sigma=-1), ValueError, "LDDMMOptions: sigma is -1"),
        (LDDMMOptions, dict(sigma=()), ValueError, "LDDMMOptions: sigma is empty"),
        (LDDMMOptions, dict(sigma="wide"), TypeError, "LDDMMOptions: sigma must be a number"),
        (LDDMMOptions, dict(control_points=2), ValueError, "LDDMMOptions: control_points is 2"),
        (LDDMMOptions, dict(control_points=10.5), TypeError, "control_points must be an integer"),
        (LDDMMOptions, dict(n_steps=0), ValueError, "LDDMMOptions: n_steps is 0"),
        (LDDMMOptions, dict(integrator="verlet"), ValueError, "integrator is 'verlet'"),
        (LDDMMOptions, dict(regularization=-1e-3), ValueError, "regularization is -0.001"),
        (LDDMMOptions, dict(strategy="magic"), ValueError, "LDDMMOptions: strategy is 'magic'"),
        (LDDMMOptions, dict(memory="lots"), ValueError, "LDDMMOptions"),
        (PrealignOptions, dict(kind="bspline"), ValueError, "PrealignOptions: kind is 'bspline'"),
        (PrealignOptions, dict(n_iter=0), ValueError, "PrealignOptions: n_iter is 0"),
        (PrealignOptions, dict(blur=(10.0, -1.0)), ValueError, "PrealignOptions: blur is -1.0"),
        (PrealignOptions, dict(blur=3.0), TypeError, "PrealignOptions: blur must be None or"),
        (PrealignOptions, dict(max_points=3), ValueError, "PrealignOptions: max_points is 3"),
        (PrealignOptions, dict(closest_point_iter=-1), ValueError, "closest_point_iter is -1"),
        (PrealignOptions, dict(closest_point_iter=2.5), TypeError, "closest_point_iter must be"),
        (LBFGSOptions, dict(max_iter=0), ValueError, "LBFGSOptions: max_iter is 0"),
        (LBFGSOptions, dict(tol=-1.0), ValueError, "LBFGSOptions: tol is -1.0"),
        (LBFGSOptions, dict(history_size=0), ValueError, "LBFGSOptions: history_size is 0"),
        (LBFGSOptions, dict(precondition="yes"), TypeError, "precondition must be True or"),
        (Level, dict(points=2, scale=1.0), ValueError, "Level: points is 2"),
        (Level, dict(points=100, scale=0), ValueError, "Level: scale is 0"),
        (Level, dict(points=100, scale=1.0, loss="l2"), ValueError, "Level: loss is 'l2'"),
        (Level, dict(points=100, scale=1.0, loss={}), ValueError, "Level: loss is \\{\\}"),
        (
            Level,
            dict(points=100, scale=1.0, loss={"varifold": -1}),
            ValueError,
            "weight of varifold is -1",
        ),
    ],
)
def test_bad_fields_name_the_class_and_field(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(**kwargs)


@pytest.mark.parametrize(
    "obj, name, value",
    [
        (LDDMMOptions(), "sigma", 5.0),
        (PrealignOptions(), "kind", "affine"),
        (LBFGSOptions(), "max_iter", 3),
        (Level(100, 2.0), "scale", 1.0),
    ],
)
def test_frozen(obj, name, value):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, name, value)


def test_normalised_fields():
    assert LDDMMOptions(sigma=10).sigma == 10.0 and isinstance(LDDMMOptions(sigma=10).sigma, float)
    assert LDDMMOptions(sigma=[10, 30]).sigma == (10.0, 30.0)
    assert PrealignOptions(blur=[20, 2]).blur == (20.0, 2.0)
    assert Level(100, 2, "varifold").loss == {"varifold": 1.0}
    assert dataclasses.replace(LDDMMOptions(), n_steps=3).n_steps == 3
    with pytest.raises(ValueError, match="n_steps is 0"):
        dataclasses.replace(LDDMMOptions(), n_steps=0)


def test_register_signature():
    p = inspect.signature(register).parameters
    assert list(p)[:5] == ["source", "target", "model", "prealign", "loss"]
    assert p["optimizer"].default is None and p["sinkhorn"].default is None
    assert p["levels"].default is None and p["varifold_sigma"].default is None  # derived
