"""pyvista renders of surfaces to PNG (and a GIF), off-screen.

VTK picks EGL or OSMesa when there is no display, so these work on a headless server with
no X (no Xvfb). pyvista is imported on use; the GIF is written by Pillow (a dependency of
pyvista and matplotlib). ``view`` says where the camera looks from: ``"x"``, ``"-x"``,
``"y"``, ``"-y"``, ``"z"``, ``"-z"`` (e.g. ``"-x"``: a lateral view of a left hemisphere in
RAS coordinates) or ``"iso"``.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..io import atomic_write
from ..registration.metrics import point_to_surface_distances
from ..registration.result import Registration
from ..shapes import Shape
from .curves import plot_history

__all__ = [
    "plot_shapes",
    "plot_overlay",
    "plot_registration",
    "plot_jacobian",
    "plot_momenta",
    "animate_flow",
]

#: The pictures :func:`plot_registration` draws, by role.
PICTURES = {"picture": "picture.png", "history": "history.png"}

VIEWS = ("x", "-x", "y", "-y", "z", "-z", "iso")
#: the colours of the moving shape and of the target in overlays (RGB hex)
COLOURS = {"moving": "#e8743b", "target": "#4c9be8"}


def _triton_before_vtk_renders() -> None:
    """Load Triton, if it is installed, before VTK first renders. On a headless machine VTK
    renders through Mesa's llvmpipe, and Triton's library loaded after that killed the
    process (a segmentation fault in ``import triton``, which torch's optimisers run at
    their first step: a picture, then ``otreg.register``, and a notebook's kernel died;
    VTK 9.6, Triton 3.9). Loaded first, both work. Costs 0.2 s and 71 MB once, which
    a registration's first L-BFGS step pays anyway."""
    try:
        import triton  # noqa: F401
    except Exception:  # not installed, or broken: nothing to protect
        pass


def _set_view(plotter, view: str) -> None:
    if view == "iso":
        plotter.view_isometric()
        return
    axis, negative = view.lstrip("-"), view.startswith("-")
    {"x": plotter.view_yz, "y": plotter.view_xz, "z": plotter.view_xy}[axis](negative=negative)


def _check(caller: str, shapes: dict, view: str) -> None:
    if view not in VIEWS:
        raise ValueError(f"{caller}: view is {view!r}; choose from {VIEWS}")
    for name, shape in shapes.items():
        if not isinstance(shape, Shape):
            raise TypeError(f"{caller}: {name} must be an otreg Shape, got {type(shape).__name__}")
        if shape.n_faces == 0:
            raise ValueError(f"{caller}: {name} has no triangles; the picture draws surfaces")


def _registration(caller: str, result, **shapes: Shape):
    """``result``, checked: a Registration, and ``shapes`` (``source=``, ``target=``) not
    swapped (each with the other side's vertex count and not its own: such pictures were
    drawn without a word). Other counts pass: a batch draws decimated copies."""
    if not isinstance(result, Registration):
        raise TypeError(
            f"{caller}: result must be an otreg Registration (what otreg.register returns), "
            f"got {type(result).__name__}"
        )
    counts = {"source": result.warped.n_points, "target": result.target.n_points}
    for role, shape in shapes.items():
        if not isinstance(shape, Shape):
            raise TypeError(f"{caller}: {role} must be an otreg Shape, got {type(shape).__name__}")
        other = "target" if role == "source" else "source"
        if shape.n_points == counts[other] != counts[role]:
            raise ValueError(
                f"{caller}: {role} has {shape.n_points} vertices, the registration's "
                f"{other}'s count ({role}: {counts[role]}): are source and target swapped?"
            )
    return result


#: the picture formats VTK's screenshot writes
PICTURE_EXTS = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")


def _render(caller: str, path: str | Path, window_size, subplots: int, draw) -> Path:
    """Open an off-screen plotter with ``subplots`` views side by side, ``draw(plotter)``,
    screenshot it to ``path`` atomically (a name VTK cannot write, or a folder that cannot
    be made, is refused first, naming ``path``)."""
    import pyvista as pv

    if not isinstance(path, (str, Path)):
        raise TypeError(f"{caller}: path must be a str or Path, got {type(path).__name__}")
    path = Path(path).expanduser()
    if path.suffix.lower() not in PICTURE_EXTS:
        raise ValueError(
            f"{caller}: path {path} has no picture extension; give one of {', '.join(PICTURE_EXTS)}"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"{caller}: cannot write {path}: {err.strerror or err}") from err
    _triton_before_vtk_renders()
    with pv.vtk_verbosity("off"):  # no "bad X server connection" note on headless machines
        plotter = pv.Plotter(off_screen=True, shape=(1, subplots), window_size=window_size)
        try:
            draw(plotter)
            try:
                atomic_write(path, lambda tmp: plotter.screenshot(str(tmp)))
            except OSError as err:
                raise OSError(f"{caller}: cannot write {path}: {err.strerror or err}") from err
        finally:
            plotter.close()
    return path


