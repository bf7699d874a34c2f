"""An interactive 3-D view of surfaces: plotly ``Mesh3d``.

It shows inline in Jupyter and, written with ``view_3d(..., path=...)``, is one
self-contained HTML file (plotly.js inside, about 5 MB) that any browser opens offline, with
no server. pyvista's ``export_html`` was the other candidate; it needs trame and its vtk.js
bundle for the same result. plotly is imported on use.
"""

from __future__ import annotations

from pathlib import Path

from ..io import atomic_write
from ..registration.metrics import point_to_surface_distances
from ..shapes import Shape

__all__ = ["view_3d", "view_registration"]


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
        colors: a colour per shape without scalars (default light grey).
        opacity: an opacity per shape, in [0, 1] (default 1).
        path: also write the view as a self-contained HTML file (atomically; it loads
            nothing from the network).

    Returns:
        the ``plotly.graph_objects.Figure`` (shown inline by Jupyter).

    Example:
        >>> import pyvista as pv, otreg
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20))
        >>> fig = otreg.viz.view_3d({"ball": ball}, scalars={"ball": ("z (mm)", ball.points[:, 2])})
        >>> [trace.name for trace in fig.data]
        ['ball']
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
        html = fig.to_html(include_plotlyjs=True, full_html=True)
        atomic_write(Path(path), lambda tmp: Path(tmp).write_text(html))
    return fig


def view_registration(result, target: Shape, path: str | Path | None = None):
    """The warped source coloured by its distance to the target (mm), with the target
    drawn half transparent: :func:`view_3d` of a registration.

    Example:
        >>> import pyvista as pv, torch, otreg, tempfile, pathlib
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
        >>> egg = ball.with_points(ball.points * torch.tensor([1.2, 0.9, 1.0], dtype=torch.float64))
        >>> res = otreg.register(ball, egg, levels=[(300, 3.0)], progress=False)
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> fig = otreg.viz.view_registration(res, egg, path=folder / "view.html")
        >>> [trace.name for trace in fig.data]
        ['target', 'warped']
    """
    warped = result.warped
    dist = point_to_surface_distances(warped.points.detach().cpu().double().numpy(), target)
    return view_3d(
        {"target": target, "warped": warped},
        scalars={"warped": ("distance to target (mm)", dist)},
        opacity={"target": 0.35},
        path=path,
    )
