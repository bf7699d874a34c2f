"""Sinkhorn divergence plus gradient: otreg vs GeomLoss (online, multiscale) vs POT.

Two noisy spheres (radius 1 and 0.8, centres 0.3 apart, noise 0.02), N = M points, blur 0.01
(eps = 1e-4), cost |x - y|^2 / 2. Each method runs in a fresh process (its own peak RSS) on
the same float32 data; the relative error is against a float64 reference computed by otreg
(multiscale with truncate 10 where N * M >= 1e8): converged to a marginal error of 1e-7
(about 2,400 iterations at N = 20,000), or where that is too long, the eps-scaling at 0.9
then 100 iterations at the final eps (which at N = 20,000 is itself 8e-5 off in value and
1.3e-2 in gradient).

    python benchmarks/sinkhorn_peers.py                 # N in 20,000, 100,000, 1,000,000
    python benchmarks/sinkhorn_peers.py --sizes 1000 5000 --methods ...
    python benchmarks/sinkhorn_peers.py --quick         # N = 1,000
    python benchmarks/sinkhorn_peers.py --record        # append the table to docs/benchmarks.md
    python benchmarks/sinkhorn_peers.py --sizes 5000 --reuse-reference --methods ...

A reference that runs is saved in ~/.cache/otreg-benchmarks/; ``--reuse-reference`` reads
it back instead of recomputing it (11 s at N = 5,000, 43 s at 20,000 and 4.6 minutes at
100,000 since Anderson mixing; 15 minutes each before): its row says so. The KeOps-based
methods (GeomLoss's) first run once on 500 points, untimed, so that their formulas are
compiled before the timed rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

from _common import peak_rss_mb, publish, run_worker, table

BLUR = 0.01
CACHE = Path.home() / ".cache" / "otreg-benchmarks"


def reference_file(n: int) -> Path:
    return CACHE / f"sinkhorn_reference_n{n}_blur{BLUR:g}.json"


# name: (library, options); every method gets the same data.
METHODS = {
    "reference (otreg float64, converged: tol 1e-7)": (
        "otreg",
        dict(scaling=0.9, tol=1e-7, max_iter=5000, dtype="float64", truncate=10.0),
    ),
    "reference (otreg float64, scaling 0.9 + 100 its)": (
        "otreg",
        dict(scaling=0.9, extra=100, dtype="float64", truncate=10.0),
    ),
    "otreg multiscale, scaling 0.9": ("otreg", dict(scaling=0.9, extra=0, multiscale=True)),
    "otreg multiscale, scaling 0.9 + 60 its": (
        "otreg",
        dict(scaling=0.9, extra=60, multiscale=True),
    ),
    "otreg multiscale, scaling 0.8 + 21 its": (
        "otreg",
        dict(scaling=0.8, extra=21, multiscale=True),
    ),
    "otreg, scaling 0.9 (blocked)": ("otreg", dict(scaling=0.9, extra=0, multiscale=False)),
    "otreg, scaling 0.9 (blocked, not compiled)": (
        "otreg",
        dict(scaling=0.9, extra=0, multiscale=False, compiled=False),
    ),
    "otreg, scaling 0.9 (keops)": (
        "otreg",
        dict(scaling=0.9, extra=0, backend="keops", multiscale=False),
    ),
    "otreg default call": ("otreg-default", {}),
    "otreg default, multiscale": ("otreg-default", {"multiscale": "force"}),
    "otreg, tol=Accuracy(gradient=1e-3)": ("otreg-default", {"accuracy": 1e-3}),
    "otreg, tol=Accuracy(gradient=1e-2)": ("otreg-default", {"accuracy": 1e-2}),
    "otreg default, tol 1e-3": ("otreg-default", {"tol": 1e-3}),
    "otreg default, multiscale, tol 1e-3": ("otreg-default", {"multiscale": "force", "tol": 1e-3}),
    "otreg default, multiscale, tol 3e-3": ("otreg-default", {"multiscale": "force", "tol": 3e-3}),
    "otreg default, multiscale, tol 1e-2": ("otreg-default", {"multiscale": "force", "tol": 1e-2}),
    "otreg default, multiscale, tol 3e-2": ("otreg-default", {"multiscale": "force", "tol": 3e-2}),
    "otreg default, multiscale, scaling 0.9, tol 1e-2": (
        "otreg-default",
        {"multiscale": "force", "tol": 1e-2, "scaling": 0.9},
    ),
    "otreg default, multiscale, scaling 0.9, tol 3e-3": (
        "otreg-default",
        {"multiscale": "force", "tol": 3e-3, "scaling": 0.9},
    ),
    "otreg default, multiscale, scaling 0.8, tol 1e-2": (
        "otreg-default",
        {"multiscale": "force", "tol": 1e-2, "scaling": 0.8},
    ),
    "otreg default, scaling 0.9, tol 1e-2": ("otreg-default", {"tol": 1e-2, "scaling": 0.9}),
    "GeomLoss default call (scaling 0.5)": ("geomloss", dict(backend="auto", scaling=0.5)),
    "GeomLoss online (keops), scaling 0.9": ("geomloss", dict(backend="online")),
    "GeomLoss multiscale, scaling 0.9": ("geomloss", dict(backend="multiscale")),
    "POT empirical_sinkhorn_divergence (log, 1000 its)": ("pot", {}),
}


def data(n: int, dtype):
    from otreg.datasets import noisy_sphere

    x = noisy_sphere(n, seed=1, dtype=dtype)
    y = noisy_sphere(n, radius=0.8, center=(0.3, 0.0, 0.0), seed=2, dtype=dtype)
    return x, y


def worker(method: str, n: int) -> dict:
    import torch

    lib, opts = METHODS[method]
    dtype = torch.float64 if opts.get("dtype") == "float64" else torch.float32
    x, y = data(n, dtype)
    x.requires_grad_(True)
    start = time.perf_counter()
    info = {}
    if lib == "otreg":
        import otreg
        from otreg import reductions
        from otreg.costs import diameter, epsilon_schedule

        reductions.COMPILED = opts.get("compiled", True)
        from otreg.ot.divergence import divergence
        from otreg.ot.problem import Multiscale, SinkhornOptions

        steps = len(epsilon_schedule(2, diameter(x[None], y[None]), BLUR, opts["scaling"]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", otreg.ConvergenceWarning)
            multiscale = opts.get("multiscale", "auto")
            if multiscale is not False:
                multiscale = Multiscale(
                    truncate=opts.get("truncate", 5.0), auto=multiscale == "auto"
                )
            options = SinkhornOptions(
                blur=BLUR,
                scaling=opts["scaling"],
                backend=opts.get("backend", "auto"),
                tol=opts.get("tol", 0.0),
                max_iter=opts.get("max_iter", steps + opts.get("extra", 0)),
                multiscale=multiscale,
            )
            value, res = divergence("bench", x, y, None, None, options)
        info = {"iters": res.n_iter, "backend": res.backend}
        if opts.get("tol", 0.0) > 0 and not res.converged:
            info["error"] = f"stopped ({res.stopped}) at marginal error {res.marginal_error:.1e}"
    elif lib == "otreg-default":  # what a user writes first
        import otreg

        changes = dict(opts)
        if changes.get("multiscale") == "force":
            changes["multiscale"] = otreg.Multiscale(auto=False)
        if "accuracy" in changes:  # the stopping rule on the value and the gradient
            changes["tol"] = otreg.Accuracy(gradient=changes.pop("accuracy"))
        from otreg.ot.divergence import divergence

        # what otreg.sinkhorn_divergence(x, y, blur=BLUR) runs, with its result's counts
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            options = otreg.SinkhornOptions(blur=BLUR, **changes)
            value, res = divergence("sinkhorn_divergence", x, y, None, None, options)
        info = {"iters": res.n_iter, "backend": res.backend}
        unconverged = [w for w in caught if issubclass(w.category, otreg.ConvergenceWarning)]
        if unconverged:
            info["error"] = str(unconverged[0].message)[:120]
    elif lib == "geomloss":
        import geomloss

        loss = geomloss.SamplesLoss(
            "sinkhorn", p=2, blur=BLUR, scaling=opts.get("scaling", 0.9), backend=opts["backend"]
        )
        value = loss(x, y)
    else:
        import ot

        # POT's sqeuclidean metric is |x - y|^2 (twice ours): reg = 2 eps gives the same plan,
        # and its value <pi, M> is twice the linear part of ours (no entropy term).
        value = (
            ot.bregman.empirical_sinkhorn_divergence(
                x,
                y,
                reg=2 * BLUR**2,
                metric="sqeuclidean",
                method="sinkhorn_log",
                numIterMax=1000,
                stopThr=1e-9,
            )
            / 2
        )
    (grad,) = torch.autograd.grad(value, x)
    return {
        "seconds": time.perf_counter() - start,
        "peak_rss_mb": peak_rss_mb(),
        "value": float(value.detach()),
        "grad": grad.double().flatten().tolist()[:3000],
        **info,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[20000, 100000, 1000000])
    parser.add_argument("--quick", action="store_true", help="N = 1,000 only")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--pot-max", type=int, default=1000, help="skip POT (dense N x M) above this N"
    )
    parser.add_argument(
        "--keops-max",
        type=int,
        default=5000,
        help="skip otreg's keops row above this N (slow on a CPU)",
    )
    parser.add_argument(
        "--dense-max",
        type=int,
        default=20000,
        help="skip the methods that sum over every pair (otreg blocked, "
        "GeomLoss online) above this N",
    )
    parser.add_argument(
        "--reference-max", type=int, default=100000, help="skip the float64 reference above this N"
    )
    parser.add_argument(
        "--converged-max",
        type=int,
        default=20000,
        help="skip the converged float64 reference above this N (about 2,400 "
        "iterations: 15 minutes at N = 20,000)",
    )
    parser.add_argument("--timeout", type=float, default=2400)
    parser.add_argument(
        "--reuse-reference",
        action="store_true",
        help="read the converged float64 reference saved by an earlier run",
    )
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]))))
        return
    import numpy as np

    sizes = [1000] if args.quick else args.sizes
    # KeOps compiles each formula on first use (about 10 s each, cached on disk): compile
    # them once on a small problem, untimed, so that the rows time the solves themselves
    for method in args.methods:
        if METHODS[method][0] == "geomloss" or "keops" in method:
            run_worker(__file__, [method, "500"], args.timeout)
    rows = []
    for n in sizes:
        ref = None
        cached = reference_file(n)
        if args.reuse_reference and cached.is_file():
            ref = json.loads(cached.read_text())
            rows.append({**ref, "error": f"saved by an earlier run ({ref.get('date', '?')})"})
        for method in args.methods:
            if args.reuse_reference and ref is not None and method.startswith("reference"):
                continue
            if METHODS[method][0] == "pot" and n > args.pot_max:
                rows.append(
                    {
                        "n": n,
                        "method": method,
                        "error": f"skipped above N={args.pot_max}"
                        " (autograd through dense iterations: 20 GB at N = 1,000)",
                    }
                )
                continue
            if "otreg" in method and "keops" in method and n > args.keops_max:
                rows.append(
                    {"n": n, "method": method, "error": f"skipped above N={args.keops_max}"}
                )
                continue
            if ("blocked" in method or "online" in method) and n > args.dense_max:
                rows.append(
                    {
                        "n": n,
                        "method": method,
                        "error": f"skipped above N="
                        f"{args.dense_max} (every pair at every iteration)",
                    }
                )
                continue
            if "converged" in method and n > args.converged_max:
                rows.append(
                    {"n": n, "method": method, "error": f"skipped above N={args.converged_max}"}
                )
                continue
            if method.startswith("reference") and n > args.reference_max:
                rows.append(
                    {"n": n, "method": method, "error": f"skipped above N={args.reference_max}"}
                )
                continue
            out = run_worker(__file__, [method, str(n)], args.timeout)
            print(
                n,
                method,
                {k: v for k, v in out.items() if k != "grad"},
                file=sys.stderr,
                flush=True,
            )
            row = {"n": n, "method": method, **out}
            if (
                method.startswith("reference")
                and "value" in row
                and (ref is None or "converged" in method)
            ):
                ref = row
                if "converged" in method:
                    CACHE.mkdir(parents=True, exist_ok=True)
                    stamp = time.strftime("%Y-%m-%d")
                    cached.write_text(json.dumps({**row, "date": stamp}))
            rows.append(row)
        for row in rows:  # errors against the converged reference if it ran, else the other
            if (
                row["n"] == n
                and ref is not None
                and row is not ref
                and "value" in row
                and not row["method"].startswith("reference")
            ):
                row["value_err"] = abs(row["value"] / ref["value"] - 1)
                g, gr = np.array(row["grad"]), np.array(ref["grad"])
                row["grad_err"] = float(np.linalg.norm(g - gr) / np.linalg.norm(gr))
        multiscale = next(
            (
                r
                for r in rows
                if r["n"] == n and "GeomLoss multiscale" in r["method"] and "seconds" in r
            ),
            None,
        )
        for r in rows:
            if r["n"] == n and multiscale and "seconds" in r:
                r["speedup"] = multiscale["seconds"] / r["seconds"]
    text = table(
        rows,
        [
            ("n", "N", "{:,}"),
            ("method", "method", ""),
            ("iters", "iterations", "{}"),
            ("seconds", "time (s)", "{:.1f}"),
            ("speedup", "GeomLoss multiscale time / time", "{:.1f}"),
            ("peak_rss_mb", "peak RSS (MB)", "{:.0f}"),
            ("value", "divergence", "{:.6f}"),
            ("value_err", "value rel. err.", "{:.1e}"),
            ("grad_err", "grad rel. err.", "{:.1e}"),
            ("error", "note", ""),
        ],
    )
    defaults = parser.parse_args([])
    variant = []
    if sizes != defaults.sizes:
        variant.append("N = " + ", ".join(f"{n:,}" for n in sizes))
    publish(
        "Sinkhorn divergence + gradient, noisy spheres, blur 0.01",
        text,
        args.record,
        "; ".join(variant),
    )


if __name__ == "__main__":
    main()
