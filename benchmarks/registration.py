"""Surface registration on real brain surfaces: otreg vs scikit-shapes, in one run.

Pairs, from fsaverage5 in nilearn's wheel (10,242 vertices a hemisphere, mm):

- ``synthetic``: left pial onto a synthetic subject made from it by a known smooth
  diffeomorphism and rigid motion (``otreg.datasets.synthetic_subjects``, seed 0): vertex
  errors against the truth;
- ``hemispheres``: left pial onto the mirrored right pial (no ground truth).

Sizes: the full surfaces, and both decimated to ``--small`` vertices (VTK quadric
decimation; the synthetic subject is then made from the decimated surface). Each method runs
in a fresh process (its own peak RSS) on the same data; distances are point-to-surface
(VTK), both ways. scikit-shapes 0.3 (``ExtrinsicDeformation`` LDDMM with Euler steps, varifold
loss normalised by the target's norm, rigid step first, its ``LBFGS``; settings chosen from
its examples) runs at the small size only by default: at full size one evaluation of its
objective takes minutes on this CPU (``--peer-full`` tries it under ``--timeout``).
KeOps formulas of the peer are compiled on its first run and cached: time a second run.

    python benchmarks/registration.py              # both pairs, full and small
    python benchmarks/registration.py --quick      # small only
    python benchmarks/registration.py --record     # append the table to docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from _common import peak_rss_mb, publish, run_worker, table

METHODS = ("otreg", "scikit-shapes")


def data(pair: str, points: int):
    """(source, target, truth or None) as float64 Shapes."""
    import torch

    from otreg import datasets

    left = datasets.fsaverage5("pial", "left").to(torch.float64)
    if points:
        left = left.decimate(points)
    if pair == "synthetic":
        (subject,) = datasets.synthetic_subjects(left, n=1, seed=0)
        return left, subject.shape, subject.shape.points
    right = datasets.fsaverage5("pial", "right").to(torch.float64).mirror(0)
    return left, (right.decimate(points) if points else right), None


def run_otreg(source, target, truth) -> tuple[object, dict]:
    from otreg import register

    res = register(source, target, truth=truth, progress=False)
    m = res.metrics
    return res.warped.points, {
        "jacobian_min": m["jacobian_min"],
        "jacobian_negative_fraction": m["jacobian_negative_fraction"],
        "evaluations": len(res.history),
    }


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

    src, tgt = polydata(source), polydata(target)
    sigma = 20.0  # mm, the LDDMM kernel width otreg uses
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

    from otreg.registration.metrics import surface_distances, vertex_error

    source, target, truth = data(pair, points)
    start = time.perf_counter()
    warped_points, extra = (run_otreg if method == "otreg" else run_skshapes)(source, target, truth)
    seconds = time.perf_counter() - start
    warped = source.with_points(warped_points.to(torch.float64))
    out = {
        "seconds": seconds,
        "peak_rss_mb": peak_rss_mb(),
        "vertices": source.n_points,
        **surface_distances(warped, target, to="surface"),
        **extra,
    }
    before = surface_distances(source, target, to="surface")
    out["mean_before_mm"] = before["mean_mm"]
    if truth is not None:
        out.update(vertex_error(warped.points, truth))
        out["vertex_error_before_mm"] = vertex_error(source.points, truth)["vertex_error_mean_mm"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--pairs",
        nargs="*",
        default=["synthetic", "hemispheres"],
        choices=["synthetic", "hemispheres"],
    )
    parser.add_argument("--small", type=int, default=1000, help="decimated size (vertices)")
    parser.add_argument("--quick", action="store_true", help="the small size only")
    parser.add_argument(
        "--peer-full", action="store_true", help="also run scikit-shapes on the full surfaces"
    )
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        m, pair, pts = args.worker
        print(json.dumps(worker(m, pair, int(pts))))
        return
    sizes = [args.small] if args.quick else [0, args.small]
    rows = []
    for pair in args.pairs:
        for points in sizes:
            base = None
            for method in METHODS:
                if method != "otreg" and points == 0 and not args.peer_full:
                    continue
                out = run_worker(__file__, [method, pair, str(points)], args.timeout)
                print(pair, points, method, out, file=sys.stderr, flush=True)
                row = {"pair": pair, "method": method, **out}
                if method == "otreg":
                    base = out
                elif base and "seconds" in out and "seconds" in base:
                    row["time_vs_otreg"] = out["seconds"] / base["seconds"]
                rows.append(row)
    text = table(
        rows,
        [
            ("pair", "pair", ""),
            ("vertices", "vertices", "{:,}"),
            ("method", "method", ""),
            ("seconds", "time (s)", "{:.1f}"),
            ("time_vs_otreg", "time / otreg's", "{:.1f}"),
            ("peak_rss_mb", "peak RSS (MB)", "{:.0f}"),
            ("mean_before_mm", "mean dist. before (mm)", "{:.2f}"),
            ("mean_mm", "mean dist. after (mm)", "{:.3f}"),
            ("hausdorff_mm", "Hausdorff after (mm)", "{:.2f}"),
            ("vertex_error_before_mm", "vertex error before (mm)", "{:.2f}"),
            ("vertex_error_mean_mm", "vertex error mean (mm)", "{:.3f}"),
            ("vertex_error_max_mm", "vertex error max (mm)", "{:.2f}"),
            ("jacobian_min", "min Jacobian", "{:.3f}"),
            ("error", "error", ""),
        ],
    )
    publish("Registration of brain surfaces: otreg vs scikit-shapes", text, args.record)


if __name__ == "__main__":
    main()
