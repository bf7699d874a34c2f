"""When to show progress bars (tqdm): where someone watches them."""

from __future__ import annotations

import sys

__all__ = ["progress_wanted"]


def progress_wanted(flag: bool | None) -> bool:
    """``flag`` if given, else on a terminal or in a Jupyter kernel only: tqdm rewrites its
    line with carriage returns, which a log file keeps (about 100 bytes an evaluation,
    7 kB or more a registration); in Jupyter, tqdm.auto draws a widget."""
    if flag is not None:
        return bool(flag)
    if "ipykernel" in sys.modules:
        return True
    return sys.stderr.isatty() if hasattr(sys.stderr, "isatty") else False
