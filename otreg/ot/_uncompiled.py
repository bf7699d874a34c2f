"""``torch.compiler.disable`` for the public solvers, without importing torch's compiler.

The decorator imports ``torch._dynamo``, 2 s of every ``import otreg`` (and of every command
line call) on a two-core machine, for the few processes that compile a model. A model can
only be compiled once ``torch._dynamo`` is loaded; until then the wrapped function is called
as it is, and from then on through ``torch.compiler.disable``, made at the first such call.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def outside_compiled_graphs(fn: F) -> F:
    """``fn`` run as it is inside a model compiled with ``torch.compile`` (a graph break;
    ``fullgraph=True`` refuses it), as ``torch.compiler.disable(fn)`` does, with the compiler
    loaded only where it is already (see the module's docstring)."""
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:  # no compiler loaded: nothing is compiled
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    # torch.compile's tracer does not step into a function so marked (it breaks the graph)
    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
