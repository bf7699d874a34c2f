"""``Shape``: a point cloud or triangle surface in world coordinates (mm), as torch tensors.

Geometry that registration differentiates (triangle areas, centres, normals) is computed in
torch, so it follows deformed points through autograd. Mesh processing that VTK already does
well (decimation, Taubin smoothing, connected components) goes through pyvista, imported on
use (``pip install otreg[mesh]``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ._checks import check_device
from .reductions.sparse import grid_labels

__all__ = ["Shape"]


def _as_tensor(x, dtype=None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x if dtype is None else x.to(dtype)
    return torch.as_tensor(np.asarray(x), dtype=dtype)


@dataclass
class Shape:
    """Points ``(N, 3)`` in mm, optional triangles ``(F, 3)``, weights ``(N,)`` and data.

    Attributes:
        points: vertex positions, float tensor ``(N, D)`` (D = 3 for surfaces), world mm
            (integer and half-precision input is widened to torch's default dtype).
        faces: vertex indices of triangles, int64 ``(F, 3)``, counter-clockwise seen from
            outside (normals point outwards), or None for a point cloud.
        weights: optional non-negative point masses ``(N,)``.
        data: per-point arrays (e.g. curvature, labels), each with N rows.
        unit: the length unit of ``points`` (``"mm"``).
        source: the file the shape was read from, if any (never overwritten by save_shape).

    Example:
        >>> import torch, otreg
        >>> tetra = otreg.Shape(torch.eye(3).repeat(2, 1)[:4] * 10.0,
        ...                     torch.tensor([[0, 1, 2], [0, 1, 3], [0, 2, 3], [1, 2, 3]]))
        >>> tetra.n_points, tetra.n_faces, tetra.unit
        (4, 4, 'mm')
    """

    points: torch.Tensor
    faces: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    data: dict[str, torch.Tensor] = field(default_factory=dict)
    unit: str = "mm"
    source: str | None = None
    #: decimate()'s results, by the vertices asked for and the versions of points and faces
    _decimations: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        caller = "Shape"
        pts = _as_tensor(self.points)
        if not pts.is_floating_point() or torch.finfo(pts.dtype).bits < 32:
            pts = pts.to(torch.get_default_dtype())  # integers and half precision widened
        if pts.dim() != 2 or pts.shape[1] < 1:
            raise ValueError(f"{caller}: points has shape {tuple(pts.shape)}; it must be (N, D)")
        if pts.shape[0] == 0:
            raise ValueError(f"{caller}: points is empty; a shape needs at least one point")
        bad = ~torch.isfinite(pts.detach())
        if bool(bad.any()):
            where = bad.any(1).nonzero().squeeze(1)
            listed = ", ".join(map(str, where[:5].tolist())) + (", ..." if len(where) > 5 else "")
            raise ValueError(
                f"{caller}: points has {len(where)} rows with NaN or infinite coordinates "
                f"(rows {listed}); all coordinates must be finite"
            )
        self.points = pts
        if self.faces is not None:
            faces = _as_tensor(self.faces)
            if faces.is_floating_point() or faces.dtype == torch.bool:
                raise TypeError(f"{caller}: faces has dtype {faces.dtype}; it must be integer")
            faces = faces.long()
            if faces.dim() != 2 or faces.shape[1] != 3:
                raise ValueError(
                    f"{caller}: faces has shape {tuple(faces.shape)}; triangles are (F, 3)"
                )
            if faces.numel() and (int(faces.min()) < 0 or int(faces.max()) >= pts.shape[0]):
                raise ValueError(
                    f"{caller}: faces index vertices {int(faces.min())} to "
                    f"{int(faces.max())} but there are {pts.shape[0]} points"
                )
            self.faces = faces.to(pts.device)
        if self.weights is not None:
            w = _as_tensor(self.weights, pts.dtype).to(pts.device)
            if w.shape != (pts.shape[0],):
                raise ValueError(
                    f"{caller}: weights has shape {tuple(w.shape)}; it must be ({pts.shape[0]},)"
                )
            if bool((w < 0).any()) or not bool(torch.isfinite(w).all()):
                raise ValueError(f"{caller}: weights must be finite and >= 0")
            self.weights = w
        for key, value in list(self.data.items()):
            value = _as_tensor(value).to(pts.device)
            if value.shape[0] != pts.shape[0]:
                raise ValueError(
                    f"{caller}: data[{key!r}] has {value.shape[0]} rows but there "
                    f"are {pts.shape[0]} points"
                )
            self.data[key] = value

    # ------------------------------------------------------------------ basics
    @property
    def n_points(self) -> int:
        """The number of points (vertices)."""
        return int(self.points.shape[0])

    @property
    def n_faces(self) -> int:
        """The number of triangles (0 for a point cloud)."""
        return 0 if self.faces is None else int(self.faces.shape[0])

    @property
    def dim(self) -> int:
        """The dimension of the points (3 for surfaces)."""
        return int(self.points.shape[1])

    def __repr__(self) -> str:
        lo, hi = self.points.detach().min(0).values, self.points.detach().max(0).values
        box = ", ".join(f"{a:.1f}..{b:.1f}" for a, b in zip(lo.tolist(), hi.tolist()))
        src = f", source={self.source!r}" if self.source else ""
        return (
            f"Shape({self.n_points:,} points, {self.n_faces:,} triangles, "
            f"{self.points.dtype}, {self.unit}, box [{box}]{src})"
        )

    def to(self, *args, **kwargs) -> Shape:
        """A copy with points (and weights, data) moved or cast like ``Tensor.to``: to a
        GPU with ``shape.to("cuda")`` (then :func:`otreg.register` runs there); a device
        this machine lacks raises ValueError saying so."""
        for given in (*args, kwargs.get("device")):
            if isinstance(given, (str, torch.device)) and torch.device(given).type == "cuda":
                check_device("Shape.to", given)
        points = self.points.to(*args, **kwargs)
        weights = None if self.weights is None else self.weights.to(*args, **kwargs)
        faces = None if self.faces is None else self.faces.to(points.device)
        data = {k: v.to(points.device) for k, v in self.data.items()}
        return replace(self, points=points, faces=faces, weights=weights, data=data)

    def with_points(self, points: torch.Tensor) -> Shape:
        """The same connectivity and data on new point positions (e.g. deformed ones)."""
        if tuple(points.shape) != tuple(self.points.shape):
            raise ValueError(
                f"Shape.with_points: points has shape {tuple(points.shape)}; "
                f"this shape has {tuple(self.points.shape)}"
            )
        return replace(self, points=points, source=None)

    def mapped(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Shape:
        """This shape on the points ``fn(points)`` (``fn``: ``(K, D)`` -> ``(K, D)``, e.g. a
        registration's transform), and so are the decimations it keeps: a decimation of
        the moved surface is then the moved decimation, with no new pass over the mesh."""
        out = self.with_points(fn(self.points))
        for (n, _, _), kept in self._decimations.items():
            key = (n, out.points._version, out.faces._version)
            out._decimations[key] = _Decimation(kept.shape.mapped(fn), kept.nearest)
        return out

    def with_data(self, **arrays: torch.Tensor | np.ndarray) -> Shape:
        """A copy with these per-vertex arrays added to ``data`` (each with N rows; a
        registration's ``transfer`` takes them by name).

        Example:
            >>> import torch, otreg
            >>> s = otreg.Shape(torch.zeros(3, 3)).with_data(height=torch.tensor([0.0, 1, 2]))
            >>> s.data["height"].tolist()
            [0.0, 1.0, 2.0]
        """
        data = dict(self.data)
        for key, value in arrays.items():
            data[key] = torch.as_tensor(value, device=self.points.device)
        return replace(self, data=data)

    def mirror(self, axis: int = 0) -> Shape:
        """The reflection through the plane ``coordinate[axis] = 0`` (x = 0: left <-> right
        in RAS/MNI space), with the triangles reoriented so that normals stay outward."""
        if not isinstance(axis, int) or not 0 <= axis < self.dim:
            raise ValueError(
                f"Shape.mirror: axis is {axis!r}; it must be an integer in [0, {self.dim})"
            )
        sign = torch.ones(self.dim, dtype=self.points.dtype, device=self.points.device)
        sign[axis] = -1
        faces = None if self.faces is None else self.faces[:, [0, 2, 1]]
        return replace(self, points=self.points * sign, faces=faces, source=None)

    @property
    def orientation(self) -> str | None:
        """``"outward"`` or ``"inward"``: where the normals of a closed surface point (the
        sign of its enclosed volume); None for a surface with a border, or a point cloud.

        Example:
            >>> from otreg import datasets
            >>> datasets.fsaverage5("pial").orientation
            'outward'
        """
        if self.n_faces == 0 or self.dim != 3:
            return None
        faces = self.faces.cpu()
        edges = torch.sort(faces[:, [0, 1, 1, 2, 2, 0]].reshape(-1, 2), dim=1).values
        keys = edges[:, 0].long() * self.n_points + edges[:, 1]
        if not bool((torch.unique(keys, return_counts=True)[1] == 2).all()):
            return None  # a border: no inside
        return "outward" if float(self.to(torch.float64).volume) > 0 else "inward"

    def flipped(self) -> Shape:
        """The same surface with its triangles reversed: normals point the other way.

        Example:
            >>> import torch
            >>> from otreg import Shape
            >>> corners = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, 0]])
            >>> tet = Shape(corners, torch.tensor([[0, 1, 2], [0, 3, 1], [1, 3, 2], [0, 2, 3]]))
            >>> tet.orientation, tet.flipped().orientation
            ('outward', 'inward')
        """
        self._need_faces("flipped")
        return replace(self, faces=self.faces[:, [0, 2, 1]], source=None)

    def _need_faces(self, what: str) -> torch.Tensor:
        if self.faces is None or self.n_faces == 0:
            raise ValueError(
                f"Shape.{what}: this shape has no triangles; {what} needs a "
                "surface (load a mesh, or a segmentation through marching cubes)"
            )
        if self.dim != 3:
            raise ValueError(f"Shape.{what}: needs 3-D points, these are {self.dim}-D")
        return self.faces

    # ------------------------------------------------------------------ geometry (torch)
    def _corners(self, what: str):
        f = self._need_faces(what)
        p = self.points
        return p[f[:, 0]], p[f[:, 1]], p[f[:, 2]]

    @property
    def face_centers(self) -> torch.Tensor:
        """Triangle centres ``(F, 3)``, mm."""
        a, b, c = self._corners("face_centers")
        return (a + b + c) / 3

    @property
    def face_normals(self) -> torch.Tensor:
        """Area-weighted triangle normals ``(F, 3)``: unit direction times area (mm^2)."""
        a, b, c = self._corners("face_normals")
        return torch.linalg.cross(b - a, c - a, dim=1) / 2

    @property
    def face_areas(self) -> torch.Tensor:
        """Triangle areas ``(F,)``, mm^2."""
        return self.face_normals.norm(dim=1)

    @property
    def point_normals(self) -> torch.Tensor:
        """Unit vertex normals ``(N, 3)``: the area-weighted mean of adjacent triangles'."""
        normals = self.face_normals
        acc = torch.zeros_like(self.points)
        for k in range(3):
            acc = acc.index_add(0, self.faces[:, k], normals)
        return acc / acc.norm(dim=1, keepdim=True).clamp_min(1e-30)

    @property
    def point_areas(self) -> torch.Tensor:
        """A third of the area of the triangles around each vertex ``(N,)``, mm^2."""
        areas = self.face_areas / 3
        acc = torch.zeros(self.n_points, dtype=areas.dtype, device=areas.device)
        for k in range(3):
            acc = acc.index_add(0, self.faces[:, k], areas)
        return acc

    def mean_curvature(self, smooth: int = 2) -> torch.Tensor:
        """Mean curvature at each vertex ``(N,)``, 1/mm: VTK's discrete estimate (needs
        pyvista), then averaged ``smooth`` times over each vertex and its neighbours (the
        raw estimate is noisy), outliers clipped at the 1st/99th percentiles.
        Positive where the surface is convex (1/R on a sphere with outward normals, a gyral
        crown); FreeSurfer's ``curv`` has the opposite sign. A signal to match and
        compare, not a differential-geometry measurement."""
        self._need_faces("mean_curvature")
        if not isinstance(smooth, int) or isinstance(smooth, bool) or smooth < 0:
            raise ValueError(f"Shape.mean_curvature: smooth is {smooth!r}; it must be an int >= 0")
        import scipy.sparse as sp

        mesh = self.to_pyvista()
        curv = np.asarray(mesh.curvature("mean"), dtype=np.float64)
        lo, hi = np.percentile(curv, [1, 99])
        curv = np.clip(curv, lo, hi)
        f = self.faces.cpu().numpy()
        i = np.concatenate([f[:, 0], f[:, 1], f[:, 2], np.arange(self.n_points)])
        j = np.concatenate([f[:, 1], f[:, 2], f[:, 0], np.arange(self.n_points)])
        adj = sp.coo_matrix((np.ones(i.size), (i, j)), shape=(self.n_points,) * 2).tocsr()
        adj = ((adj + adj.T) > 0).astype(np.float64)
        adj = sp.diags(1.0 / np.asarray(adj.sum(1)).ravel()) @ adj
        for _ in range(smooth):
            curv = adj @ curv
        return torch.as_tensor(curv, dtype=self.points.dtype, device=self.points.device)

    @property
    def area(self) -> torch.Tensor:
        """Total surface area, mm^2."""
        return self.face_areas.sum()

    @property
    def volume(self) -> torch.Tensor:
        """Signed enclosed volume (mm^3; > 0 when normals point outwards, closed surfaces)."""
        a, b, c = self._corners("volume")
        return (a * torch.linalg.cross(b, c, dim=1)).sum() / 6

    def measure(self, kind: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """The measure registration compares: ``(positions (M, D), weights (M,))``.

        ``"faces"``: Dirac masses at triangle centres weighted by area (mm^2);
        ``"points"``: at the vertices, with ``weights`` if set, else point areas for a
        surface, else 1 each; ``"auto"``: faces for surfaces, points for clouds.
        """
        if kind not in ("auto", "faces", "points"):
            raise ValueError(f"Shape.measure: kind is {kind!r}; choose 'auto', 'faces' or 'points'")
        if kind == "faces" or (kind == "auto" and self.n_faces > 0):
            return self.face_centers, self.face_areas
        if self.weights is not None:
            return self.points, self.weights
        if self.n_faces > 0:
            return self.points, self.point_areas
        return self.points, torch.ones(
            self.n_points, dtype=self.points.dtype, device=self.points.device
        )

    # ------------------------------------------------------------------ pyvista
    def to_pyvista(self):
        """A ``pyvista.PolyData`` (points in mm, triangles, data arrays)."""
        pv = _pyvista()
        pts = self.points.detach().cpu().double().numpy()
        if self.faces is None or self.n_faces == 0:
            mesh = pv.PolyData(pts)
        else:
            f = self.faces.cpu().numpy()
            cells = np.hstack([np.full((f.shape[0], 1), 3), f]).ravel()
            mesh = pv.PolyData(pts, cells)
        for key, value in self.data.items():
            mesh.point_data[key] = value.detach().cpu().numpy()
        if self.weights is not None:
            mesh.point_data["weights"] = self.weights.detach().cpu().numpy()
        return mesh

    @classmethod
    def from_pyvista(
        cls, mesh, dtype: torch.dtype = torch.float32, source: str | None = None
    ) -> Shape:
        """From any pyvista/VTK dataset: its surface, triangulated."""
        pv = _pyvista()
        if not isinstance(mesh, pv.PolyData):
            try:
                mesh = mesh.extract_surface(algorithm="dataset_surface")
            except TypeError:  # older pyvista
                mesh = mesh.extract_surface()
        if mesh.n_cells and not mesh.is_all_triangles:
            mesh = mesh.triangulate()
        pts = torch.as_tensor(np.asarray(mesh.points, dtype=np.float64), dtype=dtype)
        faces = None
        if mesh.n_cells and mesh.faces.size:
            faces = torch.as_tensor(mesh.faces.reshape(-1, 4)[:, 1:].astype(np.int64))
        data = {
            k: torch.as_tensor(np.asarray(mesh.point_data[k]))
            for k in mesh.point_data.keys()
            if k not in ("weights", "Normals", "RegionId")
            and not k.startswith("vtk")
            and np.asarray(mesh.point_data[k]).dtype.kind in "fiub"
        }
        weights = mesh.point_data["weights"] if "weights" in mesh.point_data else None
        return cls(pts, faces, weights=weights, data=data, source=source)

    def decimate(self, target_points: int) -> Shape:
        """A coarser surface of about ``target_points`` vertices (quadric decimation, by
        fast-simplification, else VTK's); each of its vertices keeps the ``data`` of the
        nearest vertex of this surface (labels stay labels). Without either, vertex
        clustering instead, with a warning once.

        A surface of over ``2 * DECIMATION_STEP`` vertices asked for fewer than
        ``DECIMATION_STEP`` is decimated to that many first, and from there: register
        decimates one surface to several sizes (the pre-alignment, the levels, the control
        points, the metrics), and VTK's pass over a 200,000-vertex mesh takes seconds. Each
        result's geometry is kept with the shape (until its points or faces change in
        place); its data are taken from the shape's at each call. Vertices that no triangle
        uses and triangles that repeat a vertex are left out.

        Example:
            >>> import torch
            >>> from otreg import datasets
            >>> s = datasets.fsaverage5("pial")
            >>> s = s.with_data(sulc=torch.as_tensor(datasets.fsaverage5_map("sulc")))
            >>> coarse = s.decimate(1000)
            >>> coarse.data["sulc"].shape[0] == coarse.n_points
            True
        """
        self._need_faces("decimate")
        if not isinstance(target_points, int) or target_points < 4:
            raise ValueError(
                f"Shape.decimate: target_points is {target_points!r}; it must be an integer >= 4"
            )
        if target_points >= self.n_points:
            return self
        kept = self._decimation(target_points)
        data = {}
        if self.data:  # the data as they are now: a caller may have changed them since
            if kept.nearest is None:
                from scipy.spatial import cKDTree

                points = self.points.detach().cpu().double().numpy()
                coarse = kept.shape.points.detach().cpu().double().numpy()
                nearest = cKDTree(points).query(coarse)[1]
                kept.nearest = torch.as_tensor(nearest, device=self.points.device)
            data = {k: v[kept.nearest] for k, v in self.data.items()}
        return replace(kept.shape, data=data)

    def _decimation(self, target_points: int) -> _Decimation:
        """The kept decimation to ``target_points`` vertices (its geometry, made here the
        first time, through the ``DECIMATION_STEP`` copy where :meth:`decimate` says so)."""
        key = (target_points, self.points._version, self.faces._version)
        if key not in self._decimations:
            if self.n_points > 2 * DECIMATION_STEP and target_points < DECIMATION_STEP:
                step = self._decimation(DECIMATION_STEP).shape
                coarse = step._decimate_once(target_points)
            else:
                coarse = self._decimate_once(target_points)
            self._decimations[key] = _Decimation(coarse)
        return self._decimations[key]

    def _decimate_once(self, target_points: int) -> Shape:
        """:meth:`decimate`'s geometry (no data), from this surface: quadric edge collapses
        by fast-simplification (pyvista's C++ wrapper of Fast-Quadric-Mesh-Simplification;
        MNI152's white-matter surface, 316,166 vertices, to 20,000: 1.3 s against VTK's
        quadric decimation's 7.2 s), else VTK's (pyvista), else vertex clustering. Vertices
        that no triangle uses are left out first (they would count in the reduction and in
        the surface's size), and so are triangles with a repeated vertex (no area: the
        edge collapses would keep them as they are)."""
        faces = self.faces
        a, b, c = faces.unbind(1)
        faces = faces[(a != b) & (b != c) & (c != a)]
        if len(faces) == 0:
            raise ValueError(
                "Shape.decimate: every triangle repeats a vertex (no area); give a surface "
                "with proper triangles"
            )
        used = torch.unique(faces)
        if len(used) < self.n_points or len(faces) < len(self.faces):
            remap = torch.full((self.n_points,), -1, dtype=torch.int64, device=used.device)
            remap[used] = torch.arange(len(used), device=used.device)
            surface = Shape(self.points.detach()[used], remap[faces], unit=self.unit)
            if target_points >= surface.n_points:
                return surface
            return surface._decimate_once(target_points)
        reduction = 1.0 - target_points / self.n_points
        try:
            import fast_simplification
        except ImportError:
            fast_simplification = None
        if fast_simplification is not None:
            # its error thresholds are absolute: in units of the surface's RMS radius, a
            # surface and a scaled copy (mm and metres) are decimated alike
            x = self.points.detach().cpu().double().numpy()
            centre = x.mean(0)
            size = float(np.sqrt(((x - centre) ** 2).sum(1).mean())) or 1.0
            points, faces = fast_simplification.simplify(
                (x - centre) / size, self.faces.cpu().numpy(), target_reduction=reduction
            )
            coarse = Shape(
                torch.as_tensor(points * size + centre, dtype=self.points.dtype),
                torch.as_tensor(faces, dtype=torch.int64),
                unit=self.unit,
            )
        else:
            try:
                mesh = self.to_pyvista()
            except ImportError:
                coarse = self._cluster_vertices(target_points)
            else:
                out = mesh.decimate(reduction)
                coarse = Shape.from_pyvista(out, dtype=self.points.dtype)
        return replace(coarse, data={}).to(self.points.device)

    def _cluster_vertices(self, target_points: int) -> Shape:
        """Vertex clustering (where fast-simplification and VTK are missing): the vertices
        merged by grid cell, the cell's side found by bisection so that about
        ``target_points`` cells are occupied;
        a cell's vertex is the mean of its vertices, and the triangles that keep three
        distinct cells remain (once each, in their orientation). The cells are the multiscale
        solver's (:func:`otreg.reductions.sparse.grid_labels`)."""
        global _clustering_warned
        if not _clustering_warned:
            _clustering_warned = True
            warnings.warn(
                "Shape.decimate: neither fast-simplification nor pyvista is installed, so "
                "surfaces are decimated by vertex clustering, coarser than quadric decimation "
                "(pip install fast-simplification)",
                UserWarning,
                stacklevel=3,
            )
        x = self.points.detach()
        span = max(float((x.max(0).values - x.min(0).values).max()), 1e-12)
        lo, hi = 0.0, span
        for _ in range(30):
            side = (lo + hi) / 2
            if int(grid_labels(x, side).max()) + 1 > target_points:
                lo = side
            else:
                hi = side
        labels = grid_labels(x, hi)
        k = int(labels.max()) + 1
        counts = torch.bincount(labels, minlength=k).to(x.dtype)
        points = torch.zeros(k, x.shape[1], dtype=x.dtype, device=x.device)
        points.index_add_(0, labels, x)
        faces = labels[self.faces]
        a, b, c = faces.unbind(1)
        distinct = (a != b) & (b != c) & (a != c)
        faces = faces[distinct]
        inverse = torch.unique(faces.sort(1).values, dim=0, return_inverse=True)[1]
        index = torch.arange(len(faces), device=x.device)
        first = torch.full((int(inverse.max()) + 1,), len(faces), device=x.device)
        first = first.scatter_reduce_(0, inverse, index, "amin").sort().values
        return Shape(points / counts[:, None], faces[first], unit=self.unit)

    def smooth(self, n_iter: int = 20, pass_band: float = 0.1) -> Shape:
        """Taubin smoothing (shrinks far less than Laplacian smoothing), VTK's filter."""
        self._need_faces("smooth")
        out = self.to_pyvista().smooth_taubin(n_iter=n_iter, pass_band=pass_band)
        return self.with_points(
            torch.as_tensor(
                np.asarray(out.points), dtype=self.points.dtype, device=self.points.device
            )
        )

    def components(self) -> list[Shape]:
        """Connected components, largest first (by vertex count)."""
        self._need_faces("components")
        mesh = self.to_pyvista()
        labelled = mesh.connectivity("all")
        ids = np.asarray(labelled.point_data["RegionId"])
        parts = []
        for region in np.unique(ids):
            part = labelled.extract_points(ids == region, adjacent_cells=False)
            parts.append(Shape.from_pyvista(part, dtype=self.points.dtype))
        return sorted(parts, key=lambda s: -s.n_points)


_clustering_warned = False


@dataclass
class _Decimation:
    """A decimation a :class:`Shape` keeps: the coarse surface's geometry (no data) and,
    once a call needed it, each coarse vertex's nearest vertex of the shape ``(n,)``, through
    which every call takes the shape's data as they are then."""

    shape: Shape
    nearest: torch.Tensor | None = None


#: See :meth:`Shape.decimate`: the size of the copy a large surface's decimations go through.
DECIMATION_STEP = 20_000


def _pyvista():
    try:
        import pyvista
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("this needs pyvista: pip install 'otreg[mesh]'") from err
    return pyvista
