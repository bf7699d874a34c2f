"""Pictures of registrations: pyvista views (off-screen PNG), matplotlib curves, and an
interactive 3-D view (plotly).

The interactive view is plotly's ``Mesh3d``: it shows inline in Jupyter and, written with
``view_3d(..., path=...)``, is one self-contained HTML file (plotly.js inside, about 5 MB)
that any browser opens offline, with no server. pyvista's ``export_html`` was the other
candidate; it needs trame and its vtk.js bundle for the same result. pyvista, matplotlib and
plotly are imported on use.
"""

from __future__ import annotations

from pathlib import Path

from .shapes import Shape

__all__ = ["plot_shapes", "plot_history", "plot_registration", "view_3d", "view_registration"]


def plot_shapes(
    shapes: dict[str, Shape],
    path: str | Path,
    colors: dict[str, str] | None = None,
    window_size: tuple[int, int] = (1500, 500),
    scalars: dict[str, tuple[str, object]] | None = None,
) -> Path:
    """Render shapes side by side (one view a shape) to a PNG, off-screen.

    ``scalars`` colours some shapes by a value per vertex: ``{name: (title, values (N,))}``,
    e.g. ``{"warped": ("distance to target (mm)", d)}``.
    """
    import pyvista as pv

    from .io import atomic_write

    colors, scalars = colors or {}, scalars or {}
    names = list(shapes)
    with pv.vtk_verbosity("off"):  # no "bad X server connection" note on headless machines
        plotter = pv.Plotter(off_screen=True, shape=(1, len(names)), window_size=window_size)
        _draw(plotter, shapes, names, colors, scalars)
        path = Path(path)
        atomic_write(path, lambda tmp: plotter.screenshot(str(tmp)))
        plotter.close()
    return path


def _draw(plotter, shapes, names, colors, scalars) -> None:
    import numpy as np

    for k, name in enumerate(names):
        plotter.subplot(0, k)
        plotter.add_text(name, font_size=10)
        mesh = shapes[name].to_pyvista()
        if name in scalars:
            title, values = scalars[name]
            mesh.point_data[title] = np.asarray(values, dtype=float)
            plotter.add_mesh(
                mesh,
                scalars=title,
                cmap="viridis",
                smooth_shading=True,
                scalar_bar_args={"title": title, "vertical": False, "fmt": "%.1f"},
            )
        else:
            plotter.add_mesh(mesh, color=colors.get(name, "lightgrey"), smooth_shading=True)
        plotter.view_yz(negative=True)  # a lateral view of a left hemisphere
    plotter.link_views()


def plot_history(history: list[dict], path: str | Path) -> Path:
    """The objective and its terms per evaluation (log scale) to a PNG.

    Drawn on a matplotlib ``Figure`` of its own (no pyplot), so it neither needs a display
    nor changes the backend of a notebook that calls it."""
    from matplotlib.figure import Figure

    from .io import atomic_write

    keys: list[str] = []
    for h in history:  # levels may have different data terms
        keys += [k for k in h if k not in (*_NOT_VALUES, *keys)]
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for key in keys:
        ax.semilogy([h.get(key, float("nan")) for h in history], label=key)
    for k in range(1, len(history)):
        if history[k].get("level") != history[k - 1].get("level"):
            ax.axvline(k - 0.5, color="grey", linewidth=0.5, linestyle="--")
    ax.set_xlabel("objective evaluation (dashed: next level)")
    ax.set_ylabel("value (energy: mm^2; data terms: their units)")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(str(tmp), dpi=100))
    return path


#: history entries that are not values of the objective or its terms
_NOT_VALUES = ("level", "evaluation", "seconds", "sinkhorn_iterations", "sinkhorn_converged")


