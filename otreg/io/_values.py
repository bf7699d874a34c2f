"""Per-vertex values in files, through nibabel: GIFTI functional and shape files
(``.func.gii``, ``.shape.gii``), GIFTI label files (``.label.gii``, with their label table),
each also gzipped (``.gii.gz``), FreeSurfer ``.annot`` (labels and colour table),
morphometry files (``lh.curv``, ``lh.thickness``, ``*.curv``...) and surface overlays in
MGH format (``.mgh``, ``.mgz``, as ``mris_preproc`` writes them), and NumPy ``.npy``.

A file is read in the format its name gives. Morphometry files have no extension of their
own, so a name that matches nothing else is read as one only if it starts with their magic
number: any other file (a ``.csv``, a gzipped file of another kind) is refused, never read
as numbers it does not hold.

An ``.annot`` stores each vertex's colour, not a label number: its labels come back as
indices into its colour table (names, colours and transparency kept), and a vertex whose
colour is black (0, 0, 0) as -1, unknown, as FreeSurfer reads it. So that labels written
to an .annot come back, a label whose colour is black or another label's is written with
one of its channels moved by a unit or a few (of 255)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "VertexValues",
    "gifti_structure",
    "kind_of_name",
    "named_structure",
    "unlabelled",
    "values_stem",
]

#: A label table: label value -> (name, RGBA colour in [0, 1]).
LabelTable = dict[int, tuple[str, tuple[float, float, float, float]]]


@dataclass
class VertexValues:
    """Values at the vertices of a surface: ``values`` ``(N,)`` or ``(N, C)`` (a map, float)
    or ``(N,)`` integers (labels, with their ``label_table``); labels carried from another
    surface also have a ``confidence`` per vertex (:meth:`~otreg.Registration.transfer`'s:
    the nearest triangle's barycentric weight on the label chosen, in [1/3, 1]).

    Example:
        >>> import torch
        >>> from otreg.io import VertexValues
        >>> v = VertexValues(torch.tensor([1, 1, 2]), {1: ("V1", (1.0, 0, 0, 1)), 2: ("V2",
        ...                  (0, 1.0, 0, 1))})
        >>> v.is_labels, v.n_vertices
        (True, 3)
    """

    values: torch.Tensor
    label_table: LabelTable | None = field(default=None)
    confidence: torch.Tensor | None = field(default=None, repr=False)
    #: the file they were read from (:func:`~otreg.io.load_values`), which
    #: :func:`~otreg.io.save_values` never overwrites
    source: Path | None = field(default=None, repr=False, compare=False)
    #: the structure a GIFTI file says they belong to (its AnatomicalStructurePrimary,
    #: e.g. ``"CortexLeft"``), checked against the surface they are carried from; values
    #: carried onto a surface whose GIFTI file says one get it, and GIFTI files written
    #: keep it
    structure: str | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        dtype = str(self.values.dtype).removeprefix("torch.")
        parts = [f"{tuple(self.values.shape)} {dtype}"]
        if self.label_table:
            names = [name for name, _ in self.label_table.values()]
            more = f", ... {len(names) - 3} more" if len(names) > 3 else ""
            parts.append(f"{len(names)} labels: {', '.join(names[:3])}{more}")
        if self.confidence is not None:
            parts.append("with confidence")
        return f"VertexValues({'; '.join(parts)})"

    @property
    def is_labels(self) -> bool:
        """Whether these are labels (integers), not a map."""
        return not (self.values.is_floating_point() or self.values.is_complex())

    @property
    def n_vertices(self) -> int:
        """The number of vertices they are given at."""
        return int(self.values.shape[0])


#: FreeSurfer's morphometry files (the "new" curv format, the only one since 1999) start
#: with these three bytes.
MORPH_MAGIC = b"\xff\xff\xff"

#: The kinds of values files: what a name ends with -> the kind :func:`suffix` returns.
KINDS = {
    ".label.gii": ".label.gii",
    ".func.gii": ".gii",
    ".shape.gii": ".gii",
    ".gii": ".gii",
    ".annot": ".annot",
    ".mgh": ".mgh",
    ".mgz": ".mgh",
    ".npy": ".npy",
}


#: The extensions of FreeSurfer's morphometry files named without a hemisphere (``NAME.curv``):
#: a name that falls through to that format (it has no extension of its own) is written
#: as one only if it starts with ``lh.`` / ``rh.``, has no extension, or ends in one of these
#: (:func:`morph_name`); ``out.xyz`` is refused rather than written as a curv file
MORPH_EXTENSIONS = (".curv", ".thickness", ".sulc", ".area", ".volume", ".jacobian_white",
                    ".avg_curv")  # fmt: skip


def morph_name(name: str) -> bool:
    """Whether a file ``name`` reads as FreeSurfer morphometry's when written (see
    :data:`MORPH_EXTENSIONS`).

    Example:
        >>> from otreg.io._values import morph_name
        >>> morph_name("lh.thickness"), morph_name("sub-01.curv"), morph_name("out.xyz")
        (True, True, False)
    """
    lower = name.lower()
    return lower.startswith(("lh.", "rh.")) or "." not in lower or lower.endswith(MORPH_EXTENSIONS)


#: Names of a label table's "no label" entries (FreeSurfer's unknown, the HCP's ???),
#: compared in lower case; a name with a medial wall in it is one too (the HCP's
#: L_Medial_Wall, Schaefer's Background+FreeSurfer_Defined_Medial_Wall)
UNLABELLED = frozenset({"unknown", "???", "background"})
_MEDIAL_WALL = re.compile(r"medial[ _]?wall", re.IGNORECASE)


def unlabelled(*values: VertexValues) -> tuple[int, ...]:
    """The label values that mean "no label": -1 (an annot's unassigned vertices) and the
    keys the values' label tables name so (:data:`UNLABELLED`).

    Example:
        >>> import torch
        >>> from otreg.io import VertexValues, unlabelled
        >>> table = {0: ("Unknown", (0, 0, 0, 0)), 1: ("V1", (1.0, 0, 0, 1))}
        >>> unlabelled(VertexValues(torch.tensor([0, 1, 1]), table))
        (-1, 0)
        >>> unlabelled(VertexValues(torch.tensor([0, 1]), {0: ("L_Medial_Wall", (0, 0, 0, 0))}))
        (-1, 0)
    """
    keys = {-1}
    for v in values:
        for key, (name, _) in (v.label_table or {}).items():
            if name.strip().lower() in UNLABELLED or _MEDIAL_WALL.search(name):
                keys.add(int(key))
    return tuple(sorted(keys))


def suffix(path: Path) -> str:
    """The kind of a values file, from its name: label.gii, gii, annot, mgh, npy or morph
    (a gzipped GIFTI, ``.gii.gz``, is of its GIFTI kind)."""
    name = path.name.lower()
    if name.endswith(".gii.gz"):
        name = name.removesuffix(".gz")
    for ext, kind in KINDS.items():
        if name.endswith(ext):
            return kind
    return "morph"  # FreeSurfer's curv, thickness, sulc, area... files have no extension


def values_stem(name: str) -> str:
    """A values file's name less its extension (:data:`KINDS`, gzipped or not; a FreeSurfer
    morphometry file has none).

    Example:
        >>> from otreg.io import values_stem
        >>> values_stem("atlas.label.gii.gz"), values_stem("lh.thickness")
        ('atlas', 'lh.thickness')
    """
    lower = name.lower()
    ends = (ext for kind in KINDS for ext in (kind, kind + ".gz") if lower.endswith(ext))
    return name[: len(name) - len(next(ends, ""))]


def _is_morph(path: Path) -> bool:
    """Whether the file starts with FreeSurfer's morphometry magic number."""
    with open(path, "rb") as f:
        return f.read(3) == MORPH_MAGIC


