"""Resume keys: a pair is done when its record carries the key of what would be run now.

The key hashes the inputs' content (SHA-256 of the files' bytes), the effective registration
options (the batch's and the row's, with every default filled in, including the library's
option objects) and the output format version. Not paths, modification times, worker or
thread counts: moving the batch folder or changing ``--workers`` reruns nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from .manifest import Pair, check_options
from .records import FORMAT

__all__ = ["DEFAULT_OPTIONS", "file_digest", "effective_options", "pair_key", "why_rerun"]

#: A batch's registration options when neither the command nor the row sets them.
DEFAULT_OPTIONS: dict[str, object] = {
    "model": "lddmm",
    "prealign": "rigid",
    "loss": None,
    "sigma": None,  # derived from the target's size
    "points": None,
    "max_iter": None,  # the library's LBFGSOptions default
    "picture": True,
}


def file_digest(path: str | Path, _cache: dict | None = None) -> str:
    """SHA-256 of a file's bytes (hex). FileNotFoundError names a missing file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def effective_options(batch: Mapping[str, object] | None, pair: Pair) -> dict[str, object]:
    """The options a pair runs with: defaults, then the batch's, then the row's; plus the
    pair's label/level and the library's option objects (their defaults change results)."""
    from ..registration.losses import SINKHORN_TERM
    from ..registration.options import LBFGSOptions, LDDMMOptions, PrealignOptions

    opts = dict(DEFAULT_OPTIONS)
    opts.update(check_options(batch or {}, "batch options"))
    opts.update(pair.options)
    opts["sigma"] = None if opts["sigma"] is None else float(opts["sigma"])
    if opts["max_iter"] is None:
        opts["max_iter"] = LBFGSOptions().max_iter
    opts["label"], opts["level"] = pair.label, pair.level
    asdict = dataclasses.asdict
    opts["library"] = {
        "lddmm": asdict(LDDMMOptions(sigma=opts["sigma"])),
        "optimizer": asdict(LBFGSOptions(max_iter=opts["max_iter"])),
        "prealign": asdict(PrealignOptions(opts["prealign"])),
        "sinkhorn": asdict(SINKHORN_TERM),
    }
    return opts


def _digest_json(value: object) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def pair_key(source_digest: str, target_digest: str, options: Mapping) -> tuple[str, dict]:
    """The resume key (hex) and its parts: ``{"source", "target", "options", "format"}``."""
    parts = {
        "source": source_digest,
        "target": target_digest,
        "options": _digest_json(options),
        "format": FORMAT,
    }
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
