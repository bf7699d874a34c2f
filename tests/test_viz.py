"""Pictures render off-screen to PNG files that are not blank."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")


def test_plot_history_writes_a_picture_and_leaves_the_backend_alone(tmp_path):
    import matplotlib
    from PIL import Image

    from otreg.viz import plot_history

    history = [
        {
            "level": 0,
            "evaluation": k,
            "energy": 1.0 + k,
            "sinkhorn": 10.0 / (k + 1),
            "sinkhorn_iterations": 40,
            "sinkhorn_converged": True,
            "loss": 5.0 / (k + 1),
            "seconds": 0.1 * k,
        }
        for k in range(10)
    ]
    before = matplotlib.get_backend()
    path = plot_history(history, tmp_path / "history.png")
    assert matplotlib.get_backend() == before
    pixels = np.asarray(Image.open(path).convert("RGB"), dtype=float)
    assert pixels.shape == (400, 600, 3)
    assert pixels.std() > 10  # not blank
    # the curves' colours (matplotlib's first three) are there
    for colour in ((31, 119, 180), (255, 127, 14), (44, 160, 44)):
        assert (np.abs(pixels - colour).sum(-1) < 30).sum() > 50, colour
    # and no fourth curve: the solver's reports (iterations, converged) are not values
    assert (np.abs(pixels - (214, 39, 40)).sum(-1) < 30).sum() == 0
