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
  163,842-vertex hemisphere) on CUDA, the first call of a process and the next one (the
  fit's time is the next call's), from arrays (no VTK on the GPU machine: their meshes
  are saved as .npz by ``--export`` on a machine that has the data).

    python benchmarks/gpu.py --export DIR          # here: the surfaces as arrays
    python benchmarks/gpu.py --surfaces DIR --record   # on the GPU machine
    python benchmarks/gpu.py --quick               # N = 1e4 only
    python benchmarks/gpu.py --tune                # the Triton kernels' tiles and warps

Each row is printed as it completes (the throughput and tuning workers' on stderr), so that
a run cut short still shows what it measured.
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


def timed(fn, repeat: int = 3, warm: bool = True) -> float:
    """The best of ``repeat`` calls (after one to compile and warm up), or of fewer where
    the calls so far took over 2 s."""
    if warm:
        fn()
    sync()
    best, spent = math.inf, 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
        spent += time.perf_counter() - start
        if spent > 2.0:
            break
    return best


def throughput_worker(backends: str, sizes: str) -> dict:
    """Every throughput row of ``backends`` and ``sizes`` (comma-separated) in this one
    process: each kernel compiled on a small problem first (Triton compiles per tile shape,
    not per size), then timed once, or the best of three where one call is short."""
    import torch

    from otreg.reductions import get_cost, kernel_product, softmin

    cost = get_cost("sqeuclidean")
    rows = []
    for n in map(int, sizes.split(",")):
        for backend in backends.split(","):
            if backend == "blocked" and n > 100_000:
                continue
            for kind, dtype in (("softmin", "float32"), ("kernel_product", "float32"),
                                ("softmin", "float64")):  # fmt: skip
                dt = getattr(torch, dtype)
                x, y = (p[None] for p in spheres(n, "cuda", dt))
                h = torch.zeros(1, n, device="cuda", dtype=dt)
                v = torch.rand(1, n, 3, device="cuda", dtype=dt)

                def call(k=None, x=x, y=y, h=h, v=v, kind=kind, backend=backend):
                    k = k or x.shape[1]
                    if kind == "softmin":
                        return softmin(x[:, :k], y[:, :k], h[:, :k], 1e-4, cost, backend)
                    return kernel_product(x[:, :k], y[:, :k], v[:, :k], 1e-2, cost, backend)

                row = {"n": n, "backend": backend, "kind": f"{kind} ({dtype})"}
                try:
                    call(min(n, 20_000))  # compile
                    seconds = timed(call, repeat=3, warm=False)
                    row.update(seconds=seconds, gpairs=n * n / seconds / 1e9)
                except Exception as err:  # a row that fails is recorded, not fatal
                    row["error"] = f"{type(err).__name__}: {str(err)[:120]}"
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    return {"rows": rows}


def tune_worker() -> dict:
    """Throughput of the Triton kernels for tile shapes and warps at N = M = 100,000: the
    forward softmin (float32) for each shape; the kernel product and the softmin's gradient
    in x for the four fastest; the softmin in float64. Returns the rows and the best shape
    of each dtype (float32: the best geometric mean of the three float32 rows)."""
    import torch

    from otreg.reductions import _triton, get_cost, kernel_product, softmin

    cost = get_cost("sqeuclidean")
    n = 100_000
    shapes32 = [(bn, bm, w) for bn, bm in ((64, 64), (128, 32), (128, 64), (256, 32), (256, 64),
                (512, 32), (128, 128), (64, 128)) for w in (4, 8)]  # fmt: skip
    shapes64 = [(32, 32, 4), (64, 32, 4), (64, 64, 4), (128, 32, 4), (64, 32, 8), (128, 32, 8)]
    data = {}
    for dtype in (torch.float32, torch.float64):
        x, y = (p[None] for p in spheres(n, "cuda", dtype))
        data[dtype] = (
            x,
            y,
            torch.zeros(1, n, device="cuda", dtype=dtype),
            torch.rand(1, n, 3, device="cuda", dtype=dtype),
        )

    def measure(label, dtype, bn, bm, warps):
        x, y, h, v = data[dtype]
        _triton.BLOCKS[dtype], _triton.NUM_WARPS[dtype] = (bn, bm), warps

        def call():
            if label == "kernel_product":
                return kernel_product(x, y, v, 1e-2, cost, "triton")
            if label == "softmin":
                return softmin(x, y, h, 1e-4, cost, "triton")
            xg = x.detach().requires_grad_(True)
            return torch.autograd.grad(softmin(xg, y, h, 1e-2, cost, "triton").sum(), xg)

        row = {"kind": f"{label} ({str(dtype)[6:]})", "tile": f"{bn} x {bm}", "warps": warps}
        try:
            seconds = timed(call, repeat=3)
            row.update(seconds=seconds, gpairs=n * n / seconds / 1e9)
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err)[:120]}"
        print(json.dumps(row), file=sys.stderr, flush=True)
        return row

    rows = [measure("softmin", torch.float32, *c) for c in shapes32]
    score = {c: [r.get("gpairs", 0.0)] for c, r in zip(shapes32, rows)}
    top = sorted(shapes32, key=lambda c: -score[c][0])[:4]
    for label in ("kernel_product", "softmin gradient"):
        for c in top:
            rows.append(measure(label, torch.float32, *c))
            score[c].append(rows[-1].get("gpairs", 0.0))
    best32 = max(top, key=lambda c: math.prod(score[c]))
    rows64 = [measure("softmin", torch.float64, *c) for c in shapes64]
    best64 = max(zip(shapes64, rows64), key=lambda cr: cr[1].get("gpairs", 0.0))[0]
    return {"rows": rows + rows64, "best": {"float32": best32, "float64": best64}}


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

    last = []  # the last timed call's outputs, so that no extra call is made (11 s at 1e6)

    def kept():
        last[:] = [run()]

    seconds = timed(kept, repeat=2)
    d, g = last[0]
    return {"seconds": seconds, "value": float(d), "grad": g.detach().double().cpu().tolist()}


