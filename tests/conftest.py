import os
import warnings

import pytest
import torch

# Without a GPU, Triton's interpreter runs the GPU kernels on the CPU (tests/reductions/
# test_triton.py). It must be chosen before triton is first imported, which
# otreg.reductions.status() and otreg.info() do: here, before any test.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

warnings.filterwarnings("ignore", message=".*CUDA libraries not found.*")

# Property tests draw the same examples on every run, so that a run's verdict never
# depends on chance; `pytest --hypothesis-profile=explore` draws new ones, and more.
try:
    from hypothesis import settings

    settings.register_profile("default", derandomize=True)
    settings.register_profile("explore", derandomize=False, max_examples=500)
    settings.load_profile("default")
except ImportError:
    pass


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Torch's global generator starts each test from the same state, so that a test that
    draws from it sees the same numbers whichever tests ran before it (one drew a case out of
    reach of its tolerance when the tests before it changed)."""
    torch.manual_seed(0)


def pytest_configure(config):
    torch.set_num_threads(max(1, torch.get_num_threads()))
    # the fused loops' verdicts measured by earlier runs on this machine are not read (each
    # run measures as a clean machine does) nor changed by this one
    import tempfile

    from otreg.reductions import _compiled

    _compiled.VERDICT_PATH = os.path.join(tempfile.mkdtemp(), "fused-verdicts.json")


def hide_module(monkeypatch, module: str) -> None:
    """Make ``import module`` (and its submodules) fail, as if it were not installed."""
    import builtins

    real_import = builtins.__import__

    def without(name, *args, **kwargs):
        if name == module or name.startswith(module + "."):
            raise ImportError(f"No module named {module!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(0)


def clouds(n=30, m=40, d=2, dtype=torch.float64, seed=0, batch=None, shift=0.3):
    """Two random clouds in [0, 1]^d and [shift, 1 + shift]^d, and random positive weights."""
    g = torch.Generator().manual_seed(seed)
    lead = () if batch is None else (batch,)
    x = torch.rand(*lead, n, d, generator=g, dtype=dtype)
    y = torch.rand(*lead, m, d, generator=g, dtype=dtype) + shift
    a = torch.rand(*lead, n, generator=g, dtype=dtype) + 0.1
    b = torch.rand(*lead, m, generator=g, dtype=dtype) + 0.1
    return x, y, a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True)


def student_t(n, seed, shift):
    """A Student-t cloud (3 degrees of freedom, scale 0.2): a bulk and a few far points."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 3, generator=g, dtype=torch.float64)
    chi2 = torch.randn(n, 3, generator=g, dtype=torch.float64).square().sum(1, keepdim=True)
    return 0.2 * z / (chi2 / 3).sqrt() + torch.tensor([shift, 0.0, 0.0], dtype=torch.float64)


def clusters(n, seed=3):
    """Eight tight clusters (std 0.02) against a uniform unit ball, float32."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    centres = 0.7 * centres / centres.norm(dim=1, keepdim=True)
    x = centres[torch.arange(n) % 8] + 0.02 * torch.randn(n, 3, generator=gen, dtype=torch.float64)
    ball = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    radii = torch.rand(n, 1, generator=gen, dtype=torch.float64) ** (1 / 3)
    y = ball / ball.norm(dim=1, keepdim=True) * radii
    return x.float(), y.float()
