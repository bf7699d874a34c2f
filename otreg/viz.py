"""Pictures of registrations: pyvista views (off-screen) and matplotlib curves.

pyvista and matplotlib are imported on use.
"""

from __future__ import annotations

from pathlib import Path

from .shapes import Shape

__all__ = ["plot_shapes", "plot_history"]


def plot_shapes(shapes: dict[str, Shape], path: str | Path, colors: dict[str, str] | None = None,
                window_size: tuple[int, int] = (1200, 600)) -> Path:
    """Render shapes side by side (one view a shape) to a PNG, off-screen."""
    import pyvista as pv

    from .io._files import atomic_write

    colors = colors or {}
    names = list(shapes)
    plotter = pv.Plotter(off_screen=True, shape=(1, len(names)), window_size=window_size)
    for k, name in enumerate(names):
        plotter.subplot(0, k)
        plotter.add_text(name, font_size=10)
        plotter.add_mesh(shapes[name].to_pyvista(), color=colors.get(name, "lightgrey"),
                         smooth_shading=True)
        plotter.view_yz(negative=True)  # a lateral view of a left hemisphere
    plotter.link_views()
    path = Path(path)

    def write(tmp: Path) -> None:
        plotter.screenshot(str(tmp))

    atomic_write(path, write)
    plotter.close()
    return path


def plot_history(history: list[dict], path: str | Path) -> Path:
    """The objective and its terms per evaluation (log scale) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .io._files import atomic_write

    keys = [k for k in history[0] if k not in ("level", "evaluation", "seconds")]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in keys:
        ax.semilogy([h[key] for h in history], label=key)
    ax.set_xlabel("objective evaluation")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(str(tmp), dpi=100))
    plt.close(fig)
    return path
