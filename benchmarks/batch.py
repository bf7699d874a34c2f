"""Batch throughput: ``otreg batch`` on Dask against the plain in-process loop, one run.

The pairs: synthetic subjects made from fsaverage5's left pial decimated to ``--points``
vertices (``otreg.datasets.synthetic_subjects``, known smooth deformations), each registered
onto the decimated template with the batch defaults (pictures included). Configurations,
each in a fresh process with empty output folders:

- ``plain loop``: the same per-pair work (``otreg.batch.worker.run_pair``: load, register,
  save, picture, record) called in a loop in one process, torch on every core;
- ``batch 1x2``: ``otreg batch --workers 1 --threads 2`` (one worker process, 2 threads);
- ``batch 2x1``: ``otreg batch --workers 2 --threads 1``.

Pairs per hour count the wall time from the command's start to its end (process start,
imports, the cluster, first compilations included); the ratio is to the plain loop.

    python benchmarks/batch.py                  # 8 pairs of 2,000 vertices
    python benchmarks/batch.py --pairs 4 --points 1000
    python benchmarks/batch.py --record         # append the table to docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import publish, table


def make_subjects(folder: Path, n: int, points: int) -> Path:
    """The template, n subjects and their manifest (to the template)."""
    from otreg import datasets, save_shape
    from otreg.batch import pairs_to_template, write_manifest

    left = datasets.fsaverage5("pial", "left").decimate(points)
    save_shape(left, folder / "template.vtk")
    files = {}
    for k, subject in enumerate(datasets.synthetic_subjects(left, n=n, seed=1)):
        files[f"s{k:02d}"] = save_shape(subject.shape, folder / f"s{k:02d}.vtk")
    return write_manifest(pairs_to_template(files, folder / "template.vtk"), folder / "pairs.csv")


def plain_loop(manifest: str, out: str) -> None:
    """The per-pair work of a batch, in this process, one pair after the other."""
    from otreg.batch import read_manifest
    from otreg.batch.engine import pair_spec, plan_batch
    from otreg.batch.worker import run_pair

    pairs = read_manifest(manifest)
    for p in plan_batch(pairs, out):
        rec = run_pair(pair_spec(Path(out), p, "plain"))
        assert rec["status"] == "done", rec


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    return time.perf_counter() - start


def summary(out: Path) -> dict:
    rows = list(csv.DictReader(open(out / "summary.csv")))
    return {
        "pair_seconds": sum(float(r["seconds"]) for r in rows) / len(rows),
        "peak_mb": max(float(r["peak_rss_mb"]) for r in rows),
        "done": sum(r["status"] == "done" for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--points", type=int, default=2000)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--plain-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_worker:
        plain_loop(*args.plain_worker)
        return
    work = Path(tempfile.mkdtemp(prefix="otreg-batch-bench-"))
    try:
        manifest = make_subjects(work, args.pairs, args.points)
        rows = []
        configs = [
            ("plain loop", [sys.executable, __file__, "--plain-worker", str(manifest)]),
            ("batch 1x2", ["--workers", "1", "--threads", "2"]),
            ("batch 2x1", ["--workers", "2", "--threads", "1"]),
        ]
        for name, extra in configs:
            out = work / name.replace(" ", "_")
            if name == "plain loop":
                cmd = [*extra, str(out)]
            else:
                cmd = [sys.executable, "-m", "otreg", "batch", str(manifest), "-o", str(out)]
                cmd += [*extra, "--no-report"]
            seconds = timed(cmd)
            if name == "plain loop":
                from otreg.batch import find_records

                recs = [doc for _, doc in find_records(out)]
                info = {
                    "pair_seconds": sum(r["seconds"] for r in recs) / len(recs),
                    "peak_mb": max(r["peak_rss_mb"] for r in recs),
                    "done": len(recs),
                }
            else:
                info = summary(out)
            rows.append(
                {"config": name, "seconds": seconds, "per_hour": 3600 * args.pairs / seconds} | info
            )
            print(json.dumps(rows[-1]), flush=True)
        base = rows[0]["per_hour"]
        for r in rows:
            r["ratio"] = r["per_hour"] / base
        body = (
            f"{args.pairs} pairs, fsaverage5 left pial decimated to {args.points} vertices onto "
            "synthetic subjects, batch defaults (pictures on); each configuration in a fresh "
            f"process on {os.cpu_count()} cores.\n\n"
            + table(
                rows,
                [
                    ("config", "configuration", ""),
                    ("done", "pairs done", "{}"),
                    ("seconds", "wall s", "{:.1f}"),
                    ("per_hour", "pairs / hour", "{:.0f}"),
                    ("ratio", "vs plain loop", "{:.2f}"),
                    ("pair_seconds", "s a pair (in the worker)", "{:.1f}"),
                    ("peak_mb", "peak RSS a pair (MB)", "{:.0f}"),
                ],
            )
        )
        publish("Batch throughput: otreg batch on Dask vs the plain loop", body, args.record)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