def plot_registration(
    result, source: Shape, target: Shape, folder: str | Path, prefix: str = ""
) -> dict[str, Path]:
    """The pictures of a registration in ``folder``: ``picture.png`` (source, target, and
    the warped source coloured by its distance to the target, mm) and ``history.png`` (the
    objective per evaluation) when there is a history; ``prefix`` goes before each name.

    Returns:
        ``{"picture": path, "history": path}``, the files written.
    """
    from .registration.metrics import point_to_surface_distances

    folder = Path(folder)
    warped = result.warped
    dist = point_to_surface_distances(warped.points.detach().double().numpy(), target)
    name = "warped (distance to target)"
    out = {
        "picture": plot_shapes(
            {"source": source, "target": target, name: warped},
            folder / f"{prefix}picture.png",
            scalars={name: ("distance to target (mm)", dist)},
        )
    }
    if result.history:
        out["history"] = plot_history(result.history, folder / f"{prefix}history.png")
    return out


def view_3d(
    shapes: dict[str, Shape],
    scalars: dict[str, tuple[str, object]] | None = None,
    colors: dict[str, str] | None = None,
    opacity: dict[str, float] | None = None,
    path: str | Path | None = None,
):
    """An interactive 3-D view of surfaces in one scene (plotly ``Mesh3d``, mm axes).

    Args:
        shapes: ``{name: Shape}`` with triangles; each a trace that the legend toggles.
        scalars: ``{name: (title, values (N,))}`` colours that shape by a value per vertex
            (viridis, with a colour bar), e.g. the distance to a target in mm.
        colors, opacity: per shape, for the ones without scalars (default light grey, 1).
        path: also write the view as a self-contained HTML file (atomically; it loads
            nothing from the network).

    Returns:
        the ``plotly.graph_objects.Figure`` (shown inline by Jupyter).
    """
    try:
        import plotly.graph_objects as go
    except ImportError as err:
        raise ImportError("the interactive view uses plotly: pip install 'otreg[mesh]'") from err
    import numpy as np

    scalars, colors, opacity = scalars or {}, colors or {}, opacity or {}
    traces = []
    for name, shape in shapes.items():
        if shape.n_faces == 0:
            raise ValueError(f"view_3d: {name!r} has no triangles; the view draws surfaces")
        p = shape.points.detach().cpu().double().numpy()
        f = shape.faces.cpu().numpy()
        style: dict = {"color": colors.get(name, "lightgrey")}
        if name in scalars:
            title, values = scalars[name]
            values = np.asarray(values, dtype=float)
            if values.shape != (shape.n_points,):
                raise ValueError(
                    f"view_3d: scalars[{name!r}] has shape {values.shape}; it needs one value "
                    f"a vertex, ({shape.n_points},)"
                )
            style = {"intensity": values, "colorscale": "Viridis", "colorbar": {"title": title}}
        traces.append(
            go.Mesh3d(
                x=p[:, 0],
                y=p[:, 1],
                z=p[:, 2],
                i=f[:, 0],
                j=f[:, 1],
                k=f[:, 2],
                name=name,
                showlegend=True,
                opacity=opacity.get(name, 1.0),
                flatshading=False,
                **style,
            )
        )
    fig = go.Figure(traces)
    fig.update_layout(
        scene={
            "aspectmode": "data",
            "xaxis_title": "x (mm)",
            "yaxis_title": "y (mm)",
            "zaxis_title": "z (mm)",
        },
        margin={"l": 0, "r": 0, "t": 30, "b": 0},
        legend={"x": 0, "y": 1},
    )
    if path is not None:
        from .io import atomic_write

        html = fig.to_html(include_plotlyjs=True, full_html=True)
        atomic_write(Path(path), lambda tmp: Path(tmp).write_text(html))
    return fig


def view_registration(result, target: Shape, path: str | Path | None = None):
    """The warped source coloured by its distance to the target (mm), with the target
    drawn half transparent: :func:`view_3d` of a registration."""
    from .registration.metrics import point_to_surface_distances

    warped = result.warped
    dist = point_to_surface_distances(warped.points.detach().cpu().double().numpy(), target)
    return view_3d(
        {"target": target, "warped": warped},
        scalars={"warped": ("distance to target (mm)", dist)},
        opacity={"target": 0.35},
        path=path,
    )
