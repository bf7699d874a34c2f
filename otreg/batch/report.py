"""The group QC page of a batch: ``build_report(folder)`` writes ``folder/index.html``.

The page is built from the per-pair records alone (:func:`~otreg.batch.records.find_records`),
so it can be rebuilt after the inputs are gone. It is one self-contained HTML file (inline CSS,
inline SVG drawn here, a small inline script to sort the table; no external resources), which
links to the pictures and folders beside it with relative URLs: it works offline from
``file://`` and when the batch folder is copied elsewhere.

The first screen answers the morning's questions: what failed, what looks wrong though it
finished (the flags of :mod:`~otreg.batch.flags`: a hemisphere on the wrong side, two
identical inputs, a metric far from the others), each with its reason, and every pair's
before and after. Then strip plots of the key metrics (the others one click away), for
batches of every pair among three or more subjects a subject-by-subject distance matrix with
a classical MDS map of the subjects, and the pictures. Opening ``index.html#sort=KEY`` (or
``#sort=-KEY``, descending) sorts the table by that column on load.
"""

from __future__ import annotations

import html
import itertools
import math
import os
import re
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

import numpy as np

from ..io import atomic_write
from .flags import describe, flag_pairs
from .records import FAILURE_CLASSES, find_records, overlap_keys, read_plan, unreadable_records

__all__ = ["build_report"]

#: Names of the metrics a record may hold, as the page shows them.
_NAMES = {
    "mean_mm": "mean surface distance after (mm)",
    "before_mean_mm": "mean surface distance before (mm)",
    "prealigned_mean_mm": "mean surface distance after pre-alignment (mm)",
    "mean_ab_mm": "source to target after (mm)",
    "mean_ba_mm": "target to source after (mm)",
    "hausdorff_mm": "Hausdorff distance after (mm)",
    "before_hausdorff_mm": "Hausdorff distance before (mm)",
    "prealigned_hausdorff_mm": "Hausdorff distance after pre-alignment (mm)",
    "varifold": "varifold distance after",
    "jacobian_min": "smallest Jacobian determinant",
    "jacobian_max": "largest Jacobian determinant",
    "jacobian_negative_fraction": "folded fraction",
    "curvature_correlation": "curvature correlation after",
    "before_curvature_correlation": "curvature correlation before",
    "energy": "deformation energy (mm²)",
    "vertex_error_mean_mm": "vertex error, mean (mm)",
    "vertex_error_median_mm": "vertex error, median (mm)",
    "vertex_error_max_mm": "vertex error, max (mm)",
    "seconds": "time (s)",
    "read_seconds": "reading the inputs (s)",
    "peak_rss_mb": "peak memory (MB)",
}
#: The strip plots on show; the other metrics' are one click away.
_KEY_STRIPS = ("mean_mm", "hausdorff_mm", "jacobian_min", "varifold", "curvature_correlation")
#: Numbers of a record that say how it ran, not how well it registered: no strip plot.
_BOOKKEEPING = {
    "source_vertices",
    "target_vertices",
    "jacobian_points",
    "prealign_seconds",
    "fit_seconds",
    "metrics_seconds",
    "seconds",
    "read_seconds",
    "sinkhorn_unconverged_evaluations",
}
#: The table's columns of metrics: (header, before key, after key); one key: no before.
_TABLE = (
    ("mean dist. (mm)", "before_mean_mm", "mean_mm"),
    ("Hausdorff (mm)", "before_hausdorff_mm", "hausdorff_mm"),
    ("curv. corr.", "before_curvature_correlation", "curvature_correlation"),
    ("min Jacobian", None, "jacobian_min"),
    ("varifold", None, "varifold"),
)


