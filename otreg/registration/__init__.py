"""Registration of surfaces: pre-alignment, LDDMM, data terms, metrics."""

from . import metrics
from .deformations import LDDMM, Affine, Rigid, Similarity
from .losses import (
    ATTACHMENTS,
    LOSSES,
    Attachment,
    Loss,
    make_attachment,
    make_loss,
    varifold_distance,
)
from .register import MODELS, PREALIGNS, Registration, prealign, register

__all__ = ["register", "Registration", "prealign", "LDDMM", "Rigid", "Similarity", "Affine",
           "Loss", "make_loss", "LOSSES", "varifold_distance", "metrics", "MODELS", "PREALIGNS",
           "Attachment", "make_attachment", "ATTACHMENTS"]
