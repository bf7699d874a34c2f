"""Pictures of shapes, registrations, transport plans and loop trade-offs.

Three media, one module each, every heavy library imported on use:

- :mod:`otreg.viz.surfaces`: pyvista renders to PNG, off-screen (VTK picks EGL or OSMesa
  without a display): side-by-side views, before/after overlays, colouring by distance or
  Jacobian determinant, momenta arrows, and the flow as an animated GIF (Pillow writes it);
- :mod:`otreg.viz.curves`: matplotlib figures (a ``Figure`` of their own, never pyplot's
  state): loss curves, a transport plan, the memory/time trade-off of loop strategies;
- :mod:`otreg.viz.interactive`: an interactive 3-D view (plotly ``Mesh3d``) that shows in
  Jupyter and saves as one offline HTML file.

Every function that writes a file writes it atomically and returns its path.
"""

from __future__ import annotations

from .curves import plot_history, plot_plan, plot_tradeoff
from .interactive import view_3d, view_registration
from .surfaces import (
    animate_flow,
    plot_jacobian,
    plot_momenta,
    plot_overlay,
    plot_registration,
    plot_shapes,
)

__all__ = [
    "plot_shapes",
    "plot_overlay",
    "plot_registration",
    "plot_jacobian",
    "plot_momenta",
    "animate_flow",
    "plot_history",
    "plot_plan",
    "plot_tradeoff",
    "view_3d",
    "view_registration",
]
