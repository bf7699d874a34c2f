"""Shared by the benchmark scripts: fresh-process workers, peak RSS, tables, the record."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "benchmarks.md"


def installed_data(package: str) -> Path | None:
    """The ``data`` folder inside an installed package (data read in place), or None."""
    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_worker(
    script: str,
    args: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    flag: str = "--worker",
    progress: bool = False,
) -> dict:
    """Run ``python script --worker ARGS`` in a fresh process; return its JSON (or an error).

    ``env`` adds environment variables for the worker (e.g. glibc malloc settings); ``flag``
    replaces ``--worker`` for a script with several kinds of worker; ``progress``: the
    worker's stderr goes to this process's as it comes (rows printed there survive a
    timeout) instead of into the error message.
    """
    cmd = [sys.executable, script, flag, *args]
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    stderr = None if progress else subprocess.PIPE
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    lines = (proc.stderr or "").strip().splitlines()
    return {"error": (lines or [f"no output (exit status {proc.returncode})"])[-1][:200]}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table; columns are (key, header, format)."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            cells.append("" if value is None else (fmt.format(value) if fmt else str(value)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def publish(title: str, body: str, save: bool, variant: str = "") -> None:
    """Print a result; with ``save``, record it in docs/benchmarks.md with the machine and
    the command that made it. ``variant`` names a run of a subset (some sizes, methods or
    pairs): it is recorded as a section of its own, so that it never replaces the full run.
    """
    print(body)
    if save:
        script = Path(sys.argv[0]).name
        command = shlex.join(["python", f"benchmarks/{script}", *sys.argv[1:]])
        record(f"{title}: {variant}" if variant else title, command, body)


def record(title: str, command: str, body: str) -> None:
    """Write a section into docs/benchmarks.md: it replaces the section of the same title
    (the history stays in git), or is appended when there is none."""
    stamp = datetime.date.today().isoformat()
    section = (
        f"## {title}\n\nRecorded: {stamp}. Machine: {machine()}\n\nCommand: `{command}`\n\n{body}\n"
    )
    RECORD.parent.mkdir(exist_ok=True)
    text = RECORD.read_text() if RECORD.exists() else "# Benchmarks\n"
    head, *sections = re.split(r"\n(?=## )", text)
    for k, old in enumerate(sections):
        if old.split("\n", 1)[0] == f"## {title}":
            sections[k] = section
            break
    else:
        sections.append(section)
    RECORD.write_text("\n".join([head.rstrip("\n") + "\n", *sections]))
