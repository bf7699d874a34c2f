"""Beside a busy process: otreg's calls alone and sharing the cores with one process that
spins, under libgomp's default spin count, under otreg's (``GOMP_SPINCOUNT=10000``), and with
otreg's calls run on the cores the busy process leaves (``otreg._info.threads_for_call``;
``OTREG_SHARE_CORES=0`` turns that off).

torch's CPU build parallelises each operation with OpenMP (libgomp on Linux), whose threads
meet at a barrier after each. Sharing the cores, a thread waits for one that is not running,
and the many short parallel regions of a Sinkhorn loop or an LDDMM fit each pay a
scheduler's time slice. Each call runs in a fresh process (the spin count is read when
libgomp loads), the fastest and slowest of its repeats after a first call (beside a busy
process the times scatter widely); the competitor is ``python -c 'while True: pass'``.

    python benchmarks/contention.py [--settings ...] [--calls ...] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import publish  # noqa: E402

CALLS = {
    "divergence + gradient, every pair, N = 5,000": """
import torch, otreg
g = torch.Generator().manual_seed(0)
x = (0.3 * torch.randn(5000, 3, generator=g)).requires_grad_(True)
y = 0.3 * torch.randn(5000, 3, generator=g) + torch.tensor([0.25, 0.0, 0.0])
def call():
    v = otreg.sinkhorn_divergence(x, y, blur=0.05, multiscale=False)
    torch.autograd.grad(v, x)
""",
    "divergence + gradient, multiscale, clusters vs ball, N = 5,000": """
import sys, torch, otreg
sys.path.insert(0, "benchmarks")
from sinkhorn_family import data
x, y = data("clusters vs ball", 5000, torch.float32)
x.requires_grad_(True)
def call():
    v = otreg.sinkhorn_divergence(x, y, blur=0.01)
    torch.autograd.grad(v, x)
""",
    "register, fsaverage5 onto Conte69 (left)": """
import otreg
from otreg import datasets
source, target = datasets.fsaverage5("pial"), datasets.conte69(surface="midthickness")
def call():
    otreg.register(source, target, progress=False)
""",
    "LDDMM gradient, 100,000 points, 200 control points": """
import torch
from otreg.registration import LDDMM
g = torch.Generator().manual_seed(0)
q = torch.rand(200, 3, generator=g, dtype=torch.float64) * 40
x = torch.rand(100_000, 3, generator=g, dtype=torch.float64) * 40
phi = LDDMM(q, sigma=10.0, n_steps=10, integrator="euler").double()
with torch.no_grad():
    phi.momenta.normal_(generator=g)
def call():
    torch.autograd.grad((phi(x) ** 2).sum(), phi.momenta)
""",
}
TIMER = """
import json, time
call()
times = []
for _ in range({repeats}):
    t = time.perf_counter(); call(); times.append(time.perf_counter() - t)
print(json.dumps([min(times), max(times)]))
"""
#: the environment of each setting: libgomp's own spin count (without OMP_WAIT_POLICY), the
#: one otreg sets when neither is set, each with torch's threads kept; otreg's defaults
SETTINGS = {
    "libgomp's spin count (300,000), torch's threads": {
        "GOMP_SPINCOUNT": "300000",
        "OTREG_SHARE_CORES": "0",
    },
    "otreg's spin count (10,000), torch's threads": {
        "GOMP_SPINCOUNT": "10000",
        "OTREG_SHARE_CORES": "0",
    },
    "otreg's defaults (10,000, the cores left free)": {
        "GOMP_SPINCOUNT": "10000",
        "OTREG_SHARE_CORES": "1",
    },
}


def timed(code: str, setting: dict, repeats: int, timeout: float) -> list[float] | None:
    env = {**os.environ, **setting}
    try:
        done = subprocess.run([sys.executable, "-c", code + TIMER.format(repeats=repeats)],
                              env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=Path(__file__).parent.parent)  # fmt: skip
    except subprocess.TimeoutExpired:
        return None
    if done.returncode:
        sys.exit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    # (libgomp's spin count: recorded before; beside a busy process, the registration then
    # takes minutes a call)
    parser.add_argument("--settings", nargs="*", choices=list(SETTINGS), default=list(SETTINGS)[1:])
    parser.add_argument("--calls", nargs="*", choices=list(CALLS), default=list(CALLS))
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    rows = []
    for name in args.calls:
        code = CALLS[name]
        repeats = 1 if name.startswith("register") else args.repeats
        for busy in (False, True):
            for label in args.settings:
                competitor = (
                    subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
                )
                try:
                    seconds = timed(code, SETTINGS[label], repeats, args.timeout)
                finally:
                    if competitor is not None:
                        competitor.kill()
                        competitor.wait()
                rows.append((name, "beside a busy process" if busy else "alone", label, seconds))
                shown = (
                    "over the timeout" if seconds is None else "{:.2f} to {:.2f} s".format(*seconds)
                )
                print(f"{name} | {rows[-1][1]} | {label} | {shown}", flush=True)
    lines = [
        "| call | cores | setting | fastest (s) | slowest (s) |",
        "|---|---|---|---|---|",
        *(
            f"| {n} | {c} | {s} | "
            + ("> timeout | |" if t is None else f"{t[0]:.2f} | {t[1]:.2f} |")
            for n, c, s, t in rows
        ),
    ]
    publish("Beside a busy process: spin count and threads", "\n".join(lines), args.record)


if __name__ == "__main__":
    main()
