"""Input validation shared by every public entry point.

One place, one message style: ``"<function>: <argument> <what it got>; <what it needs>"``.
Bad values raise ``ValueError``, wrong types ``TypeError``.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["ConvergenceWarning", "FoldWarning"]

#: frames in these folders are library code: a warning names the first line outside them
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sys.modules[__package__], torch)
)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first line outside otreg and torch: the user's
    call, however deep in otreg the warning was raised (a fixed ``stacklevel`` names a line
    of otreg whenever the call went through another of its functions)."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class ConvergenceWarning(UserWarning):
    """An iterative method stopped at its iteration cap before reaching its tolerance.

    Example:
        >>> import warnings, torch, otreg
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     res = otreg.sinkhorn(torch.rand(50, 2), torch.rand(50, 2), blur=0.01, max_iter=12)
        >>> res.converged, any(issubclass(w.category, otreg.ConvergenceWarning) for w in caught)
        (False, True)
    """


class FoldWarning(UserWarning):
    """A deformation folds: its Jacobian determinant is not positive somewhere.

    Example:
        >>> import warnings, otreg
        >>> warnings.simplefilter("error", otreg.FoldWarning)  # make a fold stop a script
        >>> issubclass(otreg.FoldWarning, UserWarning)
        True
        >>> warnings.resetwarnings()
    """


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    if isinstance(x, np.ndarray):
        return f"a NumPy array of shape {x.shape} and dtype {x.dtype} (torch.as_tensor converts it)"
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def as_points(caller: str, name: str, x: object) -> tuple[torch.Tensor, bool]:
    """Validate a point cloud and return it batched, ``(B, N, D)``, and whether it was batched.

    Accepts ``(N, D)`` or ``(B, N, D)`` floating tensors with N >= 1, D >= 1, all finite.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{caller}: {name} must be a torch.Tensor of shape (N, D) or (B, N, D), "
            f"got {_describe(x)}"
        )
    if not x.is_floating_point():
        raise TypeError(
            f"{caller}: {name} has dtype {x.dtype}; points must be floating point "
            "(float32 or float64; float16 and bfloat16 are computed in float32)"
        )
    if x.dim() not in (2, 3):
        hint = " (a 1-D tensor looks like weights: points come before their weights)"
        if caller.startswith("SinkhornLoss"):  # loss(a, x, b, y): weights first
            hint = (
                " (a 1-D tensor looks like weights: SinkhornLoss takes loss(x, y) or "
                "loss(a, x, b, y))"
            )
        raise ValueError(
            f"{caller}: {name} has shape {tuple(x.shape)}; points must be (N, D) or (B, N, D)"
            + (hint if x.dim() == 1 else "")
        )
    if x.shape[-2] == 0:
        raise ValueError(
            f"{caller}: {name} is empty (shape {tuple(x.shape)}); a point cloud needs "
            "at least one point"
        )
    if x.shape[-1] == 0 or (x.dim() == 3 and x.shape[0] == 0):
        raise ValueError(f"{caller}: {name} has shape {tuple(x.shape)}; dimensions must be >= 1")
    _check_finite(caller, name, x)
    batched = x.dim() == 3
    return (x if batched else x.unsqueeze(0)), batched


def _check_finite(caller: str, name: str, x: torch.Tensor) -> None:
    if x.is_meta:
        raise ValueError(
            f"{caller}: {name} is on the meta device (shapes without values); give a tensor "
            "on the CPU or a GPU"
        )
    bad = ~torch.isfinite(x.detach())
    if bool(bad.any()):
        n_nan = int(torch.isnan(x.detach()).sum())
        n_inf = int(bad.sum()) - n_nan
        raise ValueError(
            f"{caller}: {name} has {n_nan} NaN and {n_inf} infinite entries; "
            "all entries must be finite"
        )