class _NotValues(ValueError):
    """A file that holds something other than per-vertex values (its message says what)."""


class _NotLabels(_NotValues):
    """A label file whose values are not integers."""


def read_values(path: Path, caller: str) -> VertexValues:
    """The values in a file (errors name it and the format expected)."""
    import nibabel as nib

    kind = suffix(path)
    try:
        if kind == ".npy":
            return VertexValues(torch.as_tensor(np.load(path, allow_pickle=False)))
        if kind == ".annot":
            labels, ctab, names = nib.freesurfer.read_annot(str(path))
            table = {
                int(k): (
                    name.decode() if isinstance(name, bytes) else str(name),
                    tuple(float(c) / 255 for c in ctab[k, :3]) + (1 - float(ctab[k, 3]) / 255,),
                )
                for k, name in enumerate(names)
            }
            return VertexValues(
                torch.as_tensor(labels.astype(np.int64)), table, structure=named_structure(path)
            )
        if kind == "morph":
            if not _is_morph(path):
                raise ValueError(
                    "its name matches no known extension and it does not start with "
                    "FreeSurfer's morphometry magic number"
                )
            data = nib.freesurfer.read_morph_data(str(path))  # big-endian on disk
            return VertexValues(
                torch.as_tensor(data.astype(np.float32)), structure=named_structure(path)
            )
        if kind == ".mgh":
            data = np.asarray(nib.load(str(path)).dataobj)  # (N, 1, 1) or (N, 1, 1, C)
            if data.ndim not in (3, 4) or data.shape[1:3] != (1, 1):
                raise ValueError(f"an overlay is (N, 1, 1[, C]), this volume is {data.shape}")
            data = data.reshape(data.shape[0], -1)
            data = data[:, 0] if data.shape[1] == 1 else data
            side = named_structure(path)
            if np.issubdtype(data.dtype, np.integer):
                return VertexValues(torch.as_tensor(data.astype(np.int64)), structure=side)
            return VertexValues(torch.as_tensor(np.asarray(data, dtype=np.float32)), structure=side)
        img = nib.load(str(path))
        values = _gifti_values(img, path, kind, caller)
        return dataclasses.replace(values, structure=_structure(img))
    except _NotValues:
        raise
    except Exception as err:  # nibabel's readers raise many kinds (XML, zip, struct...)
        raise ValueError(
            f"{caller}: {path} could not be read as per-vertex values ({type(err).__name__}: "
            f"{err}); otreg reads GIFTI (.func.gii, .shape.gii, .label.gii, each also .gz), "
            "FreeSurfer .annot, morphometry files (lh.curv...) and .mgh/.mgz overlays, "
            "and .npy"
        ) from err


