"""Read and write shapes: ``load_shape`` and ``save_shape``.

Every point comes out in world millimetres (scanner RAS for MRI data):

- NIfTI ``.nii``/``.nii.gz`` and ``.mgz`` (nibabel): a label value, a binary mask, or a
  probability map with ``level=`` -> marching cubes (scikit-image) -> vertices mapped through
  the image's affine; triangles oriented with outward normals, also under a flipped axis.
- meshes ``.vtk .vtp .ply .stl .obj`` (pyvista; non-triangle faces are triangulated),
  GIFTI ``.gii``/``.gii.gz``, FreeSurfer surfaces (``lh.pial`` style, recognised by their
  magic number; shifted from tkr-RAS to scanner RAS by the c_ras of their volume info),
  point clouds ``.csv`` (x, y, z columns) and ``.npy`` ((N, 3) arrays).

``save_shape`` writes the same mesh and point formats atomically (a temporary file renamed
into place) and refuses to write over the file a shape was read from. The file helpers
(``atomic_write``, ``atomic_write_all``, ``check_writable_folder``, ``same_file``, ...)
serve the other writers (registration results, the command line).
"""

from __future__ import annotations

import dataclasses
import numbers
import warnings
from pathlib import Path

import numpy as np
import torch

from ..shapes import Shape
from . import _files, _values, _volume
from ._files import (
    OUTPUTS_RECORD,
    atomic_write,
    atomic_write_all,
    check_writable_folder,
    read_pyvista_mesh,
    remove_empty_folders,
    remove_stale_temps,
    replace_recorded_outputs,
    same_file,
)

__all__ = [
    "VertexValues",
    "unlabelled",
    "values_stem",
    "gifti_structure",
    "named_structure",
    "kind_of_name",
    "load_values",
    "save_values",
    "load_shape",
    "load_input",
    "save_shape",
    "atomic_write",
    "atomic_write_all",
    "check_writable_folder",
    "read_pyvista_mesh",
    "remove_empty_folders",
    "remove_stale_temps",
    "replace_recorded_outputs",
    "OUTPUTS_RECORD",
    "same_file",
    "VOLUME_EXTS",
    "MESH_EXTS",
]

VOLUME_EXTS = (".nii", ".nii.gz", ".mgz")
VertexValues = _values.VertexValues
unlabelled = _values.unlabelled
values_stem = _values.values_stem
gifti_structure = _values.gifti_structure
named_structure = _values.named_structure
kind_of_name = _values.kind_of_name
MESH_EXTS = (*_files.PYVISTA_EXTS, ".gii", ".gii.gz", ".csv", ".npy")


def _ext(path: Path) -> str:
    name = path.name.lower()
    for ext in (".nii.gz", ".gii.gz"):
        if name.endswith(ext):
            return ext
    return path.suffix.lower()


#: Taubin smoothing iterations :func:`load_shape` gives a surface made from a volume (pass
#: band 0.1: the voxels' steps go, the shape stays within a fraction of a voxel)
VOLUME_SMOOTH = 20


