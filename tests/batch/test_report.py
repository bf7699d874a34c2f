"""build_report: the group QC page of a batch, from synthetic records (and in a real headless
browser where chromium is installed)."""

import html
import itertools
import json
import math
import re
import shutil
import subprocess
from html.parser import HTMLParser
from urllib.parse import unquote, urlparse

import matplotlib.image as mpimg
import numpy as np
import pytest

from otreg.batch import FORMAT, build_report
from otreg.batch.report import _classical_mds


class Elements(HTMLParser):
    """Every start tag of a page: (tag, attributes)."""

    def __init__(self, page):
        super().__init__()
        self.found = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict(attrs)))

    def all(self, tag, **attrs):
        return [
            a
            for t, a in self.found
            if t == tag and all(a.get(k.rstrip("_")) == v for k, v in attrs.items())
        ]


def classes(attrs):
    return (attrs.get("class") or "").split()


@pytest.fixture(scope="module")
def png_bytes(tmp_path_factory):
    """A small real PNG (matplotlib), copied as each pair's picture."""
    path = tmp_path_factory.mktemp("png") / "p.png"
    x = np.linspace(0, 1, 48)
    mpimg.imsave(path, np.sin(8 * x)[:, None] * np.cos(5 * x)[None, :], cmap="viridis")
    return path.read_bytes()


def record(folder, pid, status="done", metrics=None, error=None, picture=None, **fields):
    """Write one pair's record (and picture) under ``folder/pairs/<pid>``; return its path."""
    where = folder / "pairs" / pid
    where.mkdir(parents=True, exist_ok=True)
    rec = {
        "format": FORMAT,
        "pair_id": pid,
        "status": status,
        "key": "0" * 16,
        "source": f"/data/{pid}/source.gii",
        "target": f"/data/{pid}/target.gii",
        "source_subject": None,
        "target_subject": None,
        "hemisphere": "L",
        "options": {"model": "lddmm"},
        "seconds": 60.0,
        "peak_rss_mb": 900.0,
        "host": "node1",
        "pid": 1234,
        "threads": 2,
        "started": "2025-01-01T00:00:00+00:00",
        "finished": "2025-01-01T00:01:00+00:00",
        "otreg_version": "0.1.0",
        "files": {"log": "log.txt"},
    }
    rec.update(fields)
    if status == "done":
        rec["metrics"] = {"mean_mm": 1.0, "hausdorff_mm": 5.0} if metrics is None else metrics
    else:
        rec["error"] = error or {"class": "error", "type": "RuntimeError", "reason": "boom"}
    (where / "log.txt").write_text("log\n")
    if picture is not None:
        (where / "picture.png").write_bytes(picture)
        rec["files"]["picture"] = "picture.png"
    path = where / ("metrics.json" if status == "done" else "error.json")
    path.write_text(json.dumps(rec))
    return path


@pytest.fixture
def batch(tmp_path, png_bytes):
    """Four done pairs (two with pictures, one id needing URL quoting) and two failures."""
    record(tmp_path, "s1_to_t", metrics={"mean_mm": 1.5, "hausdorff_mm": 6.0}, picture=png_bytes)
    record(tmp_path, "s2+b_to_t", metrics={"mean_mm": 0.5, "energy": 9.0}, picture=png_bytes)
    record(tmp_path, "s3_to_t", metrics={"mean_mm": 2.5, "hausdorff_mm": math.nan})
    record(tmp_path, "s4_to_t", metrics={"mean_mm": 1.0, "energy": 4.0}, seconds=300.0)
    oom = {"class": "out of memory", "type": "MemoryError", "reason": "killed at 30 GB"}
    record(tmp_path, "s5_to_t", "failed", error=oom)
    bad = {"class": "bad input", "type": "ValueError", "reason": "not a surface\nsecond line"}
    record(tmp_path, "s6_to_t", "failed", error={**bad, "traceback": "Traceback: x"})
    return tmp_path


