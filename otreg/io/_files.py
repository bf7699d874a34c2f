"""Meshes and point clouds: pyvista formats, GIFTI, FreeSurfer surfaces, CSV, NumPy."""

from __future__ import annotations

import contextlib
import errno
import glob
import gzip
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from .._checks import warn
from ..shapes import Shape

PYVISTA_EXTS = (".vtk", ".vtp", ".ply", ".stl", ".obj")
FREESURFER_MAGIC = b"\xff\xff\xfe"


def is_freesurfer_surface(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(3) == FREESURFER_MAGIC


_PLY_SIZES = {
    "char": 1,
    "uchar": 1,
    "int8": 1,
    "uint8": 1,
    "short": 2,
    "ushort": 2,
    "int16": 2,
    "uint16": 2,
    "int": 4,
    "uint": 4,
    "int32": 4,
    "uint32": 4,
    "float": 4,
    "float32": 4,
    "double": 8,
    "float64": 8,
}


def check_ply_size(path: Path, caller: str) -> None:
    """Refuse a PLY file shorter than its header says (VTK's reader crashes on those).

    The bound is a lower one: list properties (faces) count at least their length byte and
    three indices; ASCII files need at least one line per element.
    """
    with open(path, "rb") as fh:
        head = fh.read(65536)
    end = head.find(b"end_header")
    if not head.startswith(b"ply") or end < 0:
        raise ValueError(f"{caller}: {path} is not a PLY file (no 'ply' ... 'end_header' header)")
    body = len(head[:end]) + len(b"end_header") + 1
    lines = head[:end].decode("ascii", "replace").splitlines()
    binary = any(ln.startswith("format binary") for ln in lines)
    need, count, rows = 0, 0, 0
    for ln in lines:
        words = ln.split()
        if words[:1] == ["element"] and len(words) == 3 and words[2].isdigit():
            count = int(words[2])
            rows += count
        elif words[:1] == ["property"] and len(words) >= 3:
            if words[1] == "list" and len(words) >= 5:
                size = _PLY_SIZES.get(words[2], 1) + 3 * _PLY_SIZES.get(words[3], 4)
            else:
                size = _PLY_SIZES.get(words[1], 1)
            need += count * size
    if binary:
        have = path.stat().st_size - body
    else:
        with open(path, "rb") as fh:
            fh.seek(body)
            have = sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
    if have < (need if binary else rows):
        raise ValueError(
            f"{caller}: {path} is truncated: its header announces more data "
            f"({need if binary else rows:,} {'bytes' if binary else 'lines'} at "
            f"least) than the file holds"
        )


def read_pyvista(path: Path, caller: str, dtype) -> Shape:
    return Shape.from_pyvista(read_pyvista_mesh(path, caller), dtype=dtype, source=str(path))


def _vtk_reason(err: Exception) -> str:
    """The first message of a VTK error, without its source line and object address."""
    for line in str(err).strip().splitlines():
        if line and not re.match(r"(ERROR|Warning): In ", line) and not line.startswith(" "):
            line = re.sub(r"^vtk\w+ \(0x[0-9a-f]+\): ", "", line)
            return re.sub(r" \(0x[0-9a-f]+\)", "", line)[:300]
    return ""


def read_pyvista_mesh(path: Path, caller: str):
    """The pyvista dataset in a mesh file, or a ValueError naming the file.

    Example:
        >>> import tempfile, pathlib, otreg
        >>> from otreg.io import read_pyvista_mesh
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "lh.vtk"
        >>> _ = otreg.save_shape(otreg.datasets.fsaverage5("white"), path)
        >>> read_pyvista_mesh(path, "example").n_points
        10242
    """
    import pyvista as pv

    if path.suffix.lower() == ".ply":
        check_ply_size(path, caller)

    try:
        # VTK's readers report a truncated or corrupt file as an error message, not an
        # exception, and return what they read so far: turn the message into the error.
        # The VTK reader is run directly: pv.read and BaseReader.read log VTK's messages
        # (ERROR:root:...) and warn on top of that error.
        with warnings.catch_warnings():
            warnings.simplefilter("error", pv.VTKExecutionWarning)
            with (
                pv.vtk_verbosity("off"),
                pv.VtkErrorCatcher(raise_errors=True, send_to_logging=False, emit_warnings=True),
            ):
                reader = pv.get_reader(str(path)).reader
                reader.Update()
                mesh = pv.wrap(reader.GetOutputDataObject(0))
    except Exception as err:
        raise ValueError(
            f"{caller}: {path} could not be read as a mesh; it may be truncated or "
            f"corrupt ({type(err).__name__}: {_vtk_reason(err)})"
        ) from err
    if mesh is None:
        raise ValueError(f"{caller}: {path} could not be read as a mesh (VTK returned nothing)")
    if mesh.n_points == 0:
        raise ValueError(f"{caller}: {path} has no points")
    return mesh


def read_gifti(path: Path, caller: str, dtype) -> Shape:
    import nibabel as nib

    try:
        raw = path.read_bytes()
        if path.name.endswith(".gz"):
            raw = gzip.decompress(raw)
        img = nib.GiftiImage.from_bytes(raw)
    except Exception as err:
        raise ValueError(
            f"{caller}: {path} could not be read as GIFTI ({type(err).__name__}: {err})"
        ) from err
    points = img.agg_data("pointset")
    faces = img.agg_data("triangle")
    if points is None or len(np.shape(points)) != 2:
        raise ValueError(f"{caller}: {path} holds no surface (no NIFTI_INTENT_POINTSET array)")
    faces = None if faces is None else np.asarray(faces, dtype=np.int64)
    return Shape(
        torch.as_tensor(np.asarray(points, dtype=np.float64), dtype=dtype),
        None if faces is None else torch.as_tensor(faces),
        source=str(path),
    )


def read_freesurfer(path: Path, caller: str, dtype) -> Shape:
    """A FreeSurfer surface, moved from tkr-RAS to scanner RAS by its volume info's c_ras."""
    import nibabel.freesurfer as fs

    try:
        coords, faces, meta = fs.read_geometry(str(path), read_metadata=True)
    except Exception as err:
        raise ValueError(
            f"{caller}: {path} could not be read as a FreeSurfer surface "
            f"({type(err).__name__}: {err})"
        ) from err
    cras = meta.get("cras") if meta else None
    if cras is None:
        warn(
            f"{caller}: {path} carries no volume info: its coordinates are left in "
            "FreeSurfer's tkr-RAS frame, which may be shifted from scanner RAS (the "
            "frame of the subject's NIfTI volumes)",
            UserWarning,
        )
    else:
        coords = coords + np.asarray(cras, dtype=np.float64)
    return Shape(
        torch.as_tensor(coords, dtype=dtype),
        torch.as_tensor(faces.astype(np.int64)),
        source=str(path),
    )


def _numbers(line: str) -> bool:
    """Whether a CSV line's fields are all numbers (as float() reads them: 1e-3, nan)."""
    try:
        [float(field) for field in line.split("#")[0].split(",")]
    except ValueError:
        return False
    return True


def read_points(path: Path, caller: str, dtype) -> Shape:
    try:
        if path.suffix == ".npy":
            pts = np.load(path, allow_pickle=False)
        else:
            with open(path) as fh:
                first = fh.readline()
            skip = 0 if _numbers(first) else 1  # a header: x,y,z (not 1e-3, nan)
            pts = np.loadtxt(path, delimiter=",", skiprows=skip, ndmin=2)
    except Exception as err:
        raise ValueError(
            f"{caller}: {path} could not be read as a point cloud ({type(err).__name__}: {err})"
        ) from err
    if pts.ndim != 2 or pts.shape[0] == 0:
        raise ValueError(
            f"{caller}: {path} holds an array of shape {pts.shape}; a point cloud "
            "is (N, D) with N >= 1"
        )
    return Shape(torch.as_tensor(pts.astype(np.float64), dtype=dtype), source=str(path))


def warn_bad_triangles(shape: Shape, path: Path, caller: str) -> None:
    """Warn (UserWarning naming the file) about duplicated and zero-area triangles; the
    mesh is left as it is."""
    faces = shape.faces.cpu().numpy()
    pts = shape.points.detach().cpu().double().numpy()
    ordered = np.sort(faces, axis=1)
    if shape.n_points < 2**21:  # one int64 key a triangle, sorted: equal keys are copies
        keys = np.sort((ordered[:, 0] << 42) | (ordered[:, 1] << 21) | ordered[:, 2])
        n_dup = int((keys[1:] == keys[:-1]).sum())
    else:
        n_dup = len(faces) - len(np.unique(ordered, axis=0))
    a, b, c = pts[faces[:, 0]], pts[faces[:, 1]], pts[faces[:, 2]]
    areas = np.linalg.norm(np.cross(b - a, c - a), axis=1) / 2
    size = float(np.linalg.norm(pts.max(0) - pts.min(0)))
    n_zero = int((areas <= 1e-10 * size**2).sum())
    found = []
    if n_dup:
        found.append(
            f"{n_dup:,} duplicated triangles (the same three vertices again; every copy "
            "counts in the measures, so the surface there weighs double)"
        )
    if n_zero:
        found.append(
            f"{n_zero:,} zero-area triangles (repeated or collinear vertices; they "
            "carry no weight in the measures)"
        )
    if found:
        warn(
            f"{caller}: {path} has {' and '.join(found)} among its {len(faces):,}; otreg "
            "keeps the mesh as it is (clean it first, e.g. pyvista's clean(), if that is "
            "not intended)",
            UserWarning,
        )


def warn_inward(shape: Shape, path: Path, caller: str) -> None:
    """Warn (naming the file and the fix) when a closed surface's triangles face inward:
    its signed enclosed volume is negative. The data terms that use orientation (currents)
    then see the opposite surface; the others do not notice."""
    if shape.orientation == "inward":
        volume = float(shape.to(torch.float64).volume)
        warn(
            f"{caller}: the triangles of {path} face inward: it is a closed surface whose "
            f"enclosed volume comes out negative ({volume:,.0f} {shape.unit}^3). Data terms "
            "that use orientation (loss='currents') would see the opposite surface; "
            "reverse the triangles (shape.flipped()) or fix the file",
            UserWarning,
        )


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one existing file (through symlinks, ``..``, hard links).

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.io import same_file
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> (folder / "a.txt").write_text("x")
        1
        >>> same_file(folder / "a.txt", folder / "." / "a.txt"), same_file(folder / "a.txt", folder)
        (True, False)
    """
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is missing: writing one cannot replace the other
        return False


def check_writable_folder(folder: Path, caller: str) -> list[Path]:
    """Create ``folder`` if missing and write and delete a file in it; return the folders
    created (outermost first). PermissionError (no write permission, read-only file
    system) or ValueError (a file in the way), naming the folder, if it cannot be used.

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.io import check_writable_folder
        >>> new = pathlib.Path(tempfile.mkdtemp()) / "results" / "sub-01"
        >>> [p.name for p in check_writable_folder(new, "example")]    # the folders it created
        ['results', 'sub-01']
    """
    created = [p for p in (folder, *folder.parents) if not os.path.lexists(p)][::-1]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".otreg-write-test.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        remove_empty_folders(created)
        blocker = next(
            (p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None
        )
        if blocker is not None:
            reason = f"{blocker} is {'a file' if blocker.is_file() else 'not a folder'}"
        else:
            reason = err.strerror or str(err)
        message = f"{caller}: cannot write into the folder {folder}: {reason}"
        if blocker is None and err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise PermissionError(message) from err
        raise ValueError(message) from err
    return created


def remove_empty_folders(folders: Sequence[Path]) -> None:
    """Remove those of ``folders`` (outermost first) that exist and are empty, innermost
    first: the folders a run created, after it failed.

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.io import remove_empty_folders
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> (root / "a" / "b").mkdir(parents=True)
        >>> remove_empty_folders([root / "a", root / "a" / "b"])
        >>> list(root.iterdir())
        []
    """
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:  # not empty, gone, or not ours to remove
            pass


def _temp_affixes(path: Path) -> tuple[str, str]:
    """The prefix and suffix of ``path``'s temporary files: ``.{stem}.XXXXXXXX.tmp{ext}``."""
    suffix = "".join(path.suffixes[-2:]) if path.name.endswith(".gz") else path.suffix
    return f".{path.stem}.", ".tmp" + suffix


def remove_stale_temps(folder: Path, names: Sequence[str]) -> list[Path]:
    """Delete the temporary files an interrupted :func:`atomic_write_all` of ``names``
    left in ``folder`` (those names' pattern only); return them.

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.io import remove_stale_temps
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> remove_stale_temps(folder, ["summary.csv"])       # nothing was interrupted here
        []
    """
    removed = []
    for name in names:
        prefix, suffix = _temp_affixes(folder / name)
        pattern = re.compile(re.escape(prefix) + r"[a-z0-9_]{8}" + re.escape(suffix))
        for path in folder.glob(glob.escape(prefix) + "*" + glob.escape(suffix)):
            if pattern.fullmatch(path.name) and path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def atomic_write_all(writes: dict[Path, Callable[[Path], None]]) -> None:
    """Write several files as one: each to a temporary file beside it, then all renamed
    into place in quick succession. An error or interrupt before the renames changes none
    of them; no temporary file is left behind (a killed process leaves some: see
    :func:`remove_stale_temps`).

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.io import atomic_write_all
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> atomic_write_all({folder / "a.txt": lambda t: t.write_text("a"),
        ...                   folder / "b.txt": lambda t: t.write_text("b")})
        >>> sorted(p.name for p in folder.iterdir())
        ['a.txt', 'b.txt']
    """
    umask = os.umask(0)  # mkstemp makes files private (0600); give them the usual mode
    os.umask(umask)
    temps: dict[Path, Path] = {}
    try:
        for path, write in writes.items():
            _make_folder(path.parent)
            prefix, suffix = _temp_affixes(path)
            fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
            os.close(fd)
            temps[path] = Path(tmp)
            write(temps[path])
            os.chmod(temps[path], 0o666 & ~umask)
        for path in list(temps):
            os.replace(temps[path], path)
            del temps[path]
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


def _make_folder(folder: Path) -> None:
    """``folder`` and its parents, made where missing; ``NotADirectoryError`` naming the
    part that is a file (``mkdir`` says "File exists" of it, or "Not a directory" of the
    folder below it)."""
    for part in (folder, *folder.parents):
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "a file, not a folder", str(part))
            break
    folder.mkdir(parents=True, exist_ok=True)


