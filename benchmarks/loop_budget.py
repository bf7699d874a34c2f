"""A memory budget against the measured peak: ``iterate(..., strategy="checkpoint", memory=B)``.

The loop: 400 steps of ``x <- x + 0.01 sin(w x)`` on an 8 MB state (10^6 float64 values),
the gradient of ``sum(x_400)`` with respect to w. Each budget runs in a fresh process; the
peak is the growth of its peak resident set while the loop runs forward and backward
(:func:`otreg.loops.memory.measure_peak`). ``store`` is plain autograd (every step's saved
tensors: about 25 MB a step here).

    python benchmarks/loop_budget.py            # budgets 25 MB to 800 MB, and store
    python benchmarks/loop_budget.py --record   # append the table to docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import sys

from _common import publish, run_worker, table

BUDGETS = ("25MB", "50MB", "100MB", "120MB", "200MB", "400MB", "800MB")
STEPS = 400


def worker(memory: str) -> dict:
    import torch

    from otreg.loops import iterate
    from otreg.loops.memory import measure_peak

    x0 = torch.linspace(-0.5, 1.5, 1_000_000, dtype=torch.float64)  # 8 MB
    w = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)

    def step(x, w):
        return x + 0.01 * torch.sin(w * x)

    iterate(step, x0[:10], 2, (w,))  # first-call costs outside the measurement
    report: dict = {}

    def run():
        kwargs = {} if memory == "store" else {"strategy": "checkpoint", "memory": memory}
        y = iterate(step, x0, STEPS, (w,), report=report, **kwargs)
        return torch.autograd.grad(y.sum(), w)[0]

    try:
        grad, seconds, peak = measure_peak(run, torch.device("cpu"))
    except ValueError as err:
        return {"error": str(err).split("; raise")[0].removeprefix("iterate: ")}
    return {
        "seconds": seconds,
        "peak_mb": peak / 1e6,
        "grad": float(grad),
        "snapshots": report.get("snapshots"),
        "working_mb": (report.get("working_bytes") or 0) / 1e6 or None,
        "recomputations": report.get("recomputations"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", nargs="*", default=list(BUDGETS))
    parser.add_argument("--no-store", action="store_true")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    runs = list(args.budgets) + ([] if args.no_store else ["store"])
    rows, store = [], None
    for memory in runs:
        out = run_worker(__file__, [memory], 1800)
        print(memory, out, file=sys.stderr, flush=True)
        row = {"memory": memory, **out}
        if memory == "store":
            store = row
        rows.append(row)
    for row in rows:
        if "peak_mb" in row and row["memory"] != "store":
            budget = float(row["memory"].removesuffix("MB"))
            row["peak_over_budget"] = row["peak_mb"] / budget
        if store and "seconds" in row and "seconds" in store:
            row["time_vs_store"] = row["seconds"] / store["seconds"]
            row["grad_diff"] = abs(row["grad"] - store["grad"]) / abs(store["grad"])
    text = table(
        rows,
        [
            ("memory", "memory=", ""),
            ("peak_mb", "measured peak (MB)", "{:.0f}"),
            ("peak_over_budget", "peak / budget", "{:.2f}"),
            ("working_mb", "fixed cost, measured (MB)", "{:.0f}"),
            ("snapshots", "snapshots", "{}"),
            ("recomputations", "recomputed steps", "{}"),
            ("seconds", "time (s)", "{:.1f}"),
            ("time_vs_store", "time / store's", "{:.2f}"),
            ("grad_diff", "gradient rel. diff. from store", "{:.1e}"),
            ("error", "error", ""),
        ],
    )
    publish(f"Memory budget against measured peak: {STEPS} steps, 8 MB state", text, args.record)


if __name__ == "__main__":
    main()
