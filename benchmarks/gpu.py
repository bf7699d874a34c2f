"""otreg on a GPU against the GPU peers, in one run (under 8 minutes on one H100/H200).

Rows, each in a fresh process:

- the environment and the KeOps check's verdict (a child process compiles otreg's formulas:
  pykeops 2.3 segfaulted on CUDA 13, which must end as a verdict, not a dead process);
- throughput of one softmin and one kernel product (3 columns), forward, at N = M = 1e5
  and 1e6 (float32), and the softmin in float64, for each backend that runs here
  (``triton``, ``keops`` where its check passed; ``blocked`` at 1e5 only): G pairs/s;
- the Sinkhorn divergence with its gradient on noisy spheres (radii 1 and 0.8, centres 0.3
  apart, noise 0.02) at blur 0.01, N = 1e4, 1e5, 1e6: otreg's default call, GeomLoss's
  tensorized call (N = 1e4) and its online and multiscale calls where pykeops works,
  FlashSinkhorn where it installs; each with its gradient's error against a float64
  reference (otreg, converged, on the GPU; N <= 1e5);
- the registration pairs of ``benchmarks/registration.py`` (fsaverage5 -> Conte69 and the
  163,842-vertex hemisphere) on CUDA, from arrays (no VTK on the GPU machine: their meshes
  are saved as .npz by ``--export`` on a machine that has the data).

    python benchmarks/gpu.py --export DIR          # here: the surfaces as arrays
    python benchmarks/gpu.py --surfaces DIR --record   # on the GPU machine
    python benchmarks/gpu.py --quick               # N = 1e4 only
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

from _common import publish, run_worker, table

BLUR = 0.01


def spheres(n: int, device, dtype):
    from otreg.datasets import noisy_sphere

    x = noisy_sphere(n, 1.0, (0.0, 0.0, 0.0), seed=1, dtype=dtype).to(device)
    y = noisy_sphere(n, 0.8, (0.3, 0.0, 0.0), seed=2, dtype=dtype).to(device)
    return x, y


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat: int = 3) -> float:
    fn()  # compile / warm up
    sync()
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def throughput_worker(backend: str, kind: str, n: int, dtype: str) -> dict:
    import torch

    from otreg.reductions import get_cost, kernel_product, softmin

    dt = getattr(torch, dtype)
    x, y = spheres(n, "cuda", dt)
    cost = get_cost("sqeuclidean")
    x, y = x[None], y[None]
    if kind == "softmin":
        h = torch.zeros(1, n, device="cuda", dtype=dt)
        seconds = timed(lambda: softmin(x, y, h, 1e-4, cost, backend))
    else:
        v = torch.rand(1, n, 3, device="cuda", dtype=dt)
        seconds = timed(lambda: kernel_product(x, y, v, 1e-2, cost, backend))
    return {"seconds": seconds, "gpairs": n * n / seconds / 1e9}


def divergence_worker(method: str, n: int) -> dict:
    import torch

    import otreg

    x, y = spheres(n, "cuda", torch.float32)
    x.requires_grad_(True)

    def run():
        xx = x.detach().requires_grad_(True)
        if method == "otreg default call":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                d = otreg.sinkhorn_divergence(xx, y, blur=BLUR)
        elif method.startswith("GeomLoss"):
            from geomloss import SamplesLoss

            backend = {"tensorized": "tensorized", "online": "online", "multiscale": "multiscale"}
            kind = method.split()[1]
            d = SamplesLoss("sinkhorn", p=2, blur=BLUR, scaling=0.9, backend=backend[kind])(xx, y)
        elif method == "FlashSinkhorn (fp32)":
            from flash_sinkhorn import SamplesLoss as FlashLoss

            # half_cost: |x - y|^2 / 2 like otreg and GeomLoss; TF32 off for the accuracy
            torch.backends.cuda.matmul.allow_tf32 = False
            d = FlashLoss(loss="sinkhorn", blur=BLUR, debias=True, half_cost=True)(xx, y)
        else:
            raise ValueError(method)
        (g,) = torch.autograd.grad(d, xx)
        return d, g

    seconds = timed(run, repeat=2)
    d, g = run()
    return {"seconds": seconds, "value": float(d), "grad": g.double().cpu().tolist()}


def reference_worker(n: int) -> dict:
    import torch

    import otreg

    x, y = spheres(n, "cuda", torch.float64)
    x.requires_grad_(True)
    d = otreg.sinkhorn_divergence(x, y, blur=BLUR, tol=1e-7, max_iter=20_000, scaling=0.9)
    (g,) = torch.autograd.grad(d, x)
    return {"value": float(d), "grad": g.cpu().tolist()}


def registration_worker(folder: str, name: str) -> dict:
    import numpy as np
    import torch

    import otreg

    arrays = np.load(Path(folder) / f"{name}.npz")
    shapes = [
        otreg.Shape(torch.as_tensor(arrays[f"{r}_points"]), torch.as_tensor(arrays[f"{r}_faces"]))
        for r in ("source", "target")
    ]
    src, tgt = (s.to("cuda") for s in shapes)
    start = time.perf_counter()
    res = otreg.register(src, tgt, progress=False)
    sync()
    m = res.metrics
    return {
        "seconds": time.perf_counter() - start,
        "fit_seconds": m["fit_seconds"],
        "mean_before_mm": m["before_mean_mm"],
        "mean_mm": m["mean_mm"],
        "jacobian_min": m["jacobian_min"],
    }


def export(folder: Path) -> None:
    """The registration benchmark's surfaces as arrays, for a machine without VTK."""
    import numpy as np

    from otreg import datasets

    folder.mkdir(parents=True, exist_ok=True)
    from otreg import Shape

    fs5, conte = datasets.fsaverage5("midthickness", "left"), datasets.conte69("left")
    full = Shape.from_pyvista(fs5.to_pyvista().subdivide(2, "linear"))  # 163,842 vertices
    for name, (s, t) in {"templates-left": (fs5, conte), "full-resolution": (full, conte)}.items():
        np.savez(
            folder / f"{name}.npz",
            **{f"{r}_points": v.points.numpy() for r, v in (("source", s), ("target", t))},
            **{f"{r}_faces": v.faces.numpy() for r, v in (("source", s), ("target", t))},
        )
    print(f"wrote {folder}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--surfaces", type=Path, help="the folder --export wrote")
    parser.add_argument("--export", type=Path, help="write the surfaces as arrays and stop")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        fn = {
            "throughput": throughput_worker,
            "divergence": divergence_worker,
            "reference": reference_worker,
            "registration": registration_worker,
        }[kind]
        typed = [int(r) if r.isdigit() else r for r in rest]
        print(json.dumps(fn(*typed)))
        return
    if args.export:
        export(args.export)
        return
    import torch

    import otreg
    from otreg.reductions import keops_status

    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA device")
    ok, verdict = keops_status("cuda")
    env = (
        f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA "
        f"{torch.version.cuda}), otreg {otreg.__version__}; KeOps check: "
        f"{'passed' if ok else verdict}"
    )
    backends = ["triton"] + (["keops"] if ok else [])
    sizes = [10_000] if args.quick else [100_000, 1_000_000]
    rows = []
    for n in sizes:
        for backend in backends + (["blocked"] if n <= 100_000 else []):
            for kind, dtype in (("softmin", "float32"), ("kernel_product", "float32"),
                                ("softmin", "float64")):  # fmt: skip
                r = run_worker(__file__, ["throughput", backend, kind, str(n), dtype], args.timeout)
                rows.append({"n": n, "backend": backend, "kind": f"{kind} ({dtype})", **r})
    body = env + "\n\n" + table(
        rows,
        [("n", "N = M", "{:,}"), ("backend", "backend", ""), ("kind", "reduction", ""),
         ("seconds", "time (s)", "{:.4f}"), ("gpairs", "G pairs/s", "{:.1f}"),
         ("error", "error", "")],
    )  # fmt: skip
    methods = ["otreg default call", "GeomLoss tensorized", "FlashSinkhorn (fp32)"]
    if ok:
        methods += ["GeomLoss online", "GeomLoss multiscale"]
    rows = []
    for n in [10_000] if args.quick else [10_000, 100_000, 1_000_000]:
        ref = run_worker(__file__, ["reference", str(n)], args.timeout) if n <= 100_000 else {}
        for method in methods:
            if method == "GeomLoss tensorized" and n > 10_000:
                continue
            r = run_worker(__file__, ["divergence", method, str(n)], args.timeout)
            row = {"n": n, "method": method, **{k: v for k, v in r.items() if k != "grad"}}
            if "grad" in r and "grad" in ref:
                import numpy as np

                g, g0 = np.array(r["grad"]), np.array(ref["grad"])
                row["grad_error"] = float(np.linalg.norm(g - g0) / np.linalg.norm(g0))
            rows.append(row)
    body += "\n\n" + table(
        rows,
        [("n", "N", "{:,}"), ("method", "divergence + gradient, blur 0.01", ""),
         ("seconds", "time (s)", "{:.3f}"), ("value", "value", "{:.6f}"),
         ("grad_error", "grad rel. error (vs float64)", "{:.1e}"), ("error", "error", "")],
    )  # fmt: skip
    if args.surfaces:
        rows = []
        for name in ("templates-left", "full-resolution"):
            r = run_worker(__file__, ["registration", str(args.surfaces), name], 600)
            rows.append({"pair": name, **r})
        body += "\n\n" + table(
            rows,
            [("pair", "pair", ""), ("seconds", "time (s)", "{:.1f}"),
             ("fit_seconds", "fit (s)", "{:.1f}"), ("mean_before_mm", "before (mm)", "{:.2f}"),
             ("mean_mm", "after (mm)", "{:.3f}"), ("jacobian_min", "min Jacobian", "{:.3f}"),
             ("error", "error", "")],
        )  # fmt: skip
    publish("otreg on a GPU: reductions, divergence and registration", body, args.record)


if __name__ == "__main__":
    main()
