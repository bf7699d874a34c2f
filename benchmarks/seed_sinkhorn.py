"""The first seed problem: gradient of entropic OT between two 10,000-point circles.

Two unit circles of N points, the second shifted by 1 along x; kernel exp(-|x - y|^2 / 0.25)
(eps = 0.125 for the cost |x - y|^2 / 2); a fixed number of Sinkhorn iterations in scaling
form (u = a / K v); the gradient of the OT value with respect to the first circle.

Unrolled autograd would store every iteration's N x M kernel (1,000 x 400 MB in float32).
Each method runs in a fresh process, so its peak RSS is its own.

    python benchmarks/seed_sinkhorn.py            # N = 10,000, 1,000 iterations
    python benchmarks/seed_sinkhorn.py --quick    # N = 2,000, 100 iterations
    python benchmarks/seed_sinkhorn.py --record   # also append the table to docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings

from _common import peak_rss_mb, publish, run_worker, table

METHODS = {
    "otreg scaling (blocked)": ("otreg", "scaling", "blocked"),
    "otreg log (blocked)": ("otreg", "log", "blocked"),
    "otreg scaling (keops)": ("otreg", "scaling", "keops"),
    "POT ot.solve (dense torch, envelope gradient)": ("pot", "scaling", "dense"),
}


def worker(method: str, n: int, iters: int) -> dict:
    import torch

    from otreg.datasets import circles

    lib, form, backend = METHODS[method]
    x, y = circles(n)
    x.requires_grad_(True)
    eps = 0.125
    start = time.perf_counter()
    if lib == "otreg":
        import otreg

        blur = math.sqrt(eps)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a fixed count (tol=0) never "converges"
            res = otreg.sinkhorn(
                x, y, blur=blur, diameter=blur, form=form, backend=backend, tol=0.0, max_iter=iters
            )
        value, n_iter = res.cost, res.n_iter
    else:
        import ot

        M = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1) / 2
        a = torch.full((n,), 1.0 / n)
        # grad="envelope": the plan as the gradient of M, as otreg does (no unrolled loop);
        # reg_type "KL" is KL(pi | a x b): the same entropic value as otreg's.
        value = ot.solve(M, a, a, reg=eps, max_iter=iters, tol=0.0, grad="envelope").value
        n_iter = iters
    (grad,) = torch.autograd.grad(value, x)
    return {
        "seconds": time.perf_counter() - start,
        "peak_rss_mb": peak_rss_mb(),
        "value": float(value.detach()),
        "grad_norm": float(grad.norm()),
        "iters": n_iter,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="N = 2,000, 100 iterations")
    parser.add_argument(
        "--methods",
        nargs="*",
        choices=list(METHODS),
        default=[m for m in METHODS if "keops" not in m],
        help="default: all but keops (about 0.25 G pairs/s on a CPU: slow)",
    )
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--record", action="store_true")
    parser.add_argument(
        "--worker", nargs=3, metavar=("METHOD", "N", "ITERS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))))
        return
    n, iters = (2000, 100) if args.quick else (args.n, args.iters)
    rows = []
    for method in args.methods:
        out = run_worker(__file__, [method, str(n), str(iters)], args.timeout)
        rows.append({"method": method, **out})
        print(method, out, file=sys.stderr, flush=True)
    base = next((r for r in rows if "seconds" in r), None)
    for r in rows:
        if base and "seconds" in r:
            r["time_ratio"] = r["seconds"] / base["seconds"]
            r["grad_rel_diff"] = abs(r["grad_norm"] / base["grad_norm"] - 1)
    text = table(
        rows,
        [
            ("method", "method", ""),
            ("iters", "iterations", "{}"),
            ("seconds", "wall time (s)", "{:.1f}"),
            ("time_ratio", "time / first", "{:.2f}"),
            ("peak_rss_mb", "peak RSS (MB)", "{:.0f}"),
            ("value", "returned value", "{:.6f}"),
            ("grad_norm", "grad norm", "{:.6e}"),
            ("grad_rel_diff", "grad vs first", "{:.1e}"),
            ("error", "error", ""),
        ],
    )
    note = (
        "Both return the entropic value <pi, C> + eps KL(pi | a x b) and its envelope "
        "gradient sum_j pi_ij (x_i - y_j); POT stores the dense 10^4 x 10^4 cost and "
        "kernel matrices, otreg recomputes blocks."
    )
    publish(
        f"Seed problem: circles, N = {n:,}, {iters} iterations", text + "\n\n" + note, args.record
    )


if __name__ == "__main__":
    main()
