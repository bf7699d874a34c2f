"""Many registrations at once: a manifest of pairs, resume keys and locks, worker processes
(local or on a Dask cluster), per-pair records and the group report."""

from .bids import SubjectInput, find_inputs
from .derivatives import bids_pairs, write_dataset_description
from .manifest import Pair, all_pairs, pairs_to_template, read_manifest, write_manifest
from .records import FAILURE_CLASSES, FORMAT, find_records, read_record
from .report import build_report

__all__ = [
    "Pair",
    "read_manifest",
    "write_manifest",
    "pairs_to_template",
    "all_pairs",
    "FORMAT",
    "FAILURE_CLASSES",
    "find_records",
    "read_record",
    "build_report",
    "SubjectInput",
    "find_inputs",
    "bids_pairs",
    "write_dataset_description",
]