def load_shape(
    path: str | Path,
    label: int | float | None = None,
    *,
    level: float | None = None,
    smooth: int | None = None,
    decimate: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Shape:
    """Read a surface or point cloud, in world mm.

    Args:
        path: a volume (.nii, .nii.gz, .mgz), a mesh (.vtk, .vtp, .ply, .stl, .obj, .gii,
            FreeSurfer surface) or a point cloud (.csv, .npy).
        label: for volumes, the segmentation value whose boundary to extract.
        level: for volumes, a threshold of a probability map (voxels >= level are inside).
            Without label and level, a volume must be a 0/1 mask.
        smooth: Taubin smoothing iterations applied afterwards (0: none); default
            :data:`VOLUME_SMOOTH` for a surface made from a volume, 0 for a mesh. A
            marching-cubes surface is a staircase of voxel faces: its coarse copies
            (which a registration fits first) change under the smallest motion, and
            registering one onto itself, or onto a rigidly moved copy, fitted that noise
            (vertex errors of 0.2 to 0.3 mm, up to 2.3 mm, Jacobians 0.3 to 1.8 on an
            ellipsoid of 1 to 1.5 mm voxels; smoothed: 0.004 mm and 0.99 to 1.01).
        decimate: a target number of vertices (None: keep all).
        dtype: floating dtype of the points.

    Returns:
        :class:`~otreg.shapes.Shape` with ``source`` set to the file (an absolute path).

    Example:
        >>> import otreg, tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> path = otreg.save_shape(otreg.datasets.fsaverage5("pial"), folder / "lh.pial.gii")
        >>> otreg.load_shape(path).n_points
        10242
    """
    caller = "load_shape"
    if not isinstance(path, (str, Path)):
        raise TypeError(f"{caller}: path must be a str or Path, got {type(path).__name__}")
    path = Path(path).expanduser()
    if smooth is None:
        smooth = VOLUME_SMOOTH if path.name.lower().endswith(VOLUME_EXTS) else 0
    if not isinstance(smooth, int) or isinstance(smooth, bool) or smooth < 0:
        raise ValueError(
            f"{caller}: smooth is {smooth!r}; it must be a number of Taubin smoothing "
            "iterations, an integer >= 0"
        )
    for name, value in (("label", label), ("level", level)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(
                f"{caller}: {name} is {value!r} ({type(value).__name__}); it must be a number"
            )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"{caller}: dtype is {dtype!r}; it must be a floating torch dtype "
            "(torch.float32 or torch.float64): an integer one would round coordinates"
        )
    if not path.exists():
        raise FileNotFoundError(f"{caller}: {path} does not exist")
    if path.is_dir():
        raise ValueError(f"{caller}: {path} is a folder; give a file")
    if path.stat().st_size == 0:
        raise ValueError(f"{caller}: {path} is empty (0 bytes)")
    try:
        shape = _read(path, caller, label, level, dtype)
    except (ValueError, TypeError) as err:
        if not str(err).startswith("Shape: "):
            raise
        # the Shape's own checks (NaN coordinates, triangles out of range): name the file
        raise ValueError(f"{caller}: {path} holds an invalid shape: {str(err)[7:]}") from err
    if shape.n_faces:
        _files.warn_bad_triangles(shape, path, caller)
        if shape.dim == 3:
            _files.warn_inward(shape, path, caller)
    if smooth:
        shape = shape.smooth(n_iter=smooth)
    if decimate is not None:
        shape = shape.decimate(decimate)
    shape.source = str(path.absolute())  # still the same file if the working folder changes
    return shape


def _read(path: Path, caller: str, label, level, dtype) -> Shape:
    """The shape in a file, as its format reads it."""
    ext = _ext(path)
    if ext in VOLUME_EXTS:
        return _volume.volume_to_shape(path, caller, label=label, level=level, dtype=dtype)
    if label is not None or level is not None:
        raise ValueError(
            f"{caller}: label= and level= apply to volumes "
            f"({', '.join(VOLUME_EXTS)}), not to {path.name}"
        )
    if ext in _files.PYVISTA_EXTS:
        return _files.read_pyvista(path, caller, dtype)
    if ext in (".gii", ".gii.gz"):
        return _files.read_gifti(path, caller, dtype)
    if ext in (".csv", ".npy"):
        return _files.read_points(path, caller, dtype)
    if _files.is_freesurfer_surface(path):
        return _files.read_freesurfer(path, caller, dtype)
    raise ValueError(
        f"{caller}: {path.name} has an unknown format; otreg reads volumes "
        f"({', '.join(VOLUME_EXTS)}), meshes ({', '.join(MESH_EXTS)}) and "
        "FreeSurfer surfaces (lh.pial, rh.white, ...)"
    )


def save_shape(shape: Shape, path: str | Path) -> Path:
    """Write a shape atomically; the format follows the extension.

    Meshes: .vtk .vtp .ply .stl .obj (pyvista), .gii (GIFTI), ``lh.*``/``rh.*`` or
    ``.surf`` (FreeSurfer, coordinates as scanner RAS); point clouds: .csv, .npy.
    Refuses to overwrite ``shape.source`` (the file it was read from), however the path
    is spelled (relative, through a symlink). Only .vtk and .vtp keep ``shape.data`` and
    ``shape.weights``; the other formats warn, naming the arrays they drop.

    Example:
        >>> import otreg, tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> otreg.save_shape(otreg.datasets.fsaverage5("white"), folder / "lh.white.vtk").name
        'lh.white.vtk'
    """
    caller = "save_shape"
    if not isinstance(shape, Shape):
        raise TypeError(f"{caller}: shape must be an otreg Shape, got {type(shape).__name__}")
    path = Path(path).expanduser()
    if shape.source is not None and _files.same_file(path, shape.source):
        raise ValueError(
            f"{caller}: {path} is the file this shape was read from; otreg never "
            "overwrites an input: choose another path"
        )
    ext = _ext(path)
    if ext in _files.PYVISTA_EXTS:
        fmt = "pyvista"
    elif ext == ".gii":
        fmt = "gifti"
    elif ext in (".csv", ".npy"):
        fmt = ext[1:]
    elif ext == ".surf" or path.name.startswith(("lh.", "rh.")):
        fmt = "freesurfer"
    else:
        raise ValueError(
            f"{caller}: cannot write {path.name}: use one of "
            f"{', '.join(_files.PYVISTA_EXTS)}, .gii, .csv, .npy, or a FreeSurfer "
            "name (lh.NAME, rh.NAME, *.surf)"
        )
    needs_faces = fmt in ("gifti", "freesurfer") or ext == ".stl"  # STL stores triangles only
    if needs_faces and (shape.faces is None or shape.n_faces == 0):
        raise ValueError(
            f"{caller}: {path.name} is a surface format but the shape has no "
            "triangles; save point clouds as .csv, .npy or .vtk"
        )
    if fmt in ("gifti", "freesurfer") and shape.dim != 3:
        raise ValueError(f"{caller}: {path.name} needs 3-D points, the shape's are {shape.dim}-D")
    dropped = [*shape.data, *(["weights"] if shape.weights is not None else [])]
    if dropped and ext not in (".vtk", ".vtp"):
        warnings.warn(
            f"{caller}: {path.name} cannot hold per-vertex arrays; not written: "
            f"{', '.join(dropped)}. Save as .vtk or .vtp to keep them, or each array "
            "with otreg.io.save_values",
            UserWarning,
            stacklevel=2,
        )
    with _files.named_folder_error(caller, path):
        _files.write_shape(shape, path, fmt)
    return path


def load_input(
    path: str | Path,
    label: float | None = None,
    level: float | None = None,
    points: int | None = None,
    smooth: int | None = None,
) -> Shape:
    """An input of a registration: ``label``/``level`` apply to volumes only (the other
    input of a pair may be a mesh), ``smooth`` is :func:`load_shape`'s (None: Taubin
    smoothing for a surface made from a volume, none for a mesh) and ``points`` decimates
    to about that many vertices, the shape keeping its file as ``source`` (so that results
    never overwrite it).

    Example:
        >>> from otreg import datasets
        >>> from otreg.io import load_input
        >>> load_input(datasets.fsaverage5_path("white"), points=1000).n_points <= 1100
        True
    """
    volume = Path(path).name.lower().endswith(VOLUME_EXTS)
    shape = load_shape(
        path, label=label if volume else None, level=level if volume else None, smooth=smooth
    )
    if points is not None:
        shape = dataclasses.replace(shape.decimate(points), source=shape.source)
    return shape


def load_values(path: str | Path) -> VertexValues:
    """Per-vertex values from a file: a map (``(N,)`` or ``(N, C)`` floats) or labels
    (``(N,)`` integers with their label table).

    Formats: GIFTI ``.func.gii`` / ``.shape.gii`` (maps) and ``.label.gii`` (labels and
    their table), each also gzipped (``.gii.gz``), FreeSurfer ``.annot`` (labels; its colour
    table becomes the label table, -1 unknown), morphometry files (``lh.curv``,
    ``lh.thickness``...: a name with no other known extension, checked by the file's magic
    number) and ``.mgh`` / ``.mgz`` overlays, NumPy ``.npy``. Any other file raises
    ``ValueError``.

    Example:
        >>> import tempfile, pathlib, torch
        >>> from otreg.io import VertexValues, load_values, save_values
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "lh.aparc.label.gii"
        >>> table = {0: ("unknown", (0, 0, 0, 0)), 5: ("V1", (1.0, 0.0, 0.0, 1.0))}
        >>> _ = save_values(VertexValues(torch.tensor([0, 5, 5]), table), path)
        >>> back = load_values(path)
        >>> back.values.tolist(), back.label_table[5][0]
        ([0, 5, 5], 'V1')
    """
    caller = "load_values"
    if not isinstance(path, (str, Path)):
        raise TypeError(f"{caller}: path must be a str or Path, got {type(path).__name__}")
    path = Path(path).expanduser()
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"{caller}: {path} {what}")
    return dataclasses.replace(_values.read_values(path, caller), source=path)


