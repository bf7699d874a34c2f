"""The batch's tables: ``summary.csv`` (one row a pair, with its flags:
:mod:`~otreg.batch.flags`) and ``failed.csv``."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ..io import atomic_write
from .flags import describe, flag_pairs
from .manifest import Pair
from .records import find_records, overlap_keys, write_plan

__all__: list[str] = []

SUMMARY_METRICS = (
    "before_mean_mm",
    "mean_mm",
    "hausdorff_mm",
    "varifold",
    "jacobian_min",
    "jacobian_negative_fraction",
    "energy",
)


def write_tables(out: Path, pairs: Sequence[Pair], records: Mapping[str, dict]) -> int:
    """``summary.csv`` (one row a pair) and ``failed.csv`` (the failed ones), atomically;
    returns the number of flagged pairs."""
    flags = flag_pairs({p.pair_id: records[p.pair_id] for p in pairs if p.pair_id in records})
    overlaps = [  # the label overlaps, before and after, where the batch measured them
        key
        for after in overlap_keys(r.get("metrics") or {} for r in records.values())
        for key in (f"before_{after}", after)
    ]
    columns = [
        "pair_id",
        "status",
        "flags",
        "class",
        "reason",
        "seconds",
        "peak_rss_mb",
        "host",
        "threads",
        *SUMMARY_METRICS,
        *overlaps,
        "folder",
    ]
    rows, failed = [], []
    for pair in pairs:
        rec = records.get(pair.pair_id) or {}
        err = rec.get("error") or {}
        row = {
            "pair_id": pair.pair_id,
            "status": rec.get("status", "not run"),
            "flags": describe(flags.get(pair.pair_id, [])),
            "class": err.get("class", ""),
            "reason": err.get("reason", ""),
            "seconds": _num(rec.get("seconds")),
            "peak_rss_mb": _num(rec.get("peak_rss_mb")),
            "host": rec.get("host", ""),
            "threads": rec.get("threads", ""),
            "folder": pair.folder,
        }
        for m in (*SUMMARY_METRICS, *overlaps):
            row[m] = _num((rec.get("metrics") or {}).get(m))
        rows.append(row)
        if rec.get("status") == "failed":
            failed.append(
                {
                    "pair_id": pair.pair_id,
                    "class": err.get("class", ""),
                    "type": err.get("type", ""),
                    "reason": err.get("reason", ""),
                    "folder": pair.folder,
                }
            )
    for name, cols, data in (
        ("summary.csv", columns, rows),
        ("failed.csv", ["pair_id", "class", "type", "reason", "folder"], failed),
    ):
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
        writer.writeheader()
        writer.writerows(data)
        text = buf.getvalue()
        if name == "failed.csv" and not failed:
            (out / name).unlink(missing_ok=True)
            continue
        atomic_write(out / name, lambda tmp, text=text: tmp.write_text(text))
    return len(flags)


def tables_from_records(out: str | Path, expected: Iterable[Pair] = ()) -> int:
    """``summary.csv`` and ``failed.csv`` from every record in a folder (several runs'
    pairs, e.g. one BIDS participant job a subject), with the ``expected`` pairs that have
    no record as "not run" (a job killed before it wrote one); returns the number of
    pairs. The group page then lists them too: ``plan.json`` gets every pair, a recorded
    one with its record's key."""
    out = Path(out)
    records: dict[str, dict] = {}
    folders: dict[str, Path] = {}
    for path, doc in find_records(out):
        old = records.get(doc["pair_id"])
        if old is None or str(doc.get("finished", "")) > str(old.get("finished", "")):
            records[doc["pair_id"]] = doc
            folders[doc["pair_id"]] = path.parent.relative_to(out)
    pairs = [
        Pair(pid, doc.get("source") or "?", doc.get("target") or "?", folder=str(folders[pid]))
        for pid, doc in records.items()
    ]
    pairs += [p for p in {p.pair_id: p for p in expected}.values() if p.pair_id not in records]
    pairs.sort(key=lambda p: p.pair_id)
    write_tables(out, pairs, records)
    # the page's pairs: each recorded one with its record's key, the others "not run"
    write_plan(out, {p.pair_id: str((records.get(p.pair_id) or {}).get("key", "")) for p in pairs})
    return len(pairs)


def _num(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return str(value)
