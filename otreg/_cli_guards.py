"""What every ``otreg`` command does around its work: refuse an output folder before any
work, show warnings as plain lines, decide on progress bars, and keep stdout for the
command's own output (``--json``)."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import click

from ._progress import progress_wanted

__all__ = [
    "OUTPUTS",
    "PICTURES",
    "output_folder",
    "warnings_as_lines",
    "progress_wanted",
    "progress_option",
    "stdout_to_stderr",
]

OUTPUTS = ("warped.vtk", "parameters.npz", "registration.json")
PICTURES = ("picture.png", "history.png")


@contextlib.contextmanager
def output_folder(
    output: str, inputs: list[str], picture: bool, extra: tuple[str, ...] = ()
) -> Iterator[Path]:
    """Refuse, before any work, an output folder that cannot be one, cannot be written
    (it is created if missing) or whose files would replace an input. A folder created
    here is removed again, if still empty, when the command fails."""
    from .io import check_writable_folder, remove_empty_folders, same_file

    folder = Path(output)
    if folder.exists() and not folder.is_dir():
        raise click.BadParameter(f"{output} exists and is not a folder", param_hint="-o")
    names = OUTPUTS + (PICTURES if picture else ()) + extra
    for name in names:
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
    try:
        yield folder
    except BaseException:
        remove_empty_folders(created)
        raise


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
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # pragma: no cover - no C library here
        pass


#: --progress/--no-progress, shared by the commands that run registrations.
progress_option = click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress bars on stderr [default: when stderr is a terminal].",
)
