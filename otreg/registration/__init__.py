"""Registration of surfaces: pre-alignment, LDDMM, data terms, metrics."""

from . import metrics
from .attachments import ATTACHMENTS, make_attachment, varifold_distance
from .deformations import LDDMM, Affine, Rigid, Similarity
from .register import MODELS, PREALIGNS, Registration, prealign, register

__all__ = ["register", "Registration", "prealign", "LDDMM", "Rigid", "Similarity", "Affine",
           "make_attachment", "varifold_distance", "metrics", "ATTACHMENTS", "MODELS",
           "PREALIGNS"]
