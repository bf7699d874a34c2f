"""Data to try otreg on.

- Real brain data shipped inside installed packages, offline (``pip install otreg[data]``):
  nilearn's fsaverage5 (FreeSurfer; 10,242 vertices a hemisphere, with sulcal depth,
  curvature and thickness) and its MNI152 grey/white-matter probability maps; brainspace's
  Conte69 (fs_LR 32k, the Human Connectome Project's template: 32,492 vertices a
  hemisphere, with parcellations). Two templates built by different groups from different
  subjects, in slightly different spaces: a real registration problem. Nothing is downloaded
  and no file is copied into otreg.
- ``synthetic_subjects``: subjects made by applying known smooth random diffeomorphisms and
  rigid motions to a real surface, with ground-truth correspondences, written as mesh and
  NIfTI files for batch runs.
- ``circles``, ``noisy_sphere``: synthetic point clouds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .._checks import check_choice, check_int, check_positive
from ..io import atomic_write, load_shape, save_shape
from ..shapes import Shape
from ._ground_truth import KernelFlow, RigidMotion, random_flow, random_rigid

__all__ = [
    "circles",
    "noisy_sphere",
    "fsaverage5",
    "fsaverage5_path",
    "fsaverage5_map",
    "conte69",
    "conte69_path",
    "conte69_parcellation",
    "brainspace_data_dir",
    "mni152",
    "mni152_surface",
    "synthetic_subjects",
    "SyntheticSubject",
    "nilearn_data_dir",
]

FSAVERAGE5_SURFACES = ("pial", "white", "midthickness", "inflated", "sphere")
FSAVERAGE5_MAPS = ("sulc", "curv", "thick", "area")
CONTE69_SURFACES = ("midthickness", "sphere")
#: brainspace's parcellations of Conte69 (both hemispheres, left first; 0 = medial wall).
CONTE69_PARCELLATIONS = tuple(
    f"{atlas}_{n}" for atlas in ("schaefer", "vosdewael") for n in (100, 200, 300, 400)
) + ("schaefer_1000", "mesulam")
_FS_FILES = {
    "pial": "pial_{hemi}.gii.gz",
    "white": "white_{hemi}.gii.gz",
    "inflated": "infl_{hemi}.gii.gz",
    "sphere": "sphere_{hemi}.gii.gz",
}


def circles(
    n: int = 10_000, shift: float = 1.0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two unit circles of n evenly spaced points each, the second shifted by ``shift`` along x.

    Returns:
        x, y: ``(n, 2)`` each.

    Example:
        >>> from otreg import datasets
        >>> x, y = datasets.circles(1000)
        >>> tuple(x.shape), tuple(y.shape)
        ((1000, 2), (1000, 2))
    """
    n = check_int("circles", "n", n, 1)
    t = torch.arange(n, dtype=torch.float64) * (2 * math.pi / n)
    x = torch.stack([t.cos(), t.sin()], dim=1)
    y = x + torch.tensor([float(shift), 0.0], dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def noisy_sphere(
    n: int,
    radius: float = 1.0,
    center: tuple[float, float, float] = (0, 0, 0),
    noise: float = 0.02,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """N points uniformly distributed on a sphere, plus Gaussian noise of std ``noise``.

    Returns:
        ``(n, 3)`` points, in the units of ``radius``.

    Example:
        >>> from otreg import datasets
        >>> p = datasets.noisy_sphere(500, radius=2.0, noise=0.0)
        >>> round(float(p.norm(dim=1).mean()), 3)
        2.0
    """
    n = check_int("noisy_sphere", "n", n, 1)
    radius = check_positive("noisy_sphere", "radius", radius)
    noise = check_positive("noisy_sphere", "noise", noise, allow_zero=True)
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, 3, generator=g, dtype=torch.float64)
    p = radius * p / p.norm(dim=1, keepdim=True)
    p = p + noise * torch.randn(n, 3, generator=g, dtype=torch.float64)
    return (p + torch.tensor(center, dtype=torch.float64)).to(dtype)


# --------------------------------------------------------------------------- nilearn data
def nilearn_data_dir() -> Path:
    """The data folder inside the installed nilearn wheel.

    Example:
        >>> from otreg import datasets
        >>> (datasets.nilearn_data_dir() / "fsaverage5").is_dir()
        True
    """
    try:
        import nilearn
    except ImportError as err:
        raise ImportError(
            "the real brain data ships with nilearn: pip install 'otreg[data]'"
        ) from err
    return Path(nilearn.__file__).parent / "datasets" / "data"


def fsaverage5(
    surface: str = "pial", hemi: str = "left", dtype: torch.dtype = torch.float32
) -> Shape:
    """An fsaverage5 hemisphere (10,242 vertices, 20,480 triangles), MNI305 space, mm.

    ``surface``: ``"pial"``, ``"white"``, ``"midthickness"`` (their average, vertex by
    vertex: FreeSurfer's pial and white share vertex order), ``"inflated"`` or ``"sphere"``.

    Example:
        >>> from otreg import datasets
        >>> lh = datasets.fsaverage5("midthickness", "left")
        >>> lh.n_points, lh.n_faces, lh.unit
        (10242, 20480, 'mm')
    """
    if surface == "midthickness":
        pial, white = (fsaverage5(s, hemi, torch.float64) for s in ("pial", "white"))
        mid = pial.with_points(((pial.points + white.points) / 2).to(dtype))
        mid.source = None
        return mid
    return load_shape(fsaverage5_path(surface, hemi), dtype=dtype)


def fsaverage5_path(surface: str = "pial", hemi: str = "left") -> Path:
    """The GIFTI file of an fsaverage5 hemisphere inside nilearn's installed package.

    Example:
        >>> from otreg import datasets
        >>> datasets.fsaverage5_path("white", "right").is_file()
        True
    """
    check_choice("fsaverage5", "surface", surface, FSAVERAGE5_SURFACES)
    check_choice("fsaverage5", "hemi", hemi, ("left", "right"))
    if surface == "midthickness":
        raise ValueError(
            "fsaverage5_path: nilearn ships no midthickness file; fsaverage5('midthickness') "
            "averages pial and white"
        )
    return nilearn_data_dir() / "fsaverage5" / _FS_FILES[surface].format(hemi=hemi)


def fsaverage5_map(name: str = "sulc", hemi: str = "left") -> np.ndarray:
    """A per-vertex map of an fsaverage5 hemisphere, ``(10242,)`` float: ``"sulc"`` (sulcal
    depth, mm, positive in sulci), ``"curv"`` (mean curvature, 1/mm), ``"thick"`` (cortical
    thickness, mm) or ``"area"`` (vertex area, mm^2).

    Example:
        >>> from otreg import datasets
        >>> datasets.fsaverage5_map("sulc", "left").shape
        (10242,)
    """
    import nibabel as nib

    check_choice("fsaverage5_map", "name", name, FSAVERAGE5_MAPS)
    check_choice("fsaverage5_map", "hemi", hemi, ("left", "right"))
    path = nilearn_data_dir() / "fsaverage5" / f"{name}_{hemi}.gii.gz"
    return np.asarray(nib.load(str(path)).darrays[0].data, dtype=np.float64)


# --------------------------------------------------------------------------- brainspace data
def brainspace_data_dir() -> Path:
    """The data folder inside the installed brainspace wheel.

    Example:
        >>> from otreg import datasets
        >>> datasets.brainspace_data_dir().is_dir()
        True
    """
    try:
        import brainspace
    except ImportError as err:
        raise ImportError(
            "Conte69 (fs_LR 32k) ships with brainspace: pip install 'otreg[data]' "
            "(or pip install brainspace)"
        ) from err
    return Path(brainspace.__file__).parent / "datasets"


def conte69_path(hemi: str = "left", surface: str = "midthickness") -> Path:
    """The GIFTI file of a Conte69 hemisphere inside brainspace's installed package.

    Example:
        >>> from otreg import datasets
        >>> datasets.conte69_path("left").suffix
        '.gii'
    """
    check_choice("conte69", "hemi", hemi, ("left", "right"))
    check_choice("conte69", "surface", surface, CONTE69_SURFACES)
    suffix = "_sphere" if surface == "sphere" else ""
    return brainspace_data_dir() / "surfaces" / f"conte69_32k_{hemi[0]}h{suffix}.gii"


def conte69(
    hemi: str = "left", surface: str = "midthickness", dtype: torch.dtype = torch.float32
) -> Shape:
    """A Conte69 hemisphere (fs_LR 32k: 32,492 vertices, 64,980 triangles), MNI space, mm.

    ``data["cortex"]`` is 1 on the cortex and 0 on the medial wall (brainspace's mask).

    Example:
        >>> from otreg import datasets
        >>> lh = datasets.conte69("left")
        >>> lh.n_points, int(lh.data["cortex"].sum()) < lh.n_points
        (32492, True)
    """
    shape = load_shape(conte69_path(hemi, surface), dtype=dtype)
    mask = brainspace_data_dir() / "surfaces" / f"conte69_32k_{hemi[0]}h_mask.csv"
    shape.data["cortex"] = torch.as_tensor(np.loadtxt(mask), dtype=torch.int64)
    return shape


def conte69_parcellation(name: str = "schaefer_100", hemi: str = "left") -> np.ndarray:
    """Brainspace's parcel labels on a Conte69 hemisphere, ``(32492,)`` int (0: the medial
    wall; the right hemisphere's labels follow the left's).

    Example:
        >>> from otreg import datasets
        >>> labels = datasets.conte69_parcellation("schaefer_100", "left")
        >>> labels.shape
        (32492,)
    """
    check_choice("conte69_parcellation", "name", name, CONTE69_PARCELLATIONS)
    check_choice("conte69_parcellation", "hemi", hemi, ("left", "right"))
    path = brainspace_data_dir() / "parcellations" / f"{name}_conte69.csv"
    labels = np.loadtxt(path).astype(np.int64)
    half = labels.shape[0] // 2
    return labels[:half] if hemi == "left" else labels[half:]


def mni152(tissue: str = "wm") -> Path:
    """Path of nilearn's MNI152 (2009a) grey- or white-matter probability map (uint8, 0-255).

    Example:
        >>> from otreg import datasets
        >>> datasets.mni152("gm").name.endswith(".nii.gz")
        True
    """
    check_choice("mni152", "tissue", tissue, ("gm", "wm"))
    return nilearn_data_dir() / f"mni_icbm152_{tissue}_tal_nlin_sym_09a_converted.nii.gz"


def mni152_surface(
    tissue: str = "wm",
    threshold: float = 0.5,
    largest: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Shape:
    """The boundary of the MNI152 tissue map thresholded at ``threshold`` (a probability).

    ``largest`` keeps the largest connected component: a closed surface.

    Example:
        >>> from otreg import datasets
        >>> wm = datasets.mni152_surface("wm")
        >>> wm.n_points > 10_000, wm.unit
        (True, 'mm')
    """
    threshold = check_positive("mni152_surface", "threshold", threshold)
    if threshold >= 1:
        raise ValueError(f"mni152_surface: threshold is {threshold}; it is a probability in (0, 1)")
    shape = load_shape(mni152(tissue), level=threshold * 255, dtype=dtype)  # stored as 0-255
    if largest:
        source = shape.source
        shape = shape.components()[0]
        shape.source = source
    return shape


# --------------------------------------------------------------------------- synthetic
@dataclass
class SyntheticSubject:
    """One synthetic subject: ``shape`` = rigid(flow(base)), vertex k <-> base vertex k.

    Example:
        >>> from otreg import datasets
        >>> base = datasets.fsaverage5("pial").decimate(2000)
        >>> (s,) = datasets.synthetic_subjects(base, n=1)
        >>> truth = s.rigid(s.flow(base.points))       # where each base vertex went
        >>> bool((truth - s.shape.points).abs().max() < 1e-3)
        True
    """

    name: str
    shape: Shape
    flow: KernelFlow
    rigid: RigidMotion
    files: dict[str, Path]

    def transform(self, points: torch.Tensor) -> torch.Tensor:
        """The ground-truth map from the base's space to this subject's."""
        return self.rigid(self.flow(points))

    def inverse_transform(self, points: torch.Tensor) -> torch.Tensor:
        """The ground-truth map from this subject's space back to the base's."""
        return self.flow.inverse(self.rigid.inverse(points))


def synthetic_subjects(
    base: Shape | None = None,
    n: int = 4,
    *,
    sigma: float = 25.0,
    magnitude: float = 6.0,
    n_controls: int = 40,
    max_angle: float = 10.0,
    max_shift: float = 10.0,
    seed: int = 0,
    out_dir: str | Path | None = None,
    volume: str | None = None,
) -> list[SyntheticSubject]:
    """Subjects made from a real surface by known smooth diffeomorphisms and rigid motions.

    Args:
        base: the surface to deform (default: fsaverage5 left pial).
        n: number of subjects.
        sigma: width (mm) of the Gaussian kernels of the velocity field.
        magnitude: peak velocity (mm): about the largest non-rigid displacement.
        n_controls: kernels in the velocity field, centred on base vertices.
        max_angle: the largest rotation of the rigid motion, degrees.
        max_shift: the largest translation of the rigid motion, mm.
        seed: random seed (subjects are reproducible).
        out_dir: if given, each subject is written there: ``NAME.vtk`` (the surface),
            ``NAME_truth.npz`` (base vertices, subject vertices, rigid motion, flow) and
            ``NAME_truth.json`` (the parameters); plus ``base.vtk``.
        volume: ``"wm"`` or ``"gm"``: also write ``NAME.nii.gz``, the MNI152 tissue map
            resampled through the subject's inverse transform (same ground truth).

    Returns:
        One :class:`SyntheticSubject` per subject.

    Example:
        >>> from otreg import datasets
        >>> base = datasets.fsaverage5("pial").decimate(2000)
        >>> (s,) = datasets.synthetic_subjects(base, n=1, seed=1)
        >>> s.name, s.shape.n_points == base.n_points
        ('subject_000', True)
    """
    caller = "synthetic_subjects"
    base = fsaverage5("pial", "left") if base is None else base
    if not isinstance(base, Shape):
        raise TypeError(f"{caller}: base must be a Shape, got {type(base).__name__}")
    n = check_int(caller, "n", n, 1)
    sigma = check_positive(caller, "sigma", sigma)
    magnitude = check_positive(caller, "magnitude", magnitude, allow_zero=True)
    max_angle = check_positive(caller, "max_angle", max_angle, allow_zero=True)
    max_shift = check_positive(caller, "max_shift", max_shift, allow_zero=True)
    if volume is not None:
        check_choice(caller, "volume", volume, ("wm", "gm"))
    rng = np.random.default_rng(seed)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None and out.exists() and not out.is_dir():
        raise ValueError(f"{caller}: out_dir {out} exists and is not a folder")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        save_shape(base.with_points(base.points), out / "base.vtk")
    subjects = []
    center = base.points.detach().double().mean(0)
    for k in range(n):
        name = f"subject_{k:03d}"
        flow = random_flow(base.points, sigma, magnitude, n_controls, rng)
        rigid = random_rigid(center, max_angle, max_shift, rng)
        moved = rigid(flow(base.points.double())).to(base.points.dtype)
        shape = base.with_points(moved)
        files: dict[str, Path] = {}
        if out is not None:
            files = _write_subject(out, name, base, shape, flow, rigid, volume)
            shape.source = str(files["surface"])
        subjects.append(SyntheticSubject(name, shape, flow, rigid, files))
    return subjects


def _write_subject(
    out: Path,
    name: str,
    base: Shape,
    shape: Shape,
    flow: KernelFlow,
    rigid: RigidMotion,
    volume: str | None,
) -> dict[str, Path]:
    files = {"surface": save_shape(shape, out / f"{name}.vtk")}
    truth = {
        "base_points": base.points.detach().double().numpy(),
        "points": shape.points.detach().double().numpy(),
        "rotation": rigid.rotation.numpy(),
        "translation": rigid.translation.numpy(),
        "center": rigid.center.numpy(),
        "controls": flow.controls.numpy(),
        "momenta": flow.momenta.numpy(),
        "sigma": np.array(flow.sigma),
    }
    files["truth"] = out / f"{name}_truth.npz"
    atomic_write(files["truth"], lambda p: np.savez(p, **truth))
    meta = {
        "name": name,
        "sigma_mm": flow.sigma,
        "rotation_degrees": rigid.angle_degrees,
        "translation_mm": rigid.translation.tolist(),
        "n_controls": len(flow.controls),
        "max_displacement_mm": float(
            (shape.points.double() - rigid(base.points.double())).norm(dim=1).max()
        ),
        "files": {"surface": files["surface"].name, "truth": files["truth"].name},
    }
    if volume is not None:
        files["volume"] = out / f"{name}.nii.gz"
        _write_warped_volume(mni152(volume), files["volume"], flow, rigid)
        meta["files"]["volume"] = files["volume"].name
    files["meta"] = out / f"{name}_truth.json"
    atomic_write(files["meta"], lambda p: p.write_text(json.dumps(meta, indent=2)))
    return files


def _write_warped_volume(
    src: Path, dst: Path, flow: KernelFlow, rigid: RigidMotion, stride: int = 4
) -> None:
    """Resample ``src`` at T^-1(world grid): the volume moves with the surface."""
    import nibabel as nib
    from scipy.ndimage import map_coordinates, zoom

    img = nib.load(str(src))
    data = np.asanyarray(img.dataobj)
    shape = data.shape
    # The inverse map is smooth: evaluate it on a coarse grid, interpolate to every voxel.
    axes = [np.arange(0, s, stride, dtype=np.float64) for s in shape]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    world = nib.affines.apply_affine(img.affine, grid)
    back = flow.inverse(rigid.inverse(torch.as_tensor(world))).numpy()
    vox = nib.affines.apply_affine(np.linalg.inv(img.affine), back)
    coarse = vox.reshape(*[len(a) for a in axes], 3) - grid.reshape(*[len(a) for a in axes], 3)
    factors = [s / len(a) for s, a in zip(shape, axes)]
    disp = np.stack(
        [
            zoom(coarse[..., d], factors, order=1)[: shape[0], : shape[1], : shape[2]]
            for d in range(3)
        ]
    )
    ident = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"))
    warped = map_coordinates(data.astype(np.float32), ident + disp, order=1, mode="constant")
    out = nib.Nifti1Image(
        np.clip(np.rint(warped), 0, 255).astype(data.dtype), img.affine, img.header
    )
    atomic_write(dst, lambda p: nib.save(out, str(p)))
