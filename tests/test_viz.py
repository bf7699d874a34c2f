"""Pictures render off-screen to PNG files that are not blank."""

from __future__ import annotations

import re
from pathlib import Path

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


def _browser_screenshot(html: Path, png: Path, folder: Path) -> None:
    """Headless chromium (WebGL through SwiftShader) screenshots ``html``; skips without it."""
    import shutil
    import subprocess

    names = ("chromium", "chromium-browser", "google-chrome")
    exe = next((shutil.which(n) for n in names if shutil.which(n)), None)
    if exe is None:
        pytest.skip("no chromium binary found (chromium, chromium-browser or google-chrome)")
    cmd = [exe, "--headless", "--no-sandbox", "--no-first-run", "--use-angle=swiftshader"]
    cmd += ["--enable-unsafe-swiftshader", "--window-size=900,700", "--virtual-time-budget=8000"]
    cmd += [f"--user-data-dir={folder / '.profile'}", f"--screenshot={png}", html.as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0 and png.is_file(), done.stderr[-2000:]


def test_the_interactive_view_is_one_offline_html_file_a_browser_draws(tmp_path):
    """The surfaces coloured by a value, written as HTML: nothing loaded from the network,
    and headless chromium draws them (many coloured pixels, not only the colour bar)."""
    pytest.importorskip("plotly")
    pv = pytest.importorskip("pyvista")
    from PIL import Image

    from otreg.shapes import Shape
    from otreg.viz import view_3d

    sphere = Shape.from_pyvista(pv.Sphere(radius=20, theta_resolution=40, phi_resolution=40))
    bigger = sphere.with_points(sphere.points * 1.1)
    html = tmp_path / "view.html"
    fig = view_3d(
        {"target": bigger, "warped": sphere},
        scalars={"warped": ("x (mm)", sphere.points[:, 0].numpy())},
        opacity={"target": 0.3},
        path=html,
    )
    assert [t.name for t in fig.data] == ["target", "warped"]
    text = html.read_text()
    assert "plotly" in text and not re.search(r'src="https?://', text)
    png = tmp_path / "view.png"
    _browser_screenshot(html, png, tmp_path)
    pixels = np.asarray(Image.open(png).convert("RGB"), dtype=int)[:, :780]  # no colour bar
    colourful = (pixels.max(-1) - pixels.min(-1)) > 60
    assert colourful.mean() > 0.05, colourful.mean()  # the viridis sphere is drawn


def test_view_3d_refuses_bad_input(tmp_path, monkeypatch):
    pytest.importorskip("plotly")
    import builtins

    import torch

    from otreg.shapes import Shape
    from otreg.viz import view_3d

    tri = Shape(torch.eye(3), torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="'cloud' has no triangles"):
        view_3d({"cloud": Shape(torch.eye(3))})
    with pytest.raises(ValueError, match=r"scalars\['tri'\] has shape \(2,\); it needs one"):
        view_3d({"tri": tri}, scalars={"tri": ("v", [1.0, 2.0])})
    real_import = builtins.__import__

    def no_plotly(name, *args, **kwargs):
        if name.startswith("plotly"):
            raise ImportError("No module named 'plotly'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_plotly)
    with pytest.raises(ImportError, match=r"pip install 'otreg\[mesh\]'"):
        view_3d({"tri": tri})
