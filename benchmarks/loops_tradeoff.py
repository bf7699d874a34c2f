"""Memory and time of each loop-differentiation strategy on a 1,000-step loop, 100 MB state.

The loop is an additive-coupling flow (exactly invertible, so every strategy applies):

    a <- a + dt tanh(b W1),   b <- b + dt sin(a W2),   a, b: (500,000, 25) float32 (100 MB)

and the gradient of sum(a * b) at the end with respect to the initial state and W1, W2.
Each method runs in a fresh process: its peak RSS is its own. ``store`` cannot hold 1,000
steps here (about 300 MB saved per step): it runs on ``--store-steps`` steps and the table
gives the measured per-step memory. The peer is torch.utils.checkpoint on sqrt(n) segments.
A fixed point z = tanh(z W)/2 + c with z of (rows, 25) (half the loop's state; the "states"
column counts its own size) compares implicit with unrolled differentiation.

    python benchmarks/loops_tradeoff.py            # n = 1,000
    python benchmarks/loops_tradeoff.py --quick    # n = 100, state 10 MB
    python benchmarks/loops_tradeoff.py --record   # append the table to docs/benchmarks.md

A second table, the budget sweep, is what a user picks a budget from: 400 steps of an 8 MB
state (the loop above with 40,000 rows), ``strategy="checkpoint", memory=B`` for budgets
from 25 MB up to one that holds every state, against ``store``, each in a fresh process
*without* the allocator setting above (``iterate`` makes it itself when given a budget):
measured peak growth (:func:`otreg.loops.memory.measure_peak`, probes included) against the
bound 1.25 B + 30 MB, time against store's.

    python benchmarks/loops_tradeoff.py --sweep-only [--record]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from _common import peak_rss_mb, publish, run_worker, table

METHODS = [
    "store",
    "checkpoint, log2(n) snapshots",
    "checkpoint, sqrt(n) snapshots",
    "checkpoint, memory='1GB'",
    "reversible",
    "torch.utils.checkpoint, sqrt(n) segments",
    "fixed point, implicit (GMRES)",
    "fixed point, implicit (fixed-point adjoint)",
    "fixed point, unrolled",
]
DT = 0.1
# glibc keeps freed heap memory resident (and raises its mmap threshold up to 32 MB after the
# first free), so peak RSS would count memory that is free. Serving every buffer of 1 MB or
# more by mmap returns it to the system when freed: peak RSS then follows live tensors.
# Every method pays the same page-fault cost.
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def problem(rows: int, dim: int = 25):
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(rows, dim, generator=g).requires_grad_()
    b = torch.randn(rows, dim, generator=g).requires_grad_()
    W1 = (torch.randn(dim, dim, generator=g) / dim**0.5).requires_grad_()
    W2 = (torch.randn(dim, dim, generator=g) / dim**0.5).requires_grad_()
    return a, b, W1, W2


def step(state, W1, W2):
    import torch

    a, b = state
    a = a + DT * torch.tanh(b @ W1)
    return a, b + DT * torch.sin(a @ W2)


def inverse(state, W1, W2):
    import torch

    a, b = state
    b = b - DT * torch.sin(a @ W2)
    return a - DT * torch.tanh(b @ W1), b


def worker(method: str, n: int, rows: int, store_steps: int) -> dict:
    import torch
    from torch.utils.checkpoint import checkpoint

    from otreg.loops import fixed_point, iterate

    a, b, W1, W2 = problem(rows)
    leaves = (a, b, W1, W2)
    report: dict = {}
    start = time.perf_counter()
    steps = n
    if method.startswith("fixed point"):
        c = b.detach()

        def fp_step(z, W1, c):
            return torch.tanh(z @ W1) / 2 + c

        z = fixed_point(
            fp_step,
            torch.zeros_like(c),
            (W1, b),
            tol=1e-6,
            backward="implicit" if "implicit" in method else "unroll",
            solver="fixed_point" if "adjoint" in method else "gmres",
            report=report,
        )
        loss = (z * z).sum()
        leaves = (W1, b)
        steps = report["n_iter"]
    elif method.startswith("torch.utils"):
        seg = max(1, round(math.sqrt(n)))

        def segment(a, b, k):
            for _ in range(k):
                a, b = step((a, b), W1, W2)
            return a, b

        x = (a, b)
        done = 0
        while done < n:
            k = min(seg, n - done)
            x = checkpoint(segment, *x, k, use_reentrant=False)
            done += k
        loss = (x[0] * x[1]).sum()
    else:
        kw: dict = {}
        strategy = method.split(",")[0]
        if method == "store":
            steps = store_steps
        elif "log2" in method:
            kw["snapshots"] = math.ceil(math.log2(n))
        elif "sqrt" in method:
            kw["snapshots"] = math.ceil(math.sqrt(n))
        elif "memory" in method:
            kw["memory"] = "1GB"
        elif strategy == "reversible":
            kw["inverse"] = inverse
        x = iterate(step, (a, b), steps, (W1, W2), strategy=strategy, report=report, **kw)
        loss = (x[0] * x[1]).sum()
    torch.autograd.grad(loss, leaves)
    return {
        "seconds": time.perf_counter() - start,
        "peak_rss_mb": peak_rss_mb(),
        "steps": steps,
        "snapshots": report.get("snapshots"),
        "recomputations": report.get("recomputations"),
        "drift": report.get("drift"),
        "backward_residual": report.get("backward_residual"),
    }


SWEEP_BUDGETS = ("25MB", "50MB", "100MB", "200MB", "400MB", "1GB", "4GB")
SWEEP_STEPS, SWEEP_ROWS = 400, 40_000


def sweep_worker(budget: str, n: int, rows: int) -> dict:
    """One row of the budget sweep: ``store`` or ``checkpoint`` under ``memory=budget``."""
    import torch

    from otreg.loops import iterate
    from otreg.loops.memory import measure_peak

    a, b, W1, W2 = problem(rows)
    report: dict = {}

    def run():
        kw = {} if budget == "store" else {"strategy": "checkpoint", "memory": budget}
        x = iterate(step, (a, b), n, (W1, W2), report=report, **kw)
        return torch.autograd.grad((x[0] * x[1]).sum(), (a, b, W1, W2))

    _, seconds, peak = measure_peak(run, torch.device("cpu"))
    return {
        "seconds": seconds,
        "growth_mb": None if peak is None else peak / 1e6,
        "snapshots": report.get("snapshots"),
        "recomputations": report.get("recomputations", 0 if budget == "store" else None),
        "working_mb": report["working_bytes"] / 1e6 if "working_bytes" in report else None,
    }


def sweep(timeout: float) -> str:
    """The budget sweep's table (see the module's docstring)."""
    state_mb = 2 * SWEEP_ROWS * 25 * 4 / 1e6
    rows_out = []
    for budget in ("store", *SWEEP_BUDGETS):
        args = [budget, str(SWEEP_STEPS), str(SWEEP_ROWS)]
        out = run_worker(__file__, args, timeout, flag="--sweep-worker")
        print("sweep", budget, out, file=sys.stderr, flush=True)
        row = {"budget": budget, **out}
        if budget != "store" and out.get("growth_mb") is not None:
            from otreg.loops.budget import parse_bytes

            bound = 1.25 * parse_bytes("sweep", budget) / 1e6 + 30
            row["bound_mb"] = bound
            row["within"] = "yes" if out["growth_mb"] <= bound else "NO"
        rows_out.append(row)
    store = rows_out[0]
    for r in rows_out:
        if "seconds" in r and "seconds" in store:
            r["time_vs_store"] = r["seconds"] / store["seconds"]
    text = table(
        rows_out,
        [
            ("budget", "memory=", ""),
            ("snapshots", "snapshots", "{}"),
            ("recomputations", "recomputed steps", "{}"),
            ("working_mb", "measured working cost (MB)", "{:.0f}"),
            ("growth_mb", "measured peak growth (MB)", "{:.0f}"),
            ("bound_mb", "bound 1.25 B + 30 MB", "{:.0f}"),
            ("within", "within", ""),
            ("seconds", "time (s)", "{:.1f}"),
            ("time_vs_store", "time / store's", "{:.2f}"),
            ("error", "error", ""),
        ],
    )
    return (
        f"Budget sweep: {SWEEP_STEPS} steps, state {state_mb:.0f} MB, strategy='checkpoint', "
        "each budget in a fresh process (no allocator setting from the script)\n\n" + text
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=500_000, help="state: 2 x (rows, 25) fp32")
    parser.add_argument("--store-steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="n = 100, rows = 50,000")
    parser.add_argument("--methods", nargs="*", default=METHODS, choices=METHODS)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--sweep-only", action="store_true", help="only the budget sweep")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--sweep-worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        m, n, rows, ss = args.worker
        print(json.dumps(worker(m, int(n), int(rows), int(ss))))
        return
    if args.sweep_worker:
        budget, n, rows = args.sweep_worker
        print(json.dumps(sweep_worker(budget, int(n), int(rows))))
        return
    if args.sweep_only:
        publish(f"Loop budgets: {SWEEP_STEPS} steps, 8 MB state", sweep(args.timeout), args.record)
        return
    n, rows = (100, 50_000) if args.quick else (args.n, args.rows)
    state_mb = 2 * rows * 25 * 4 / 1e6
    base = run_worker(__file__, ["fixed point, unrolled", "1", "1", "1"], args.timeout, WORKER_ENV)
    rows_out = []
    for method in args.methods:
        out = run_worker(
            __file__, [method, str(n), str(rows), str(args.store_steps)], args.timeout, WORKER_ENV
        )
        print(method, out, file=sys.stderr, flush=True)
        row = {"method": method, **out}
        if "peak_rss_mb" in out:
            size = state_mb / 2 if method.startswith("fixed point") else state_mb  # z only
            row["states"] = (out["peak_rss_mb"] - base.get("peak_rss_mb", 0)) / size
        rows_out.append(row)
    store = next((r for r in rows_out if r["method"] == "store" and "seconds" in r), None)
    for r in rows_out:
        if store and "seconds" in r and not r["method"].startswith("fixed"):
            r["time_vs_store"] = (r["seconds"] / r["steps"]) / (store["seconds"] / store["steps"])
    text = table(
        rows_out,
        [
            ("method", "method", ""),
            ("steps", "steps", "{}"),
            ("snapshots", "snapshots", "{}"),
            ("recomputations", "recomputed steps", "{}"),
            ("seconds", "time (s)", "{:.1f}"),
            ("time_vs_store", "time per step / store's", "{:.2f}"),
            ("peak_rss_mb", "peak RSS (MB)", "{:.0f}"),
            ("states", "peak above import, in states", "{:.1f}"),
            ("drift", "drift", "{:.1e}"),
            ("backward_residual", "adjoint residual", "{:.1e}"),
            ("error", "error", ""),
        ],
    )
    header = (
        f"n = {n:,} steps, state {state_mb:.0f} MB; baseline RSS (Python, torch, "
        f"otreg imported) {base.get('peak_rss_mb', float('nan')):.0f} MB"
    )
    publish(
        f"Loop strategies: {n:,} steps, {state_mb:.0f} MB state",
        header + "\n\n" + text + "\n\n" + sweep(args.timeout),
        args.record,
    )


if __name__ == "__main__":
    main()
