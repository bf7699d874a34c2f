"""What looks wrong in a batch that ran, though every pair says done: flags a pair carries
into ``summary.csv`` and onto the group page, each with its reason.

- **side**: a hemisphere filed as left whose source lies right of the midline (x > 0 in
  RAS, by more than :data:`MIDLINE_MARGIN_MM`), or the reverse; a source and a target on
  opposite sides.
- **duplicate**: two different files of the batch with the same content (the resume key's
  digest: one subject's surface under two names?), two pairs with the same source and target
  contents, or a pair whose source and target are. One file used by several pairs (a
  template, a subject of an all-pairs batch) is no duplicate.
- **outlier**: a metric far from the batch's others, by robust statistics: beyond
  :data:`OUTLIER_MADS` times the median absolute deviation (scaled to a standard
  deviation) from the median, and by at least :data:`OUTLIER_MIN_CHANGE` of it, in the
  direction that is worse, once at least :data:`OUTLIER_MIN_PAIRS` pairs are done; the
  label overlaps (``<labels>_dice``) where the batch measured them. The group page's strip
  plots mark these pairs, no others.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .records import overlap_keys

__all__: list[str] = []

#: A hemisphere's centroid lies 25 to 35 mm off the midline; within this, no side is read.
MIDLINE_MARGIN_MM = 10.0
#: Robust standard deviations from the median beyond which a metric is an outlier.
OUTLIER_MADS = 3.5
#: Outliers are looked for once this many pairs are done.
OUTLIER_MIN_PAIRS = 5
#: ... and are at least this fraction of the median away from it: in a batch of near-equal
#: pairs the deviation's spread is tiny, and a smallest Jacobian of 0.722 against a median of
#: 0.74 (no fold) or a Dice of 0.993 against 0.995 was flagged
OUTLIER_MIN_CHANGE = 0.05
#: The metrics looked at for outliers, the direction that is worse, and their names.
OUTLIER_METRICS = {
    "mean_mm": ("high", "mean surface distance after", "mm"),
    "hausdorff_mm": ("high", "Hausdorff distance after", "mm"),
    "jacobian_min": ("low", "smallest Jacobian determinant", ""),
    "varifold": ("high", "varifold distance after", ""),
    "before_mean_mm": ("high", "mean surface distance before", "mm"),
}


@dataclass(frozen=True)
class Flag:
    """One thing that looks wrong: its kind (side, duplicate, outlier), the reason in
    words, and for an outlier the metric and its value against the batch's (``detail``)."""

    kind: str
    reason: str
    metric: str | None = None
    detail: str = ""


def describe(flags: list[Flag]) -> str:
    """A pair's flags in one line, its outliers together."""
    out = [f.reason for f in flags if f.kind != "outlier"]
    far = [f.detail for f in flags if f.kind == "outlier"]
    if far:
        out.append("far from the batch's other pairs: " + "; ".join(far))
    return "; ".join(out)


def flag_pairs(records: Mapping[str, dict]) -> dict[str, list[Flag]]:
    """The flags of every pair that has some, from its final record (pair id -> record)."""
    done = {pid: r for pid, r in records.items() if r.get("status") == "done"}
    out: dict[str, list[Flag]] = {}
    for pid, rec in done.items():
        out.setdefault(pid, []).extend(_side(rec))
    for pid, flag in _duplicates(done):
        out.setdefault(pid, []).append(flag)
    for pid, flag in _outliers(done):
        out.setdefault(pid, []).append(flag)
    return {pid: flags for pid, flags in out.items() if flags}


def _side(rec: dict) -> list[Flag]:
    checks = rec.get("checks") or {}
    src, tgt = checks.get("source_mean_x_mm"), checks.get("target_mean_x_mm")
    found = []
    side = {"L": -1, "R": 1}.get(rec.get("hemisphere") or "")
    if side and isinstance(src, (int, float)) and src * side < -MIDLINE_MARGIN_MM:
        where = "right" if src > 0 else "left"
        found.append(
            Flag(
                "side",
                f"filed as hemisphere {rec['hemisphere']} but its source lies {where} of the "
                f"midline (mean x {src:+.1f} mm): a mislabelled hemisphere?",
            )
        )
    elif (
        isinstance(src, (int, float))
        and isinstance(tgt, (int, float))
        and min(abs(src), abs(tgt)) > MIDLINE_MARGIN_MM
        and src * tgt < 0
    ):
        found.append(
            Flag(
                "side",
                f"source and target lie on opposite sides of the midline (mean x "
                f"{src:+.1f} and {tgt:+.1f} mm): a left hemisphere onto a right one?",
            )
        )
    return found


def _duplicates(done: Mapping[str, dict]):
    files: dict[str, dict[str, list[tuple[str, str]]]] = {}  # digest -> path -> (pair, role)
    contents: dict[tuple[str, str], list[str]] = {}  # (source, target) digests -> pairs
    for pid, rec in done.items():
        parts = rec.get("key_parts") or {}
        src, tgt = parts.get("source"), parts.get("target")
        if src and src == tgt:
            yield pid, Flag("duplicate", "its source and target files have the same content")
        if src and tgt:
            contents.setdefault((src, tgt), []).append(pid)
        for role, digest in (("source", src), ("target", tgt)):
            if digest:
                path = os.path.normpath(str(rec.get(role) or ""))
                files.setdefault(digest, {}).setdefault(path, []).append((pid, role))
    for pids in contents.values():
        for pid in pids:
            others = [p for p in pids if p != pid]
            if others:
                shown = ", ".join(others[:3]) + (" ..." if len(others) > 3 else "")
                yield pid, Flag("duplicate", f"the same source and target contents as {shown}")
    for by_path in files.values():  # one file used by several pairs is no duplicate
        for path, uses in by_path.items():
            others = sorted(p for p in by_path if p != path)
            for pid, role in uses if others else ():
                shown = others[0] + (f" and {len(others) - 1} more" if len(others) > 1 else "")
                yield (
                    pid,
                    Flag("duplicate", f"its {role} file has the same content as {shown}"),
                )


def _outliers(done: Mapping[str, dict]):
    if len(done) < OUTLIER_MIN_PAIRS:
        return
    overlaps = {
        k: ("low", f"label overlap {k[:-5]} (Dice)", "")
        for k in overlap_keys(rec.get("metrics") or {} for rec in done.values())
    }
    for key, (worse, name, unit) in {**OUTLIER_METRICS, **overlaps}.items():
        values = {
            pid: float(v)
            for pid, rec in done.items()
            if isinstance(v := (rec.get("metrics") or {}).get(key), (int, float))
            and math.isfinite(v)
        }
        if len(values) < OUTLIER_MIN_PAIRS:
            continue
        arr = np.array(list(values.values()))
        median = float(np.median(arr))
        spread = 1.4826 * float(np.median(np.abs(arr - median)))
        reach = max(OUTLIER_MADS * spread, OUTLIER_MIN_CHANGE * abs(median))
        if reach == 0:
            continue
        for pid, v in values.items():
            if (v - median if worse == "high" else median - v) > reach:
                u = f" {unit}" if unit else ""
                detail = f"{name} {v:.3g}{u} (median {median:.3g}{u})"
                side = "above" if worse == "high" else "below"
                reason = f"{name} {v:.3g}{u}, far {side} the batch's (median {median:.3g}{u})"
                yield pid, Flag("outlier", reason, key, detail)
