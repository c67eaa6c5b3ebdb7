"""The ``raysinga`` command line: ``train``, ``inspect``, ``verify``, ``export``, ``plot``,
``generate``, ``graph``, ``runs``, ``status`` and ``tune``. Nothing in the library imports it."""

from __future__ import annotations

from .commands import main, program

__all__ = ["main", "program"]
