"""What a node's Python can import, asked by a task shipped by value (its own module's import
must not be what fails). Imports nothing of raysinga at module level."""

from __future__ import annotations

NEEDED = (
    "numpy",
    "msgpack",
    "pyarrow",
    "raysinga",
    "raysinga.actors.worker",
    "raysinga.actors.server",
    "raysinga.actors.stub",
)


def probe(modules: tuple[str, ...] = NEEDED) -> dict[str, str]:
    """The node's address, its Python, and the first module of ``modules`` that cannot be
    imported there, with why (``module`` empty where every one imports)."""
    import importlib  # noqa: PLC0415
    import socket  # noqa: PLC0415
    import sys  # noqa: PLC0415

    found = {"host": socket.gethostname(), "python": sys.executable, "module": "", "why": ""}
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported by name, not raised on the node
            found.update(module=name, why=f"{type(e).__name__}: {e}")
            break
    return found
