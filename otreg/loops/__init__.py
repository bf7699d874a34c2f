"""Differentiate long loops under a memory budget."""

from .iterate import STRATEGIES, iterate
from .schedules import binomial_schedule, min_recomputations

__all__ = ["iterate", "STRATEGIES", "binomial_schedule", "min_recomputations"]