def _structure(img) -> str | None:
    """A GIFTI image's AnatomicalStructurePrimary (the file's or its first array's)."""
    for meta in (img.meta, *(d.meta for d in img.darrays[:1])):
        found = dict(meta or {}).get("AnatomicalStructurePrimary")
        if found:
            return str(found)
    return None


#: FreeSurfer's hemisphere prefixes (lh.aparc.annot, rh.curv, lh.pial) as GIFTI's structures
HEMISPHERE_PREFIXES = {"lh.": "CortexLeft", "rh.": "CortexRight"}


def named_structure(path: str | Path | None) -> str | None:
    """The structure a FreeSurfer file's name says (``lh.``: CortexLeft, ``rh.``:
    CortexRight), or None: .annot and morphometry files carry no structure of their own.

    Example:
        >>> from otreg.io import named_structure
        >>> named_structure("surf/rh.curv"), named_structure("thickness.npy")
        ('CortexRight', None)
    """
    name = "" if path is None else Path(path).name
    return next((s for p, s in HEMISPHERE_PREFIXES.items() if name.startswith(p)), None)


def gifti_structure(path: str | Path | None) -> str | None:
    """The AnatomicalStructurePrimary of a GIFTI file (a surface or values), or None (no
    such file, not GIFTI, none said, unreadable).

    Example:
        >>> from otreg.io import gifti_structure
        >>> gifti_structure("lh.thickness") is None      # not a GIFTI file
        True
    """
    import nibabel as nib

    if path is None or not str(path).lower().removesuffix(".gz").endswith(".gii"):
        return None
    try:
        return _structure(nib.load(str(path)))
    except Exception:  # a moved or unreadable file: nothing to compare with
        return None


