"""The per-pair records a batch writes, and reading them back.

Each pair's folder gets, last of its files, one record: ``<prefix>metrics.json`` when the
registration finished, ``<prefix>error.json`` when it failed. Both are JSON objects with:

- ``format`` (:data:`FORMAT`), ``pair_id``, ``status`` (``"done"`` or ``"failed"``),
  ``key`` (the resume key, hex) and ``key_parts`` (``source``, ``target``, ``options``,
  ``format``: what the key is made of, for the reasons a pair reruns);
- ``source``, ``target`` (absolute paths when run), ``source_subject``, ``target_subject``,
  ``hemisphere`` (or null), ``options`` (the effective registration options);
- ``metrics`` (done: the registration's metrics, e.g. ``mean_mm``, ``hausdorff_mm``,
  ``varifold``, ``jacobian_min``, ``energy``, and ``before_mean_mm``/``before_hausdorff_mm``
  for the surfaces before registration);
- ``error`` (failed: ``class`` one of :data:`FAILURE_CLASSES`, ``type`` (the exception's class
  name), ``reason`` (one line), ``traceback`` (text or null));
- ``seconds``, ``peak_rss_mb``, ``host``, ``pid``, ``threads``, ``started``, ``finished``
  (ISO 8601, UTC), ``otreg_version``;
- ``files``: output role -> file name in the same folder (``warped``, ``parameters``,
  ``registration``, ``log``, ``picture``), only those written.

Everything the group report shows comes from these records, so it can be rebuilt without the
inputs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..io import atomic_write

__all__ = ["FORMAT", "FAILURE_CLASSES", "read_record", "find_records"]

#: Version of the output layout and records; part of every resume key.
FORMAT = 1

#: What a failure's ``error.class`` can be.
FAILURE_CLASSES = (
    "missing input",  # an input file does not exist
    "bad input",  # an input could not be read or is not a surface (ValueError...)
    "error",  # any other exception during the registration
    "timeout",  # ran longer than --timeout
    "crash",  # the worker process died (a segfault, a kill) more times than allowed
    "out of memory",  # the worker process was killed near its memory limit
    "no worker",  # no worker process stayed alive to run it (see dispatch.NO_WORKER_SECONDS)
)

DONE_NAME = "metrics.json"
FAILED_NAME = "error.json"
#: The batch folder's list of the pairs its runs planned, with each pair's latest key (a
#: run of some pairs, ``--only``, keeps the others'): a record of another key is from
#: earlier inputs or options (the group page says "not run").
PLAN_NAME = "plan.json"


def write_plan(folder: str | Path, keys: dict[str, str]) -> None:
    """Record the pairs a run planned (pair id -> key) in ``folder/plan.json``, atomically."""
    text = json.dumps({"format": FORMAT, "keys": keys}, indent=1)
    atomic_write(Path(folder) / PLAN_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def read_plan(folder: str | Path) -> dict[str, str] | None:
    """The pair ids and keys of the last planned run (:func:`write_plan`), or None."""
    try:
        doc = json.loads((Path(folder) / PLAN_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    keys = doc.get("keys") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
    return {str(k): str(v) for k, v in keys.items()} if isinstance(keys, dict) else None


def read_record(path: str | Path) -> dict | None:
    """A record, or None if the file is missing, unreadable or not a record of this
    format (an interrupted or foreign file counts as no record).

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.batch import read_record
        >>> read_record(pathlib.Path(tempfile.mkdtemp()) / "missing.json") is None
        True
    """
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "pair_id" not in doc:
        return None
    if doc.get("status") not in ("done", "failed"):
        return None
    return doc


def find_records(folder: str | Path) -> list[tuple[Path, dict]]:
    """Every record under a batch folder: (path, record), sorted by pair id. Hidden folders
    (temporary ones) are skipped.

    Example:
        >>> import tempfile
        >>> from otreg.batch import find_records
        >>> find_records(tempfile.mkdtemp())                  # a folder without a batch
        []
    """
    folder = Path(folder)
    found = []
    for path in folder.rglob("*.json"):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if not (path.name.endswith(DONE_NAME) or path.name.endswith(FAILED_NAME)):
            continue
        doc = read_record(path)
        if doc is not None:
            found.append((path, doc))
    found.sort(key=lambda item: (item[1]["pair_id"], item[0].name))
    return found


def unreadable_records(folder: str | Path) -> list[Path]:
    """The files under a batch folder named as records that do not read as one (truncated,
    edited, of another format): the group page lists them rather than drop their pairs."""
    folder = Path(folder)
    return sorted(
        path
        for path in folder.rglob("*.json")
        if not any(part.startswith(".") for part in path.relative_to(folder).parts)
        and path.name.endswith((DONE_NAME, FAILED_NAME))
        and read_record(path) is None
    )


def failure_reason(record: dict) -> str:
    """A failure record's class and reason, one line."""
    err = record.get("error") or {}
    return f"{err.get('class', '?')}: {err.get('reason', '')}"


def overlap_keys(metrics: Iterable[Mapping]) -> list[str]:
    """The label overlaps that some of these metrics hold (``<labels>_dice``, after the
    registration; each beside its ``before_<labels>_dice``), sorted."""
    keys = {k for m in metrics for k in m if k.endswith("_dice")}
    return sorted(k for k in keys if not k.startswith("before_"))
