"""A memory budget bounds the measured peak: each budget in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

STEPS = 100
#: an 8 MB state; the gradient of sum(x_n) with respect to w, and the same gradient by
#: forward sensitivities (dx_{k+1}/dw = dx_k/dw (1 + 0.01 w cos(w x_k)) + 0.01 x_k cos(w x_k)),
#: an oracle that stores nothing
SCRIPT = """
import json, sys, torch
from otreg.loops import iterate
from otreg.loops.memory import measure_peak
memory, steps = sys.argv[1], int(sys.argv[2])
x0 = torch.linspace(-0.5, 1.5, 1_000_000, dtype=torch.float64)
w = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
step = lambda x, w: x + 0.01 * torch.sin(w * x)
iterate(step, x0[:10], 2, (w,))
report = {}
def run():
    y = iterate(step, x0, steps, (w,), strategy="checkpoint", memory=memory, report=report)
    return torch.autograd.grad(y.sum(), w)[0]
try:
    grad, seconds, peak = measure_peak(run, torch.device("cpu"))
except ValueError as err:
    print(json.dumps({"error": str(err)}))
    raise SystemExit
with torch.no_grad():
    x, dx, wv = x0.clone(), torch.zeros_like(x0), float(w)
    for _ in range(steps):
        c = torch.cos(wv * x)
        dx = dx * (1 + 0.01 * wv * c) + 0.01 * x * c
        x = x + 0.01 * torch.sin(wv * x)
print(json.dumps({"peak_mb": peak / 1e6, "grad": float(grad), "oracle": float(dx.sum()),
                  "snapshots": report["snapshots"], "working_mb": report["working_bytes"] / 1e6}))
"""


def run_budget(memory: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, memory, str(STEPS)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_measured_peak_stays_within_the_budget_and_grows_with_it():
    peaks = []
    for budget_mb in (120, 200, 400):
        out = run_budget(f"{budget_mb}MB")
        assert out["peak_mb"] <= 1.25 * budget_mb + 30, out
        assert out["grad"] == pytest.approx(out["oracle"], rel=1e-9), out
        peaks.append(out["peak_mb"])
    assert peaks[0] <= peaks[1] + 10 and peaks[1] <= peaks[2] + 10, peaks  # monotonic
    assert peaks[2] > 2 * peaks[0]  # the larger budget is used: more snapshots


def test_a_budget_below_one_step_names_the_minimum():
    out = run_budget("25MB")
    message = out["error"]
    assert "memory budget 25.0 MB is below what checkpointing this loop needs" in message
    need = float(message.split("needs: ")[1].split(" MB")[0].replace(",", ""))
    assert 25 < need < 200  # one step of an 8 MB state forward and backward, plus 3 states
