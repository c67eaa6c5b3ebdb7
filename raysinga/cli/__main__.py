"""``python -m raysinga.cli``: the ``raysinga`` command."""

from .main import program

program()