def test_one_row_per_record_counts_and_failures(batch):
    page = build_report(batch).read_text()
    rows = Elements(page).all("tr")
    rows = [a for a in rows if "pair" in classes(a)]
    assert [a["data-pair"] for a in rows] == [
        "s1_to_t", "s2+b_to_t", "s3_to_t", "s4_to_t", "s5_to_t", "s6_to_t"
    ]  # fmt: skip
    assert [a["data-pair"] for a in rows if "failed" in classes(a)] == ["s5_to_t", "s6_to_t"]
    assert '<span id="n-done">4</span> done' in page
    assert '<span id="n-failed">2</span> failed' in page
    counts = dict(re.findall(r'data-class="([^"]+)">(\d+) ', page))
    assert counts == {"bad input": "1", "out of memory": "1"}
    failures = re.findall(r'<tr class="failure" data-pair="([^"]+)">(.*?)</tr>', page, re.S)
    assert [f[0] for f in failures] == ["s5_to_t", "s6_to_t"]
    assert "killed at 30 GB" in failures[0][1]
    assert "not a surface" in failures[1][1] and "second line" not in failures[1][1]
    assert "<details><summary>traceback</summary><pre>Traceback: x</pre>" in failures[1][1]
    assert "compute time 10 min (sum over pairs)" in page  # 5 x 60 s + 300 s


def test_thumbnails_link_relative_existing_files(batch, png_bytes):
    # listed but missing: no thumbnail
    record(batch, "s7_to_t", files={"picture": "gone.png"})
    out = build_report(batch)
    page = out.read_text()
    imgs = Elements(page).all("img")
    assert len(imgs) == 2
    assert "data:" not in page and "base64" not in page
    assert "<link" not in page and not re.search(r'(src|href)="(\w+:)?//', page)  # offline
    for img in imgs:
        assert img["loading"] == "lazy"
        src = urlparse(img["src"])
        assert not src.scheme and not src.path.startswith("/")
        assert (batch / unquote(src.path)).is_file()
        assert f'<a href="{html.escape(img["src"])}"><img' in page
    assert "pairs/s2%2Bb_to_t/picture.png" in {i["src"] for i in imgs}


def test_strip_plots_of_the_key_metrics_the_rest_one_click_away(batch):
    page = build_report(batch).read_text()
    strips = dict(re.findall(r'<svg class="strip" data-metric="([^"]+)"(.*?)</svg>', page, re.S))
    assert list(strips) == ["mean_mm", "hausdorff_mm", "energy", "seconds", "peak_rss_mb"]
    shown, more = page.split('<details id="more-metrics">', 1)
    assert 'data-metric="mean_mm"' in shown and 'data-metric="energy"' in more
    assert "deformation energy (mm²)" in more and "mean surface distance after (mm)" in shown
    dots = {k: len(re.findall(r'<a class="dot"', v)) for k, v in strips.items()}
    # hausdorff: one value is NaN; seconds and RSS: failed pairs too
    assert dots == {"mean_mm": 4, "hausdorff_mm": 1, "energy": 2, "seconds": 6, "peak_rss_mb": 6}
    hrefs = re.findall(r'<a class="dot" href="([^"]+)"><circle[^>]*><title>([^<]+)</', page)
    assert ("pairs/s1_to_t/picture.png", "s1_to_t: 1.5") in hrefs  # its picture
    assert ("pairs/s3_to_t/", "s3_to_t: 2.5") in hrefs  # no picture: its folder
    # a NaN is blank in the table
    row = re.search(r'data-pair="s3_to_t">(.*?)</tr>', page).group(1)
    assert '<td class="num" data-v="">' in row