def save_values(values: VertexValues | torch.Tensor | np.ndarray, path: str | Path) -> Path:
    """Write per-vertex values atomically, in the format of ``path``'s name (see
    :func:`load_values`); a tensor or array is a map (floats) or labels (integers, no
    table). ``.func.gii``, ``.shape.gii`` and morphometry files are maps whatever the dtype
    (integers are written as float32, with a warning; ``.shape.gii`` has GIFTI's shape
    intent), ``.gii`` follows the dtype; labels in GIFTI have a table entry for every value
    (an annot's unassigned -1: ``???``). Refuses to overwrite ``values.source`` (the file
    they were read from), values that the format cannot hold (several columns in a
    morphometry file, labels beyond 32 bits, map values beyond float32's range but in
    ``.npy``: 1e-300 would be 0) and a label format for anything but one integer a vertex;
    warns where labels' table cannot be kept (``.npy``, ``.mgh``). Its folder is made
    where missing (``NotADirectoryError`` where a file is in the way). Returns the path
    written.

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from otreg.io import load_values, save_values
        >>> path = Path(tempfile.mkdtemp()) / "thickness.func.gii"
        >>> save_values(torch.tensor([2.5, 3.0, 1.75]), path).name
        'thickness.func.gii'
        >>> load_values(path).values.tolist()
        [2.5, 3.0, 1.75]
    """
    caller = "save_values"
    if isinstance(values, np.ndarray):
        values = torch.as_tensor(values)
    if isinstance(values, torch.Tensor):
        values = VertexValues(values)
    if not isinstance(values, VertexValues):
        raise TypeError(
            f"{caller}: values must be a VertexValues, a tensor or an array, got "
            f"{type(values).__name__}"
        )
    path = Path(path).expanduser()
    kind = _values.suffix(path)
    if kind == "morph" and not _values.morph_name(path.name):
        raise ValueError(
            f"{caller}: otreg does not write per-vertex values as {path.suffix} "
            f"({path.name}); name the file .func.gii, .label.gii, .annot, .mgh, .mgz, .npy, or "
            "lh.NAME (rh.NAME, NAME.curv, NAME.thickness..., or a name without an "
            "extension) for a FreeSurfer morphometry file"
        )
    if values.source is not None and _files.same_file(path, values.source):
        raise ValueError(
            f"{caller}: {path} is the file these values were read from; otreg never "
            "overwrites an input: choose another path"
        )
    data = values.values
    if data.is_complex():
        raise TypeError(f"{caller}: values are {data.dtype}; give real numbers or integers")
    if kind in (".label.gii", ".annot") and not values.is_labels:
        raise ValueError(
            f"{caller}: {path.name} holds labels but the values are {data.dtype}: "
            "give integers, or a .func.gii / .npy name for a map"
        )
    if kind in (".label.gii", ".annot", "morph") and data.dim() != 1:
        what = "a FreeSurfer morphometry file holds" if kind == "morph" else "labels hold"
        raise ValueError(
            f"{caller}: {path.name}: {what} one value a vertex, the values have shape "
            f"{tuple(data.shape)}; write several columns as .func.gii, .mgh or .npy"
        )
    if values.is_labels and kind != ".npy" and data.numel():
        low, high = int(data.min()), int(data.max())
        limits = torch.iinfo(torch.int32)
        if low < limits.min or high > limits.max:
            raise ValueError(
                f"{caller}: {path.name} stores labels as 32-bit integers; these range from "
                f"{low} to {high}: renumber them, or write .npy"
            )
    if not values.is_labels and kind != ".npy" and data.is_floating_point():
        finite = data.detach()[torch.isfinite(data.detach())].abs().double()
        single = torch.finfo(torch.float32)
        beyond = int(((finite > single.max) | ((finite > 0) & (finite < single.tiny))).sum())
        if beyond:
            raise ValueError(
                f"{caller}: {path.name} stores maps as 32-bit floats, which would turn "
                f"{beyond} of these values into 0 or infinity (they lie beyond "
                f"{single.tiny:.3g} to {single.max:.3g} in size): rescale them (e.g. -log10 "
                "of p-values), or write .npy"
            )
    if values.is_labels and (_values.map_name(path.name) or kind == "morph"):
        what = "a FreeSurfer morphometry file" if kind == "morph" else "a GIFTI map"
        if data.numel() and int(data.abs().max()) > 2**24:
            raise ValueError(
                f"{caller}: {path.name} is {what}, of 32-bit floats, which hold integers "
                f"up to 2^24 exactly; these labels reach {int(data.abs().max())}: write "
                ".label.gii or .npy"
            )
        warnings.warn(
            f"{caller}: {path.name} is {what} (its name): these integer labels are "
            "written as float32 values and read back as a map"
            + (", without their table (names and colours)" if values.label_table else "")
            + ": write .label.gii to keep them labels",
            UserWarning,
            stacklevel=2,
        )
    elif kind == ".annot" and values.is_labels:
        keys = sorted(values.label_table or set(data.unique().tolist()) - {-1})
        if keys != list(range(len(keys))):
            shown = ", ".join(str(k) for k in keys[:4]) + (", ..." if len(keys) > 4 else "")
            warnings.warn(
                f"{caller}: {path.name}: an .annot numbers its labels by their table's order, "
                f"so the ids {shown} are read back as 0 to {len(keys) - 1} (names and colours "
                "kept): write .label.gii to keep the ids",
                UserWarning,
                stacklevel=2,
            )
    elif values.label_table and kind not in (".label.gii", ".gii", ".annot"):
        warnings.warn(
            f"{caller}: {path.name} keeps the labels but not their table (names and colours): "
            "write .label.gii or .annot to keep it",
            UserWarning,
            stacklevel=2,
        )
    with _files.named_folder_error(caller, path):
        atomic_write(path, lambda tmp: _values.write_values(values, tmp, kind, path.name))
    return path
