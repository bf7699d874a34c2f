"""Registration of surfaces: pre-alignment, LDDMM, data terms, metrics."""

from . import metrics
from .lddmm import LDDMM, ComposedLDDMM
from .linear import Affine, Rigid, Similarity
from .losses import (
    LOSSES,
    SINKHORN_TERM,
    Loss,
    make_loss,
    varifold_distance,
)
from .options import (
    MODELS,
    PREALIGNS,
    LBFGSOptions,
    LDDMMOptions,
    Level,
    PrealignOptions,
    RefineOptions,
)
from .prealign import prealign
from .register import register
from .result import Registration

__all__ = [
    "register",
    "Registration",
    "prealign",
    "LDDMMOptions",
    "RefineOptions",
    "PrealignOptions",
    "LBFGSOptions",
    "Level",
    "LDDMM",
    "ComposedLDDMM",
    "Rigid",
    "Similarity",
    "Affine",
    "Loss",
    "make_loss",
    "LOSSES",
    "SINKHORN_TERM",
    "varifold_distance",
    "metrics",
    "MODELS",
    "PREALIGNS",
]