def _bar_format(low: float, high: float) -> str:
    """The printf format of a colour bar's labels from ``low`` to ``high`` (its five labels a
    quarter of the range apart): enough decimals that they differ, e.g. ``%.3f`` for 0 to
    0.1 mm (0.000, 0.025, ... where ``%.1f`` printed 0.0, 0.0, 0.1, 0.1, 0.1).

    Example:
        >>> _bar_format(0.0, 0.1), _bar_format(0.0, 1.0), _bar_format(0.0, 250.0)
        ('%.3f', '%.2f', '%.0f')
    """
    step = (high - low) / 4
    if not math.isfinite(step) or step <= 0:
        return "%.1f"
    return f"%.{min(6, max(0, math.ceil(-math.log10(step)) + 1))}f"


def _add_scalars(plotter, mesh, title: str, values, cmap: str, clim=None, fmt=None) -> None:
    import numpy as np

    values = np.asarray(values, dtype=float)
    mesh.point_data[title] = values
    if fmt is None:
        low, high = clim or (float(values.min()), float(values.max()))
        fmt = _bar_format(low, high)
    plotter.add_mesh(
        mesh,
        scalars=title,
        cmap=cmap,
        clim=clim,
        smooth_shading=True,
        scalar_bar_args={"title": title, "vertical": False, "fmt": fmt},
    )


def plot_shapes(
    shapes: dict[str, Shape],
    path: str | Path,
    colors: dict[str, str] | None = None,
    window_size: tuple[int, int] = (1500, 500),
    scalars: dict[str, tuple[str, object]] | None = None,
    view: str = "-x",
) -> Path:
    """Render shapes side by side, one view a shape, to a PNG of ``window_size`` pixels.

    Args:
        shapes: ``{title: Shape}`` surfaces.
        path: the PNG to write.
        colors: ``{title: colour}`` (default light grey).
        window_size: ``(width, height)`` pixels.
        scalars: colour some shapes by a value per vertex: ``{title: (bar title, values
            (N,))}``, e.g. ``{"warped": ("distance to target (mm)", d)}``.
        view: where the camera looks from (module docstring).

    Example:
        >>> import pyvista as pv, otreg, tempfile, pathlib
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=10))
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> otreg.viz.plot_shapes({"ball": ball}, folder / "ball.png", window_size=(300, 300)).name
        'ball.png'
    """
    colors, scalars = colors or {}, scalars or {}
    _check("plot_shapes", shapes, view)
    for name, given in scalars.items():
        if name not in shapes:
            raise ValueError(
                f"plot_shapes: scalars names {name!r}, which is not one of the shapes "
                f"({', '.join(map(repr, shapes))})"
            )
        count = len(given[1]) if hasattr(given[1], "__len__") else -1
        if count != shapes[name].n_points:
            raise ValueError(
                f"plot_shapes: scalars for {name!r} hold {count} values; the shape has "
                f"{shapes[name].n_points} vertices"
            )
    names = list(shapes)

    def draw(plotter):
        for k, name in enumerate(names):
            plotter.subplot(0, k)
            plotter.add_text(name, font_size=10)
            mesh = shapes[name].to_pyvista()
            if name in scalars:
                title, values = scalars[name]
                _add_scalars(plotter, mesh, title, values, "viridis")
            else:
                plotter.add_mesh(mesh, color=colors.get(name, "lightgrey"), smooth_shading=True)
            _set_view(plotter, view)
        plotter.link_views()

    return _render("plot_shapes", path, window_size, len(names), draw)


def plot_overlay(
    before: Shape,
    after: Shape,
    target: Shape,
    path: str | Path,
    window_size: tuple[int, int] = (1200, 600),
    view: str = "-x",
) -> Path:
    """Before and after, each with the target: two views side by side, the moving shape
    orange and the target blue (``COLOURS``), both opaque, so that each view shows which
    surface lies outside the other: large single-coloured patches before, a fine mottle of
    both colours where the surfaces coincide after.

    Args:
        before: the source as it was (or pre-aligned).
        after: the warped source (``Registration.warped``).
        target: the target surface.
        path: the PNG to write.
        window_size: ``(width, height)`` pixels.
        view: where the camera looks from (module docstring).

    Example:
        >>> import pyvista as pv, otreg, tempfile, pathlib
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=10))
        >>> moved = ball.with_points(ball.points + 3.0)
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> otreg.viz.plot_overlay(moved, ball, ball, folder / "overlay.png").name
        'overlay.png'
    """
    _check("plot_overlay", {"before": before, "after": after, "target": target}, view)

    def draw(plotter):
        for k, (title, moving) in enumerate((("before", before), ("after", after))):
            plotter.subplot(0, k)
            plotter.add_text(title, font_size=10)
            plotter.add_mesh(target.to_pyvista(), color=COLOURS["target"], smooth_shading=True)
            plotter.add_mesh(moving.to_pyvista(), color=COLOURS["moving"], smooth_shading=True)
            _set_view(plotter, view)
        plotter.link_views()

    return _render("plot_overlay", path, window_size, 2, draw)