def show(row: dict) -> dict:
    """Print a row as it completes (without its gradient)."""
    print(json.dumps({k: v for k, v in row.items() if k != "grad"}), flush=True)
    return row


def reference_worker(n: int) -> dict:
    import torch

    import otreg

    x, y = spheres(n, "cuda", torch.float64)
    x.requires_grad_(True)
    d = otreg.sinkhorn_divergence(x, y, blur=BLUR, tol=1e-6, max_iter=20_000, scaling=0.9)
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
    first = time.perf_counter() - start
    start = time.perf_counter()  # the next call in this process: compiled, imported
    res = otreg.register(src, tgt, progress=False)
    sync()
    m = res.metrics
    return {
        "seconds": first,
        "next_seconds": time.perf_counter() - start,
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
    parser.add_argument("--tune", action="store_true", help="time the kernels' tile shapes")
    parser.add_argument(
        "--without", action="append", default=[], help="leave out the methods naming this"
    )
    parser.add_argument(
        "--sizes", default="10000,100000,1000000", help="the divergence rows' N, comma-separated"
    )
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        fn = {
            "throughput": throughput_worker,
            "tune": tune_worker,
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
    print(env, flush=True)
    if args.tune:
        r = run_worker(__file__, ["tune"], 20 * args.timeout, progress=True)
        print(json.dumps({"best": r.get("best")}))
        print(table(r.get("rows", [r]), [("kind", "reduction", ""), ("tile", "tile", ""),
                    ("warps", "warps", ""), ("seconds", "time (s)", "{:.4f}"),
                    ("gpairs", "G pairs/s", "{:.1f}"), ("error", "error", "")]))  # fmt: skip
        return
    backends = ["triton"] + (["keops"] if ok else []) + ["blocked"]
    sizes = [10_000] if args.quick else [100_000, 1_000_000]
    r = run_worker(
        __file__,
        ["throughput", ",".join(backends), ",".join(map(str, sizes))],
        4 * args.timeout,
        progress=True,
    )
    rows = r.get("rows", [r])
    body = env + "\n\n" + table(
        rows,
        [("n", "N = M", "{:,}"), ("backend", "backend", ""), ("kind", "reduction", ""),
         ("seconds", "time (s)", "{:.4f}"), ("gpairs", "G pairs/s", "{:.1f}"),
         ("error", "error", "")],
    )  # fmt: skip
    methods = ["otreg default call", "GeomLoss tensorized", "FlashSinkhorn (fp32)"]
    if ok:
        methods += ["GeomLoss online", "GeomLoss multiscale"]
    methods = [m for m in methods if not any(w in m for w in args.without)]
    rows = []
    for n in [10_000] if args.quick else [int(n) for n in args.sizes.split(",")]:
        ref = {}
        if n <= 100_000:
            ref = run_worker(__file__, ["reference", str(n)], 2 * args.timeout)
            show({"n": n, "reference": "float64", **ref})
        for method in methods:
            if (method == "GeomLoss tensorized" and n > 10_000) or (
                method != "otreg default call" and n > 100_000
            ):  # past what fits or ends within the time limit
                continue
            # FlashSinkhorn autotunes its kernels on its first call: more time for it
            limit = args.timeout * (3 if method.startswith("Flash") else 1)
            r = run_worker(__file__, ["divergence", method, str(n)], limit)
            row = {"n": n, "method": method, **{k: v for k, v in r.items() if k != "grad"}}
            if "grad" in r and "grad" in ref:
                import numpy as np

                g, g0 = np.array(r["grad"]), np.array(ref["grad"])
                row["grad_error"] = float(np.linalg.norm(g - g0) / np.linalg.norm(g0))
            rows.append(show(row))
    body += "\n\n" + table(
        rows,
        [("n", "N", "{:,}"), ("method", "divergence + gradient, blur 0.01", ""),
         ("seconds", "time (s)", "{:.3f}"), ("value", "value", "{:.6f}"),
         ("grad_error", "grad rel. error (vs float64)", "{:.1e}"), ("error", "error", "")],
    )  # fmt: skip
    if args.surfaces:
        rows = []
        for name in ("templates-left", "full-resolution"):
            r = run_worker(__file__, ["registration", str(args.surfaces), name], 3 * args.timeout)
            rows.append(show({"pair": name, **r}))
        body += "\n\n" + table(
            rows,
            [("pair", "pair", ""), ("seconds", "time (s)", "{:.1f}"),
             ("next_seconds", "next call (s)", "{:.1f}"), ("fit_seconds", "fit (s)", "{:.1f}"),
             ("mean_before_mm", "before (mm)", "{:.2f}"),
             ("mean_mm", "after (mm)", "{:.3f}"), ("jacobian_min", "min Jacobian", "{:.3f}"),
             ("error", "error", "")],
        )  # fmt: skip
    publish("otreg on a GPU: reductions, divergence and registration", body, args.record)


if __name__ == "__main__":
    main()
