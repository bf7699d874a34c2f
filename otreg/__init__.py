"""otreg: optimal transport and diffeomorphic registration on PyTorch, within a memory budget.

The public API is what this module exports; everything else is private.
"""

from . import datasets, loops, registration
from ._checks import ConvergenceWarning, FoldWarning
from ._info import info, package_version
from .io import load_shape, save_shape
from .ot import (
    Accuracy,
    Implicit,
    Multiscale,
    SinkhornLoss,
    SinkhornOptions,
    SinkhornResult,
    TransportPlan,
    Unroll,
    sinkhorn,
    sinkhorn_divergence,
)
from .reductions import KeOpsUnavailable
from .registration import (
    LBFGSOptions,
    LDDMMOptions,
    Level,
    PrealignOptions,
    RefineOptions,
    Registration,
    register,
)
from .shapes import Shape

__version__ = package_version("otreg")

__all__ = [
    "__version__",
    "sinkhorn",
    "SinkhornResult",
    "SinkhornOptions",
    "Implicit",
    "Unroll",
    "Multiscale",
    "Accuracy",
    "sinkhorn_divergence",
    "SinkhornLoss",
    "TransportPlan",
    "ConvergenceWarning",
    "FoldWarning",
    "KeOpsUnavailable",
    "info",
    "loops",
    "Shape",
    "load_shape",
    "save_shape",
    "datasets",
    "register",
    "Registration",
    "LDDMMOptions",
    "PrealignOptions",
    "RefineOptions",
    "LBFGSOptions",
    "Level",
    "registration",
]