def test_bookkeeping_gets_no_strip_plot(tmp_path):
    metrics = {"mean_mm": 1.0, "source_vertices": 900, "jacobian_points": 900,
               "metrics_seconds": 2.0, "seconds": 9.0, "sulc_correlation": 0.8}  # fmt: skip
    record(tmp_path, "a", metrics=metrics)
    page = build_report(tmp_path).read_text()
    strips = re.findall(r'<svg class="strip" data-metric="([^"]+)"', page)
    assert sorted(strips) == ["mean_mm", "peak_rss_mb", "seconds", "sulc_correlation"]
    assert "sulc correlation" in page and "sulc_correlation</b>" not in page


def test_label_overlaps_get_columns_strips_flags_and_csv_columns(tmp_path):
    """A batch that measured label overlaps: before and after side by side, first in the
    table and the strips, a pair far below the others flagged, both in the CSV."""
    from otreg.batch import Pair
    from otreg.batch.tables import write_tables

    afters = [0.85, 0.88, 0.86, 0.87, 0.855, 0.865, 0.41]
    for i, after in enumerate(afters):
        metrics = {"mean_mm": 1.0, "before_lh_aparc_dice": 0.6, "lh_aparc_dice": after}
        record(tmp_path, f"s{i}", metrics=metrics)
    page = build_report(tmp_path).read_text()
    heads = re.findall(r'<th data-key="([^"]+)"', page)
    assert heads.index("before_lh_aparc_dice") + 1 == heads.index("lh_aparc_dice")
    # the first metrics of the table, and the first strips, before and after
    assert heads[3:5] == ["before_lh_aparc_dice", "lh_aparc_dice"]
    shown = page.split('<details id="more-metrics">', 1)[0]
    strips = re.findall(r'data-metric="([^"]+)"', shown)
    assert strips[:2] == ["lh_aparc_dice", "before_lh_aparc_dice"]
    assert "label overlap lh_aparc (Dice) after" in shown
    assert "label overlap lh_aparc (Dice) before" in shown
    flagged = dict(re.findall(r'<tr class="flag" data-pair="([^"]+)" data-kind="([^"]+)"', page))
    assert flagged == {"s6": "outlier"}
    assert "label overlap lh_aparc (Dice) 0.41 (median 0.86)" in page
    records_ = {p.name: json.loads((p / "metrics.json").read_text()) for p in
                (tmp_path / "pairs").iterdir()}  # fmt: skip
    write_tables(tmp_path, [Pair(pid, "/a", "/b") for pid in sorted(records_)], records_)
    head, first = (tmp_path / "summary.csv").read_text().splitlines()[:2]
    columns = head.split(",")
    assert columns.index("before_lh_aparc_dice") + 1 == columns.index("lh_aparc_dice")
    assert first.split(",")[columns.index("lh_aparc_dice")] == "0.85"


