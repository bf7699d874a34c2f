r"""LDDMM: a diffeomorphism by geodesic shooting from control points with momenta.

:class:`LDDMM` is an ``nn.Module`` whose parameter (the momenta) an optimiser fits, and
whose ``forward(points)`` maps ``(N, 3)`` points (mm) to their deformed positions.

LDDMM (Miller, Trouvé, Younes): control points q (N, 3) with momenta p (N, 3) evolve by
Hamilton's equations for H(q, p) = 1/2 sum_ij p_i . k(q_i, q_j) p_j,

.. math::

    \dot q_i = \sum_j k(q_i, q_j)\, p_j, \qquad
    \dot p_i = \sum_j (p_i \cdot p_j)\, k'(q_i, q_j)\, (q_i - q_j),

with ``k'(x, y) = sum_s w_s / sigma_s^2 exp(-|x - y|^2 / (2 sigma_s^2))``, and any other point x
follows the velocity field: x' = sum_j k(x, q_j) p_j. Time runs from 0 to 1 in ``n_steps``
steps (Euler, RK4 or a leapfrog-type splitting). Every kernel sum is a lazy reduction; the
time loop is differentiated through :func:`otreg.loops.iterate` with the chosen strategy and
memory budget. The deformation energy is H(q_0, p_0) (constant along the geodesic).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parametrize

from .._checks import check_choice, check_int
from ..loops import iterate
from ..loops.budget import resolve_strategy
from .kernels import GaussianKernel
from .options import INTEGRATORS, LDDMMOptions

__all__ = ["LDDMM", "ComposedLDDMM"]

#: :meth:`LDDMM.whitened` factors the control points' kernel matrix up to this many points
#: (a dense (N, N) matrix: 200 MB and a second or two at 5,000)
WHITEN_MAX_POINTS = 5000


class LDDMM(nn.Module):
    """Geodesic shooting from control points with momenta (the parameter).

    Args:
        control_points: q_0, ``(N, 3)`` mm (e.g. the source vertices or a decimated subset).
        sigma: kernel width(s) in mm (a sum of Gaussians if several).
        kernel_weights: weight of each width (default 1 each).
        n_steps: time steps from t = 0 to 1 (default :class:`LDDMMOptions`' 6).
        integrator: ``"euler"``, ``"rk4"`` or ``"leapfrog"`` (default
            :class:`LDDMMOptions`' ``"leapfrog"``).
        strategy, memory: how the time loop is differentiated (:func:`otreg.loops.iterate`):
            ``memory`` (bytes or ``"500MB"``) bounds the measured peak growth of shooting
            forward and backward; with it, ``strategy`` defaults to ``"checkpoint"``
            (snapshots fitted to the budget), without it to ``"store"``.
        backend: reduction backend.

    Example:
        >>> import torch
        >>> from otreg.registration import LDDMM
        >>> phi = LDDMM(torch.randn(50, 3) * 10, sigma=8.0, n_steps=6).double()
        >>> with torch.no_grad():
        ...     _ = phi.momenta.normal_()
        >>> x = torch.randn(200, 3, dtype=torch.float64) * 10
        >>> tuple(phi(x).shape), float(phi.energy()) > 0     # moved points (mm), energy (mm^2)
        ((200, 3), True)
    """

    def __init__(
        self,
        control_points: torch.Tensor,
        sigma: float | Sequence[float],
        kernel_weights: Sequence[float] | None = None,
        n_steps: int = LDDMMOptions.n_steps,
        integrator: str = LDDMMOptions.integrator,
        strategy: str | None = LDDMMOptions.strategy,
        memory: int | str | None = LDDMMOptions.memory,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        caller = "LDDMM"
        q = torch.as_tensor(control_points).detach()
        if q.dim() != 2 or q.shape[0] == 0:
            raise ValueError(
                f"{caller}: control_points has shape {tuple(q.shape)}; it must be "
                "(N, D) with N >= 1"
            )
        self.kernel = GaussianKernel(sigma, kernel_weights, backend, caller)
        self.n_steps = check_int(caller, "n_steps", n_steps, 1)
        self.integrator = check_choice(caller, "integrator", integrator, INTEGRATORS)
        self.strategy, self.memory = resolve_strategy(caller, strategy, memory), memory
        self.register_buffer("control_points", q.clone())
        self.momenta = nn.Parameter(torch.zeros_like(q))

    @classmethod
    def from_options(cls, control_points: torch.Tensor, options: LDDMMOptions) -> LDDMM:
        """The deformation that ``options`` describe, from ``control_points`` ``(N, 3)``;
        ``options.sigma`` must be set (:func:`otreg.register` derives it from the target).

        Example:
            >>> import torch, otreg
            >>> from otreg.registration import LDDMM
            >>> phi = LDDMM.from_options(torch.zeros(4, 3), otreg.LDDMMOptions(sigma=5.0))
            >>> phi.n_steps, phi.integrator
            (6, 'leapfrog')
        """
        if options.sigma is None:
            raise ValueError(
                "LDDMM.from_options: options.sigma is None; give the kernel width in mm "
                "(register() derives it from the target's size)"
            )
        return cls(
            control_points,
            sigma=options.sigma,
            n_steps=options.n_steps,
            integrator=options.integrator,
            strategy=options.strategy,
            memory=options.memory,
        )

    def extra_repr(self) -> str:
        """The control points, kernel, steps and integrator."""
        return (
            f"{self.control_points.shape[0]} control points, {self.kernel}, "
            f"n_steps={self.n_steps}, integrator={self.integrator!r}"
        )

    # ---------------------------------------------------------------- dynamics
    def _sums(self, q, p, z):
        """Kernel sums of the field of (q, p) at the points z, in coordinates centred on q's
        mean c (the kernels are translation invariant; rounding is not), one reduction a
        width: ``(c, z - c, sum_j k p_j, sum_j k' p_j, sum_j k' (q_j - c) p_j^T)``, the
        last (N, D, D)."""
        D = q.shape[1]
        c = q.detach().mean(0)
        qc = q - c
        both = torch.cat([p, (qc[:, :, None] * p[:, None, :]).reshape(-1, D * D)], 1)
        k_both, kd_both = self.kernel.with_derivative(z - c, qc, both)
        return c, z - c, k_both[:, :D], kd_both[:, :D], kd_both[:, D:].reshape(-1, D, D)

    def _velocities(self, q, p, x):
        """(dq, dp, dx) at (q, p, x); x may have 0 rows."""
        c, qc, kp, kpp, kqpp = self._sums(q, p, q)
        # dp_i = sum_j (p_i . p_j) k'_ij (q_i - q_j)
        dp = qc * (p * kpp).sum(1, keepdim=True) - torch.einsum("nab,nb->na", kqpp, p)
        dx = self.kernel(x - c, qc, p) if x.shape[0] else x
        return kp, dp, dx

    def _step(self, state, *_params):
        q, p, x = state
        h = 1.0 / self.n_steps
        f = self._velocities
        if self.integrator == "euler":
            dq, dp, dx = f(q, p, x)
            return q + h * dq, p + h * dp, x + h * dx
        if self.integrator == "leapfrog":
            _, dp, _ = f(q, p, x[:0])
            p_half = p + h / 2 * dp
            dq, _, dx = f(q, p_half, x)
            q_new, x_new = q + h * dq, x + h * dx
            _, dp, _ = f(q_new, p_half, x[:0])
            return q_new, p_half + h / 2 * dp, x_new
        k1 = f(q, p, x)
        k2 = f(*(s + h / 2 * d for s, d in zip(state, k1)))
        k3 = f(*(s + h / 2 * d for s, d in zip(state, k2)))
        k4 = f(*(s + h * d for s, d in zip(state, k3)))
        return tuple(
            s + h / 6 * (a + 2 * b + 2 * c + d) for s, a, b, c, d in zip(state, k1, k2, k3, k4)
        )

    def shoot(self, points: torch.Tensor | None = None, report: dict | None = None):
        """Integrate from t = 0 to 1: ``(q_1, p_1, points_1)``."""
        q0 = self.control_points.to(self.momenta.dtype)
        x0 = q0[:0] if points is None else points.to(q0.dtype)
        if x0.shape[1] != q0.shape[1]:
            raise ValueError(
                f"LDDMM: points are {x0.shape[1]}-D but the control points {q0.shape[1]}-D"
            )
        return iterate(
            self._step,
            (q0, self.momenta, x0),
            self.n_steps,
            (self.momenta,),
            strategy=self.strategy,
            memory=self.memory,
            report=report,
        )

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        """Deformed positions of ``points`` (N, 3) at t = 1. The flow runs in the momenta's
        dtype; points of another dtype get its displacement added in theirs, so that float64
        points keep their digits through a float32 fit (and a zero flow leaves them as they
        are)."""
        return _moved_in_dtype(points, self.shoot(points)[2])

    def inverse(self, points: torch.Tensor, tol: float = 1e-10, max_iter: int = 50) -> torch.Tensor:
        """The inverse of :meth:`forward` at ``points`` (N, D), no gradient: the time steps
        undone from the last to the first, each by solving ``step(z) = y`` for z with the
        fixed-point iteration ``z <- z - (step(z) - y)`` (it contracts while the step moves
        points by less than their spacing changes: ``h |Dv| < 1``). The inverse of the discrete
        map :meth:`forward` applies, to ``tol`` times the points' size (at least 8 of the
        dtype's epsilons).

        Example:
            >>> import torch
            >>> from otreg.registration import LDDMM
            >>> phi = LDDMM(torch.randn(30, 3) * 10, sigma=8.0).double()
            >>> with torch.no_grad():
            ...     _ = phi.momenta.normal_()
            >>> x = torch.randn(100, 3, dtype=torch.float64) * 10
            >>> bool((phi.inverse(phi(x)) - x).abs().max() < 1e-8)
            True
        """
        with torch.no_grad():
            q = self.control_points.to(self.momenta.dtype)
            p = self.momenta.detach()
            y = points.detach().to(q.dtype)
            states = [(q, p)]
            for _ in range(self.n_steps - 1):
                q, p, _ = self._step((q, p, y[:0]))
                states.append((q, p))
            scale = float(y.abs().max()) if y.numel() else 1.0
            tol = max(tol, 8 * torch.finfo(q.dtype).eps)  # what the dtype can reach
            for q, p in reversed(states):
                z = y
                for _ in range(max_iter):
                    moved = self._step((q, p, z))[2]
                    z, change = z - (moved - y), float((moved - y).abs().max())
                    if change <= tol * max(scale, 1.0):
                        break
                y = z
        return y.to(points.dtype)

    def trajectory(self, points: torch.Tensor) -> list[torch.Tensor]:
        """Positions of ``points`` at every time step (n_steps + 1 tensors), no gradient."""
        with torch.no_grad():
            state = (
                self.control_points.to(self.momenta.dtype),
                self.momenta.detach(),
                points.to(self.momenta.dtype),
            )
            out = [state[2]]
            for _ in range(self.n_steps):
                state = self._step(state)
                out.append(state[2])
        return out

    def _field_and_jacobian(self, q, p, x):
        """The velocity ``v(x)`` (N, D) of the field of (q, p) and its Jacobian ``Dv(x)``
        (N, D, D), ``Dv_ab = sum_j k'(x, q_j) p_ja (q_jb - x_b)``: one reduction a width."""
        _, xc, kp, kpp, kqpp = self._sums(q, p, x)
        return kp, kqpp.transpose(1, 2) - kpp[:, :, None] * xc[:, None, :]

    def jacobians(self, points: torch.Tensor) -> torch.Tensor:
        """The Jacobian matrices ``d phi(x) / dx`` of the deformation at ``points`` (N, D):
        ``(N, D, D)``, no gradient. Carried along the flow with the points (the tangent
        map of the same integrator's steps, so it is the Jacobian of the discrete map that
        :meth:`forward` applies, to rounding): no backward pass, no taped graph, the
        kernel sums of :meth:`forward` with D * D more values each."""
        return self.forward_with_jacobians(points)[1]

    def forward_with_jacobians(self, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(forward(points), jacobians(points))`` in one flow, no gradient; the positions
        in the points' dtype as :meth:`forward` gives them."""
        with torch.no_grad():
            q = self.control_points.to(self.momenta.dtype)
            p = self.momenta.detach()
            x = points.detach().to(q.dtype)
            n, D = x.shape
            F = torch.eye(D, dtype=q.dtype, device=q.device).expand(n, D, D).clone()
            h = 1.0 / self.n_steps
            f, g = self._velocities, self._field_and_jacobian
            for _ in range(self.n_steps):
                if self.integrator == "euler":
                    dq, dp, _ = f(q, p, x[:0])
                    v, Dv = g(q, p, x)
                    q, p, x, F = q + h * dq, p + h * dp, x + h * v, F + h * (Dv @ F)
                elif self.integrator == "leapfrog":
                    _, dp, _ = f(q, p, x[:0])
                    p_half = p + h / 2 * dp
                    dq, _, _ = f(q, p_half, x[:0])
                    v, Dv = g(q, p_half, x)
                    q, x, F = q + h * dq, x + h * v, F + h * (Dv @ F)
                    _, dp, _ = f(q, p_half, x[:0])
                    p = p_half + h / 2 * dp
                else:  # rk4: each stage's tangent is Dv at that stage times its F
                    state, slopes = (q, p, x, F), []
                    for a in (0.0, h / 2, h / 2, h):
                        s = state
                        if slopes:
                            s = tuple(u + a * d for u, d in zip(state, slopes[-1]))
                        dq, dp, _ = f(s[0], s[1], x[:0])
                        v, Dv = g(s[0], s[1], s[2])
                        slopes.append((dq, dp, v, Dv @ s[3]))
                    k1, k2, k3, k4 = slopes
                    q, p, x, F = (
                        u + h / 6 * (a + 2 * b + 2 * c + d)
                        for u, a, b, c, d in zip(state, k1, k2, k3, k4)
                    )
        return _moved_in_dtype(points, x), F

    def hamiltonian(self, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """H(q, p) = 1/2 sum_ij p_i . k(q_i, q_j) p_j, in mm^2."""
        c = q.detach().mean(0)
        return 0.5 * (p * self.kernel(q - c, q - c, p)).sum()

    def energy(self) -> torch.Tensor:
        """The deformation energy H(q_0, p_0) (half the squared geodesic length)."""
        return self.hamiltonian(self.control_points.to(self.momenta.dtype), self.momenta)

    # ---------------------------------------------------------------- fitting
    def kernel_factor(self) -> torch.Tensor:
        """L, lower triangular with ``L L^T = K + j I``: K ``(N, N)`` the kernel matrix at the
        control points, j a jitter of 1e-6 of its diagonal (more if needed) that keeps the
        factorisation defined when control points nearly coincide. Float64."""
        q = self.control_points.double()
        K = self.kernel.matrix(q, q)
        eye = torch.eye(q.shape[0], dtype=q.dtype, device=q.device)
        jitter = 1e-6 * float(K.diagonal().mean())
        for _ in range(8):
            L, info = torch.linalg.cholesky_ex(K + jitter * eye)
            if int(info) == 0:
                return L
            jitter *= 10
        raise RuntimeError("LDDMM: the kernel matrix at the control points is not positive")

    @contextlib.contextmanager
    def whitened(self) -> Iterator[nn.Parameter]:
        """Within the block, the momenta are ``p = L^{-T} u`` (:meth:`kernel_factor`) and the
        parameter to optimise is u, yielded: the deformation energy is then about
        ``|u|^2 / 2``, a well-conditioned quadratic, where in p it is ``p^T K p / 2`` with K's
        eigenvalues spread over many decades (Gaussian kernels). The objective is the same;
        L-BFGS reaches a given value in fewer iterations (measured in docs/guide/registration.md).
        On leaving, ``momenta`` is a plain parameter again with the fitted value. Above
        ``WHITEN_MAX_POINTS`` control points it yields ``momenta`` itself."""
        if self.control_points.shape[0] > WHITEN_MAX_POINTS:
            yield self.momenta
            return
        factor = self.kernel_factor().to(self.momenta.dtype)
        parametrize.register_parametrization(self, "momenta", _Whitening(factor))
        try:
            yield self.parametrizations.momenta.original
        finally:
            parametrize.remove_parametrizations(self, "momenta", leave_parametrized=True)

    # ---------------------------------------------------------------- arrays
    def to_arrays(self) -> dict[str, np.ndarray]:
        """The deformation as arrays (``control_points``, ``momenta``, ``sigma``,
        ``kernel_weights``, ``n_steps``, ``integrator``), as
        :meth:`otreg.registration.Registration.save` writes them."""
        return {
            "control_points": self.control_points.cpu().numpy(),
            "momenta": self.momenta.detach().cpu().numpy(),
            "sigma": np.array(self.kernel.sigmas),
            "kernel_weights": np.array(self.kernel.weights),
            "n_steps": np.array(self.n_steps),
            "integrator": np.array(self.integrator),
        }

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> LDDMM:
        """The deformation that :meth:`to_arrays` wrote, in the momenta's dtype (a float32 fit
        maps points as it did)."""
        momenta = torch.as_tensor(arrays["momenta"])
        deformation = cls(
            torch.as_tensor(arrays["control_points"]),
            sigma=arrays["sigma"].tolist(),
            kernel_weights=arrays["kernel_weights"].tolist(),
            n_steps=int(arrays["n_steps"]),
            integrator=str(arrays["integrator"]),
        ).to(momenta.dtype if momenta.is_floating_point() else torch.float64)
        with torch.no_grad():
            deformation.momenta.copy_(momenta)
        return deformation


class ComposedLDDMM(nn.Module):
    """LDDMM deformations applied one after the other: :func:`otreg.register`'s fit and its
    refinement (fitted afterwards, from where the first left the source, with a narrower
    kernel). The composition of diffeomorphisms is one; it has :class:`LDDMM`'s
    ``forward``, ``inverse``, ``jacobians``, ``trajectory`` and ``energy``.

    Args:
        stages: the deformations, in the order they apply; each one's control points lie
            where the ones before moved them.

    Example:
        >>> import torch
        >>> from otreg.registration import LDDMM, ComposedLDDMM
        >>> first = LDDMM(torch.randn(30, 3) * 10, sigma=8.0).double()
        >>> second = LDDMM(torch.randn(60, 3) * 10, sigma=3.0, n_steps=2).double()
        >>> with torch.no_grad():
        ...     _ = first.momenta.normal_(), second.momenta.normal_()
        >>> phi = ComposedLDDMM([first, second])
        >>> x = torch.randn(100, 3, dtype=torch.float64) * 10
        >>> bool((phi(x) - second(first(x))).abs().max() == 0)
        True
        >>> bool((phi.inverse(phi(x)) - x).abs().max() < 1e-8)
        True
    """

    def __init__(self, stages: Sequence[LDDMM]) -> None:
        super().__init__()
        stages = list(stages)
        if not stages or not all(isinstance(s, LDDMM) for s in stages):
            raise TypeError(
                f"ComposedLDDMM: stages must be a non-empty sequence of LDDMM, got {stages!r}"
            )
        self.stages = nn.ModuleList(stages)

    def extra_repr(self) -> str:
        """The number of stages."""
        return f"{len(self.stages)} stages"

    @property
    def control_points(self) -> torch.Tensor:
        """The first stage's control points (the others start where it moved them)."""
        return self.stages[0].control_points

    @property
    def momenta(self) -> torch.Tensor:
        """The first stage's momenta."""
        return self.stages[0].momenta

    @property
    def kernel(self) -> GaussianKernel:
        """The first stage's kernel."""
        return self.stages[0].kernel

    @property
    def n_steps(self) -> int:
        """The time steps of all stages (:meth:`trajectory` has one more position)."""
        return sum(stage.n_steps for stage in self.stages)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        """Deformed positions of ``points`` (N, 3) after every stage."""
        for stage in self.stages:
            points = stage(points)
        return points

    def inverse(self, points: torch.Tensor, tol: float = 1e-10, max_iter: int = 50) -> torch.Tensor:
        """The stages' :meth:`LDDMM.inverse`, last first."""
        for stage in reversed(self.stages):
            points = stage.inverse(points, tol, max_iter)
        return points

    def jacobians(self, points: torch.Tensor) -> torch.Tensor:
        """``d phi(x) / dx`` at ``points`` (N, D): ``(N, D, D)``, the product of each stage's
        :meth:`LDDMM.jacobians` at the points it receives, no gradient."""
        return self.forward_with_jacobians(points)[1]

    def forward_with_jacobians(self, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(forward(points), jacobians(points))``, each stage's flow run once, no gradient."""
        F = None
        for stage in self.stages:
            points, J = stage.forward_with_jacobians(points)
            F = J if F is None else J @ F
        return points, F

    def trajectory(self, points: torch.Tensor) -> list[torch.Tensor]:
        """Positions of ``points`` at every time step of every stage, no gradient."""
        out = [points]
        for stage in self.stages:
            out += stage.trajectory(out[-1])[1:]
        return out

    def energy(self) -> torch.Tensor:
        """The sum of the stages' deformation energies, mm^2."""
        return sum(stage.energy() for stage in self.stages)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The first stage's :meth:`LDDMM.to_arrays`, and each later stage's with its keys
        prefixed ``stage2_``, ``stage3_``..."""
        out = self.stages[0].to_arrays()
        for k, stage in enumerate(self.stages[1:], start=2):
            out.update({f"stage{k}_{key}": a for key, a in stage.to_arrays().items()})
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> LDDMM | ComposedLDDMM:
        """What :meth:`to_arrays` (or :meth:`LDDMM.to_arrays`) wrote: an :class:`LDDMM`
        when it holds one stage."""
        stages = [LDDMM.from_arrays(arrays)]
        while f"stage{len(stages) + 1}_momenta" in arrays:
            prefix = f"stage{len(stages) + 1}_"
            own = {
                key.removeprefix(prefix): a for key, a in arrays.items() if key.startswith(prefix)
            }
            stages.append(LDDMM.from_arrays(own))
        return stages[0] if len(stages) == 1 else cls(stages)


def _moved_in_dtype(points: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
    """``moved`` (a flow's positions of ``points``, in the flow's dtype) in the points' dtype:
    the flow's displacement added to the points as they are."""
    if moved.dtype == points.dtype:
        return moved
    return points + (moved - points.to(moved.dtype)).to(points.dtype)


class _Whitening(nn.Module):
    """``p = L^{-T} u`` for :meth:`LDDMM.whitened` (``right_inverse``: ``u = L^T p``)."""

    def __init__(self, factor: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("factor", factor)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return torch.linalg.solve_triangular(self.factor.T, u, upper=True)

    def right_inverse(self, p: torch.Tensor) -> torch.Tensor:
        return self.factor.T @ p
