"""Throughput of the log-sum-exp reduction (softmin) on the CPU, against the machine's limit.

The reduction is out_i = -eps log sum_j exp(h_j - |x_i - y_j|^2 / (2 eps)) over N x M pairs,
3-D float32 points, N = M (default 30,000), as in one Sinkhorn half-iteration. Rows:

- the machine's limit: every pair needs one exponential, so the rate of a vectorised
  ``exp`` over a buffer that stays in cache (torch's own vectorised kernel, run in place
  on 64 K floats per thread, repeated) bounds any pairs-per-second figure; the rate of a
  multiply-add over the same buffer is given too;
- otreg's ``blocked`` backend (the CPU default above 4e6 pairs), forward, and forward plus
  the gradient with respect to x, y and h;
- pykeops 2.3 on the CPU (its generic CPU backend), forward and forward plus gradient;
- dense torch in chunks of rows (``torch.logsumexp`` over an (n, M) block): the plain way.

G pairs/s = N M / seconds (forward) or 2 N M / seconds (forward + backward sweep, the count
of pair evaluations). Each row is the median of ``--repeat`` runs after one warm-up run (KeOps
compiles on its first call).

    python benchmarks/reductions.py            # N = M = 30,000
    python benchmarks/reductions.py --record   # append the table to docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _common import publish, table


def timed(fn, repeat: int) -> float:
    fn()  # warm-up (and KeOps compilation)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_limit(repeat: int) -> list[dict]:
    threads = torch.get_num_threads()
    buf = torch.rand(threads * 65536) * -20
    inner = 200

    def exp_loop():
        for _ in range(inner):
            torch.exp(buf, out=out)

    def fma_loop():
        for _ in range(inner):
            torch.addcmul(buf, buf, buf, out=out)

    out = torch.empty_like(buf)
    n = buf.numel() * inner
    t_exp, t_fma = timed(exp_loop, repeat), timed(fma_loop, repeat)
    return [{"method": f"limit: vectorised exp in cache ({threads} threads)",
             "gpairs": n / t_exp / 1e9},
            {"method": f"limit: vectorised multiply-add in cache ({threads} threads)",
             "gpairs": n / t_fma / 1e9}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=30_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-keops", action="store_true")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()

    from otreg import reductions as R
    from otreg.costs import get_cost

    n, eps, cost = args.n, 0.01, get_cost("sqeuclidean")
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(1, n, 3, generator=g), torch.rand(1, n, 3, generator=g)
    h = torch.randn(1, n, generator=g) * 0.1
    pairs = n * n
    rows = machine_limit(args.repeat)

    def forward(backend):
        return lambda: R.softmin(x, y, h, eps, cost, backend)

    def with_grad(backend):
        def run():
            xs, ys, hs = (t.clone().requires_grad_() for t in (x, y, h))
            out = R.softmin(xs, ys, hs, eps, cost, backend)
            torch.autograd.grad(out.sum(), (xs, ys, hs))
        return run

    def chunked():
        rows_ = max(1, R.BLOCK_ELEMENTS // n)
        for s in range(0, n, rows_):
            C = torch.cdist(x[0, s:s + rows_], y[0]) ** 2 / 2
            -eps * torch.logsumexp(h[0] - C / eps, dim=1)

    cases = [("otreg blocked, forward", forward("blocked"), 1),
             ("otreg blocked, forward + gradient (x, y, h)", with_grad("blocked"), 2)]
    if not args.no_keops:
        cases += [("pykeops CPU, forward", forward("keops"), 1),
                  ("pykeops CPU, forward + gradient (x, y, h)", with_grad("keops"), 2)]
    cases += [("dense torch in row chunks (cdist + logsumexp), forward", chunked, 1)]
    for name, fn, sweeps in cases:
        try:
            seconds = timed(fn, args.repeat)
        except Exception as err:  # a missing compiler for KeOps, say
            rows.append({"method": name, "error": str(err).splitlines()[0][:100]})
            continue
        rows.append({"method": name, "seconds": seconds, "gpairs": sweeps * pairs / seconds / 1e9})
        print(rows[-1], file=sys.stderr, flush=True)
    exp_rate = rows[0]["gpairs"]
    blocked = rows[2].get("gpairs")
    for r in rows:
        if "gpairs" in r:
            r["of_limit"] = r["gpairs"] / exp_rate
            if blocked and not r["method"].startswith("limit"):
                r["blocked_over"] = blocked / r["gpairs"]
    text = table(rows, [("method", "method", ""), ("seconds", "time (s)", "{:.2f}"),
                        ("gpairs", "G pairs/s (limit: G ops/s)", "{:.3f}"),
                        ("of_limit", "fraction of the exp limit", "{:.2f}"),
                        ("blocked_over", "otreg blocked forward / this", "{:.1f}"),
                        ("error", "error", "")])
    header = f"N = M = {n:,}, 3-D, float32, eps = {eps}"
    publish("Log-sum-exp reduction throughput on the CPU", header + "\n\n" + text,
            args.record)


if __name__ == "__main__":
    main()