def test_flagged_pairs_come_first_with_their_reasons(tmp_path):
    """A right hemisphere filed as left, two byte-identical sources and a far outlier: each
    in the attention list with its reason, marked in the table and in summary.csv."""
    from otreg.batch import Pair
    from otreg.batch.tables import write_tables

    checks = {"source_mean_x_mm": -30.0, "target_mean_x_mm": -31.0}
    parts = lambda src: {"key_parts": {"source": src, "target": "tpl"},  # noqa: E731
                         "target": "/data/tpl.gii"}  # fmt: skip
    for i, mean in enumerate([0.6, 0.7, 0.65, 0.62, 0.68, 0.66]):
        record(tmp_path, f"s{i}", metrics={"mean_mm": mean}, checks=checks, **parts(f"d{i}"))
    record(tmp_path, "wrong_side", metrics={"mean_mm": 0.7}, **parts("dw"),
           checks={"source_mean_x_mm": 32.6, "target_mean_x_mm": -31.0})  # fmt: skip
    record(tmp_path, "copy", metrics={"mean_mm": 0.64}, checks=checks, **parts("d1"))
    record(tmp_path, "far", metrics={"mean_mm": 4.08}, checks=checks, **parts("df"))
    page = build_report(tmp_path).read_text()
    flagged = dict(re.findall(r'<tr class="flag" data-pair="([^"]+)" data-kind="([^"]+)"', page))
    assert flagged == {"wrong_side": "side", "copy": "duplicate", "s1": "duplicate",
                       "far": "outlier"}  # fmt: skip
    assert "lies right of the midline (mean x +32.6 mm)" in page
    assert "its source file has the same content as /data/copy/source.gii" in page
    assert "mean surface distance after 4.08 mm (median 0.66 mm)" in page
    assert '<span id="n-flagged">4</span> flagged' in page
    far = re.search(r'data-pair="far">(.*?)</tr>', page).group(1)
    assert 'class="num bad"' in far and "far above the batch" in far
    records_ = {p.name: json.loads((p / "metrics.json").read_text()) for p in
                (tmp_path / "pairs").iterdir()}  # fmt: skip
    pairs = [Pair(pid, "/a", "/b") for pid in records_]
    assert write_tables(tmp_path, pairs, records_) == 4
    rows = {r.split(",")[0]: r for r in (tmp_path / "summary.csv").read_text().splitlines()}
    assert "mislabelled hemisphere" in rows["wrong_side"] and "far from the batch" in rows["far"]
    assert rows["s0"].split(",")[2] == ""


def test_one_file_used_by_several_pairs_is_no_duplicate(tmp_path):
    """A template carried onto subjects and an all-pairs batch use one file in several
    pairs by design: not flagged; the same pair listed twice, and a pair whose source and
    target have the same content, are."""
    from otreg.batch.flags import flag_pairs

    def rec(src, tgt, src_digest, tgt_digest):
        return {"status": "done", "source": src, "target": tgt,
                "key_parts": {"source": src_digest, "target": tgt_digest}}  # fmt: skip

    atlas = {f"tpl_to_s{i}": rec("/d/tpl.gii", f"/d/s{i}.gii", "T", f"S{i}") for i in range(4)}
    every = {f"s{i}_to_s{j}": rec(f"/d/s{i}.gii", f"/d/s{j}.gii", f"S{i}", f"S{j}")
             for i in range(3) for j in range(3) if i != j}  # fmt: skip
    assert flag_pairs(atlas) == {} and flag_pairs(every) == {}
    twice = {**atlas, "again": rec("/d/tpl.gii", "/d/s0.gii", "T", "S0"),
             "self": rec("/d/s1.gii", "/d/s1_copy.gii", "S1", "S1")}  # fmt: skip
    flags = {pid: [f.reason for f in found] for pid, found in flag_pairs(twice).items()}
    assert flags["again"] == ["the same source and target contents as tpl_to_s0"]
    assert "the same source and target contents as again" in flags["tpl_to_s0"]
    assert "its source and target files have the same content" in flags["self"]
    assert "its target file has the same content as /d/s1_copy.gii" in flags["tpl_to_s1"]


def test_near_equal_pairs_are_not_outliers_and_red_dots_are_the_flagged_ones(tmp_path):
    """A batch of near-equal pairs (a spread of a few thousandths): no outlier, and no red
    dot on its strips; a pair far below on the label overlap is flagged and is the one red
    dot of that strip."""
    jac = [0.74, 0.741, 0.739, 0.74, 0.722, 0.738]
    dice = [0.995, 0.993, 0.995, 0.995, 0.994, 0.71]
    for i, (j, d) in enumerate(zip(jac, dice)):
        metrics = {"mean_mm": 0.5 + 0.001 * i, "jacobian_min": j, "curvature_correlation":
                   0.8 + 0.05 * (i == 2), "before_dseg_dice": 0.6, "dseg_dice": d}  # fmt: skip
        record(tmp_path, f"s{i}", metrics=metrics)
    page = build_report(tmp_path).read_text()
    flagged = dict(re.findall(r'<tr class="flag" data-pair="([^"]+)" data-kind="([^"]+)"', page))
    assert flagged == {"s5": "outlier"}
    strips = re.findall(r'(<svg class="strip" data-metric="([^"]+)".*?</svg>)', page, re.S)
    assert {key for _, key in strips} >= {"dseg_dice", "jacobian_min", "curvature_correlation"}
    for svg, key in strips:
        reds = re.findall(r'fill="#d62728"[^>]*><title>([^:]+):', svg)
        assert reds == (["s5"] if key == "dseg_dice" else []), (key, reds)


