"""What a Sinkhorn solve is asked to do: the options (defaults written once) and the
validated, batched problem.

:class:`SinkhornOptions` is a frozen dataclass: :func:`otreg.sinkhorn`,
:func:`otreg.sinkhorn_divergence`, :class:`otreg.SinkhornLoss` and the registration's
Sinkhorn term all take one, and its fields' defaults are the only place the defaults are
written. Options that only make sense together travel as one object, so that an option that
cannot be honoured cannot be written:

- ``backward="envelope" | "implicit" | Implicit(tol, max_iter) | "unroll" |
  Unroll(strategy, memory)``: the unrolled loop's checkpointing strategy exists only inside
  :class:`Unroll`;
- ``multiscale="auto" | True | False | Multiscale(truncate, cluster_scale, auto)``: the
  truncation settings exist only inside :class:`Multiscale`;
- ``tol=1e-3 | Accuracy(value, gradient, every)``: a number bounds the marginal error; an
  :class:`Accuracy` states what the caller uses instead, the value and its gradient.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import reductions
from .._checks import (
    as_points,
    as_weights,
    check_choice,
    check_int,
    check_positive,
    check_same_device_dtype,
    warn,
)
from ..costs import Cost, epsilon_schedule, get_cost
from ..costs import diameter as bounding_diameter
from ..loops.budget import parse_bytes
from ..loops.iterate import STRATEGIES
from .convergence import Accuracy
from .multiscale import (
    auto_cluster_scale,
    multiscale_unfit,
    worthwhile,
)

__all__ = ["SinkhornOptions", "Implicit", "Unroll", "Multiscale"]

FORMS = ("log", "scaling")
#: Half-precision dtypes (autocast's): their points are computed in float32 (8 or 11 bits of
#: mantissa cannot resolve the scores at a useful blur), values returned in their dtype.
HALF = (torch.float16, torch.bfloat16)

#: GeomLoss's SamplesLoss options that otreg names otherwise, for the unknown-option error
GEOMLOSS_NAMES = {
    "p": "GeomLoss's p is the cost: p=2 is cost='sqeuclidean' (the default), p=1 cost='euclidean'",
    "loss": "otreg's losses are Sinkhorn's: give no loss name",
    "potentials": "the potentials are in otreg.sinkhorn(x, y).f and .g",
    "truncate": "multiscale=otreg.Multiscale(truncate=...)",
    "cluster_scale": "multiscale=otreg.Multiscale(cluster_scale=...)",
}
BACKWARDS = ("envelope", "implicit", "unroll")
#: the named ``relaxation`` settings (a number in [1, 2) fixes the over-relaxation weight)
RELAXATIONS = ("anderson", "auto")


def _number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class Implicit:
    """``backward=Implicit(...)``: differentiable potentials by the implicit function
    theorem at the fixed point, its adjoint system solved matrix-free.

    Args:
        tol: relative residual of the adjoint solve (at least 50 times the points' dtype
            rounding: 6e-6 in float32, where the residual itself is computed).
        max_iter: most iterations (products J^T u) of the adjoint solve.

    Example:
        >>> import torch, otreg
        >>> x, y = torch.rand(100, 3, requires_grad=True), torch.rand(120, 3)
        >>> otreg.sinkhorn(x, y, blur=0.1, backward=otreg.Implicit()).cost.backward()
        >>> tuple(x.grad.shape)
        (100, 3)
    """

    tol: float = 1e-10
    max_iter: int = 1000

    def __post_init__(self) -> None:
        object.__setattr__(self, "tol", check_positive("Implicit", "tol", self.tol))
        object.__setattr__(self, "max_iter", check_int("Implicit", "max_iter", self.max_iter, 1))


#: the loop strategies a Sinkhorn iteration can run (``"reversible"`` needs an inverse)
UNROLL_STRATEGIES = tuple(s for s in STRATEGIES if s != "reversible")


@dataclass(frozen=True)
class Unroll:
    """``backward=Unroll(...)``: autograd through the iterations at the final eps, run by
    :func:`otreg.loops.iterate` (the eps-scaling gives the warm start).

    Args:
        strategy: ``"store"``, ``"checkpoint"`` or ``"offload"`` (a Sinkhorn iteration
            has no inverse to run it backward, which ``"reversible"`` needs).
        memory: the budget for ``"checkpoint"``: bytes or a size like ``"500MB"``.

    Example:
        >>> import torch, otreg
        >>> x, y = torch.rand(100, 3, requires_grad=True), torch.rand(120, 3)
        >>> res = otreg.sinkhorn(x, y, blur=0.1, backward=otreg.Unroll("checkpoint", "20MB"))
        >>> res.cost.backward()
        >>> bool(torch.isfinite(x.grad).all())
        True
    """

    strategy: str = "store"
    memory: int | str | None = None

    def __post_init__(self) -> None:
        check_choice("Unroll", "strategy", self.strategy, UNROLL_STRATEGIES)
        if self.memory is not None:
            parse_bytes("Unroll", self.memory)


@dataclass(frozen=True)
class Multiscale:
    """``multiscale=Multiscale(...)``: coarse-to-fine with truncated kernels
    (:mod:`otreg.ot.multiscale`).

    Args:
        truncate: dropped terms change each softmin by at most eps * exp(-truncate),
            relative mass.
        cluster_scale: the side of the grid clusters, in the points' units; default
            ``diameter * max(N, M) ** (-1/D)``.
        auto: only where it pays (the rule of ``multiscale="auto"``); False requires it and
            raises ``ValueError`` where it cannot run.

    Example:
        >>> import torch, otreg
        >>> x, y = torch.rand(2000, 3), torch.rand(2000, 3)
        >>> res = otreg.sinkhorn(x, y, blur=0.05, multiscale=otreg.Multiscale(auto=False))
        >>> res.backend, res.converged
        ('multiscale', True)
    """

    truncate: float = 5.0
    cluster_scale: float | None = None
    auto: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "truncate", check_positive("Multiscale", "truncate", self.truncate)
        )
        if self.cluster_scale is not None:
            scale = check_positive("Multiscale", "cluster_scale", self.cluster_scale)
            object.__setattr__(self, "cluster_scale", scale)
        if not isinstance(self.auto, bool):
            raise TypeError(f"Multiscale: auto must be True or False, got {self.auto!r}")


@dataclass(frozen=True)
class SinkhornOptions:
    """The options of a Sinkhorn solve, with their defaults (see :func:`otreg.sinkhorn`
    for each one's meaning). Frozen: derive variants with :meth:`replace`.

    ``dataclasses.asdict(options)`` is what results record.

    Example:
        >>> import otreg
        >>> opts = otreg.SinkhornOptions(blur=0.01, reach=0.5)
        >>> opts.replace(tol=1e-6).tol, opts.reach
        (1e-06, 0.5)
    """

    blur: float = 0.05
    reach: float | None = None
    diameter: float | None = None
    scaling: float = 0.5
    cost: str = "sqeuclidean"
    form: str = "log"
    backend: str = "auto"
    tol: float | Accuracy = 1e-3
    max_iter: int = 2000
    relaxation: float | str = "anderson"
    backward: str | Implicit | Unroll = "envelope"
    multiscale: bool | str | Multiscale = "auto"

    def __post_init__(self) -> None:
        for name, value in _checked("SinkhornOptions", self).items():
            object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> SinkhornOptions:
        """A copy with some options changed (unknown names raise ``TypeError``)."""
        return resolve_options("SinkhornOptions", self, **changes)

    @property
    def backward_kind(self) -> str:
        """``"envelope"``, ``"implicit"`` or ``"unroll"``."""
        if isinstance(self.backward, Implicit):
            return "implicit"
        if isinstance(self.backward, Unroll):
            return "unroll"
        return self.backward

    @property
    def multiscale_setting(self) -> Multiscale | None:
        """The multiscale request as an object: None for ``False``."""
        if self.multiscale is False:
            return None
        if self.multiscale is True:
            return Multiscale()
        if self.multiscale == "auto":
            return Multiscale(auto=True)
        return self.multiscale


_FIELDS = tuple(f.name for f in dataclasses.fields(SinkhornOptions))


def _checked(caller: str, options: SinkhornOptions | dict) -> dict:
    """The option values checked and normalised (numbers as floats); errors name
    ``caller``."""
    v = (
        dict(options)
        if isinstance(options, dict)
        else {name: getattr(options, name) for name in _FIELDS}
    )
    v["blur"] = check_positive(caller, "blur", v["blur"])
    if v["reach"] is not None:
        v["reach"] = check_positive(caller, "reach", v["reach"])
    if v["diameter"] is not None:
        v["diameter"] = check_positive(caller, "diameter", v["diameter"])
    if not _number(v["scaling"]) or not 0 < v["scaling"] < 1:
        raise ValueError(f"{caller}: scaling is {v['scaling']!r}; it must be in (0, 1)")
    v["scaling"] = float(v["scaling"])
    cost = get_cost(v["cost"], caller)
    v["cost"] = cost.name
    check_choice(caller, "form", v["form"], FORMS)
    check_choice(caller, "backend", v["backend"], reductions.BACKENDS)
    if not isinstance(v["tol"], Accuracy):
        try:
            v["tol"] = check_positive(caller, "tol", v["tol"], allow_zero=True)
        except TypeError:
            raise TypeError(
                f"{caller}: tol must be a number (a bound on the marginal error) or an "
                f"otreg.Accuracy (the value's and the gradient's), got {type(v['tol']).__name__}"
            ) from None
    v["max_iter"] = check_int(caller, "max_iter", v["max_iter"], 1)
    w = v["relaxation"]
    if w not in RELAXATIONS and (not _number(w) or not 1 <= w < 2):
        raise ValueError(
            f"{caller}: relaxation is {w!r}; it must be 'anderson', 'auto' or in [1, 2) "
            "(1: plain Sinkhorn updates; 1.5-1.9 over-relaxes them)"
        )
    v["relaxation"] = w if w in RELAXATIONS else float(w)
    backward = v["backward"]
    if not isinstance(backward, (Implicit, Unroll)):
        check_choice(caller, "backward", backward, BACKWARDS)
    ms = v["multiscale"]
    if not (ms in ("auto", True, False) or isinstance(ms, Multiscale)):
        raise ValueError(
            f"{caller}: multiscale is {ms!r}; use 'auto', True, False or "
            "otreg.Multiscale(truncate, cluster_scale)"
        )
    if ms is True or (isinstance(ms, Multiscale) and not ms.auto):
        backward_kind = (
            backward
            if isinstance(backward, str)
            else ("implicit" if isinstance(backward, Implicit) else "unroll")
        )
        unfit = multiscale_unfit(cost, v["form"], backward_kind)
        if unfit:
            raise ValueError(
                f"{caller}: multiscale={ms!r} but {unfit}; use multiscale='auto' or False"
            )
    return v


def _functorch_active() -> bool:
    """Whether a torch.func transform is running (torch's own flag, where it has one)."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


class KeywordDefault:
    """A keyword's default, shown as its value (``blur=0.05``) but told apart from the same
    value given by the caller: a keyword given replaces its field of ``options`` even where
    it equals the default (``reach=None``: balanced), one left out does not; and only a blur
    left at its default warns about the data's span."""

    def __init__(self, value) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


#: each option's keyword default (:class:`KeywordDefault`)
KEYWORD_DEFAULTS = {f.name: KeywordDefault(f.default) for f in dataclasses.fields(SinkhornOptions)}


def resolve_options(
    caller: str, options: SinkhornOptions | None = None, **changes: Any
) -> SinkhornOptions:
    """``options`` (default: the defaults) with ``changes``, checked; errors name ``caller``."""
    if options is not None and not isinstance(options, SinkhornOptions):
        raise TypeError(
            f"{caller}: options must be an otreg.SinkhornOptions, got {type(options).__name__}"
        )
    unknown = sorted(set(changes) - set(_FIELDS))
    if unknown:
        hints = "".join(f"; {GEOMLOSS_NAMES[k]}" for k in unknown if k in GEOMLOSS_NAMES)
        raise TypeError(
            f"{caller}: unknown option(s) {', '.join(unknown)}; the options are "
            f"{', '.join(_FIELDS)}{hints}"
        )
    base = options or SinkhornOptions()
    values = {name: getattr(base, name) for name in _FIELDS}
    values.update(changes)
    return SinkhornOptions(**_checked(caller, values))


# ------------------------------------------------------------------ validated problem
@dataclass
class Problem:
    """Validated, batched inputs and the options resolved for them: what the loop reads."""

    x: torch.Tensor  # (B, N, D)
    y: torch.Tensor  # (B, M, D)
    a: torch.Tensor  # (B, N)
    b: torch.Tensor  # (B, M)
    batched: bool
    cost: Cost
    rho: float | None  # reach ** p
    schedule: list[float]
    form: str
    backend: str
    tol: float | Accuracy
    max_iter: int
    relaxation: float | str
    multiscale: Multiscale | None  # resolved: None when every pair is summed
    options: SinkhornOptions
    size: float  # the data's bounding-box diagonal, in the points' units
    out_dtype: torch.dtype  # the inputs' dtype: float16/bfloat16 are computed in float32

    @property
    def eps(self) -> float:
        return self.schedule[-1]

    def damping(self, eps: float) -> float:
        return 1.0 if self.rho is None else 1.0 / (1.0 + eps / self.rho)

    @classmethod
    def build(cls, caller: str, x, y, a, b, options: SinkhornOptions) -> Problem:
        """Check the inputs against each other and the options; batch them."""
        if _functorch_active():
            raise NotImplementedError(
                f"{caller}: torch.func transforms (grad, vmap, jacrev...) are not supported: "
                "otreg's solves and reductions are torch.autograd.Functions with their own "
                "backward; use torch.autograd.grad or .backward(), and a batch (B, N, D) "
                "instead of vmap"
            )
        x, x_batched = as_points(caller, "x", x)
        y, y_batched = as_points(caller, "y", y)
        if x_batched != y_batched:
            raise ValueError(
                f"{caller}: x has shape {tuple(x.shape[x_batched ^ 1 :])} and y "
                f"{tuple(y.shape[y_batched ^ 1 :])}; give both batched (B, N, D) "
                "or neither"
            )
        if x.shape[0] != y.shape[0]:
            raise ValueError(
                f"{caller}: x has batch size {x.shape[0]} but y has "
                f"{y.shape[0]}; a batch needs the same number of problems on "
                "both sides"
            )
        if x.shape[-1] != y.shape[-1]:
            raise ValueError(
                f"{caller}: x has points of dimension {x.shape[-1]} but y of "
                f"dimension {y.shape[-1]}; both need the same D"
            )
        out_dtype = x.dtype
        dtypes = {x.dtype, y.dtype}
        if len(dtypes) == 2 and dtypes & set(HALF) and torch.float64 not in dtypes:
            # a model's half-precision output against a float32 target (autocast): both
            # in float32, the value and x's gradient back in x's dtype (against float64,
            # refused as float32 is: convert one of them)
            x, y = x.float(), y.float()
            a, b = (w.float() if isinstance(w, torch.Tensor) and w.dtype in HALF else w
                    for w in (a, b))  # fmt: skip
        check_same_device_dtype(caller, {"x": x, "y": y})
        if out_dtype in HALF:  # an autocast model's: computed in float32, returned as given
            x, y = x.float(), y.float()
            a, b = (w.float() if isinstance(w, torch.Tensor) and w.dtype == out_dtype else w
                    for w in (a, b))  # fmt: skip
        if options.backend == "keops":
            try:
                reductions.resolve_backend("keops", 0, x.device, dtype=x.dtype)
            except TypeError as err:
                raise TypeError(f"{caller}: {err}") from None
        a = as_weights(caller, "a", a, x, "x")
        b = as_weights(caller, "b", b, y, "y")
        o = options
        cost = get_cost(o.cost, caller)
        rho = None if o.reach is None else o.reach**cost.p
        size = bounding_diameter(x, y)
        _check_representable(caller, x.dtype, size, o.blur, cost.p)
        diam = size if o.diameter is None else o.diameter
        schedule = epsilon_schedule(cost.p, max(diam, o.blur), o.blur, o.scaling)
        if len(schedule) > o.max_iter:
            raise ValueError(
                f"{caller}: max_iter is {o.max_iter} but the eps-scaling schedule "
                f"alone has {len(schedule)} steps (diameter {diam:.3g}, blur "
                f"{o.blur:.3g}, scaling {o.scaling}); raise max_iter or lower "
                "scaling"
            )
        if rho is None:
            # summed in float64; each weight is rounded in its own dtype by up to half its
            # epsilon, so normalised bfloat16 weights may sum to 1 +- 0.4%
            ma, mb = a.detach().double().sum(1), b.detach().double().sum(1)
            rel = (ma - mb).abs() / torch.maximum(ma, mb)
            worst = int(rel.argmax())
            if float(rel[worst]) > max(1e-5, torch.finfo(out_dtype).eps):
                where = f" (problem {worst} of the batch)" if x_batched else ""
                raise ValueError(
                    f"{caller}: a has total mass {ma[worst].item():.6g} and b "
                    f"{mb[worst].item():.6g}{where}; balanced OT (reach=None) needs "
                    "equal masses: normalise the weights or set reach for "
                    "unbalanced OT"
                )
            # masses this close are made equal (b scaled to a's): any difference left makes
            # the potentials drift without bound once tol is below it
            b = b * (ma / mb).to(b.dtype)[:, None]
        multiscale = _resolve_multiscale(caller, o, x, y, cost, diam)
        return cls(
            x,
            y,
            a,
            b,
            x_batched,
            cost,
            rho,
            schedule,
            o.form,
            o.backend,
            o.tol,
            o.max_iter,
            o.relaxation,
            multiscale,
            o,
            size,
            out_dtype,
        )


def _check_representable(caller: str, dtype: torch.dtype, size: float, blur: float, p: int):
    """Costs up to ``size ** p`` and eps = ``blur ** p`` must be normal numbers of ``dtype``."""
    info = torch.finfo(dtype)
    if not math.isfinite(size) or size**p > info.max / 4:
        reach = f"reach {size:.3g}^{p}" if math.isfinite(size) else "overflow"
        raise ValueError(
            f"{caller}: the points' costs {reach}, beyond {dtype}'s largest number "
            f"{info.max:.3g}: rescale the points (and the blur) or use float64"
        )
    if blur**p < info.tiny:
        raise ValueError(
            f"{caller}: blur is {blur:g}, so eps = blur^{p} = {blur**p:.3g}, below "
            f"{dtype}'s smallest normal number {info.tiny:.3g}: rescale the points (and the "
            "blur) or use float64"
        )


def _resolve_multiscale(
    caller: str, o: SinkhornOptions, x, y, cost: Cost, diam: float
) -> Multiscale | None:
    """The multiscale settings for the batched problem x (B, N, D), y (B, M, D), or None
    when every pair is summed; a required multiscale that cannot run raises."""
    setting = o.multiscale_setting
    if setting is None:
        return None
    unfit = multiscale_unfit(cost, o.form, o.backward_kind)
    if unfit is None and x.shape[0] > 1:
        unfit = f"the inputs are a batch of {x.shape[0]} problems (multiscale solves one)"
    if unfit is None and x.dtype not in (torch.float32, torch.float64):
        unfit = f"the points are {x.dtype} (multiscale clusters them in float32 or float64)"
    if not setting.auto and unfit:
        raise ValueError(
            f"{caller}: multiscale={o.multiscale!r} but {unfit}; use multiscale='auto' or False"
        )
    n, dim = max(x.shape[1], y.shape[1]), x.shape[-1]
    scale = setting.cluster_scale or auto_cluster_scale(diam, n, dim)
    fast = reductions.fast_all_pairs(x.device, x.dtype)
    pairs = x.shape[1] * y.shape[1]
    if setting.auto and (unfit or not worthwhile(pairs, dim, o.blur, scale, fast)):
        return None
    if setting.auto and diam > FAR_POINTS_SPAN * bulk_diameter(x, y):
        return None
    return dataclasses.replace(setting, cluster_scale=scale)


#: ``multiscale="auto"`` sums every pair where the clouds' bounding box is more than this
#: many times as wide as their bulk's (:func:`bulk_diameter`): a few far points then set
#: the cells' side, the bulk falls in a few cells, and the far points' costs over eps reach
#: float32's rounding in the truncated softmins. Measured on Student-t clouds (3 degrees of
#: freedom, N = 5,000, blur 0.1 at a scale 0.2, divergence with its gradient, two cores):
#: the multiscale solver stalled above tol after 353 iterations (28 s, gradient 10% off),
#: every pair converged in 4.3 s (gradient 1.7e-3 off). The ratio was 5.8 there; 1.04 to
#: 1.50 on spheres, Gaussian clouds, clusters and brain surfaces.
FAR_POINTS_SPAN = 3.0
#: the bulk's box: between these quantiles of each coordinate
BULK_QUANTILE = 0.005


def bulk_diameter(x: torch.Tensor, y: torch.Tensor) -> float:
    """Diagonal of the box between the ``BULK_QUANTILE`` and ``1 - BULK_QUANTILE`` quantiles
    of each coordinate over both clouds (B, N, D) (on at most 2^16 evenly spaced points)."""
    both = torch.cat([x.detach().reshape(-1, x.shape[-1]), y.detach().reshape(-1, y.shape[-1])])
    both = both[:: max(1, both.shape[0] >> 16)].double()
    q = torch.tensor([BULK_QUANTILE, 1 - BULK_QUANTILE], dtype=both.dtype, device=both.device)
    low, high = torch.quantile(both, q, dim=0)
    return float((high - low).norm())


#: A default blur is flagged when the data span more than this many times it.
DEFAULT_BLUR_SPAN = 100


def warn_default_blur(caller: str, p: Problem) -> None:
    """Warn when the blur, left at its default, is far below the data's span (brain
    surfaces in mm at 0.05 mm: slow, and rarely what is meant)."""
    blur = p.options.blur
    if p.size > DEFAULT_BLUR_SPAN * blur:
        warn(
            f"{caller}: blur is the default {blur:g}, in the points' units, but the "
            f"points span {p.size:.3g}: the solve resolves details of {blur:g} units "
            "(slow, and rarely what is meant for data in mm). Set blur (a tenth to a "
            "hundredth of the span is usual; 1 to 5 suits brain surfaces in mm)",
            UserWarning,
        )


def no_autocast(device: torch.device):
    """A block where torch.autocast is off on ``device``: the solver's reductions stay in
    the problem's dtype (float32 or float64) inside a mixed-precision model."""
    return torch.autocast(device_type=device.type, enabled=False)
