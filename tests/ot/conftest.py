"""The Sinkhorn layer's tests run on every reduction backend.

Modules that use the ``each_backend`` fixture run each test once per backend, with
``backend="auto"`` pointed at it: ``tensorized`` and ``blocked`` in the default run, ``keops``
with ``-m slow`` (it compiles a few dozen formulas on an empty cache).
"""

import pytest

from otreg import reductions


@pytest.fixture(
    params=[
        "tensorized",
        "blocked",
        pytest.param("keops", marks=(pytest.mark.slow, pytest.mark.keops)),
    ]
)
def each_backend(request, monkeypatch):
    """The backend that ``auto`` resolves to in this test."""
    if request.param == "tensorized":
        monkeypatch.setattr(reductions, "TENSORIZED_MAX_PAIRS", 1 << 62)
        monkeypatch.setattr(reductions, "TENSORIZED_MAX_PAIRS_RECORDED", 1 << 62)
    else:
        monkeypatch.setattr(reductions, "TENSORIZED_MAX_PAIRS", 0)
        monkeypatch.setattr(reductions, "TENSORIZED_MAX_PAIRS_RECORDED", 0)
    if request.param == "keops":
        ok, why = reductions.keops_status()
        if not ok:
            pytest.skip(why)
        monkeypatch.setattr(reductions, "KEOPS_ON_CPU", True)
    return request.param