def test_the_record_of_the_last_run_s_inputs_wins_and_other_batches_pairs_are_left_out(
    tmp_path,
):
    """A pair done, then failed on a broken input (a newer error.json of another key), then
    the input restored (the plan's key is the done record's again): the page says done.
    Records of pairs the last run did not plan (an earlier batch of other pairs in the
    folder) are left out, with a note."""
    from otreg.batch.records import write_plan

    done = record(tmp_path, "s3", metrics={"mean_mm": 0.5}, key="k-good",
                  finished="2025-01-01T00:01:00+00:00")  # fmt: skip
    failed = done.parent / "error.json"
    rec = json.loads(done.read_text())
    rec.update(status="failed", key="k-broken", finished="2025-01-02T00:00:00+00:00",
               error={"class": "bad input", "reason": "empty file"})  # fmt: skip
    failed.write_text(json.dumps(rec))
    record(tmp_path, "s4", metrics={"mean_mm": 0.6}, key="k4")
    record(tmp_path, "old_pair", metrics={"mean_mm": 9.0}, key="k-old")
    write_plan(tmp_path, {"s3": "k-good", "s4": "k4"})
    page = build_report(tmp_path).read_text()
    assert '<span id="n-pairs">2</span> pairs: <span id="n-done">2</span>' in page
    assert 'id="n-not-run"' not in page
    assert 'data-pair="old_pair"' not in page and "empty file" not in page
    assert "1 record(s) of pairs not in the last run's manifest left out" in page
    assert "1 older record(s) of pairs run again left out" in page


def test_an_unreadable_record_is_listed_not_dropped(tmp_path):
    record(tmp_path, "a")
    record(tmp_path, "b")
    path = record(tmp_path, "c")
    path.write_text(path.read_text()[:40])  # truncated
    page = build_report(tmp_path).read_text()
    assert '<span id="n-pairs">2</span> pairs' in page and "1 unreadable record(s)" in page
    assert re.search(r'class="unreadable"><td>c</td>.*metrics.json cannot be read', page)


def test_a_failure_reason_is_not_prefixed_twice(tmp_path):
    err = {"class": "error", "type": "ValueError", "reason": "ValueError: no"}
    record(tmp_path, "a", "failed", error=err)
    page = build_report(tmp_path).read_text()
    assert "ValueError: no" in page and "ValueError: ValueError" not in page


def all_pairs_batch(folder, subjects, energy, **fields):
    for (a, b), e in zip(itertools.combinations(subjects, 2), energy):
        metrics = {"mean_mm": 1.0, "energy": e, "before_mean_mm": 2 * e}
        for key in fields.get("drop", ()):
            metrics.pop(key)
        record(folder, f"{a}_to_{b}", metrics=metrics, source_subject=a, target_subject=b)


def test_all_pairs_of_subjects_give_distance_matrix_and_mds(tmp_path):
    all_pairs_batch(tmp_path, ["A", "B", "C", "D"], [4.0, 9.0, 16.0, 1.0, 4.0, 9.0])
    # the other direction of A-B: distances are averaged (sqrt(4) + sqrt(16)) / 2 = 3
    record(tmp_path, "B_to_A", metrics={"energy": 16.0}, source_subject="B", target_subject="A")
    page = build_report(tmp_path).read_text()
    els = Elements(page)
    assert len(els.all("svg", class_="matrix")) == 1
    assert len([a for a in els.all("rect") if "cell" in classes(a)]) == 16
    assert len(els.all("svg", class_="mds")) == 1
    assert len(els.all("circle", class_="subject")) == 4
    assert "A – B: 3<" in page and "A – C: 3<" in page and "C – D: 3<" in page
    assert "sqrt(energy)" in page


