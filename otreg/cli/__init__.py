"""The ``otreg`` command line (click): the group and ``info`` here; the commands in
:mod:`~otreg.cli.ot` (``distance``), :mod:`~otreg.cli.register` (``register``, ``demo``),
:mod:`~otreg.cli.batch` (``batch``, ``manifest``, ``report``) and :mod:`~otreg.cli.bids`
(``bids``); what they share in :mod:`~otreg.cli._common`."""

from __future__ import annotations

import click

from .._info import info as show_info
from ._common import Command
from .batch import batch, manifest, report
from .bids import bids
from .ot import distance
from .register import demo, register_cmd, transfer

__all__ = ["main"]


class _Group(click.Group):
    """click's group, but Ctrl-C (or SIGTERM, which the commands raise as
    KeyboardInterrupt) exits with 130, as shells expect and ``otreg batch`` documents,
    instead of click's "Aborted!" and 1. The commands leave no partial output."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("otreg: interrupted; nothing partial was left", err=True)
            ctx.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="otreg")
def main() -> None:
    """Optimal transport and registration on PyTorch, within a memory budget.

    Exit codes, of every command: 0 done; 1 an error, named on stderr (a bad option, a
    missing or unreadable input); 3 done in part (a batch with failed pairs, a distance
    printed though the solver stopped short of --tol); 130 interrupted (nothing partial
    is left).
    """


@main.command(cls=Command)
@click.option("--no-keops", is_flag=True, help="Do not compile a test formula with KeOps.")
def info(no_keops: bool) -> None:
    """Versions, the backends that work here and the KeOps cache folder."""
    show_info(check_keops=not no_keops)


for command in (distance, register_cmd, demo, transfer, batch, bids, manifest, report):
    main.add_command(command)
