"""Data to try otreg on: synthetic point clouds with known geometry.

(Real brain surfaces shipped by installed packages, and synthetic subjects with ground-truth
deformations, join this module with the shapes layer.)
"""

from __future__ import annotations

import math

import torch

from ._checks import check_int, check_positive

__all__ = ["circles", "noisy_sphere"]


def circles(n: int = 10_000, shift: float = 1.0, dtype: torch.dtype = torch.float32
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two unit circles of n evenly spaced points each, the second shifted by ``shift`` along x.

    Returns:
        x, y: ``(n, 2)`` each.
    """
    n = check_int("circles", "n", n, 1)
    t = torch.arange(n, dtype=torch.float64) * (2 * math.pi / n)
    x = torch.stack([t.cos(), t.sin()], dim=1)
    y = x + torch.tensor([float(shift), 0.0], dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def noisy_sphere(n: int, radius: float = 1.0, center: tuple[float, float, float] = (0, 0, 0),
                 noise: float = 0.02, seed: int = 0, dtype: torch.dtype = torch.float32
                 ) -> torch.Tensor:
    """n points uniformly distributed on a sphere, plus Gaussian noise of std ``noise``.

    Returns:
        ``(n, 3)`` points, in the units of ``radius``.
    """
    n = check_int("noisy_sphere", "n", n, 1)
    radius = check_positive("noisy_sphere", "radius", radius)
    noise = check_positive("noisy_sphere", "noise", noise, allow_zero=True)
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, 3, generator=g, dtype=torch.float64)
    p = radius * p / p.norm(dim=1, keepdim=True)
    p = p + noise * torch.randn(n, 3, generator=g, dtype=torch.float64)
    return (p + torch.tensor(center, dtype=torch.float64)).to(dtype)