def test_subject_views_fall_back_to_before_mean(tmp_path):
    all_pairs_batch(tmp_path, ["A", "B", "C"], [1.0, 2.0, 3.0], drop=["energy"])
    page = build_report(tmp_path).read_text()
    assert 'class="matrix"' in page
    note = re.search(r'<p class="note" id="distance-metric">(.*?)</p>', page).group(1)
    assert "before_mean_mm" in note and "energy is missing" in note
    page = build_report(tmp_path, distance_metric="mean_mm").read_text()
    assert "Distance: mean_mm" in page


def test_to_template_and_incomplete_batches_have_no_subject_views(tmp_path):
    for s in ["A", "B", "C", "D"]:
        record(
            tmp_path, f"{s}_to_tpl", metrics={"energy": 4.0}, source_subject=s, target_subject="tpl"
        )
    page = build_report(tmp_path).read_text()
    assert 'class="matrix"' not in page and 'class="mds"' not in page
    assert 'id="subjects"' not in page

    other = tmp_path / "other"
    all_pairs_batch(other, ["A", "B", "C"], [1.0, 2.0])  # A-B, A-C done
    record(other, "B_to_C", "failed", source_subject="B", target_subject="C")
    page = build_report(other).read_text()
    assert 'class="matrix"' not in page and 'class="mds"' not in page
    assert "1 of 3 subject pairs have no finished registration" in page

    extra = tmp_path / "extra"  # every pair of A, B, C, and D with A only: a note, no map
    all_pairs_batch(extra, ["A", "B", "C"], [1.0, 2.0, 3.0])
    record(extra, "D_to_A", metrics={"energy": 1.0}, source_subject="D", target_subject="A")
    page = build_report(extra).read_text()
    assert 'class="matrix"' not in page
    assert "the records cover 4 of the 6 pairs of these 4 subjects" in page


def test_classical_mds_recovers_a_rectangle():
    corners = np.array([[0.0, 0.0], [3.0, 0.0], [3.0, 4.0], [0.0, 4.0]])
    d = np.linalg.norm(corners[:, None] - corners[None], axis=-1)
    xy, eig = _classical_mds(d)
    assert xy.shape == (4, 2)
    np.testing.assert_allclose(np.linalg.norm(xy[:, None] - xy[None], axis=-1), d, atol=1e-6)
    np.testing.assert_allclose(eig[2:], 0.0, atol=1e-9)
    assert eig[0] >= eig[1] > 0
    np.testing.assert_allclose(xy.mean(axis=0), 0.0, atol=1e-9)  # centred


def test_record_text_is_escaped(tmp_path):
    attack = "<script>alert(1)</script>"
    error = {"class": "error", "type": "X<y>", "reason": attack, "traceback": f"tb {attack}"}
    record(tmp_path, "p1", "failed", error=error, host=f"h&{attack}")
    page = build_report(tmp_path, title=f"batch {attack}").read_text()
    assert attack not in page
    assert "alert(1)" in page  # shown, escaped
    assert page.count(html.escape(attack)) >= 4  # title x2, reason, traceback, host
    assert "X&lt;y&gt;" in page
    assert len(re.findall(r"<script>", page)) == 1  # the page's own


def test_corrupt_and_foreign_records_are_ignored(tmp_path):
    record(tmp_path, "good")
    partial = record(tmp_path, "partial")
    partial.write_text(partial.read_text()[:40])
    foreign = record(tmp_path, "foreign")
    foreign.write_text(json.dumps({**json.loads(foreign.read_text()), "format": FORMAT + 1}))
    (tmp_path / "pairs" / "other.json").write_text("[1, 2]")
    page = build_report(tmp_path).read_text()
    assert re.findall(r'<tr class="pair[^"]*" data-pair="([^"]+)"', page) == ["good"]