def plot_registration(
    result, source: Shape, target: Shape, folder: str | Path, prefix: str = ""
) -> dict[str, Path]:
    """The pictures of a registration in ``folder``: ``picture.png`` (source, target, and
    the warped source coloured by its distance to the target, mm) and ``history.png`` (the
    objective per evaluation) when there is a history; ``prefix`` goes before each name.

    Returns:
        ``{"picture": path, "history": path}``, the files written.

    Example:
        >>> import pyvista as pv, torch, otreg, tempfile, pathlib
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
        >>> egg = ball.with_points(ball.points * torch.tensor([1.2, 0.9, 1.0], dtype=torch.float64))
        >>> res = otreg.register(ball, egg, levels=[(300, 3.0)], progress=False)
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> sorted(otreg.viz.plot_registration(res, ball, egg, folder))
        ['history', 'picture']
    """
    result = _registration("plot_registration", result, source=source, target=target)
    folder = Path(folder)
    warped = result.warped
    dist = point_to_surface_distances(warped.points.detach().cpu().double().numpy(), target)
    name = "warped (distance to target)"
    out = {
        "picture": plot_shapes(
            {"source": source, "target": target, name: warped},
            folder / f"{prefix}{PICTURES['picture']}",
            scalars={name: ("distance to target (mm)", dist)},
        )
    }
    if result.history:
        out["history"] = plot_history(result.history, folder / f"{prefix}{PICTURES['history']}")
    return out


def plot_jacobian(
    result,
    source: Shape,
    path: str | Path,
    window_size: tuple[int, int] = (800, 600),
    view: str = "-x",
) -> Path:
    """The warped source coloured by the Jacobian determinant of the whole transform at each
    source vertex (local volume change: < 1 shrinks, > 1 grows, <= 0 folds), on a blue-red
    scale centred on 1.

    Args:
        result: the :class:`~otreg.registration.Registration`.
        source: the source it registered (its vertices are where the determinant is taken).
        path: the PNG to write.
        window_size: ``(width, height)`` pixels.
        view: where the camera looks from (module docstring).

    Example:
        >>> import pyvista as pv, torch, otreg, tempfile, pathlib
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
        >>> egg = ball.with_points(ball.points * torch.tensor([1.2, 0.9, 1.0], dtype=torch.float64))
        >>> res = otreg.register(ball, egg, levels=[(300, 3.0)], progress=False)
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> otreg.viz.plot_jacobian(res, ball, folder / "jacobian.png").name
        'jacobian.png'
    """
    result = _registration("plot_jacobian", result)
    _check("plot_jacobian", {"source": source}, view)
    warped = source.with_points(result.transform(source.points))
    fitted = result.warped.points.to(warped.points)
    if warped.n_points == len(fitted):  # the registration's own source lands on its warped
        off = float((warped.points - fitted).norm(dim=1).mean())
        size = float((fitted.max(0).values - fitted.min(0).values).norm())
        if off > 1e-3 * size:
            raise ValueError(
                f"plot_jacobian: source is not the registration's source: carried through "
                f"the map, its vertices land {off:.3g} mm from the warped surface's on "
                "average (a surface of another subject with the same vertex count?)"
            )
    det = torch.linalg.det(result.jacobians(source.points))
    spread = max(float((det - 1).abs().max()), 1e-3)

    def draw(plotter):
        plotter.add_text(f"Jacobian determinant: {float(det.min()):.2f} to {float(det.max()):.2f}")
        _add_scalars(
            plotter,
            warped.to_pyvista(),
            "Jacobian determinant",
            det.cpu().numpy(),
            "coolwarm",
            clim=(1 - spread, 1 + spread),
            fmt="%.2f",
        )
        _set_view(plotter, view)

    return _render("plot_jacobian", path, window_size, 1, draw)


