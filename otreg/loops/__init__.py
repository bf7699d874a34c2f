"""Differentiate long loops under a memory budget."""

from .fixed_point import fixed_point
from .iterate import STRATEGIES, iterate
from .profile import ProfileResult, profile
from .schedules import binomial_schedule, min_recomputations

__all__ = [
    "iterate",
    "STRATEGIES",
    "fixed_point",
    "binomial_schedule",
    "min_recomputations",
    "profile",
    "ProfileResult",
]
