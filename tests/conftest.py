import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*CUDA libraries not found.*")


def pytest_configure(config):
    torch.set_num_threads(max(1, torch.get_num_threads()))


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