def plot_momenta(
    result,
    source: Shape,
    path: str | Path,
    window_size: tuple[int, int] = (800, 600),
    view: str = "-x",
) -> Path:
    """The LDDMM deformation's initial velocity at its control points, as arrows (true
    length, mm per unit time, coloured by length) over the pre-aligned source.

    The velocity ``v_i = sum_j k(q_i, q_j) p_j`` is drawn rather than the momenta p: it has
    the units of a displacement, and over the flow's unit time it is about how far each
    control point moves.

    Example:
        >>> import pyvista as pv, torch, otreg, tempfile, pathlib
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
        >>> egg = ball.with_points(ball.points * torch.tensor([1.2, 0.9, 1.0], dtype=torch.float64))
        >>> res = otreg.register(ball, egg, levels=[(300, 3.0)], progress=False)
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> otreg.viz.plot_momenta(res, ball, folder / "momenta.png").name
        'momenta.png'
    """
    import pyvista as pv

    result = _registration("plot_momenta", result)
    _check("plot_momenta", {"source": source}, view)
    deformation = result.deformation
    if deformation is None:
        raise ValueError("plot_momenta: the registration has no LDDMM deformation (linear model)")
    with torch.no_grad():
        q = deformation.control_points.double()
        p = deformation.momenta.detach().double()
        c = q.mean(0)
        v = deformation.kernel(q - c, q - c, p)
    moved = source if result.linear is None else source.with_points(_linear(result, source))
    arrows = pv.PolyData(q.cpu().numpy())
    speed = "speed (mm per unit time)"
    arrows["velocity"] = v.cpu().numpy()
    arrows[speed] = v.norm(dim=1).cpu().numpy()
    glyphs = arrows.glyph(orient="velocity", scale=speed, factor=1.0)

    def draw(plotter):
        plotter.add_text(f"initial velocity at {q.shape[0]} control points")
        plotter.add_mesh(moved.to_pyvista(), color="lightgrey", opacity=0.5, smooth_shading=True)
        plotter.add_mesh(
            glyphs,
            scalars=speed,
            cmap="plasma",
            scalar_bar_args={
                "title": speed,
                "vertical": False,
                "fmt": _bar_format(0.0, float(arrows[speed].max())),
            },
        )
        _set_view(plotter, view)

    return _render("plot_momenta", path, window_size, 1, draw)


def _linear(result, shape: Shape) -> torch.Tensor:
    with torch.no_grad():
        return result.linear(shape.points.double()).to(shape.points.dtype)


def animate_flow(
    result,
    source: Shape,
    path: str | Path,
    target: Shape | None = None,
    window_size: tuple[int, int] = (600, 500),
    view: str = "-x",
    seconds: float = 2.0,
) -> Path:
    """The source moving along the LDDMM flow, as an animated GIF that loops: one frame a
    time step (from the pre-aligned source to the warped one), the target translucent
    behind when given.

    Args:
        result: a :class:`~otreg.registration.Registration` with an LDDMM deformation.
        source: the registered source.
        path: the GIF to write.
        target: drawn translucent in every frame.
        seconds: the duration of one pass.
        window_size: ``(width, height)`` pixels.
        view: where the camera looks from (module docstring).

    Example:
        >>> import pyvista as pv, torch, otreg, tempfile, pathlib
        >>> ball = otreg.Shape.from_pyvista(pv.Sphere(radius=20)).to(torch.float64)
        >>> egg = ball.with_points(ball.points * torch.tensor([1.2, 0.9, 1.0], dtype=torch.float64))
        >>> res = otreg.register(ball, egg, levels=[(300, 3.0)], progress=False)
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> otreg.viz.animate_flow(res, ball, folder / "flow.gif", target=egg).name
        'flow.gif'
    """
    import pyvista as pv
    from PIL import Image

    result = _registration("animate_flow", result)
    shapes = {"source": source} if target is None else {"source": source, "target": target}
    _check("animate_flow", shapes, view)
    if result.deformation is None:
        raise ValueError("animate_flow: the registration has no LDDMM deformation to animate")
    if not seconds > 0:
        raise ValueError(f"animate_flow: seconds is {seconds}; it must be > 0")
    start = source.points.double() if result.linear is None else _linear(result, source).double()
    frames_points = result.deformation.trajectory(start)
    mesh = source.to_pyvista()
    frames = []
    _triton_before_vtk_renders()
    with pv.vtk_verbosity("off"):
        plotter = pv.Plotter(off_screen=True, window_size=window_size)
        try:
            if target is not None:
                plotter.add_mesh(
                    target.to_pyvista(), color=COLOURS["target"], opacity=0.35, smooth_shading=True
                )
            plotter.add_mesh(mesh, color=COLOURS["moving"], smooth_shading=True)
            _set_view(plotter, view)
            plotter.reset_camera()
            for k, pts in enumerate(frames_points):
                mesh.points = pts.detach().cpu().numpy()
                plotter.add_text(f"t = {k / (len(frames_points) - 1):.2f}", name="time")
                plotter.render()
                frames.append(Image.fromarray(plotter.screenshot(return_img=True)))
        finally:
            plotter.close()
    duration = int(1000 * seconds / len(frames))
    path = Path(path)
    atomic_write(
        path,
        lambda tmp: frames[0].save(
            str(tmp),
            format="GIF",
            save_all=True,
            append_images=frames[1:],
            duration=duration,
            loop=0,
        ),
    )
    return path
