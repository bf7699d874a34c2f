"""otreg's solvers inside models compiled with torch.compile: run as they are (a graph break),
and no compiler loaded by ``import otreg``."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import otreg


def test_import_leaves_the_compiler_unloaded_and_a_model_compiled_later_breaks_at_the_loss():
    # torch.compiler.disable imports torch._dynamo: 2 s of each import on two cores; the
    # solvers are marked for the compiler only once it is loaded
    code = """
import sys, torch, otreg
print("torch._dynamo" in sys.modules)
x, y = torch.randn(50, 3), torch.randn(40, 3)
eager = otreg.sinkhorn_divergence(x, y, blur=0.1)
model = lambda x, y: otreg.sinkhorn_divergence(x, y, blur=0.1)
print(torch.allclose(torch.compile(model, backend="eager")(x, y), eager))
torch._dynamo.reset()
try:
    torch.compile(model, backend="eager", fullgraph=True)(x, y)
except Exception as err:
    print("disable" in str(err))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "True"], done.stdout


def test_a_compiled_model_runs_the_loss_as_it_is():
    # tracing the converging loop recompiled at each call (54 recompilations, 113 s for one
    # call of 200 points); disabled for torch.compile, the model's graph breaks at the loss
    import torch._dynamo

    torch._dynamo.reset()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)
            self.loss = otreg.SinkhornLoss(blur=0.1)

        def forward(self, x, y):
            return self.loss(self.linear(x), y) + otreg.sinkhorn_divergence(x, y, blur=0.1)

    torch.manual_seed(0)
    model, x, y = Model(), torch.randn(200, 3), torch.randn(150, 3) + 0.5
    eager = model(x, y)
    compiled = torch.compile(model, backend="eager")  # (dynamo's tracing, no inductor)
    start = time.perf_counter()
    for _ in range(2):
        value = compiled(x, y)
        value.backward()
    assert time.perf_counter() - start < 30
    assert torch.allclose(value, eager, rtol=1e-5)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(Exception, match="disable"):  # no whole graph: said, not traced
        torch._dynamo.reset()
        torch.compile(model, backend="eager", fullgraph=True)(x, y)
    torch._dynamo.reset()
