"""Surfaces from 3-D volumes (NIfTI, MGZ): label or mask -> marching cubes -> world mm."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..shapes import Shape


def load_volume(path: Path, caller: str):
    """(data as a 3-D array, voxel-to-world affine) with clear errors for bad files."""
    import nibabel as nib

    try:
        img = nib.load(str(path))
        data = np.asanyarray(img.dataobj)
    except (OSError, EOFError, ValueError, nib.filebasedimages.ImageFileError) as err:
        raise ValueError(
            f"{caller}: {path} could not be read as a volume ({type(err).__name__}: "
            f"{err}); the file may be truncated or not NIfTI/MGZ"
        ) from err
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise ValueError(
            f"{caller}: {path} has shape {data.shape}; a surface needs a 3-D volume "
            "(select one volume of a 4-D series first)"
        )
    if 0 in data.shape:
        raise ValueError(f"{caller}: {path} is empty (shape {data.shape})")
    return data, np.asarray(img.affine, dtype=np.float64)


#: A label value matches voxels within this distance (float noise: 17.0000001 is 17).
LABEL_TOLERANCE = 1e-3
#: A label image whose nonzero voxels hold more than this fraction of non-integer values was
#: resampled with interpolation, which blends labels at every boundary: refused.
INTERPOLATED_FRACTION = 0.01


def _label_mask(data: np.ndarray, label, path: Path, caller: str) -> np.ndarray:
    """The voxels of ``label``; an image that is not a label image (interpolated) is
    refused, float noise around the labels is tolerated."""
    if data.dtype.kind != "f":
        mask = data == label
    else:
        values = data[np.isfinite(data) & (data != 0)]
        off = np.abs(values - np.round(values)) > LABEL_TOLERANCE
        if values.size and off.mean() > INTERPOLATED_FRACTION:
            examples = ", ".join(f"{v:.4g}" for v in np.unique(values[off])[:4])
            raise ValueError(
                f"{caller}: {path} is not a label image: {100 * off.mean():.0f}% of its "
                f"nonzero voxels hold non-integer values (e.g. {examples}; "
                f"{np.unique(values).size:,} distinct values). It looks resampled with "
                "linear interpolation, which blends the labels at every boundary and "
                "shrinks or moves each structure. Resample segmentations with "
                "nearest-neighbour interpolation (flirt -interp nearestneighbour, "
                "mri_vol2vol --interp nearest, antsApplyTransforms -n NearestNeighbor), "
                "or give level= for a probability map"
            )
        mask = np.abs(data - label) <= LABEL_TOLERANCE
    if not mask.any():
        present = np.unique(data[np.isfinite(data)]) if data.dtype.kind == "f" else np.unique(data)
        shown = ", ".join(f"{v:g}" for v in present[:30])
        more = f" and {present.size - 30} more" if present.size > 30 else ""
        raise ValueError(
            f"{caller}: label {label} is absent from {path}; labels present: {shown}{more}"
        )
    return mask


def _mask(data: np.ndarray, label, level, path: Path, caller: str) -> np.ndarray:
    if label is not None and level is not None:
        raise ValueError(
            f"{caller}: give label= (a segmentation value) or level= (a threshold "
            f"of a probability map) for {path}, not both"
        )
    if label is not None:
        return _label_mask(data, label, path, caller)
    if level is not None:
        top = float(np.nanmax(data))
        if 0 < level < 1 and top >= 2:  # a probability given for a map stored as 0-255
            raise ValueError(
                f"{caller}: level={level} is a probability but {path} holds values up to "
                f"{top:g} (a map stored as 0 to {top:g}?); give level in the map's own "
                f"units, e.g. level={level * top:g}"
            )
        mask = data >= level
        if not mask.any():
            raise ValueError(
                f"{caller}: no voxel of {path} reaches level={level} (max {np.nanmax(data):g})"
            )
        return mask
    values = np.unique(data)
    if values.size <= 2 and set(values.tolist()) <= {0, 1}:
        if not (data == 1).any():
            raise ValueError(f"{caller}: the mask {path} is all zero")
        return data == 1
    raise ValueError(
        f"{caller}: {path} has {values.size} distinct values; give label= for a "
        "segmentation or level= for a probability map"
    )


def _without_fins(faces: np.ndarray) -> np.ndarray:
    """Marching cubes' triangles without the fins it leaves at some saddle voxels: a
    triangle and its reverse on the same three vertices (no area between them, both counted
    in the measures). Both go; a repeated triangle of one orientation keeps one copy."""
    key = np.sort(faces, axis=1)
    _, inverse, counts = np.unique(key, axis=0, return_inverse=True, return_counts=True)
    if (counts == 1).all():
        return faces
    # the orientation of a triangle: whether it is an even permutation of its sorted key
    even = (
        ((faces[:, 0] == key[:, 0]) & (faces[:, 1] == key[:, 1]))
        | ((faces[:, 1] == key[:, 0]) & (faces[:, 2] == key[:, 1]))
        | ((faces[:, 2] == key[:, 0]) & (faces[:, 0] == key[:, 1]))
    )
    inverse = inverse.reshape(-1)
    n_even = np.bincount(inverse, weights=even, minlength=len(counts))
    n_odd = counts - n_even
    net = n_even - n_odd  # +1, -1: one triangle of that orientation is left; 0: none
    keep = counts[inverse] == 1
    for group in np.flatnonzero((counts > 1) & (net != 0)):  # a few dozen
        members = np.flatnonzero(inverse == group)
        keep[next(k for k in members if even[k] == (net[group] > 0))] = True
    return faces[keep]


def volume_to_shape(
    path: Path, caller: str, label=None, level=None, step_size: int = 1, dtype=torch.float32
) -> Shape:
    """Marching cubes (scikit-image) on the mask, mapped through the affine to world mm.

    The mask is padded by one voxel so that the surface is closed. Triangles are oriented so
    that normals point outwards in world space, also when the affine flips an axis.
    """
    import nibabel as nib
    from skimage.measure import marching_cubes

    data, affine = load_volume(path, caller)
    mask = _mask(data, label, level, path, caller)
    padded = np.pad(mask.astype(np.float32), 1)
    verts, faces, _, _ = marching_cubes(
        padded, level=0.5, step_size=step_size, allow_degenerate=False
    )
    verts = verts - 1.0  # undo the padding: voxel indices of the original grid
    world = nib.affines.apply_affine(affine, verts)
    faces = _without_fins(faces.astype(np.int64))
    shape = Shape(torch.as_tensor(world, dtype=torch.float64), torch.as_tensor(faces))
    if float(shape.volume) < 0:  # outward normals in world space, whatever the affine
        faces = faces[:, [0, 2, 1]]
    return Shape(torch.as_tensor(world, dtype=dtype), torch.as_tensor(faces), source=str(path))