def _gifti_values(img, path: Path, kind: str, caller: str) -> VertexValues:
    """The values of a GIFTI image (read from ``path``, of the values ``kind``)."""
    import nibabel as nib

    intents = {nib.nifti1.intent_codes.label[d.intent] for d in img.darrays}
    if intents & {"pointset", "triangle"}:
        raise _NotValues(
            f"{caller}: {path} is a surface (points and triangles), not values at its "
            "vertices: read it with otreg.load_shape"
        )
    arrays = [d.data for d in img.darrays]
    data = arrays[0] if len(arrays) == 1 else np.stack(arrays, axis=1)
    if kind == ".label.gii" and not np.issubdtype(data.dtype, np.integer):
        fractional = np.asarray(data) != np.round(np.asarray(data))
        if fractional.any():
            raise _NotLabels(
                f"{caller}: {path} is a label file but {int(fractional.sum())} of its "
                f"values are not whole numbers (e.g. {float(data[fractional][0])}); labels "
                "are integers: name a map .func.gii or .shape.gii"
            )
    if kind == ".label.gii" or np.issubdtype(data.dtype, np.integer):
        table = {int(lab.key): _label_entry(lab) for lab in img.labeltable.labels}
        return VertexValues(torch.as_tensor(data.astype(np.int64)), table or None)
    return VertexValues(torch.as_tensor(np.asarray(data)))


#: the colour of a GIFTI label that gives none (nibabel writes labels without one by default)
NO_COLOUR = (0.5, 0.5, 0.5, 1.0)


def _label_entry(lab) -> tuple[str, tuple[float, ...]]:
    """A GIFTI label's ``(name, rgba)``: a label without a name is ``label<key>``, a colour
    component it does not give is :data:`NO_COLOUR`'s."""
    name = getattr(lab, "label", None)
    rgba = tuple(NO_COLOUR[k] if c is None else float(c) for k, c in enumerate(lab.rgba))
    return (f"label{int(lab.key)}" if name is None else str(name)), rgba


#: The GIFTI intent of a map by its file's name (a label file's is NIFTI_INTENT_LABEL).
MAP_INTENTS = {".shape.gii": "NIFTI_INTENT_SHAPE", ".func.gii": "NIFTI_INTENT_NONE"}


def map_name(name: str) -> bool:
    """Whether a file name asks for a GIFTI map (``.func.gii``, ``.shape.gii``, gzipped
    or not), whatever its values' dtype."""
    plain = name.lower().removesuffix(".gz")
    return any(plain.endswith(e) for e in MAP_INTENTS)


def kind_of_name(name: str | Path) -> str | None:
    """What a values file's name asks for: ``"labels"`` (``.label.gii``, ``.annot``),
    ``"map"`` (``.func.gii``, ``.shape.gii``; gzipped or not) or None (``.gii``, ``.npy``,
    ``.mgh``, morphometry files: the values' dtype decides).

    Example:
        >>> from otreg.io import kind_of_name
        >>> kind_of_name("lh.aparc.annot"), kind_of_name("thick.func.gii"), kind_of_name("x.npy")
        ('labels', 'map', None)
    """
    path = Path(name)
    if suffix(path) in (".label.gii", ".annot"):
        return "labels"
    return "map" if map_name(path.name) else None


def _annot_colour(rgba) -> list[int]:
    """A colour-table row of an .annot: red, green, blue and transparency (255 (1 - alpha)),
    0 to 255."""
    return [round(255 * c) for c in rgba[:3]] + [round(255 * (1 - rgba[3]))]


