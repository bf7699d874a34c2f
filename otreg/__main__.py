"""``python -m otreg``: the command line."""

from .cli import main

main()
