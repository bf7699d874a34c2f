"""Accelerating the Sinkhorn updates at the final eps: plain vs adaptive over-relaxation vs
Anderson mixing, on the same problems, in one process.

Each row is one problem solved three times (``relaxation=1``, ``"auto"``, ``"anderson"``)
from the same eps-scaling; iterations to ``tol`` (the eps-scaling's included), seconds, and
the value's relative difference from the plain run's where that converged (or from
``auto``'s). A run that does not reach ``tol`` shows why it stopped (``max_iter`` at
``MAX_ITER``, or ``stalled`` at the dtype's rounding floor) and its marginal error.

    python benchmarks/acceleration.py
    python benchmarks/acceleration.py --record   # append the table to docs/benchmarks.md
    python benchmarks/acceleration.py --small-clouds   # Anderson vs auto, 200-2,000 points

``--small-clouds`` sweeps uniform clouds in the unit cube (N and 1.3 N points, float32, the
default tol) at blurs 0.01 and 0.05, best of three calls each: where Anderson mixing loses
to the over-relaxation (blurs far below the points' spacing on small clouds).
"""

from __future__ import annotations

import argparse
import time
import warnings

from _common import publish, table

MAX_ITER = 3000


def problems():
    """(name, x, y, a, b, options) for each problem."""
    import torch

    from otreg.datasets import noisy_sphere

    def spheres(n, dtype):
        return (
            noisy_sphere(n, seed=1, dtype=dtype),
            noisy_sphere(n, radius=0.8, center=(0.3, 0.0, 0.0), seed=2, dtype=dtype),
        )

    g = torch.Generator().manual_seed(0)
    cube = torch.rand(300, 3, generator=g), torch.rand(400, 3, generator=g)
    square = torch.rand(5000, 2, generator=g), torch.rand(5100, 2, generator=g)
    f64 = torch.float64
    out = []
    for blur in (0.1, 0.05, 0.02):
        out.append(
            (
                f"noisy spheres, N = 2,000, float64, blur {blur}, tol 1e-6",
                *spheres(2000, f64),
                dict(blur=blur, tol=1e-6),
            )
        )
    out += [
        (
            "noisy spheres, N = 5,000, float32, blur 0.01, tol 1e-3 (the default call's)",
            *spheres(5000, torch.float32),
            dict(blur=0.01),
        ),
        ("same, unbalanced (reach 0.3)", *spheres(5000, torch.float32), dict(blur=0.01, reach=0.3)),
        (
            "uniform in a square, N = 5,000, float32, blur 0.005, tol 1e-3",
            *square,
            dict(blur=0.005),
        ),
        ("uniform in a cube, N = 300, float32, blur 0.01, tol 1e-3", *cube, dict(blur=0.01)),
    ]
    return out


def small_clouds(record: bool) -> None:
    import torch

    import otreg

    def best_of_three(x, y, relaxation, blur):
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            res = otreg.sinkhorn(x, y, blur=blur, relaxation=relaxation)
            seconds.append(time.perf_counter() - start)
        return min(seconds), res

    g = torch.Generator().manual_seed(0)
    rows = []
    for n in (200, 500, 1000, 2000):
        x, y = torch.rand(n, 3, generator=g), torch.rand(int(1.3 * n), 3, generator=g)
        for blur in (0.01, 0.05):
            row = {"n": n, "blur": blur}
            for label in ("anderson", "auto"):
                seconds, res = best_of_three(x, y, label, blur)
                row[f"{label}_iter"] = res.n_iter if res.converged else f"{res.stopped}"
                row[f"{label}_ms"] = 1e3 * seconds
            row["speedup"] = row["auto_ms"] / row["anderson_ms"]
            rows.append(row)
            print(row, flush=True)
    columns = [
        ("n", "N", "{:,}"),
        ("blur", "blur", "{:g}"),
        ("anderson_iter", "Anderson: iterations", ""),
        ("anderson_ms", "time (ms)", "{:.0f}"),
        ("auto_iter", "over-relaxation: iterations", ""),
        ("auto_ms", "time (ms)", "{:.0f}"),
        ("speedup", "auto time / Anderson time", "{:.2f}"),
    ]
    publish(
        "Final-eps acceleration on small uniform clouds: Anderson vs over-relaxation",
        table(rows, columns),
        record,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--small-clouds", action="store_true")
    args = parser.parse_args()
    import torch

    import otreg

    if args.small_clouds:
        return small_clouds(args.record)

    otreg.sinkhorn(torch.rand(50, 3), torch.rand(60, 3), blur=0.05)  # first-call costs
    rows = []
    for name, x, y, options in problems():
        row = {"problem": name}
        values = {}
        for label, relaxation in (("plain", 1.0), ("auto", "auto"), ("anderson", "anderson")):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", otreg.ConvergenceWarning)
                start = time.perf_counter()
                res = otreg.sinkhorn(x, y, relaxation=relaxation, max_iter=MAX_ITER, **options)
                seconds = time.perf_counter() - start
            values[label] = float(res.cost) if res.converged else None
            row[f"{label}_iter"] = (
                f"{res.n_iter:,}"
                if res.converged
                else f"{res.n_iter:,}: {res.stopped} at {res.marginal_error:.1e}"
            )
            row[f"{label}_s"] = seconds
        reference = values["plain"] if values["plain"] is not None else values["auto"]
        if reference is not None and values["anderson"] is not None:
            row["diff"] = abs(values["anderson"] / reference - 1)
        row["speedup"] = row["auto_s"] / row["anderson_s"]
        rows.append(row)
        print(row, flush=True)
    columns = [
        ("problem", "problem", ""),
        ("plain_iter", "plain: iterations", ""),
        ("plain_s", "time (s)", "{:.2f}"),
        ("auto_iter", "over-relaxation (auto)", ""),
        ("auto_s", "time (s)", "{:.2f}"),
        ("anderson_iter", "Anderson (default)", ""),
        ("anderson_s", "time (s)", "{:.2f}"),
        ("speedup", "auto time / Anderson time", "{:.2f}"),
        ("diff", "Anderson value vs plain", "{:.1e}"),
    ]
    publish(
        "Final-eps acceleration: plain, over-relaxation, Anderson",
        table(rows, columns),
        args.record,
    )


if __name__ == "__main__":
    main()