def _distinct_colours(ctab: np.ndarray) -> None:
    """In place: make the colours (K, 4) of an .annot's table distinct and never black. An
    .annot stores each vertex's colour, so two labels of one colour would come back as one,
    and black, colour 0, comes back as -1 (no label): such a colour moves by the fewest
    units (of 255) in one channel that make it a colour of its own."""
    used: set[tuple[int, ...]] = set()
    for row in ctab:
        rgb = tuple(int(c) for c in row[:3])
        step = 0
        while rgb == (0, 0, 0) or rgb in used:
            step += 1
            moved = [
                rgb[:c] + (rgb[c] + d,) + rgb[c + 1 :] for c in range(3) for d in (step, -step)
            ]
            free = [m for m in moved if 0 <= min(m) and max(m) <= 255 and m not in used]
            if free:
                rgb = free[0]
            elif step > 255:  # every colour one channel away is taken: any free one
                rgb = next(
                    c for c in itertools.product(range(256), repeat=3) if c not in used and any(c)
                )
        used.add(rgb)
        row[:3] = rgb


def write_values(values: VertexValues, path: Path, kind: str, name: str = "") -> None:
    """Write values in the format ``kind`` (:func:`suffix` of the final name, ``name``) at
    ``path`` (the temporary file the caller renames into place)."""
    import nibabel as nib

    data = values.values.detach().cpu().numpy()
    if kind == ".npy":
        with open(path, "wb") as f:
            np.save(f, data)
    elif kind == ".annot":
        table = values.label_table or {int(k): (f"label{k}", NO_COLOUR) for k in
                                       np.unique(data)}  # fmt: skip
        keys = sorted(table)
        index = {k: i for i, k in enumerate(keys)}
        ctab = np.array([_annot_colour(table[k][1]) for k in keys])
        _distinct_colours(ctab)
        names = [table[k][0] for k in keys]
        labels = np.array([index.get(int(v), -1) for v in data], dtype=np.int32)
        nib.freesurfer.write_annot(str(path), labels, ctab, names, fill_ctab=True)
    elif kind == "morph":
        nib.freesurfer.write_morph_data(str(path), data.astype(np.float32))
    elif kind == ".mgh":
        volume = data.reshape(data.shape[0], 1, 1, -1) if data.ndim == 2 else data[:, None, None]
        dtype = np.int32 if values.is_labels else np.float32
        nib.save(nib.MGHImage(np.ascontiguousarray(volume.astype(dtype)), np.eye(4)), str(path))
    else:
        labels = values.is_labels and not map_name(name)  # the name says which
        columns = data[:, None] if data.ndim == 1 else data
        plain = name.lower().removesuffix(".gz")
        ends = next((e for e in MAP_INTENTS if plain.endswith(e)), None)
        intent = "NIFTI_INTENT_LABEL" if labels else MAP_INTENTS.get(ends, "NIFTI_INTENT_NONE")
        dtype = np.int32 if labels else np.float32
        img = nib.GiftiImage(
            darrays=[
                nib.gifti.GiftiDataArray(np.ascontiguousarray(c.astype(dtype)), intent=intent)
                for c in columns.T
            ]
        )
        if values.structure:  # the structure they belong to, as Workbench and FreeSurfer say it
            img.meta["AnatomicalStructurePrimary"] = values.structure
        if labels:  # every key written has an entry (-1, an annot's unassigned: ???)
            table = dict(values.label_table or {})
            for key in sorted(set(np.unique(data).tolist()) - set(table)):
                table[key] = ("???", (0.0, 0.0, 0.0, 0.0)) if key == -1 else (
                    f"label{key}", NO_COLOUR)  # fmt: skip
            for key, (label, rgba) in sorted(table.items()):
                lab = nib.gifti.GiftiLabel(key=int(key), red=rgba[0], green=rgba[1],
                                           blue=rgba[2], alpha=rgba[3])  # fmt: skip
                lab.label = label
                img.labeltable.labels.append(lab)
        nib.save(img, str(path))
