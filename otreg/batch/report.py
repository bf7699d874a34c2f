"""The group QC page of a batch: ``build_report(folder)`` writes ``folder/index.html``.

The page is built from the per-pair records alone (:func:`~otreg.batch.records.find_records`),
so it can be rebuilt after the inputs are gone. It is one self-contained HTML file (inline CSS,
inline SVG drawn here, a small inline script to sort the table; no external resources), which
links to the pictures and folders beside it with relative URLs: it works offline from
``file://`` and when the batch folder is copied elsewhere.

Sections: a header (counts, time), the failures by class, a sortable table of the pairs, a
strip plot per metric, for batches of every pair among three or more subjects a
subject-by-subject distance matrix with a classical MDS map of the subjects, and thumbnails.
Opening ``index.html#sort=KEY`` (or ``#sort=-KEY``, descending) sorts the table by that column
on load.
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
from .records import FAILURE_CLASSES, find_records

__all__ = ["build_report"]

#: Metrics shown in the table, in this order (key, header).
_KEY_METRICS = (
    ("mean_mm", "mean (mm)"),
    ("hausdorff_mm", "Hausdorff (mm)"),
    ("varifold", "varifold"),
    ("jacobian_min", "min Jacobian"),
    ("jacobian_negative_fraction", "folded fraction"),
    ("curvature_correlation", "curvature corr."),
    ("energy", "energy (mm²)"),
    ("before_mean_mm", "mean before (mm)"),
    ("before_hausdorff_mm", "Hausdorff before (mm)"),
)
#: Record-level numbers with a strip plot too, after the metrics.
_RUN_NUMBERS = (("seconds", "seconds"), ("peak_rss_mb", "peak RSS (MB)"))

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.5em;margin:0 0 .2em}h2{font-size:1.2em;margin:1.5em 0 .5em}
table{border-collapse:collapse}
td,th{padding:2px 8px;border-bottom:1px solid #ddd;white-space:nowrap}
.scroll{max-height:75vh;overflow:auto;border:1px solid #ddd;display:inline-block;max-width:100%}
#pairs th{cursor:pointer;background:#f3f3f3;text-align:left;position:sticky;top:0}td.bad{color:#c00}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}tr.failed{background:#fde8e8}
.note{color:#555}.grid{display:flex;flex-wrap:wrap;gap:8px}
figure{margin:0;width:200px;font-size:12px}figure img{width:200px;border:1px solid #ccc}
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
    rows, stale = _rows(folder)
    title = title if title is not None else f"otreg batch: {folder.resolve().name}"
    page = _page(rows, stale, title, distance_metric)
    out = folder / "index.html"
    atomic_write(out, lambda tmp: tmp.write_text(page, encoding="utf-8"))
    return out


def _rows(folder: Path) -> tuple[list[dict], int]:
    """One row per pair id, sorted by pair id (where a pair has two records, e.g. an old
    error.json beside a newer metrics.json: the one finished last), and how many records
    were left out that way."""
    best: dict[str, dict] = {}
    records = find_records(folder)
    for path, rec in records:
        metrics, error, files = (
            rec.get(k) if isinstance(rec.get(k), dict) else {}
            for k in ("metrics", "error", "files")
        )
        rel = path.parent.relative_to(folder).as_posix()
        base = "" if rel == "." else quote(rel) + "/"
        row = {
            "id": str(rec["pair_id"]),
            "done": rec["status"] == "done",
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
        }
        old = best.get(row["id"])
        if old is None or (row["finished"], row["done"]) > (old["finished"], old["done"]):
            best[row["id"]] = row
    return [best[k] for k in sorted(best)], len(records) - len(best)


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


def _page(rows: list[dict], stale: int, title: str, metric: str) -> str:
    n_done = sum(r["done"] for r in rows)
    secs = [r["seconds"] for r in rows if r["seconds"] is not None]
    times = [t for r in rows for t in (_iso(r["started"]), _iso(r["finished"])) if t]
    built = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    facts = [
        f'<span id="n-done">{n_done}</span> done, '
        f'<span id="n-failed">{len(rows) - n_done}</span> failed '
        f'(<span id="n-pairs">{len(rows)}</span> pairs)'
    ]
    if secs:
        facts.append(f"compute time {_duration(sum(secs))} (sum over pairs)")
    if len(times) > 1:
        facts.append(
            f"first start to last finish {_duration((max(times) - min(times)).total_seconds())}"
        )
    facts.append(f'built <time id="built">{built}</time>')
    parts = [f"<h1>{_e(title)}</h1>", f'<p id="summary">{" · ".join(facts)}</p>']
    if stale:
        parts.append(f'<p class="note">{stale} older record(s) of pairs run again left out.</p>')
    if not rows:
        parts.append('<p id="empty">No pairs have finished yet: no records in this folder.</p>')
    else:
        sections = [_failures(rows), _table(rows), _strips(rows), subjects_section(rows, metric)]
        sections.append(_thumbs(rows))
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


def _table(rows: list[dict]) -> str:
    present = [(k, h) for k, h in _KEY_METRICS if any(k in r["metrics"] for r in rows)]
    cols = [("pair", "pair", False), ("status", "status", False), ("class", "error class", False)]
    cols += [(k, h, True) for k, h in present] + [(k, h, True) for k, h in _RUN_NUMBERS]
    cols.append(("host", "host", False))
    head = "".join(
        f'<th data-key="{k}" data-type="{"num" if n else "text"}">{_e(h)}</th>' for k, h, n in cols
    )
    body = []
    for r in rows:
        status = "done" if r["done"] else "failed"
        cls, reason = str(r["error"].get("class") or ""), _line(r["error"].get("reason"))
        cells = [
            f'<td data-v="{_e(r["id"])}"><a href="{_e(r["href"])}">{_e(r["id"])}</a></td>',
            f'<td data-v="{status}">{status}</td>',
            f'<td data-v="{_e(cls)}" title="{_e(reason)}">{_e(cls)}</td>',
        ]
        for k, _, num in cols[3:]:
            if num:
                v = r["metrics"].get(k) if k in dict(present) else r[k]
                raw = "" if v is None else repr(v).replace("inf", "Infinity")
                bad = " bad" if k == "jacobian_min" and v is not None and v <= 0 else ""
                cells.append(f'<td class="num{bad}" data-v="{raw}">{_fmt(v)}</td>')
        cells.append(f'<td data-v="{_e(r["host"])}">{_e(r["host"])}</td>')
        body.append(f'<tr class="pair {status}" data-pair="{_e(r["id"])}">{"".join(cells)}</tr>')
    return (
        '<h2 id="pairs-section">Pairs</h2><p class="note">Click a column header to sort.</p>'
        f'<div class="scroll"><table id="pairs"><thead><tr>{head}</tr></thead>\n<tbody>\n'
        + "\n".join(body)
        + "\n</tbody></table></div>"
    )


def _line(reason: object, limit: int = 400) -> str:
    """The first line of a reason, at most ``limit`` characters."""
    text = str(reason or "").strip().splitlines()
    return text[0][:limit] if text else ""


def _strips(rows: list[dict]) -> str:
    """A strip plot per metric any record has (the key ones first), then seconds and peak
    RSS: one dot per pair, linked to its picture (or folder); outliers (over 3.5 robust
    standard deviations from the median) in red."""
    extra = sorted({k for r in rows for k in r["metrics"]} - {k for k, _ in _KEY_METRICS})
    out = []
    for key, label in (*_KEY_METRICS, *((k, k) for k in extra), *_RUN_NUMBERS):
        run = key in dict(_RUN_NUMBERS)
        pts = [(r, r[key] if run else r["metrics"].get(key)) for r in rows]
        pts = [(r, v) for r, v in pts if v is not None and math.isfinite(v)]
        if pts:
            out.append(_strip(key, label, pts))
    return '<h2 id="strips">Metrics</h2>' + "\n".join(out) if out else ""


def _strip(key: str, label: str, pts: list[tuple[dict, float]]) -> str:
    w, h, pad = 800, 64, 14
    vals = np.array([v for _, v in pts])
    lo, hi, med = float(vals.min()), float(vals.max()), float(np.median(vals))
    mad = 1.4826 * float(np.median(np.abs(vals - med)))
    dots = []
    for i, (r, v) in enumerate(pts):
        x = w / 2 if hi == lo else pad + (v - lo) / (hi - lo) * (w - 2 * pad)
        y = 8 + (h - 30) * ((i * 0.6180339887) % 1.0)  # deterministic jitter
        odd = mad > 0 and abs(v - med) > 3.5 * mad
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
    figs = []
    for r in rows:
        if r["picture"]:
            mean = r["metrics"].get("mean_mm")
            caption = f" mean {_fmt(mean)} mm" if mean is not None else ""
            figs.append(
                f'<figure><a href="{_e(r["picture"])}"><img src="{_e(r["picture"])}" '
                f'loading="lazy" alt="{_e(r["id"])}"></a><figcaption>'
                f'<a href="{_e(r["href"])}">{_e(r["id"])}</a>{caption}</figcaption></figure>'
            )
    return f'<h2 id="thumbs">Pictures</h2><div class="grid">{"".join(figs)}</div>' if figs else ""


def _failures(rows: list[dict]) -> str:
    failed = [r for r in rows if not r["done"]]
    if not failed:
        return '<h2 id="failures">Failures</h2><p>None.</p>'
    counts = Counter(str(r["error"].get("class") or "unknown") for r in failed)
    order = [c for c in FAILURE_CLASSES if c in counts] + sorted(set(counts) - {*FAILURE_CLASSES})
    table = "".join(
        f'<tr class="error-class" data-class="{_e(c)}"><td>{_e(c)}</td>'
        f'<td class="num">{counts[c]}</td></tr>'
        for c in order
    )
    items = []
    for r in failed:
        err = r["error"]
        log = f' <a href="{_e(r["log"])}">log</a>' if r["log"] else ""
        tb = err.get("traceback") if isinstance(err.get("traceback"), str) else ""
        tb = f"<details><summary>traceback</summary><pre>{_e(tb)}</pre></details>" if tb else ""
        items.append(
            f'<li class="failure" data-pair="{_e(r["id"])}"><a href="{_e(r["href"])}">'
            f"{_e(r['id'])}</a> <b>{_e(err.get('class') or 'unknown')}</b> "
            f"<code>{_e(err.get('type') or '')}</code>: "
            f"{_e(_line(err.get('reason')))}{log}{tb}</li>"
        )
    return (
        f'<h2 id="failures">Failures</h2><table class="classes"><thead><tr><th>class</th>'
        f"<th>pairs</th></tr></thead><tbody>{table}</tbody></table><ul>{''.join(items)}</ul>"
    )


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
    if len(names) < 3 or {frozenset(p) for p in subs if p[0] != p[1]} != wanted:
        return ""  # not every pair of subjects, e.g. every subject to a template
    head = '<h2 id="subjects">Subjects</h2>'
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
