"""``python -m kvlab`` = the ``kvlab`` command."""

from kvlab.cli import entry

entry()