def test_a_pair_run_again_shows_its_latest_record(tmp_path):
    record(tmp_path, "p1", "failed", finished="2025-01-01T00:01:00+00:00")
    record(tmp_path, "p1", finished="2025-01-02T00:01:00+00:00")
    page = build_report(tmp_path).read_text()
    assert re.findall(r'<tr class="pair ([a-z]+)" data-pair="p1"', page) == ["done"]
    assert "1 older record(s)" in page


def test_records_of_earlier_inputs_are_not_run_as_the_summary_says(tmp_path):
    """The last run planned p1 with a new key (its manifest row was fixed) and was stopped
    before it finished, and p3 never ran: their rows say "not run", the old failure is
    not counted or shown, as summary.csv has it; p2 is current."""
    from otreg.batch.records import read_plan, write_plan

    record(tmp_path, "p1", "failed", key="a" * 16)
    record(tmp_path, "p2", key="b" * 16)
    write_plan(tmp_path, {"p1": "c" * 16, "p2": "b" * 16, "p3": "d" * 16})
    assert read_plan(tmp_path) == {"p1": "c" * 16, "p2": "b" * 16, "p3": "d" * 16}
    page = build_report(tmp_path).read_text()
    rows = re.findall(r'<tr class="pair ([a-z-]+)" data-pair="(p\d)"', page)
    assert {pid: kind for kind, pid in rows} == {"p1": "not-run", "p2": "done", "p3": "not-run"}
    assert '<span id="n-failed">0</span> failed' in page
    assert '<span id="n-not-run">2</span> not run' in page
    assert "boom" not in page and 'class="failure"' not in page
    assert len(re.findall(r'<tr class="not-run" data-pair="p[13]">', page)) == 2


def test_rebuild_is_the_same_except_the_date_and_leaves_no_temp_files(batch):
    def undated(path):
        return re.sub(r'<time id="built">[^<]*</time>', "", path.read_text())

    first = undated(build_report(str(batch)))
    assert undated(build_report(batch)) == first
    assert sorted(p.name for p in batch.iterdir()) == ["index.html", "pairs"]
    assert not [p for p in batch.rglob("*") if ".tmp" in p.name]


def test_empty_batch_folder_says_so(tmp_path):
    page = build_report(tmp_path).read_text()
    assert "No pairs have finished yet" in page
    assert '<span id="n-done">0</span>' in page and "<tr" not in page


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_report(tmp_path / "nowhere")
    with pytest.raises(TypeError, match="folder must be a path"):
        build_report(3)
    with pytest.raises(TypeError, match="title"):
        build_report(tmp_path, title=1)
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError):
        build_report(tmp_path / "f")
    assert not (tmp_path / "index.html").exists()


# --- in a real browser -------------------------------------------------------------------