def as_weights(
    caller: str, name: str, w: object, points: torch.Tensor, points_name: str
) -> torch.Tensor:
    """Validate weights for batched points ``(B, N, D)``; return them as ``(B, N)``.

    ``None`` gives uniform weights ``1/N``. Weights must be finite, >= 0, with positive total
    mass in every batch, on the device and of the dtype of the points.
    """
    B, N = points.shape[0], points.shape[1]
    if w is None:
        return torch.full((B, N), 1.0 / N, dtype=points.dtype, device=points.device)
    if not isinstance(w, torch.Tensor):
        raise TypeError(
            f"{caller}: {name} must be a torch.Tensor of shape ({N},) or ({B}, {N}) "
            f"or None, got {_describe(w)}"
        )
    if not w.is_floating_point():
        raise TypeError(f"{caller}: {name} has dtype {w.dtype}; weights must be floating point")
    given = tuple(w.shape)
    if w.dim() == 1:
        w = w.unsqueeze(0)
    if w.dim() != 2 or w.shape[1] != N or w.shape[0] not in (1, B):
        raise ValueError(
            f"{caller}: {name} has shape {given} but {points_name} has {N} points "
            f"(batch {B}); weights must be ({N},) or ({B}, {N})"
        )
    check_same_device_dtype(caller, {points_name: points, name: w})
    _check_finite(caller, name, w)
    n_neg = int((w.detach() < 0).sum())
    if n_neg:
        raise ValueError(f"{caller}: {name} has {n_neg} negative entries; weights must be >= 0")
    mass = w.detach().sum(dim=1)
    if bool((mass <= 0).any()):
        where = f" in problem {int((mass <= 0).nonzero()[0])} of the batch" if B > 1 else ""
        raise ValueError(
            f"{caller}: {name} has zero total mass{where}; weights need a positive sum"
        )
    return w.expand(B, N)


def check_same_device_dtype(caller: str, tensors: dict[str, torch.Tensor]) -> None:
    """All tensors share one dtype and one device."""
    items = list(tensors.items())
    name0, t0 = items[0]
    for name, t in items[1:]:
        if t.dtype != t0.dtype:
            raise TypeError(
                f"{caller}: {name} has dtype {t.dtype} but {name0} has {t0.dtype}; "
                f"convert them to one dtype (e.g. {name}.to({name0}.dtype))"
            )
        if t.device != t0.device:
            raise ValueError(
                f"{caller}: {name} is on {t.device} but {name0} is on {t0.device}; "
                "move them to one device"
            )


def check_positive(
    caller: str, name: str, value: object, *, allow_none: bool = False, allow_zero: bool = False
) -> float | None:
    """A finite real number > 0 (or >= 0 with allow_zero; or None with allow_none), as a
    Python float: NumPy's scalars (``np.float32(0.05)``, ``np.int64(3)``) are numbers too."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            if value.requires_grad:  # float() would cut it from the graph without a word
                raise TypeError(
                    f"{caller}: {name} is a tensor that requires grad; no gradient flows "
                    f"to {name}: pass a number ({name}.item()) or {name}.detach()"
                )
            value = float(value)
        else:
            raise TypeError(f"{caller}: {name} must be a number, got {_describe(value)}")
    value = float(value)
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        need = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{caller}: {name} is {value!r}; it must be a finite number {need}")
    return value


def check_int(caller: str, name: str, value: object, minimum: int) -> int:
    """An integer >= minimum, as a Python int (NumPy's integers are integers too)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{caller}: {name} must be an integer, got {_describe(value)}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{caller}: {name} is {value}; it must be >= {minimum}")
    return value


def check_choice(caller: str, name: str, value: object, choices: Sequence[str]) -> str:
    """One of a fixed set of names."""
    if value not in choices:
        names = ", ".join(map(repr, choices))
        raise ValueError(f"{caller}: {name} is {value!r}; choose one of {names}")
    return value  # type: ignore[return-value]


def check_progress(caller: str, progress: object) -> bool:
    """Whether to show progress bars (tqdm): ``progress`` if True or False; for None, only
    where someone watches them, on a terminal or in a Jupyter kernel (tqdm rewrites its line
    with carriage returns, which a log file keeps: about 100 bytes an evaluation, 7 kB or
    more a registration; in Jupyter, tqdm.auto draws a widget)."""
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"{caller}: progress is {progress!r}; it must be True, False or None")
    if progress is not None:
        return progress
    ipython = sys.modules.get("IPython")  # a Jupyter kernel's shell has a kernel; a process
    shell = ipython.get_ipython() if ipython is not None else None  # that imported one, not
    if getattr(shell, "kernel", None) is not None:
        return True
    return sys.stderr.isatty() if hasattr(sys.stderr, "isatty") else False


def check_device(caller: str, device: object) -> torch.device | None:
    """``device`` (None, a ``torch.device`` or its name: ``"cpu"``, ``"cuda"``,
    ``"cuda:1"``) as a device this process can use; ValueError naming it otherwise."""
    if device is None:
        return None
    try:
        dev = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{caller}: device is {device!r}; give 'cpu', 'cuda' or 'cuda:N'") from err
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"{caller}: device is {device!r} but torch {torch.__version__} sees no CUDA "
                "device here (a CPU build, or no driver): leave it out to run on the CPU"
            )
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"{caller}: device is {device!r} but this machine has {count} CUDA "
                f"device(s): cuda:0 to cuda:{count - 1}"
            )
    elif dev.type != "cpu":
        raise ValueError(f"{caller}: device is {device!r}; give 'cpu', 'cuda' or 'cuda:N'")
    return dev
