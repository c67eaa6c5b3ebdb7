"""``python -m raysinga.cli``: the ``raysinga`` command."""

from .commands import program

program()
