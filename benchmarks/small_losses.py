"""The Sinkhorn loss on small clouds, called as a training loop calls it: otreg against GeomLoss.

A model trained with an OT loss calls it on small clouds thousands of times, so the cost of
one warm call (value and gradient, in one process, after a first call) is what matters,
not the import or the first call's. Problems: Gaussian clouds of N and N + 10 points (std
1, centres 0.5 apart) and noisy spheres (radii 1 and 0.8, centres 0.3 apart), float32, at
several blurs. Methods: ``otreg.sinkhorn_divergence(x, y, blur=b)`` and GeomLoss's
``SamplesLoss("sinkhorn", p=2, blur=b)`` (its default: every pair, scaling 0.5, no
convergence test). Each time is the median of ``--calls`` warm calls; the gradient's error
is against otreg's float64 solve at ``tol=1e-9``.

    python benchmarks/small_losses.py
    python benchmarks/small_losses.py --sizes 50 300 --record
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from _common import publish, table

from otreg.datasets import noisy_sphere


def clouds(kind: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The problem's two float32 clouds, (n, 3) and (n + 10, 3)."""
    if kind == "gaussians":
        g = torch.Generator().manual_seed(0)
        return torch.randn(n, 3, generator=g), torch.randn(n + 10, 3, generator=g) + 0.5
    x = noisy_sphere(n, seed=1, dtype=torch.float32)
    return x, noisy_sphere(n + 10, radius=0.8, center=(0.3, 0.0, 0.0), seed=2, dtype=torch.float32)


def timed(loss, x, y, calls: int) -> tuple[float, torch.Tensor, list[str]]:
    """The median time of ``calls`` warm calls of ``loss`` with its gradient in x, the
    gradient, and the warnings of the first call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        xx = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(loss(xx, y), xx)
    times = []
    for _ in range(calls):
        xx = x.clone().requires_grad_()
        start = time.perf_counter()
        (grad,) = torch.autograd.grad(loss(xx, y), xx)
        times.append(time.perf_counter() - start)
    return statistics.median(times), grad, [str(w.message)[:80] for w in caught]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[50, 300, 1000])
    parser.add_argument("--blurs", type=float, nargs="*", default=[0.02, 0.05, 0.2])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    import geomloss

    import otreg

    rows = []
    for kind in ("gaussians", "spheres"):
        for n in args.sizes:
            for blur in args.blurs:
                x, y = clouds(kind, n)
                exact = x.double().requires_grad_()
                value = otreg.sinkhorn_divergence(exact, y.double(), blur=blur, tol=1e-9,
                                                  max_iter=100_000)  # fmt: skip
                (reference,) = torch.autograd.grad(value, exact)
                row = {"problem": kind, "n": n, "blur": blur}
                methods = {
                    "otreg": lambda a, b, blur=blur: otreg.sinkhorn_divergence(a, b, blur=blur),
                    "geomloss": geomloss.SamplesLoss("sinkhorn", p=2, blur=blur),
                }
                for name, loss in methods.items():
                    seconds, grad, warned = timed(loss, x, y, args.calls)
                    error = float((grad.double() - reference).norm() / reference.norm())
                    row |= {f"{name}_s": seconds, f"{name}_error": error}
                    if warned:
                        row["note"] = f"{name} warned: {warned[0]}"
                row["ratio"] = row["otreg_s"] / row["geomloss_s"]
                print(row, flush=True)
                rows.append(row)
    columns = [
        ("problem", "problem", ""),
        ("n", "N", "{:,}"),
        ("blur", "blur", "{:g}"),
        ("otreg_s", "otreg (s)", "{:.3f}"),
        ("geomloss_s", "GeomLoss (s)", "{:.3f}"),
        ("ratio", "otreg / GeomLoss", "{:.1f}"),
        ("otreg_error", "otreg gradient error", "{:.1e}"),
        ("geomloss_error", "GeomLoss gradient error", "{:.1e}"),
        ("note", "note", ""),
    ]
    ratios = sorted(r["ratio"] for r in rows)
    summary = (
        f"\n\nTimes: the median of {args.calls} warm calls (value and gradient) in one "
        f"process. otreg / GeomLoss: median {statistics.median(ratios):.1f}, from "
        f"{ratios[0]:.1f} to {ratios[-1]:.1f}. otreg converges (marginal error 1e-3); "
        "GeomLoss's default call runs its annealing once, unconverged, hence its errors."
    )
    publish("The Sinkhorn loss on small clouds: otreg vs GeomLoss", table(rows, columns) + summary,
            args.record)  # fmt: skip


if __name__ == "__main__":
    main()
