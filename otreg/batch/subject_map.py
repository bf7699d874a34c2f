"""The subjects section of the group page (:mod:`otreg.batch.report`), for batches of every
pair among three or more subjects: a subject-by-subject distance matrix drawn as a heatmap
and a classical MDS map of the subjects, both inline SVG."""

from __future__ import annotations

import itertools
import math

import numpy as np

from ._text import _e, _fmt

__all__ = ["subjects_section"]


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
