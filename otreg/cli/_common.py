"""What the ``otreg`` commands share: the output folder refused before any work, warnings
as plain lines, stdout kept for ``--json``, ``--progress``, and the flags declared once: the
registration options (the fields of :class:`~otreg.batch.job.JobOptions`) and the volume
options (``--label``, ``--level``)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import click
import torch

from .._checks import check_device
from .._info import usable_cores
from ..batch.dispatch import sigterm_as_interrupt
from ..batch.job import JOB_FILES, JOB_LOSSES, JOB_OPTION_NAMES, JobOptions
from ..batch.worker import STAGING_PREFIX
from ..io import (
    VOLUME_EXTS,
    VOLUME_SMOOTH,
    check_writable_folder,
    remove_empty_folders,
    replace_recorded_outputs,
    same_file,
)
from ..registration.options import MODELS, PREALIGNS, LBFGSOptions

__all__: list[str] = []


@contextlib.contextmanager
def output_folder(output: str, inputs: list[str], extra: tuple[str, ...] = ()) -> Iterator[Path]:
    """Refuse, before any work, an output folder that cannot be one, cannot be written
    (it is created if missing) or whose files would replace an input; then yield a hidden
    staging folder inside it for the command's files.

    When the command ends well its files replace an earlier job's in the folder, and the
    files that the earlier run recorded writing (in :data:`~otreg.io.OUTPUTS_RECORD`) and
    this one did not write are removed, so that the folder holds one run's results; any
    other file (the user's, an input) is never touched, whatever its name. When it fails or
    is interrupted (Ctrl-C, or SIGTERM, which raises KeyboardInterrupt here)
    the staging folder goes, the folder is as it was, and removed if this command made it."""
    folder = Path(output).expanduser()
    if folder.exists() and not folder.is_dir():
        raise click.BadParameter(f"{output} exists and is not a folder", param_hint="-o")
    for name in (*JOB_FILES.values(), *extra):
        for given in inputs:
            if same_file(folder / name, given):
                raise click.BadParameter(
                    f"writing {name} into {output} would replace the "
                    f"input {given}; choose another folder",
                    param_hint="-o",
                )
    try:
        created = check_writable_folder(folder, "otreg")
    except (PermissionError, ValueError) as err:
        raise click.BadParameter(str(err).removeprefix("otreg: "), param_hint="-o") from err
    for old in folder.glob(STAGING_PREFIX + "*"):  # a killed run's
        shutil.rmtree(old, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=folder))
    try:
        with sigterm_as_interrupt():
            yield staging
        _publish(staging, folder, inputs)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        remove_empty_folders(created)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, folder: Path, inputs: list[str]) -> None:
    """Move the staged files into ``folder``, then remove the files that the earlier run
    recorded writing and this one did not replace (never an input), and record this run's
    (:func:`otreg.io.replace_recorded_outputs`), with Ctrl-C and SIGTERM held until it is
    done (then raised), so that the folder never mixes two runs."""
    new = {p.name for p in staging.iterdir()}
    with _signals_held():
        for name in sorted(new):
            os.replace(staging / name, folder / name)
        replace_recorded_outputs(folder, new, inputs)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """While active (in the main thread), SIGINT and SIGTERM wait: the first one received
    is raised as KeyboardInterrupt at the end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in held}
    for s in held:
        signal.signal(s, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    if caught:
        raise KeyboardInterrupt


@contextlib.contextmanager
def warnings_as_lines() -> Iterator[None]:
    """Show warnings as 'warning: message' lines on stderr, without Python's file and line
    of source (click's own, for warnings raised in a command)."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        click.echo(f"warning: {message}", err=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


@contextlib.contextmanager
def stdout_to_stderr(active: bool) -> Iterator[None]:
    """While active, send what libraries print (KeOps' compilation messages, C code writing
    to file descriptor 1) to stderr, so that stdout carries only the command's output."""
    if not active:
        yield
        return
    sys.stdout.flush()
    _flush_c_stdio()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no file descriptors 1 and 2: Python's stdout only
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            _flush_c_stdio()
            os.dup2(saved, 1)
            os.close(saved)


def _flush_c_stdio() -> None:
    """Flush the C library's buffered stdout, so that it goes where fd 1 points now."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # pragma: no cover - no C library here
        pass


#: --threads, for the commands that run one registration in this process.
threads_option = click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Torch threads [default: torch's, one a core, at most the CPUs this process may "
    "use]. Beside other busy processes, fewer "
    "threads than cores can be faster (a registration took 29 s with 1 thread where the "
    "default took 76 s, with two other processes on 2 cores).",
)


def _device(ctx, param, value):
    """The name's form only: whether the device is there is checked where the work runs."""
    try:
        kind = None if value is None else torch.device(value).type
    except (RuntimeError, TypeError):
        kind = "?"
    if kind not in (None, "cpu", "cuda"):
        raise click.BadParameter(f"{value!r}; give cpu, cuda or cuda:N")
    return value


def check_local_device(device: str | None) -> None:
    """For a command that registers in this process: --device is here (a batch's workers
    check theirs where they run), as a usage error naming the option."""
    try:
        check_device("--device", device)
    except ValueError as err:
        message = str(err).removeprefix("--device: ")
        raise click.BadParameter(message, param_hint="'--device'") from err


#: --device, for the commands that run registrations.
device_option = click.option(
    "--device",
    default=None,
    callback=_device,
    help="Where to register: cpu, cuda (a batch's workers spread over the GPUs) or cuda:N "
    "[default: cpu].",
)


def set_threads(threads: int | None) -> None:
    """Apply --threads (torch's intra-op threads); without it, torch's default (one a core
    of the machine, or of the affinity) at most the CPUs this process may use (a CPU quota,
    :func:`otreg._info.usable_cores`)."""
    if threads is None:
        threads = min(torch.get_num_threads(), usable_cores())
    torch.set_num_threads(threads)


#: --progress/--no-progress, shared by the commands that run registrations.
progress_option = click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress bars on stderr [default: when stderr is a terminal].",
)


