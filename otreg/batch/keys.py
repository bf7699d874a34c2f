"""Resume keys: a pair is done when its record carries the key of what would be run now.

The key hashes the inputs' content (SHA-256 of the files' bytes, the values files to carry
across included), the effective registration options (the batch's and the row's, with every
default filled in, including the library's option objects) and the output format version.
Not paths, modification times, worker or thread counts: moving the batch folder or changing
``--workers`` reruns nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from .job import JobOptions
from .manifest import Pair
from .records import FORMAT

__all__: list[str] = []


def file_digest(path: str | Path, _cache: dict | None = None) -> str:
    """SHA-256 of a file's bytes (hex). FileNotFoundError names a missing file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} {'is a folder' if path.is_dir() else 'does not exist'}")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def effective_options(batch: Mapping[str, object] | None, pair: Pair) -> dict[str, object]:
    """The options a pair runs with, as its record keeps them: the defaults, then the
    batch's, then the row's (:class:`~otreg.batch.job.JobOptions`, with the library's option
    objects), plus the pair's label and level."""
    options = JobOptions.from_mapping(batch or {}, "batch options")
    options = JobOptions.from_mapping(pair.options, f"pair {pair.pair_id}: options", options)
    return options.record() | {"label": pair.label, "level": pair.level}


def _digest_json(value: object) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def pair_key(
    source_digest: str, target_digest: str, options: Mapping, values: Mapping | None = None
) -> tuple[str, dict]:
    """The resume key (hex) and its parts: ``{"source", "target", "options", "format"}``,
    and ``"values"`` (the digests of the files carried across, by side) where there are any."""
    parts = {
        "source": source_digest,
        "target": target_digest,
        "options": _digest_json(options),
        "format": FORMAT,
    }
    if values and any(values.values()):
        parts["values"] = _digest_json(values)
    return _digest_json(parts), parts


def why_rerun(record: Mapping, parts: Mapping, options: Mapping) -> str:
    """Why a pair whose record has another key runs again, in words."""
    old = record.get("key_parts") or {}
    reasons = []
    if old.get("format") != parts["format"]:
        reasons.append(f"output format {old.get('format')} -> {parts['format']}")
    for role in ("source", "target"):
        if old.get(role) != parts[role]:
            reasons.append(f"{role} file content changed")
    if old.get("values") != parts.get("values"):
        reasons.append("the values to carry changed")
    if old.get("options") != parts["options"]:
        before = record.get("options") or {}
        changed = [
            f"{k} {before.get(k)!r} -> {options.get(k)!r}"
            for k in sorted(set(before) | set(options))
            if k != "library" and before.get(k) != options.get(k)
        ]
        if not changed and before.get("library") != options.get("library"):
            changed = ["the library's default options"]
        reasons.append("options changed: " + ", ".join(changed or ["(not recorded)"]))
    return "; ".join(reasons) or "key changed"
