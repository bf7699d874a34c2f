"""What a machine's one-off measurements keep on disk between processes: a JSON object in a
file, read tolerant of damage (a missing, unreadable or foreign file reads as empty: the
measurement is made again) and written whole, atomically, so that two processes writing
at once leave one whole file; a folder that cannot be written keeps the result for this
process only. The KeOps check (:mod:`._keops`) and the fused loops' verdicts
(:mod:`._compiled`) use it."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

__all__: list[str] = []


def read(path: str | Path) -> dict:
    """The JSON object in ``path``, or {} if there is none that can be read."""
    try:
        got = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def write(path: str | Path, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it (nothing if the folder
    cannot be written)."""
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