@contextlib.contextmanager
def named_folder_error(caller: str, path: Path):
    """Re-raise :func:`_make_folder`'s error naming the ``caller`` and the ``path`` it
    could not write."""
    try:
        yield
    except NotADirectoryError as err:
        raise NotADirectoryError(
            f"{caller}: cannot write {path}: {err.filename} is a file, not a folder"
        ) from err


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Write through a temporary file in the same folder, then rename over ``path``.

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.io import atomic_write
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "out.txt"
        >>> atomic_write(path, lambda tmp: tmp.write_text("done"))
        >>> path.read_text(), [p.name for p in path.parent.iterdir()]   # no temporary file left
        ('done', ['out.txt'])
    """
    atomic_write_all({path: write})


#: the hidden file in an output folder that lists the files its last run wrote, one name a
#: line: the only files a later run into the folder removes
OUTPUTS_RECORD = ".otreg-outputs"


def replace_recorded_outputs(folder: Path, written, inputs: Sequence) -> None:
    """After a run wrote the files named ``written`` into ``folder``: remove those that the
    folder's record (:data:`OUTPUTS_RECORD`) lists from the run before and this one did
    not write (never an input, never anything outside the folder), then record this
    run's, so that the folder never mixes two runs' files.

    Example:
        >>> import tempfile, pathlib
        >>> from otreg.io import replace_recorded_outputs
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> for name in ("a.vtk", "old.png", "mine.txt"):
        ...     _ = (folder / name).write_text(name)
        >>> replace_recorded_outputs(folder, ["a.vtk", "old.png"], [])   # a first run's
        >>> replace_recorded_outputs(folder, ["a.vtk"], [])   # a second wrote a.vtk only
        >>> sorted(p.name for p in folder.iterdir())   # its picture gone, the user's kept
        ['.otreg-outputs', 'a.vtk', 'mine.txt']
    """
    written = set(written)
    record = folder / OUTPUTS_RECORD
    earlier = set(record.read_text().split("\n")) if record.is_file() else set()
    for name in sorted(earlier - written - {""}):
        old = folder / name
        if (
            "/" not in name
            and old.is_file()
            and not any(given is not None and same_file(old, given) for given in inputs)
        ):
            old.unlink()
    atomic_write(record, lambda p: p.write_text("".join(n + "\n" for n in sorted(written))))


def write_shape(shape: Shape, path: Path, fmt: str) -> None:
    pts = shape.points.detach().cpu().double().numpy()
    faces = None if shape.faces is None else shape.faces.cpu().numpy()

    def write(tmp: Path) -> None:
        if fmt == "pyvista":
            shape.to_pyvista().save(str(tmp))
        elif fmt == "gifti":
            import nibabel as nib

            arrays = [
                nib.gifti.GiftiDataArray(pts.astype(np.float32), intent="NIFTI_INTENT_POINTSET")
            ]
            if faces is not None:
                arrays.append(
                    nib.gifti.GiftiDataArray(faces.astype(np.int32), intent="NIFTI_INTENT_TRIANGLE")
                )
            nib.save(nib.GiftiImage(darrays=arrays), str(tmp))
        elif fmt == "freesurfer":
            import nibabel.freesurfer as fs

            # Coordinates are scanner RAS: record c_ras = 0 so that readers add nothing.
            info = {
                "head": np.array([2, 0, 20], dtype=np.int32),
                "valid": "1  # volume info valid",
                "filename": "otreg",
                "volume": np.array([256, 256, 256]),
                "voxelsize": np.ones(3),
                "xras": np.array([-1.0, 0, 0]),
                "yras": np.array([0, 0, -1.0]),
                "zras": np.array([0, 1.0, 0]),
                "cras": np.zeros(3),
            }
            fs.write_geometry(str(tmp), pts, faces.astype(np.int32), volume_info=info)
        elif fmt == "npy":
            with open(tmp, "wb") as fh:
                np.save(fh, pts)
        else:  # csv
            header = ",".join("xyz"[k] if k < 3 else f"x{k}" for k in range(pts.shape[1]))
            np.savetxt(tmp, pts, delimiter=",", header=header, comments="")

    atomic_write(path, write)