def chromium(folder, *args):
    """Run headless chromium on ``args``; its stdout. Skips where there is no chromium."""
    names = ("chromium", "chromium-browser", "google-chrome")
    exe = next((shutil.which(n) for n in names if shutil.which(n)), None)
    if exe is None:
        pytest.skip("no chromium binary found (chromium, chromium-browser or google-chrome)")
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    cmd += [f"--user-data-dir={folder / '.profile'}", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def table_rows(page):
    """(pair id, {column key: sort value}) for each row of the pairs table, in page order."""
    els = Elements(page)
    keys = [a["data-key"] for a in els.all("th") if "data-key" in a]
    rows = []
    for tag, a in els.found:
        if tag == "tr" and "pair" in classes(a):
            rows.append((a["data-pair"], []))
        elif tag == "td" and "data-v" in a:
            rows[-1][1].append(a["data-v"])
    return [(pid, dict(zip(keys, values))) for pid, values in rows]


def test_browser_dom_has_one_row_per_record(batch):
    dom = chromium(batch, "--dump-dom", build_report(batch).as_uri())
    assert len([a for a in Elements(dom).all("tr") if "pair" in classes(a)]) == 6
    assert len(Elements(dom).all("img")) == 2
    assert "window.sortTable" in dom


def test_browser_sorts_the_table(batch):
    page = build_report(batch)
    before = table_rows(chromium(batch, "--dump-dom", page.as_uri()))
    assert [p for p, _ in before] == sorted(p for p, _ in before)  # by pair id
    up = table_rows(chromium(batch, "--dump-dom", page.as_uri() + "#sort=mean_mm"))
    order = ["s2+b_to_t", "s4_to_t", "s1_to_t", "s3_to_t", "s5_to_t", "s6_to_t"]
    assert [p for p, _ in up] == order
    assert [r["mean_mm"] for _, r in up] == ["0.5", "1.0", "1.5", "2.5", "", ""]
    down = table_rows(chromium(batch, "--dump-dom", page.as_uri() + "#sort=-seconds"))
    assert [p for p, _ in down][0] == "s4_to_t"  # 300 s, the others 60 s
    # clicking a header twice: descending, blanks (the failures) still last
    clicked = batch / "clicked.html"
    click = "<script>for (const i of [1, 2]) document.querySelector('th[data-key=mean_mm]').click()"
    clicked.write_text(page.read_text().replace("</body>", click + "</script></body>"))
    dom = chromium(batch, "--dump-dom", clicked.as_uri())
    assert [p for p, _ in table_rows(dom)] == order[3::-1] + order[4:]
    assert '<th data-key="mean_mm" data-type="num" aria-sort="descending">' in dom


def test_browser_screenshot_is_not_blank(batch):
    page = build_report(batch)
    shot = batch / "shot.png"
    size = ["--window-size=1280,1600", "--hide-scrollbars"]
    chromium(batch, f"--screenshot={shot}", *size, page.as_uri())
    pixels = mpimg.imread(shot)[..., :3]
    assert pixels.shape[:2] == (1600, 1280)
    assert pixels.var() > 1e-3, pixels.var()  # a blank page: 0


def test_browser_first_screen_shows_what_needs_attention(tmp_path, png_bytes):
    """A laptop-sized first screen (1280 x 800) of a real browser: the attention block (its
    amber border) and the flagged pair's highlighted row are in it."""
    checks = {"source_mean_x_mm": -30.0, "target_mean_x_mm": -31.0}
    for i in range(30):  # a long table: the flagged pair is last by name
        record(tmp_path, f"a{i:02d}", metrics={"mean_mm": 0.6 + 0.001 * i}, checks=checks,
               picture=png_bytes)  # fmt: skip
    record(tmp_path, "z_wrong_side", metrics={"mean_mm": 0.61}, picture=png_bytes,
           checks={"source_mean_x_mm": 32.6, "target_mean_x_mm": -31.0})  # fmt: skip
    out = build_report(tmp_path)
    dom = chromium(tmp_path, "--dump-dom", out.as_uri())
    attention = dom.split('id="pairs-section"')[0]
    assert 'data-pair="z_wrong_side" data-kind="side"' in attention
    shot = tmp_path / "first-screen.png"
    chromium(tmp_path, "--window-size=1280,800", "--hide-scrollbars", f"--screenshot={shot}",
             out.as_uri())  # fmt: skip
    pixels = (mpimg.imread(shot)[..., :3] * 255).round().astype(int)
    assert pixels.shape[:2] == (800, 1280)

    def shows(rgb):
        return bool((np.abs(pixels - np.array(rgb)).sum(-1) <= 6).any())

    assert shows((224, 160, 0))  # the attention block's border
    assert shows((255, 244, 214))  # the flagged row's background
