"""Linear maps of 3-D points: ``Rigid``, ``Similarity`` and ``Affine`` (about a centre),
and their weighted least-squares fit to matched points (Kabsch, Umeyama, affine).

Each is an ``nn.Module`` whose parameters an optimiser can fit, and whose
``forward(points)`` maps ``(N, 3)`` points (mm) to their moved positions; its parameters
live on the device and in the dtype of the centre it is built with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

__all__ = ["Rigid", "Similarity", "Affine"]


def rotation_matrix(w: torch.Tensor) -> torch.Tensor:
    """Rotation of axis-angle vector w (3,) (radians), Rodrigues' formula, differentiable."""
    theta = torch.sqrt((w * w).sum() + 1e-24)
    k = w / theta
    K = torch.zeros(3, 3, dtype=w.dtype, device=w.device)
    K = K.index_put(
        (torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([1, 2, 0, 2, 0, 1])),
        torch.stack([-k[2], k[1], k[2], -k[0], -k[1], k[0]]),
    )
    eye = torch.eye(3, dtype=w.dtype, device=w.device)
    return eye + torch.sin(theta) * K + (1 - torch.cos(theta)) * (K @ K)


class _Linear(nn.Module):
    """x -> A (x - c) + c + t, with A built from the parameters."""

    def __init__(self, center: torch.Tensor) -> None:
        super().__init__()
        center = torch.as_tensor(center).detach()
        self.register_buffer("center", center.clone())
        self.translation = nn.Parameter(torch.zeros_like(center[:3]))

    def matrix(self) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        A, c = self.matrix().to(points.dtype), self.center.to(points.dtype)
        return (points - c) @ A.T + c + self.translation.to(points.dtype)

    def inverse(self, points: torch.Tensor) -> torch.Tensor:
        A, c = self.matrix().to(points.dtype), self.center.to(points.dtype)
        return (points - c - self.translation.to(points.dtype)) @ torch.linalg.inv(A).T + c

    def set_from(self, A: torch.Tensor, t: torch.Tensor) -> None:
        """Set the parameters from a matrix A and a translation t (about ``center``)."""
        raise NotImplementedError

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The map as arrays (``linear_kind``, ``linear_matrix``, ``linear_translation``,
        ``linear_center``), as :meth:`otreg.registration.Registration.save` writes them."""
        return {
            "linear_kind": np.array(type(self).__name__.lower()),
            "linear_matrix": self.matrix().detach().cpu().numpy(),
            "linear_translation": self.translation.detach().cpu().numpy(),
            "linear_center": self.center.cpu().numpy(),
        }

    @staticmethod
    def from_arrays(arrays: Mapping[str, np.ndarray]) -> Affine:
        """The map that :meth:`to_arrays` wrote, as an :class:`Affine` of the same matrix,
        translation and center (float64; exact whatever the saved kind)."""
        linear = Affine(torch.as_tensor(arrays["linear_center"])).double()
        linear.set_from(
            torch.as_tensor(arrays["linear_matrix"]), torch.as_tensor(arrays["linear_translation"])
        )
        return linear


class Rigid(_Linear):
    """Rotation about ``center`` (axis-angle parameter, radians) and translation (mm).

    Example:
        >>> import torch
        >>> from otreg.registration import Rigid
        >>> r = Rigid(torch.zeros(3)).double()
        >>> r(torch.ones(2, 3, dtype=torch.float64)).detach()     # the identity until fitted
        tensor([[1., 1., 1.],
                [1., 1., 1.]], dtype=torch.float64)
    """

    def __init__(self, center: torch.Tensor) -> None:
        super().__init__(center)
        self.rotation = nn.Parameter(torch.zeros_like(self.center))

    def matrix(self) -> torch.Tensor:
        """The 3 x 3 matrix A of the map."""
        return rotation_matrix(self.rotation)

    def set_from(self, A: torch.Tensor, t: torch.Tensor) -> None:
        """Set the parameters from a matrix A and a translation t (about ``center``)."""
        with torch.no_grad():
            self.rotation.copy_(rotation_vector(A.to(self.center)))
            self.translation.copy_(t.to(self.center))


def rotation_vector(R: torch.Tensor) -> torch.Tensor:
    """The axis-angle vector (3,) (angle in [0, pi], radians) of a rotation matrix R (3, 3),
    through its quaternion from the largest of its trace and diagonal (Shepperd's method):
    exact at half a turn too, where the axis read from R's antisymmetric part vanishes (a
    rotation of 180 degrees became the identity).

    Example:
        >>> import torch
        >>> from otreg.registration.linear import rotation_vector
        >>> rotation_vector(torch.diag(torch.tensor([-1.0, -1.0, 1.0], dtype=torch.float64)))
        tensor([0.0000, 0.0000, 3.1416], dtype=torch.float64)
    """
    t = float(torch.trace(R))
    k = int(torch.argmax(torch.stack([R.new_tensor(t), *R.diagonal()])))
    if k == 0:
        w = math.sqrt(max(0.0, 1 + t)) / 2
        v = torch.stack([R[2, 1] - R[1, 2], R[0, 2] - R[2, 0], R[1, 0] - R[0, 1]]) / (4 * w)
    else:
        i, j, m = k - 1, k % 3, (k + 1) % 3
        q = [0.0] * 3
        big = math.sqrt(max(0.0, 1 + 2 * float(R[i, i]) - t)) / 2
        w = float(R[m, j] - R[j, m]) / (4 * big)
        q[i], q[j], q[m] = (
            big,
            float(R[i, j] + R[j, i]) / (4 * big),
            float(R[i, m] + R[m, i]) / (4 * big),
        )
        v = R.new_tensor(q)
    if w < 0:
        w, v = -w, -v
    n = float(v.norm())
    return v / n * (2 * math.atan2(n, w)) if n > 1e-12 else torch.zeros_like(v)


class Similarity(Rigid):
    """Rigid motion and an isotropic scale (log-parametrised).

    Example:
        >>> import torch
        >>> from otreg.registration import Similarity
        >>> float(torch.linalg.det(Similarity(torch.zeros(3)).double().matrix()))
        1.0
    """

    def __init__(self, center: torch.Tensor) -> None:
        super().__init__(center)
        self.log_scale = nn.Parameter(torch.zeros_like(self.center[0]))

    def matrix(self) -> torch.Tensor:
        """The 3 x 3 matrix A of the map."""
        return torch.exp(self.log_scale) * rotation_matrix(self.rotation)

    def set_from(self, A: torch.Tensor, t: torch.Tensor) -> None:
        """Set the parameters from a matrix A and a translation t (about ``center``)."""
        scale = float(torch.linalg.det(A)) ** (1 / 3)
        super().set_from(A / scale, t)
        with torch.no_grad():
            self.log_scale.fill_(math.log(scale))


class Affine(_Linear):
    """Any invertible linear map about ``center`` and a translation.

    Example:
        >>> import torch
        >>> from otreg.registration import Affine
        >>> a = Affine(torch.zeros(3)).double()
        >>> a.set_from(2 * torch.eye(3), torch.zeros(3))
        >>> a(torch.ones(1, 3, dtype=torch.float64)).detach()
        tensor([[2., 2., 2.]], dtype=torch.float64)
    """

    def __init__(self, center: torch.Tensor) -> None:
        super().__init__(center)
        self.linear = nn.Parameter(torch.eye(3, dtype=self.center.dtype, device=self.center.device))

    def matrix(self) -> torch.Tensor:
        """The 3 x 3 matrix A of the map."""
        return self.linear

    def set_from(self, A: torch.Tensor, t: torch.Tensor) -> None:
        """Set the parameters from a matrix A and a translation t (about ``center``)."""
        with torch.no_grad():
            self.linear.copy_(A.to(self.center))
            self.translation.copy_(t.to(self.center))


def fit_linear(
    kind: str, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, center: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted least-squares (A, t) with y ~ A (x - center) + center + t.

    ``kind``: ``"rigid"`` (Kabsch), ``"similarity"`` (Umeyama) or ``"affine"``.
    """
    x, y, w = x.detach().double(), y.detach().double(), w.detach().double()
    w = w / w.sum()
    c = center.detach().double()
    mx, my = (w[:, None] * x).sum(0), (w[:, None] * y).sum(0)
    xc, yc = x - mx, y - my
    if kind == "affine":
        cov_xx = (w[:, None, None] * xc[:, :, None] * xc[:, None, :]).sum(0)
        cov_yx = (w[:, None, None] * yc[:, :, None] * xc[:, None, :]).sum(0)
        A = cov_yx @ torch.linalg.inv(cov_xx)
    else:
        cov = (w[:, None, None] * yc[:, :, None] * xc[:, None, :]).sum(0)
        U, S, Vt = torch.linalg.svd(cov)
        d = torch.ones(3, dtype=x.dtype, device=x.device)
        d[2] = torch.sign(torch.linalg.det(U @ Vt))
        A = U @ torch.diag(d) @ Vt
        if kind == "similarity":
            A = A * (S * d).sum() / (w * (xc * xc).sum(1)).sum()
    t = my - c - A @ (mx - c)
    return A, t


#: The linear models by name.
LINEAR = {"rigid": Rigid, "similarity": Similarity, "affine": Affine}