def _name(key: str) -> str:
    """A metric's name on the page (``sulc_correlation`` -> ``sulc correlation``)."""
    if key in _NAMES:
        return _NAMES[key]
    if key.endswith("_dice"):
        when = "before" if key.startswith("before_") else "after"
        return f"label overlap {key.removeprefix('before_')[:-5]} (Dice) {when}"
    text = key.replace("_", " ")
    return text[:-3] + " (mm)" if text.endswith(" mm") else text


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.5em;margin:0 0 .2em}h2{font-size:1.2em;margin:1.2em 0 .4em}
table{border-collapse:collapse}
td,th{padding:2px 8px;border-bottom:1px solid #ddd;white-space:nowrap}
.scroll{max-height:60vh;overflow:auto;border:1px solid #ddd;display:inline-block;max-width:100%}
#pairs th{cursor:pointer;background:#f3f3f3;text-align:left;position:sticky;top:0}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}td.bad{color:#c00;font-weight:600}
tr.failed{background:#fde8e8}tr.flagged{background:#fff4d6}td.why{white-space:normal;max-width:60em}
#attention{border-left:4px solid #e0a000;padding:.2em .8em;background:#fffaf0}
#attention.clear{border-color:#2ca02c;background:#f3fbf3}
#attention tr.flag{background:#fff4d6}#attention tr.not-run,tr.not-run{background:#eef1f5}
#attention tr.failure,#attention tr.unreadable{background:#fde8e8}
.note{color:#555}.grid{display:flex;flex-wrap:wrap;gap:12px}
figure{margin:0;width:360px;font-size:12px}figure img{width:360px;border:1px solid #ccc}
pre{white-space:pre-wrap;font-size:12px;background:#f6f6f6;padding:.5em}
svg text{font:11px sans-serif}
"""

_SCRIPT = """
function sortTable(key, desc) {
  const table = document.getElementById('pairs');
  const heads = table ? [...table.tHead.rows[0].cells] : [];
  const col = heads.findIndex((h) => h.dataset.key === key);
  if (col < 0) return false;
  const num = heads[col].dataset.type === 'num', body = table.tBodies[0];
  heads.forEach((h, i) => h.toggleAttribute('aria-sort', i === col));
  heads[col].setAttribute('aria-sort', desc ? 'descending' : 'ascending');
  const value = (r) => (num ? parseFloat(r.cells[col].dataset.v) : r.cells[col].dataset.v);
  const rows = [...body.rows].sort((a, b) => {
    const x = value(a), y = value(b);
    if (!num) return desc ? y.localeCompare(x) : x.localeCompare(y);
    if (isNaN(x) || isNaN(y)) return isNaN(x) - isNaN(y);  // blanks last
    return desc ? y - x : x - y;
  });
  rows.forEach((r) => body.appendChild(r));
  return true;
}
window.sortTable = sortTable;
function sortFromHash() {
  const m = /^#sort=(-?)(.+)$/.exec(location.hash);
  if (m) sortTable(decodeURIComponent(m[2]), m[1] === '-');
}
document.querySelectorAll('#pairs th').forEach((th) => th.addEventListener('click',
  () => sortTable(th.dataset.key, th.getAttribute('aria-sort') === 'ascending')));
window.addEventListener('hashchange', sortFromHash);
sortFromHash();
"""


def build_report(
    folder: str | os.PathLike, title: str | None = None, distance_metric: str = "energy"
) -> Path:
    """Write the group QC page of a batch folder, from its records only.

    Args:
        folder: the batch folder (records anywhere below it, see ``find_records``).
        title: the page's title; default ``"otreg batch: <folder name>"``.
        distance_metric: the metric of the subject-by-subject distance matrix (all-pairs
            batches of >= 3 subjects). ``"energy"`` (mm^2) is shown as sqrt(energy) in mm;
            other metrics as they are. Where a record lacks it, ``before_mean_mm`` is used
            instead and the page says so.

    Returns:
        The path of ``folder/index.html`` (written atomically).

    Raises:
        TypeError: ``folder``, ``title`` or ``distance_metric`` of the wrong type.
        FileNotFoundError: ``folder`` does not exist.
        NotADirectoryError: ``folder`` is a file.

    Example:
        >>> import tempfile
        >>> from otreg.batch import build_report
        >>> build_report(tempfile.mkdtemp()).name     # a folder with no records yet: an empty page
        'index.html'
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"build_report: folder must be a path, got {type(folder).__name__}")
    for name, value in (("title", title), ("distance_metric", distance_metric)):
        if not isinstance(value, str) and not (name == "title" and value is None):
            raise TypeError(f"build_report: {name} must be a string, got {type(value).__name__}")
    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"build_report: batch folder {folder} does not exist")
    if not folder.is_dir():
        raise NotADirectoryError(f"build_report: {folder} is not a folder")
    rows, stale, foreign = _rows(folder)
    title = title if title is not None else f"otreg batch: {folder.resolve().name}"
    page = _page(rows, (stale, foreign), unreadable_records(folder), title, distance_metric)
    out = folder / "index.html"
    atomic_write(out, lambda tmp: tmp.write_text(page, encoding="utf-8"))
    return out


def _rows(folder: Path) -> tuple[list[dict], int, int]:
    """One row per pair id, sorted by pair id, with its flags; how many records were left
    out as older ones of a pair (where a pair has two records, e.g. an old error.json beside
    a newer metrics.json: the one of the last run's inputs and options, else the one
    finished last), and how many as records of pairs the last run did not plan (a folder
    used for an earlier batch of other pairs: as summary.csv does)."""
    best: dict[str, dict] = {}
    records = find_records(folder)
    plan = read_plan(folder)
    foreign = 0
    if plan is not None:
        foreign = sum(str(rec["pair_id"]) not in plan for _, rec in records)
        records = [(path, rec) for path, rec in records if str(rec["pair_id"]) in plan]
    plan = plan or {}
    for path, rec in records:
        metrics, error, files = (
            rec.get(k) if isinstance(rec.get(k), dict) else {}
            for k in ("metrics", "error", "files")
        )
        rel = path.parent.relative_to(folder).as_posix()
        base = "" if rel == "." else quote(rel) + "/"
        pid = str(rec["pair_id"])
        row = {
            "id": pid,
            "done": rec["status"] == "done",
            # a record of earlier inputs or options: the last run planned the pair again
            "outdated": pid in plan and str(rec.get("key")) != plan[pid],
            "metrics": {k: _num(v) for k, v in metrics.items() if _num(v) is not None},
            "error": error,
            "href": base or "./",
            "picture": _file_link(path.parent, base, files.get("picture")),
            "log": _file_link(path.parent, base, files.get("log")),
            "subjects": (rec.get("source_subject"), rec.get("target_subject")),
            "started": str(rec.get("started") or ""),
            "finished": str(rec.get("finished") or ""),
            "seconds": _num(rec.get("seconds")),
            "peak_rss_mb": _num(rec.get("peak_rss_mb")),
            "host": str(rec.get("host") or ""),
            "record": rec,
        }
        old = best.get(row["id"])
        rank = (not row["outdated"], row["finished"], row["done"])
        if old is None or rank > (not old["outdated"], old["finished"], old["done"]):
            best[row["id"]] = row
    stale = len(records) - len(best)
    for pid in set(plan) - set(best):  # planned, never finished: as summary.csv says
        best[pid] = {
            "id": pid, "done": False, "outdated": True, "metrics": {}, "error": {},
            "href": "./", "picture": None, "log": None, "subjects": (None, None),
            "started": "", "finished": "", "seconds": None, "peak_rss_mb": None, "host": "",
            "record": None,
        }  # fmt: skip
    for row in best.values():
        row["state"] = "not run" if row["outdated"] else "done" if row["done"] else "failed"
        if row["outdated"]:  # its numbers and picture are of other inputs or options
            row.update(done=False, metrics={}, error={}, picture=None, seconds=None)
    current = {pid: row["record"] for pid, row in best.items() if not row["outdated"]}
    flags = flag_pairs(current)
    for pid, row in best.items():
        row["flags"] = flags.get(pid, [])
    return [best[k] for k in sorted(best)], stale, foreign


def _file_link(where: Path, base: str, name: object) -> str | None:
    """The quoted relative URL of a file named by a record, if it is a plain name (no folder
    part) of a file that exists beside the record."""
    if not isinstance(name, str) or not name or Path(name).name != name:
        return None
    return base + quote(name) if (where / name).is_file() else None


def _num(value: object) -> float | None:
    """A number as a float; None for NaN, booleans and anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) else float(value)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.3g} s"
    m = round(seconds / 60)
    return f"{m} min" if m < 60 else f"{m // 60} h {m % 60} min"


def _iso(text: str) -> datetime | None:
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _page(
    rows: list[dict], left: tuple[int, int], unreadable: list[Path], title: str, metric: str
) -> str:
    n_done = sum(r["state"] == "done" for r in rows)
    n_failed = sum(r["state"] == "failed" for r in rows)
    n_flagged = sum(bool(r["flags"]) for r in rows)
    secs = [r["seconds"] for r in rows if r["seconds"] is not None]
    times = [t for r in rows for t in (_iso(r["started"]), _iso(r["finished"])) if t]
    built = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    facts = [
        f'<span id="n-pairs">{len(rows)}</span> pairs: <span id="n-done">{n_done}</span> '
        f'done, <span id="n-failed">{n_failed}</span> failed, '
        f'<span id="n-flagged">{n_flagged}</span> flagged'
        + (
            f', <span id="n-not-run">{len(rows) - n_done - n_failed}</span> not run'
            if len(rows) > n_done + n_failed
            else ""
        )
        + (f", {len(unreadable)} unreadable record(s)" if unreadable else "")
    ]
    if secs:
        facts.append(f"compute time {_duration(sum(secs))} (sum over pairs)")
    if len(times) > 1:
        facts.append(
            f"first start to last finish {_duration((max(times) - min(times)).total_seconds())}"
        )
    facts.append(f'built <time id="built">{built}</time>')
    parts = [f"<h1>{_e(title)}</h1>", f'<p id="summary">{" · ".join(facts)}</p>']
    stale, foreign = left
    if stale:
        parts.append(f'<p class="note">{stale} older record(s) of pairs run again left out.</p>')
    if foreign:
        parts.append(
            f'<p class="note">{foreign} record(s) of pairs not in the last run\'s manifest '
            "left out (an earlier batch of other pairs in this folder).</p>"
        )
    if not rows and not unreadable:
        parts.append('<p id="empty">No pairs have finished yet: no records in this folder.</p>')
    else:
        sections = [
            _attention(rows, unreadable),
            _table(rows),
            _strips(rows),
            subjects_section(rows, metric),
            _thumbs(rows),
        ]
        nav = re.findall(r'<h2 id="([^"]+)">([^<]+)</h2>', "".join(sections))
        parts.append("<p>" + " · ".join(f'<a href="#{a}">{b}</a>' for a, b in nav) + "</p>")
        parts += sections
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_e(title)}</title>\n<style>{_CSS}</style></head>\n<body>\n"
        + "\n".join(p for p in parts if p)
        + f"\n<script>{_SCRIPT}</script>\n</body></html>\n"
    )


def _attention(rows: list[dict], unreadable: list[Path]) -> str:
    """What failed, what looks wrong though it finished, and the records that cannot be
    read: one line each, with the reason (a failure's traceback and log one click away)."""
    items = []
    for r in rows:
        link = f'<a href="{_e(r["href"])}">{_e(r["id"])}</a>'
        if r["state"] == "not run":
            items.append(
                f'<tr class="not-run" data-pair="{_e(r["id"])}"><td>{link}</td><td><b>not run'
                '</b></td><td class="why">the last run planned it (new inputs or options, or '
                "never run) and did not finish it: the next run does</td></tr>"
            )
        elif not r["done"]:
            err = r["error"]
            log = f' <a href="{_e(r["log"])}">log</a>' if r["log"] else ""
            tb = err.get("traceback") if isinstance(err.get("traceback"), str) else ""
            tb = f"<details><summary>traceback</summary><pre>{_e(tb)}</pre></details>" if tb else ""
            items.append(
                f'<tr class="failure" data-pair="{_e(r["id"])}"><td>{link}</td><td><b>failed: '
                f'{_e(err.get("class") or "unknown")}</b></td><td class="why">'
                f"{_e(_reason(err))}{log}{tb}</td></tr>"
            )
        if r["flags"]:
            kinds = ", ".join(dict.fromkeys(f.kind for f in r["flags"]))
            items.append(
                f'<tr class="flag" data-pair="{_e(r["id"])}" data-kind="{_e(kinds)}">'
                f"<td>{link}</td><td><b>{_e(kinds)}</b></td>"
                f'<td class="why">{_e(describe(r["flags"]))}</td></tr>'
            )
    for path in unreadable:
        items.append(
            f'<tr class="unreadable"><td>{_e(path.parent.name)}</td><td><b>unreadable record'
            f'</b></td><td class="why">{_e(path.name)} cannot be read (truncated or edited?): '
            "rerun the batch to redo this pair</td></tr>"
        )
    if not items:
        return (
            '<h2 id="attention-head">Needs attention</h2><p id="attention" class="clear">'
            "Every pair finished, and nothing looks unusual.</p>"
        )
    failed = [r for r in rows if r["state"] == "failed"]
    counts = Counter(str(r["error"].get("class") or "unknown") for r in failed)
    order = [c for c in FAILURE_CLASSES if c in counts] + sorted(set(counts) - {*FAILURE_CLASSES})
    by_class = ", ".join(
        f'<span class="error-class" data-class="{_e(c)}">{counts[c]} {_e(c)}</span>' for c in order
    )
    head = f"<p>Failed: {by_class}.</p>" if failed else ""
    return (
        f'<h2 id="attention-head">Needs attention</h2><div id="attention">{head}'
        f'<table class="attention"><tbody>{"".join(items)}</tbody></table></div>'
    )


def _reason(err: dict) -> str:
    """A failure's reason without the exception's name repeated in front of it."""
    reason, kind = _line(err.get("reason")), str(err.get("type") or "")
    while kind and reason.startswith(f"{kind}: "):
        reason = reason[len(kind) + 2 :]
    return f"{kind}: {reason}" if kind and reason else reason or kind


def _table(rows: list[dict]) -> str:
    """Every pair, its flags, and before and after side by side; flagged values marked."""
    overlaps = [
        (f"{k[:-5]} Dice", f"before_{k}", k) for k in overlap_keys(r["metrics"] for r in rows)
    ]
    # the label overlaps first: where a batch carried labels, they are what it is for
    present = [c for c in (*overlaps, *_TABLE) if any(c[2] in r["metrics"] for r in rows)]
    head = ['<th data-key="pair" data-type="text">pair</th>']
    head.append('<th data-key="status" data-type="text">status</th>')
    head.append('<th data-key="flags" data-type="text">flags</th>')
    for label, before, after in present:
        if before is not None:
            head.append(f'<th data-key="{before}" data-type="num">{_e(label)} before</th>')
        head.append(
            f'<th data-key="{after}" data-type="num">{"after" if before else _e(label)}</th>'
        )
    head.append('<th data-key="seconds" data-type="num">time (s)</th>')
    head.append('<th data-key="picture" data-type="text">picture</th>')
    body = []
    for r in rows:
        status = r["state"]
        if status == "failed":
            status_cell = f"failed: {_e(r['error'].get('class') or 'unknown')}"
        else:
            status_cell = status
        marked = {f.metric: f.reason for f in r["flags"] if f.metric}
        kinds = ", ".join(dict.fromkeys(f.kind for f in r["flags"]))
        why = describe(r["flags"])
        cells = [
            f'<td data-v="{_e(r["id"])}"><a href="{_e(r["href"])}">{_e(r["id"])}</a></td>',
            f'<td data-v="{status}">{status_cell}</td>',
            f'<td data-v="{_e(kinds)}" title="{_e(why)}">{_e(kinds)}</td>',
        ]
        for _, before, after in present:
            for key in (before, after):
                if key is None:
                    continue
                v = r["metrics"].get(key)
                raw = "" if v is None else repr(v).replace("inf", "Infinity")
                bad = key in marked or (key == "jacobian_min" and v is not None and v <= 0)
                title = f' title="{_e(marked[key])}"' if key in marked else ""
                cells.append(
                    f'<td class="num{" bad" if bad else ""}" data-v="{raw}"{title}>{_fmt(v)}</td>'
                )
        secs = r["seconds"]
        cells.append(f'<td class="num" data-v="{"" if secs is None else secs}">{_fmt(secs)}</td>')
        pic = f'<a href="{_e(r["picture"])}">picture</a>' if r["picture"] else ""
        cells.append(f'<td data-v="{_e(r["picture"] or "")}">{pic}</td>')
        kind = r["state"] if r["state"] != "done" else "flagged" if r["flags"] else "done"
        kind = kind.replace(" ", "-")
        body.append(f'<tr class="pair {kind}" data-pair="{_e(r["id"])}">{"".join(cells)}</tr>')
    return (
        '<h2 id="pairs-section">Pairs</h2><p class="note">Before and after each '
        "registration; click a column header to sort, a pair for its folder.</p>"
        f'<div class="scroll"><table id="pairs"><thead><tr>{"".join(head)}</tr></thead>\n'
        "<tbody>\n" + "\n".join(body) + "\n</tbody></table></div>"
    )


def _line(reason: object, limit: int = 400) -> str:
    """The first line of a reason, at most ``limit`` characters."""
    text = str(reason or "").strip().splitlines()
    return text[0][:limit] if text else ""


def _strips(rows: list[dict]) -> str:
    """A strip plot per key metric, one dot per pair linked to its picture (or folder),
    flagged values in red; the other metrics' (not the bookkeeping) one click away."""
    overlaps = overlap_keys(r["metrics"] for r in rows)
    key_strips = (*overlaps, *(f"before_{k}" for k in overlaps), *_KEY_STRIPS)
    keys = sorted(
        {k for r in rows for k in r["metrics"]} - _BOOKKEEPING - set(key_strips),
        key=lambda k: (k not in _NAMES, _name(k)),
    )

    def plots(names):
        out = []
        for key in names:
            run = key in ("seconds", "peak_rss_mb")
            pts = [(r, r[key] if run else r["metrics"].get(key)) for r in rows]
            pts = [(r, v) for r, v in pts if v is not None and math.isfinite(v)]
            if pts:
                out.append(_strip(key, _name(key), pts))
        return out

    shown = plots(key_strips)
    more = plots((*keys, "seconds", "peak_rss_mb"))
    if not shown and not more:
        return ""
    extra = (
        f'<details id="more-metrics"><summary>{len(more)} more: the other metrics, time '
        "and memory</summary>" + "\n".join(more) + "</details>"
        if more
        else ""
    )
    return '<h2 id="strips">Metrics</h2>' + "\n".join(shown) + extra


def _strip(key: str, label: str, pts: list[tuple[dict, float]]) -> str:
    w, h, pad = 800, 64, 14
    vals = np.array([v for _, v in pts])
    lo, hi, med = float(vals.min()), float(vals.max()), float(np.median(vals))
    dots = []
    for i, (r, v) in enumerate(pts):
        x = w / 2 if hi == lo else pad + (v - lo) / (hi - lo) * (w - 2 * pad)
        y = 8 + (h - 30) * ((i * 0.6180339887) % 1.0)  # deterministic jitter
        # red: the pairs flagged as far from the batch on this metric (the flags' rule), and
        # a fold
        odd = any(f.metric == key for f in r["flags"]) or (key == "jacobian_min" and v <= 0)
        href = r["picture"] or r["href"]
        dots.append(
            f'<a class="dot" href="{_e(href)}"><circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" '
            f'fill="{"#d62728" if odd else "#1f77b4"}" fill-opacity="0.7">'
            f"<title>{_e(r['id'])}: {_fmt(v)}</title></circle></a>"
        )
    axis = (
        f'<line x1="{pad}" x2="{w - pad}" y1="{h - 18}" y2="{h - 18}" stroke="#999"/>'
        f'<text x="{pad}" y="{h - 4}">{_fmt(lo)}</text>'
        f'<text x="{w / 2}" y="{h - 4}" text-anchor="middle">median {_fmt(med)}</text>'
        f'<text x="{w - pad}" y="{h - 4}" text-anchor="end">{_fmt(hi)}</text>'
    )
    return (
        f'<div class="strip-row"><b>{_e(label)}</b> <span class="note">({len(pts)} pairs)</span>'
        f'<br><svg class="strip" data-metric="{_e(key)}" width="{w}" height="{h}" '
        f'viewBox="0 0 {w} {h}" role="img" aria-label="{_e(label)}">'
        + "".join(dots)
        + axis
        + "</svg></div>"
    )


def _thumbs(rows: list[dict]) -> str:
    """The pictures, the flagged pairs' first."""
    figs = []
    for r in sorted(rows, key=lambda r: not r["flags"]):
        if r["picture"]:
            mean = r["metrics"].get("mean_mm")
            caption = f" mean {_fmt(mean)} mm" if mean is not None else ""
            figs.append(
                f'<figure><a href="{_e(r["picture"])}"><img src="{_e(r["picture"])}" '
                f'loading="lazy" alt="{_e(r["id"])}"></a><figcaption>'
                f'<a href="{_e(r["href"])}">{_e(r["id"])}</a>{caption}</figcaption></figure>'
            )
    return f'<h2 id="thumbs">Pictures</h2><div class="grid">{"".join(figs)}</div>' if figs else ""


# ----------------------------------------------------------------------- text


def _fmt(value: float | None) -> str:
    """3 significant digits, thousands separators from 1,000 on; blank for None."""
    if value is None or math.isinf(value):
        return "" if value is None else str(value)
    a = abs(value)
    if a == 0 or 1e-3 <= a < 999.5:
        return f"{value:.3g}"
    return f"{value:,.0f}" if a >= 999.5 else f"{value:.2e}"


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


# ------------------------------------------------ subjects: distances and MDS map


def subjects_section(rows: list[dict], metric: str) -> str:
    """The distance matrix and MDS map of the subjects, for a batch whose records cover every
    pair of >= 3 subjects (else nothing, or a note on why not where every pair was run)."""
    subs = [r["subjects"] for r in rows]
    if not all(isinstance(s, str) and s for pair in subs for s in pair):
        return ""
    names = sorted({s for pair in subs for s in pair})
    wanted = {frozenset(p) for p in itertools.combinations(names, 2)}
    head = '<h2 id="subjects">Subjects</h2>'
    if len(names) < 3 or len({b for _, b in subs}) < 2:
        return ""  # every subject onto one template: no subject-by-subject view to draw
    missing = wanted - {frozenset(p) for p in subs if p[0] != p[1]}
    if missing:
        example = " and ".join(sorted(next(iter(sorted(missing, key=sorted)))))
        return (
            f'{head}<p class="note" id="no-matrix">No subject-by-subject distances: the '
            f"records cover {len(wanted) - len(missing)} of the {len(wanted)} pairs of these "
            f"{len(names)} subjects (none for {_e(example)}, for one). Register every pair "
            "(otreg manifest all-pairs) for the distance matrix and the map.</p>"
        )
    for key in dict.fromkeys((metric, "before_mean_mm")):
        vals: dict[frozenset, dict[tuple, list[float]]] = {p: {} for p in wanted}
        for r in rows:
            v = r["metrics"].get(key)
            a, b = r["subjects"]
            if r["done"] and a != b and v is not None and math.isfinite(v):
                v = math.sqrt(max(v, 0.0)) if key == "energy" else v
                vals[frozenset(r["subjects"])].setdefault(r["subjects"], []).append(v)
        if all(vals.values()):
            break
    else:
        lacking = sum(not v for v in vals.values())
        return (
            f'{head}<p class="note" id="no-matrix">No subject-by-subject distances: '
            f"{lacking} of {len(wanted)} subject pairs have no finished registration with "
            f"{_e(metric)} or before_mean_mm.</p>"
        )
    index = {s: i for i, s in enumerate(names)}
    d = np.zeros((len(names), len(names)))
    for p, by_direction in vals.items():
        a, b = sorted(p)
        d[index[a], index[b]] = d[index[b], index[a]] = np.mean(
            [np.mean(v) for v in by_direction.values()]
        )
    what = {"energy": "sqrt(energy): the length of the deformation, mm"}.get(key, key)
    if key == "before_mean_mm":
        what = "before_mean_mm: the mean surface distance before registration, mm"
    note = (
        f'<p class="note" id="distance-metric">Distance: {_e(what)}; the mean of both '
        "directions where both were run."
        + (f" ({_e(metric)} is missing from some records.)" if key != metric else "")
        + "</p>"
    )
    coords, eig = _classical_mds(d)
    pos = np.clip(eig, 0.0, None)
    kept = float(pos[:2].sum() / pos.sum()) if pos.sum() > 0 else 1.0
    return (
        f"{head}{note}{_heatmap(names, d)}<p>Classical MDS of these distances (2 dimensions "
        f"keep {kept:.0%} of the positive eigenvalues):</p>{_scatter(names, coords)}"
    )


def _classical_mds(d: np.ndarray, dim: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Classical (Torgerson) MDS: points whose Euclidean distances best match ``d``.

    Done here with numpy (double centering, then ``numpy.linalg.eigh``) because scikit-learn
    is not a dependency, and its ``MDS`` is iterative SMACOF from a random start, while this
    is exact, fast for a few hundred subjects and the same on every rebuild.

    Args:
        d: (n, n) symmetric distances.
        dim: the number of coordinates.

    Returns:
        (n, dim) coordinates (axes by decreasing eigenvalue, each signed so that its largest
        entry is positive) and the (n,) eigenvalues, decreasing.
    """
    d = np.asarray(d, dtype=np.float64)
    n = d.shape[0]
    j = np.eye(n) - 1.0 / n
    b = -0.5 * j @ (d**2) @ j
    w, v = np.linalg.eigh((b + b.T) / 2)
    w, v = w[::-1], v[:, ::-1]
    x = np.zeros((n, dim))
    k = min(dim, n)
    x[:, :k] = v[:, :k] * np.sqrt(np.clip(w[:k], 0.0, None))
    signs = np.sign(x[np.abs(x).argmax(axis=0), np.arange(dim)])
    return x * np.where(signs == 0, 1.0, signs), w


def _color(t: float) -> str:
    """A viridis-like colour for t in [0, 1]."""
    stops = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
    t = min(max(t, 0.0), 1.0) * (len(stops) - 1)
    i = min(int(t), len(stops) - 2)
    c = [round(a + (b - a) * (t - i)) for a, b in zip(stops[i], stops[i + 1])]
    return "#{:02x}{:02x}{:02x}".format(*c)


def _heatmap(names: list[str], d: np.ndarray) -> str:
    n, off = len(names), d[~np.eye(len(names), dtype=bool)]
    lo, hi = float(off.min()), float(off.max())  # the colour scale leaves out the diagonal
    cell = max(6, min(36, 600 // n))
    margin = 12 + 7 * min(max(len(s) for s in names), 24)
    size = margin + n * cell
    out = [f'<svg class="matrix" width="{size + 10}" height="{size + 30}" role="img">']
    for i, a in enumerate(names):
        out.append(
            f'<text x="{margin - 4}" y="{margin + (i + 0.5) * cell + 4:.1f}" '
            f'text-anchor="end">{_e(a)}</text><text transform="translate('
            f'{margin + (i + 0.5) * cell + 4:.1f},{margin - 4}) rotate(-90)">{_e(a)}</text>'
        )
        for j, b in enumerate(names):
            fill = "#ddd" if i == j else _color((d[i, j] - lo) / ((hi - lo) or 1.0))
            out.append(
                f'<rect class="cell" x="{margin + j * cell}" y="{margin + i * cell}" '
                f'width="{cell}" height="{cell}" fill="{fill}">'
                f"<title>{_e(a)} – {_e(b)}: {_fmt(float(d[i, j]))}</title></rect>"
            )
    out.append(
        f'<text x="{margin}" y="{size + 20}">dark: {_fmt(lo)}, yellow: {_fmt(hi)}</text></svg>'
    )
    return "".join(out)


def _scatter(names: list[str], xy: np.ndarray) -> str:
    w, pad = 480, 60
    lo, span = xy.min(axis=0), float(np.ptp(xy, axis=0).max()) or 1.0
    p = pad + (xy - lo) / span * (w - 2 * pad)  # one scale for both axes
    h = round(float(p[:, 1].max()) + pad)
    out = [f'<svg class="mds" width="{w}" height="{h}" role="img">']
    for name, (x, y) in zip(names, p):
        out.append(
            f'<circle class="subject" cx="{x:.1f}" cy="{h - y:.1f}" r="4" fill="#1f77b4">'
            f'<title>{_e(name)}</title></circle><text x="{x + 6:.1f}" y="{h - y - 6:.1f}">'
            f"{_e(name)}</text>"
        )
    return "".join(out) + "</svg>"
