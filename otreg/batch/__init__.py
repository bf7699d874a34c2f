"""Many registrations at once: a manifest of pairs, resume keys and locks, worker processes
(local or on a Dask cluster), per-pair records and the group report."""

from .bids import SubjectInput, bids_pairs, find_inputs, write_dataset_description
from .engine import BatchResult, Planned, plan_batch, run_batch
from .job import JobOptions, run_job
from .manifest import Pair, all_pairs, pairs_to_template, read_manifest, write_manifest
from .records import FAILURE_CLASSES, FORMAT, find_records, read_record
from .report import build_report

__all__ = [
    "JobOptions",
    "run_job",
    "run_batch",
    "plan_batch",
    "BatchResult",
    "Planned",
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
