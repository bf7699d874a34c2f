"""The default Sinkhorn call against GeomLoss over a family of problems, not one.

A converging solver's time depends on the problem (how many iterations its final blur
needs), so one benchmark problem hides it. Problems (float32 data, the squared distance
over 2 as cost, the divergence and its gradient in the first cloud):

- ``spheres, shift S``: two noisy unit spheres (noise 0.02), centres S diameters apart;
- ``spheres, radii 1 and 0.5``: a unit sphere and one of radius 0.5, centres 0.1 apart;
- ``clusters vs ball``: eight tight clusters (std 0.02) against a uniform unit ball;
- ``gaussians``: two Gaussian clouds (std 0.3, centres 0.25 apart), whose outliers, alone
  in their cells, move their potentials far at the final blur;
- ``heavy tails``: two Student-t clouds (3 degrees of freedom, scale 0.2, centres 0.25
  apart; at N = 5,000 a diameter of 22, so its own blur 0.1): a few points far out in the
  tails, which converge last and weigh most in the gradient;
- ``heavy tails, draw K``: the same clouds drawn again (K = 2 to 5; their references take
  one to more than ten minutes each, once: they are cached);
- ``brains, blur B mm``: fsaverage5's left pial surface's vertices (10,242, nilearn's
  wheel) against Conte69's left midthickness (32,492, brainspace's), in mm.

The synthetic clouds have ``--sizes`` points each (5,000 by default) and ``--blur`` 0.01
(0.005 of their diameter); the brains their own vertices and blurs 1 and 3 mm. Methods:
``otreg.sinkhorn_divergence(x, y, blur=b)`` (the default call), GeomLoss's default call
(``SamplesLoss("sinkhorn", p=2, blur=b)``, scaling 0.5) and its multiscale backend at
scaling 0.5 and 0.9. Each call runs in a fresh process; the KeOps formulas GeomLoss uses
are compiled first, untimed. Errors are against a float64 reference: otreg's solver
iterated at the final blur to a marginal error of 1e-7 (``--reference-tol``; Anderson
mixing), saved in
~/.cache/otreg-benchmarks/ and read back by later runs (``--fresh-reference`` recomputes)
made by the same generation of the solver (``REFERENCE_SOLVER``, in the file's name).

    python benchmarks/sinkhorn_family.py                   # every problem, N = 5,000
    python benchmarks/sinkhorn_family.py --problems clusters
    python benchmarks/sinkhorn_family.py --repeats 3       # medians of 3 runs in turn
    python benchmarks/sinkhorn_family.py --record          # into docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

from _common import peak_rss_mb, publish, run_worker, table

CACHE = Path.home() / ".cache" / "otreg-benchmarks"
#: the solver generation whose references a run reads back: changed with each change of
#: the solver that moves converged values. "pattern-checked": the multiscale loop stops
#: only on a pattern a search of every cell pair confirms (references made before it,
#: the clusters against a ball at N = 20,000 among them, were 3.3e-5 off)
REFERENCE_SOLVER = "pattern-checked"

#: name: (kind, parameters); brains carry their own blur (mm).
PROBLEMS = {
    "spheres, shift 0.05": ("spheres", {"shift": 0.05, "radius": 1.0}),
    "spheres, shift 0.25": ("spheres", {"shift": 0.25, "radius": 1.0}),
    "spheres, shift 1": ("spheres", {"shift": 1.0, "radius": 1.0}),
    "spheres, radii 1 and 0.5": ("spheres", {"shift": 0.05, "radius": 0.5}),
    "clusters vs ball": ("clusters", {}),
    "gaussians": ("gaussians", {}),
    "heavy tails": ("heavy tails", {"blur": 0.1}),
    # other draws of the same clouds: the final updates' count on these swings with the
    # rounding (65 to 430 on five draws), so one draw does not measure the solver
    **{
        f"heavy tails, draw {k}": ("heavy tails", {"blur": 0.1, "seed": 4 + k})
        for k in (2, 3, 4, 5)
    },
    "brains, blur 3 mm": ("brains", {"blur": 3.0}),
    "brains, blur 1 mm": ("brains", {"blur": 1.0}),
}
METHODS = {
    "reference (float64, converged)": ("reference", {}),
    "otreg default call": ("otreg", {}),
    "GeomLoss default call": ("geomloss", {"backend": "auto", "scaling": 0.5}),
    "GeomLoss multiscale, scaling 0.5": ("geomloss", {"backend": "multiscale", "scaling": 0.5}),
    "GeomLoss multiscale, scaling 0.9": ("geomloss", {"backend": "multiscale", "scaling": 0.9}),
}


def data(problem: str, n: int, dtype):
    """The two clouds of a problem, ``(N, 3)`` and ``(M, 3)``."""
    import torch

    from otreg import datasets

    kind, p = PROBLEMS[problem]
    if kind == "spheres":
        x = datasets.noisy_sphere(n, seed=1, dtype=torch.float64)
        y = datasets.noisy_sphere(
            n, radius=p["radius"], center=(2.0 * p["shift"], 0, 0), seed=2, dtype=torch.float64
        )
    elif kind == "clusters":
        g = torch.Generator().manual_seed(3)
        centres = torch.randn(8, 3, generator=g, dtype=torch.float64)
        centres = 0.7 * centres / centres.norm(dim=1, keepdim=True)
        x = centres[torch.arange(n) % 8] + 0.02 * torch.randn(
            n, 3, generator=g, dtype=torch.float64
        )
        ball = torch.randn(n, 3, generator=g, dtype=torch.float64)
        radii = torch.rand(n, 1, generator=g, dtype=torch.float64) ** (1 / 3)
        y = ball / ball.norm(dim=1, keepdim=True) * radii
    elif kind == "gaussians":
        g = torch.Generator().manual_seed(4)
        x = 0.3 * torch.randn(n, 3, generator=g, dtype=torch.float64)
        y = 0.3 * torch.randn(n, 3, generator=g, dtype=torch.float64)
        y[:, 0] += 0.25
    elif kind == "heavy tails":
        import numpy as np

        rng = np.random.default_rng(p.get("seed", 5))
        x = torch.from_numpy(0.2 * rng.standard_t(3, (n, 3)))
        y = torch.from_numpy(0.2 * rng.standard_t(3, (n, 3)))
        y[:, 0] += 0.25
    else:
        x = datasets.fsaverage5("pial", dtype=torch.float64).points
        y = datasets.conte69(surface="midthickness", dtype=torch.float64).points
    return x.to(dtype).contiguous(), y.to(dtype).contiguous()


def blur_of(problem: str, blur: float) -> float:
    kind, p = PROBLEMS[problem]
    return p.get("blur", blur)


def worker(method: str, problem: str, n: int, blur: float, reference_tol: float) -> dict:
    import torch

    lib, opts = METHODS[method]
    blur = blur_of(problem, blur)
    x, y = data(problem, n, torch.float64 if lib == "reference" else torch.float32)
    x.requires_grad_(True)
    info: dict = {}
    start = time.perf_counter()
    if lib in ("otreg", "reference"):
        import otreg
        from otreg.ot.divergence import divergence

        options = otreg.SinkhornOptions(blur=blur)
        if lib == "reference":  # the default's annealing, then the final blur to 1e-7
            options = otreg.SinkhornOptions(blur=blur, tol=reference_tol, max_iter=50_000)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # what otreg.sinkhorn_divergence(x, y, blur=blur) runs, with its result's counts
            value, res = divergence("sinkhorn_divergence", x, y, None, None, options)
        info = {"iters": res.n_iter, "backend": res.backend}
        unconverged = [w for w in caught if issubclass(w.category, otreg.ConvergenceWarning)]
        if unconverged:
            info["note"] = "warned: " + str(unconverged[0].message)[:100]
    else:
        import geomloss

        loss = geomloss.SamplesLoss("sinkhorn", p=2, blur=blur, **opts)
        value = loss(x, y)
    (grad,) = torch.autograd.grad(value, x)
    return {
        "seconds": time.perf_counter() - start,
        "peak_rss_mb": peak_rss_mb(),
        "value": float(value.detach()),
        "grad": grad.double().flatten().tolist(),
        **info,
    }


def reference_file(problem: str, n: int, blur: float, tol: float) -> Path:
    name = problem.replace(" ", "-").replace(",", "")
    blur = blur_of(problem, blur)
    return CACHE / f"family_{name}_n{n}_blur{blur:g}_tol{tol:g}_{REFERENCE_SOLVER}.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--problems", nargs="*", default=list(PROBLEMS), help="names, or their beginnings"
    )
    parser.add_argument("--sizes", type=int, nargs="*", default=[5000])
    parser.add_argument("--blur", type=float, default=0.01, help="of the synthetic problems")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--fresh-reference", action="store_true")
    parser.add_argument(
        "--reference-tol", type=float, default=1e-7, help="the reference's marginal error"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each method, in turn (the times: their median; the ratios: the "
        "median of each run's)",
    )
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        method, problem, n, blur, tol = args.worker
        print(json.dumps(worker(method, problem, int(n), float(blur), float(tol))))
        return
    import numpy as np

    picked = [p for name in args.problems for p in PROBLEMS if p == name or p.startswith(name)]
    problems = list(dict.fromkeys(picked))  # once each (a name also selects those it begins)
    if not problems:
        sys.exit(f"--problems: none of {args.problems} names a problem of {list(PROBLEMS)}")
    for method in args.methods:  # KeOps compiles its formulas once, untimed
        if METHODS[method][0] == "geomloss":
            run_worker(__file__, [method, "spheres, shift 0.05", "500", "0.05", "0"], args.timeout)
    rows = []
    for problem in problems:
        sizes = [10_242] if PROBLEMS[problem][0] == "brains" else args.sizes
        for n in sizes:
            cached = reference_file(problem, n, args.blur, args.reference_tol)
            ref = None
            if cached.is_file() and not args.fresh_reference:
                ref = json.loads(cached.read_text())
            here: dict[str, dict] = {}
            runs: dict[str, list[float]] = {m: [] for m in args.methods}
            for run in range(args.repeats):  # the methods in turn, so that a slow spell
                for method in args.methods:  # of the machine falls on all of them
                    if METHODS[method][0] == "reference" and method in here:
                        continue  # (once)
                    if METHODS[method][0] == "reference" and ref is not None:
                        # named as today (a cache written before a rename keeps its old name)
                        saved = f"saved by an earlier run ({ref['date']})"
                        here[method] = {**ref, "method": method, "note": saved}
                        continue
                    call = [method, problem, str(n), str(args.blur), str(args.reference_tol)]
                    out = run_worker(__file__, call, args.timeout)
                    shown = {k: v for k, v in out.items() if k != "grad"}
                    print(problem, n, method, run, shown, file=sys.stderr, flush=True)
                    if "seconds" in out:
                        runs[method].append(out["seconds"])
                    if method in here and "error" not in out:
                        continue  # (the first run's values: the same computation)
                    row = {"problem": problem, "n": n, "method": method, **out}
                    if "error" in out:  # a worker that failed or ran out of time: said
                        row["note"] = "; ".join(filter(None, (row.get("note"), out["error"])))
                    ok = "value" in out and "note" not in out
                    if METHODS[method][0] == "reference" and ok:
                        # (an unconverged reference, which warned, is shown but not saved)
                        ref = {**row, "date": time.strftime("%Y-%m-%d")}
                        CACHE.mkdir(parents=True, exist_ok=True)
                        cached.write_text(json.dumps(ref))
                    here[method] = row
            peers = [m for m in args.methods if m.startswith("GeomLoss") and runs[m]]
            for method, row in here.items():
                if runs[method] and METHODS[method][0] != "reference":
                    row["seconds"] = statistics.median(runs[method])
                    if args.repeats > 1:
                        row["runs"] = ", ".join(f"{t:.2f}" for t in runs[method])
                    # each run's time over that run's fastest GeomLoss call, then the median
                    ratios = [
                        t / min(runs[m][k] for m in peers if k < len(runs[m]))
                        for k, t in enumerate(runs[method])
                        if any(k < len(runs[m]) for m in peers)
                    ]
                    if ratios:
                        row["time_ratio"] = statistics.median(ratios)
            here = list(here.values())
            accurate = next(
                (r for r in here if r["method"] == "GeomLoss multiscale, scaling 0.9"), None
            )
            for row in here:
                is_ref = METHODS[row["method"]][0] == "reference"
                if ref is not None and "value" in row and not is_ref:
                    row["value_err"] = abs(row["value"] / ref["value"] - 1)
                    g, gr = np.array(row["grad"]), np.array(ref["grad"])
                    row["grad_err"] = float(np.linalg.norm(g - gr) / np.linalg.norm(gr))
            if accurate is not None and "grad_err" in accurate:
                for row in here:
                    if "grad_err" in row:
                        row["err_ratio"] = row["grad_err"] / accurate["grad_err"]
            rows += here
    columns = [
        ("problem", "problem", ""),
        ("n", "N", "{:,}"),
        ("method", "method", ""),
        ("iters", "iterations", "{}"),
        ("seconds", "time (s)", "{:.2f}"),
        *([("runs", "runs (s)", "")] if args.repeats > 1 else []),
        ("time_ratio", "time / GeomLoss's fastest", "{:.2f}"),
        ("peak_rss_mb", "peak RSS (MB)", "{:.0f}"),
        ("value_err", "value rel. err.", "{:.1e}"),
        ("grad_err", "grad rel. err.", "{:.1e}"),
        ("err_ratio", "grad err. / GeomLoss 0.9's", "{:.2f}"),
        ("note", "note", ""),
    ]
    ours = [r for r in rows if r["method"] == "otreg default call" and "time_ratio" in r]
    summary = ""
    if ours:
        times = [r["time_ratio"] for r in ours]
        errs = [r["err_ratio"] for r in ours if "err_ratio" in r]
        worst = max(ours, key=lambda r: r["time_ratio"])
        summary = (
            f"\n\nThe default call's time over GeomLoss's fastest: median "
            f"{statistics.median(times):.2f}, worst {max(times):.2f} ({worst['problem']}); "
            f"its gradient error over GeomLoss's accurate call's (scaling 0.9): median "
            f"{statistics.median(errs):.2f}, worst {max(errs):.2f}."
            if errs
            else ""
        )
    body = table(rows, columns) + summary
    defaults = parser.parse_args([])
    variant = []
    if problems != list(PROBLEMS):
        variant.append("; ".join(problems))
    if args.methods != defaults.methods:
        variant.append("; ".join(args.methods))
    if args.sizes != defaults.sizes or args.blur != defaults.blur:
        variant.append(f"N = {', '.join(map(str, args.sizes))}, blur {args.blur:g}")
    if args.repeats > 1:
        variant.append(f"{args.repeats} runs each")
    publish("Sinkhorn over a family of problems: the default call vs GeomLoss", body,
            args.record, ", ".join(variant))  # fmt: skip


if __name__ == "__main__":
    main()
