"""Entropic optimal transport: the Sinkhorn solver, the divergence and the lazy plan.

Modules: :mod:`~otreg.ot.problem` (the options objects and the validated problem),
:mod:`~otreg.ot.solver` (``sinkhorn``: checks, solve, hand-off), :mod:`~otreg.ot.loop` (the
loop against a kernel), :mod:`~otreg.ot.gradient` (envelope, implicit and unrolled
gradients), :mod:`~otreg.ot.result` (the result and its convergence report),
:mod:`~otreg.ot.multiscale` (the truncated kernel and the coarse problem),
:mod:`~otreg.ot.convergence` (Anderson mixing, relaxation and stopping rule),
:mod:`~otreg.ot.divergence`, :mod:`~otreg.ot.plan`.
"""

from .convergence import Accuracy
from .divergence import SinkhornLoss, sinkhorn_divergence
from .plan import TransportPlan
from .problem import Implicit, Multiscale, SinkhornOptions, Unroll
from .result import SinkhornResult
from .solver import sinkhorn

__all__ = [
    "sinkhorn",
    "SinkhornResult",
    "sinkhorn_divergence",
    "SinkhornLoss",
    "TransportPlan",
    "SinkhornOptions",
    "Implicit",
    "Unroll",
    "Multiscale",
    "Accuracy",
]