#: --smooth, for the commands that read surfaces (``register``, ``batch``, ``bids``,
#: ``distance``)
smooth_option = click.option(
    "--smooth",
    type=click.IntRange(min=0),
    help=f"Taubin smoothing iterations for the inputs as read [default: {VOLUME_SMOOTH} for "
    "a surface made from a volume, none for a mesh; 0 keeps a volume's voxel steps].",
)


def registration_options(f):
    """The flags of the fields of :class:`~otreg.batch.job.JobOptions`, declared once for
    ``register``, ``batch`` and ``bids``. Each defaults to None, 'not given', so that a
    manifest row's own options can win; :func:`job_options` fills in JobOptions'
    defaults (shown in the help)."""
    d = JobOptions()
    options = [
        click.option(
            "--model", type=click.Choice(MODELS), help=f"Deformation model [default: {d.model}]."
        ),
        click.option(
            "--prealign",
            type=click.Choice(PREALIGNS),
            help=f"Linear pre-alignment [default: {d.prealign}].",
        ),
        click.option(
            "--loss",
            type=click.Choice(JOB_LOSSES),
            help="Data term at every level [default: sinkhorn at the coarse level, "
            "varifold at the fine one].",
        ),
        click.option(
            "--sigma",
            type=click.FloatRange(min=0, min_open=True),
            help="LDDMM kernel width, mm [default: two widths, a tenth and a 27th of the "
            "target's size].",
        ),
        click.option(
            "--points",
            type=click.IntRange(min=100),
            help="Decimate both surfaces to about this many vertices first (the warped "
            "surface written is still the whole source).",
        ),
        smooth_option,
        click.option(
            "--max-iter",
            type=click.IntRange(min=1),
            help=f"L-BFGS iterations a level [default: {LBFGSOptions().max_iter}].",
        ),
        click.option(
            "--refine/--no-refine",
            default=None,
            help="After the LDDMM fit, fit a narrower one on what is left [default: on].",
        ),
        click.option(
            "--picture/--no-picture",
            default=None,
            help="Draw picture.png and history.png [default: on].",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def given_registration_options(kw: dict) -> dict:
    """The registration flags that were given (not None), by :class:`JobOptions` field."""
    return {name: kw[name] for name in JOB_OPTION_NAMES if kw.get(name) is not None}


def job_options(kw: dict) -> JobOptions:
    """JobOptions from the registration flags given, defaults for the others."""
    return JobOptions.from_mapping(given_registration_options(kw), "otreg")


def volume_options(f):
    """--label and --level: which structure of a volume input becomes a surface."""
    f = click.option(
        "--level",
        type=float,
        help="Threshold of probability maps, in the map's own units (volumes only).",
    )(f)
    return click.option(
        "--label", type=float, help="Segmentation label (for the inputs that are volumes)."
    )(f)


def check_volume_options(label: float | None, level: float | None, paths: list[str]) -> None:
    """--label and --level apply to volumes: refuse them when no input is one, and
    refuse both at once."""
    given = [name for name, value in (("--label", label), ("--level", level)) if value is not None]
    if len(given) == 2:
        raise click.UsageError(
            "give --label (a segmentation value) or --level (a threshold of a probability "
            "map), not both"
        )
    if given and not any(Path(p).name.lower().endswith(VOLUME_EXTS) for p in paths):
        raise click.UsageError(
            f"{given[0]} applies to volumes ({', '.join(VOLUME_EXTS)}); "
            f"{' and '.join(paths)} {'is not one' if len(paths) == 1 else 'are not'}: "
            f"leave {given[0]} out for meshes and point clouds"
        )


class Command(click.Command):
    """An otreg command: its usage errors (click's checks of options and arguments) exit
    with 1, as the command's own checks of its inputs do (3 says a batch had failed pairs
    or a distance did not converge, so 2 is not used)."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as err:
            err.exit_code = 1
            raise

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as err:
            err.exit_code = 1
            raise
