"""otreg: optimal transport and diffeomorphic registration on PyTorch, within a memory budget.

The public API is what this module exports; everything else is private.
"""

import os as _os
import sys as _sys

# torch's OpenMP threads (libgomp) spin 300,000 times at each barrier before they sleep:
# beside another busy process, a thread then waits for one that is not running at each of a
# loop's many short parallel regions (a registration took 388 s instead of 27 s on 2 cores
# beside one busy process; 68 s with 10,000 spins, and the same time alone:
# docs/performance.md, "Threads"). Set here, before torch loads libgomp, unless the user
# chose (GOMP_SPINCOUNT or OMP_WAIT_POLICY) or torch is loaded already.
if "torch" not in _sys.modules and not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(_os.environ):
    _os.environ["GOMP_SPINCOUNT"] = "10000"
del _os, _sys

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
