"""Smooth random diffeomorphisms and rigid motions with known ground truth (for test data).

A diffeomorphism here is the time-1 flow of a stationary velocity field made of Gaussian
kernels, v(x) = sum_k exp(-|x - c_k|^2 / (2 sigma^2)) m_k, integrated with RK4; its inverse is
the flow of -v. Kernel sums run on otreg's reductions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .. import reductions
from ..costs import get_cost

__all__: list[str] = []


@dataclass
class KernelFlow:
    """x -> flow of v for unit time; ``inverse`` flows -v."""

    controls: torch.Tensor  # (K, 3) mm
    momenta: torch.Tensor  # (K, 3) mm / unit time
    sigma: float  # mm
    steps: int = 16

    def __repr__(self) -> str:  # the (K, 3) tensors would fill a screen
        speed = float(self.momenta.norm(dim=1).max()) if len(self.momenta) else 0.0
        return (
            f"KernelFlow({len(self.controls)} controls, sigma={self.sigma:g} mm, "
            f"max momentum {speed:.3g} mm, steps={self.steps})"
        )

    def _velocity(self, x: torch.Tensor, sign: float) -> torch.Tensor:
        v = reductions.kernel_product(
            x[None],
            self.controls[None].to(x.dtype),
            self.momenta[None].to(x.dtype),
            self.sigma**2,
            get_cost("sqeuclidean"),
            "auto",
        )[0]
        return sign * v

    def _flow(self, x: torch.Tensor, sign: float) -> torch.Tensor:
        h = 1.0 / self.steps
        x = x.detach().double()
        for _ in range(self.steps):
            k1 = self._velocity(x, sign)
            k2 = self._velocity(x + h / 2 * k1, sign)
            k3 = self._velocity(x + h / 2 * k2, sign)
            k4 = self._velocity(x + h * k3, sign)
            x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        return x

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._flow(x, 1.0).to(x.dtype)

    def inverse(self, x: torch.Tensor) -> torch.Tensor:
        return self._flow(x, -1.0).to(x.dtype)


@dataclass
class RigidMotion:
    """x -> R (x - center) + center + t."""

    rotation: torch.Tensor  # (3, 3)
    translation: torch.Tensor  # (3,)
    center: torch.Tensor  # (3,)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        R_, t, c = (v.to(x.dtype) for v in (self.rotation, self.translation, self.center))
        return (x - c) @ R_.T + c + t

    def inverse(self, x: torch.Tensor) -> torch.Tensor:
        R_, t, c = (v.to(x.dtype) for v in (self.rotation, self.translation, self.center))
        return (x - c - t) @ R_ + c

    @property
    def angle_degrees(self) -> float:
        cos = (float(torch.trace(self.rotation)) - 1) / 2
        return math.degrees(math.acos(max(-1.0, min(1.0, cos))))


def random_flow(
    points: torch.Tensor, sigma: float, magnitude: float, n_controls: int, rng: np.random.Generator
) -> KernelFlow:
    """A flow whose velocity peaks at about ``magnitude`` mm, controls spread over the points."""
    p = points.detach().double()
    idx = rng.choice(p.shape[0], size=min(n_controls, p.shape[0]), replace=False)
    controls = p[torch.as_tensor(idx)]
    momenta = torch.as_tensor(rng.normal(size=controls.shape))
    flow = KernelFlow(controls, momenta, float(sigma))
    peak = float(flow._velocity(p, 1.0).norm(dim=1).max())
    flow.momenta = momenta * (magnitude / max(peak, 1e-12))
    return flow


def random_rigid(
    center: torch.Tensor, max_angle: float, max_shift: float, rng: np.random.Generator
) -> RigidMotion:
    """A rotation by up to ``max_angle`` degrees about a random axis and a shift up to max_shift."""
    axis = rng.normal(size=3)
    axis /= np.linalg.norm(axis)
    angle = math.radians(rng.uniform(-max_angle, max_angle))
    K = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    rot = np.eye(3) + math.sin(angle) * K + (1 - math.cos(angle)) * K @ K
    shift = rng.normal(size=3)
    shift *= rng.uniform(0, max_shift) / np.linalg.norm(shift)
    return RigidMotion(
        torch.as_tensor(rot), torch.as_tensor(shift), center.detach().double().clone()
    )
