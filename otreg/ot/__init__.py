"""Entropic optimal transport: the Sinkhorn solver, the divergence and the lazy plan."""

from .divergence import SinkhornLoss, sinkhorn_divergence
from .plan import TransportPlan
from .sinkhorn import SinkhornResult, sinkhorn

__all__ = ["sinkhorn", "SinkhornResult", "sinkhorn_divergence", "SinkhornLoss", "TransportPlan"]
