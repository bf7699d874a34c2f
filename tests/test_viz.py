"""Pictures render off-screen to PNG files that are not blank."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import hide_module

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
    import torch

    from otreg.shapes import Shape
    from otreg.viz import view_3d

    tri = Shape(torch.eye(3), torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="'cloud' has no triangles"):
        view_3d({"cloud": Shape(torch.eye(3))})
    with pytest.raises(ValueError, match=r"scalars\['tri'\] has shape \(2,\); it needs one"):
        view_3d({"tri": tri}, scalars={"tri": ("v", [1.0, 2.0])})
    hide_module(monkeypatch, "plotly")
    with pytest.raises(ImportError, match=r"pip install 'otreg\[mesh\]'"):
        view_3d({"tri": tri})


# ---------------------------------------------------------------- every picture function
def _pixels(path: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"), dtype=int)


def _orange(p: np.ndarray) -> np.ndarray:  # the moving shape (viz.COLOURS), under shading
    return (p[..., 0] > p[..., 1] + 40) & (p[..., 1] > p[..., 2] + 20)


def _blue(p: np.ndarray) -> np.ndarray:  # the target, under shading
    return p[..., 2] > p[..., 0] + 40


def _colourful(p: np.ndarray) -> np.ndarray:
    return (p.max(-1) - p.min(-1)) > 60


@pytest.fixture(scope="module")
def fitted():
    """A small LDDMM registration: a sphere onto an ellipsoid (r = 20 mm)."""
    pv = pytest.importorskip("pyvista")
    import torch

    from otreg import LBFGSOptions, RefineOptions, Shape, register

    src = Shape.from_pyvista(pv.Sphere(radius=20, theta_resolution=24, phi_resolution=24))
    src = src.to(torch.float64)
    tgt = src.with_points(src.points * torch.tensor([1.3, 0.8, 1.0], dtype=torch.float64))
    res = register(
        src,
        tgt,
        prealign="none",
        levels=[(300, 3.0, "varifold")],
        optimizer=LBFGSOptions(max_iter=6),
        refine=RefineOptions(sigma=5.0, levels=[(500, 2.5)]),  # drawn as one deformation
        progress=False,
    )
    return res, src, tgt


def test_plot_shapes_and_overlay(fitted, tmp_path):
    from otreg.viz import plot_overlay, plot_shapes

    res, src, tgt = fitted
    p = _pixels(plot_shapes({"a": src, "b": tgt}, tmp_path / "s.png", window_size=(600, 300)))
    assert p.shape == (300, 600, 3) and p.std() > 10
    grey = (p.sum(-1) < 700) & (p.max(-1) - p.min(-1) < 40)  # the shaded grey shapes
    assert grey.mean() > 0.15
    p = _pixels(plot_overlay(src, res.warped, tgt, tmp_path / "o.png"))
    assert p.shape == (600, 1200, 3)
    for half in (p[:, :600], p[:, 600:]):  # before and after: both shapes in each view
        assert _orange(half).mean() > 0.01 and _blue(half).mean() > 0.01


def test_plot_jacobian_and_momenta(fitted, tmp_path):
    from otreg.viz import plot_jacobian, plot_momenta

    res, src, _ = fitted
    p = _pixels(plot_jacobian(res, src, tmp_path / "j.png"))
    assert p.shape == (600, 800, 3) and p.std() > 10
    assert _colourful(p).mean() > 0.05  # coolwarm colours, not only grey
    p = _pixels(plot_momenta(res, src, tmp_path / "m.png", view="iso"))
    assert p.shape == (600, 800, 3) and _colourful(p).mean() > 0.01  # the plasma arrows
    other = src.with_points(src.points.flip(0))  # another subject, the same vertex count
    with pytest.raises(ValueError, match="source is not the registration's source: carried"):
        plot_jacobian(res, other, tmp_path / "wrong.png")
    assert not (tmp_path / "wrong.png").exists()


def test_animate_flow_writes_one_frame_a_time_step(fitted, tmp_path):
    from PIL import Image, ImageSequence

    from otreg.viz import animate_flow

    res, src, tgt = fitted
    path = animate_flow(res, src, tmp_path / "flow.gif", target=tgt, window_size=(300, 250))
    gif = Image.open(path)
    frames = [np.asarray(f.convert("RGB"), dtype=int) for f in ImageSequence.Iterator(gif)]
    assert len(frames) == res.deformation.n_steps + 1 == 6 + 2 + 1  # the refinement's too
    assert frames[0].shape == (250, 300, 3) and gif.info.get("loop") == 0
    assert np.abs(frames[0] - frames[-1]).mean() > 1  # the shape moved
    assert _orange(frames[-1]).mean() > 0.02


def test_plot_plan_and_tradeoff(tmp_path):
    import torch

    import otreg
    from otreg.viz import plot_plan, plot_tradeoff

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(40, 2, generator=g), torch.rand(50, 2, generator=g) + 1.0
    plan = otreg.sinkhorn(x, y, blur=0.05).plan
    p = _pixels(plot_plan(x, y, plan, tmp_path / "plan.png", max_lines=100))
    assert p.shape == (600, 600, 3)
    for colour in ((31, 119, 180), (255, 127, 14)):  # the two clouds
        assert (np.abs(p - colour).sum(-1) < 30).sum() > 100, colour
    rows = [
        {"strategy": "store", "peak_bytes": 8e8, "seconds": 1.0},
        {"strategy": "checkpoint", "peak_bytes": 1e8, "seconds": 1.6, "memory": "100MB"},
    ]
    p = _pixels(plot_tradeoff(rows, tmp_path / "tradeoff.png"))
    assert p.shape == (450, 600, 3)
    for colour in ((31, 119, 180), (255, 127, 14)):  # one point a row
        assert (np.abs(p - colour).sum(-1) < 30).sum() > 50, colour


def test_picture_functions_refuse_bad_input(fitted, tmp_path):
    import torch

    from otreg import register
    from otreg.viz import (
        animate_flow,
        plot_momenta,
        plot_overlay,
        plot_plan,
        plot_registration,
        plot_shapes,
        plot_tradeoff,
    )

    res, src, tgt = fitted
    with pytest.raises(ValueError, match="view is 'top'; choose from"):
        plot_overlay(src, res.warped, tgt, tmp_path / "o.png", view="top")
    with pytest.raises(TypeError, match="result must be an otreg Registration"):
        plot_momenta({"momenta": 1}, src, tmp_path / "m.png")
    rigid = register(src, tgt, model="rigid", progress=False)
    with pytest.raises(ValueError, match="no LDDMM deformation"):
        animate_flow(rigid, src, tmp_path / "f.gif")
    with pytest.raises(
        ValueError, match=r"plan has shape \(3, 3\); it must be \(N, M\) = \(4, 5\)"
    ):
        plot_plan(torch.rand(4, 2), torch.rand(5, 2), torch.rand(3, 3), tmp_path / "p.png")
    with pytest.raises(ValueError, match="rows is empty"):
        plot_tradeoff([], tmp_path / "t.png")
    # a name VTK cannot write: named with the path given (it was pyvista's message about
    # otreg's temporary file)
    with pytest.raises(ValueError, match=r"plot_momenta: path .*m.pdf has no picture extension"):
        plot_momenta(res, src, tmp_path / "m.pdf")
    with pytest.raises(OSError, match=r"plot_shapes: cannot write /proc/ps.png"):
        plot_shapes({"a": src}, "/proc/ps.png")
    with pytest.raises(ValueError, match=r"scalars for 'a' hold 7 values; the shape has"):
        plot_shapes({"a": src}, tmp_path / "s.png", scalars={"a": ("d", np.zeros(7))})
    with pytest.raises(ValueError, match=r"scalars names 'b', which is not one of the shapes"):
        plot_shapes({"a": src}, tmp_path / "s.png", scalars={"b": ("d", np.zeros(7))})
    small = src.decimate(100)
    swapped = register(small, tgt, model="rigid", progress=False)
    with pytest.raises(ValueError, match="are source and target swapped"):
        plot_registration(swapped, tgt, small, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing half-written


TRITON_AFTER_A_PICTURE = """
import sys
import pyvista as pv
import otreg
from otreg import viz
ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20))
viz.plot_shapes({"ball": ball}, sys.argv[1])
import triton  # what torch's optimisers import at their first step
print("alive")
"""


def test_a_picture_then_triton_does_not_kill_the_process(tmp_path):
    """On a headless machine VTK renders through Mesa's llvmpipe, and Triton's library
    loaded after it segfaulted (a picture, then otreg.register's first L-BFGS step, killed
    a notebook's kernel): otreg's pictures load Triton first."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    pytest.importorskip("pyvista")
    done = subprocess.run(
        [sys.executable, "-c", TRITON_AFTER_A_PICTURE, str(tmp_path / "ball.png")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "alive" in done.stdout, done.stderr[-2000:]
    assert (tmp_path / "ball.png").stat().st_size > 0
