"""What a node's Python can import, asked by a task shipped by value (its own module's import
must not be what fails). Imports nothing of raysinga at module level."""

from __future__ import annotations

# What a node's Python needs beside Ray when the run ships raysinga: the packages of
# raysinga's dependencies that its roles import (the others serve the driver: the job's
# schema files, event files, tracking). Import name -> the name pip installs it by.
# docs/cluster.md lists them; tests/cluster/test_node_packages.py trains on a node that has
# only these and Ray.
NODE_PACKAGES = {
    "numpy": "numpy",
    "msgpack": "msgpack",
    "pyarrow": "pyarrow",
    "yaml": "pyyaml",
    "pydantic": "pydantic",
    "xxhash": "xxhash",
    "threadpoolctl": "threadpoolctl",
}
ROLE_MODULES = ("raysinga.actors.worker", "raysinga.actors.server", "raysinga.actors.stub")
# the dependencies first, so that a missing one is named as itself
NEEDED = (*NODE_PACKAGES, "raysinga", *ROLE_MODULES)


def probe(modules: tuple[str, ...] = NEEDED) -> dict[str, str]:
    """The node's address, its Python, and the first module of ``modules`` that cannot be
    imported there, with why (``module`` empty where every one imports) and, where a module it
    imports is not there, that module's name (``missing``: ``ml_dtypes`` where importing
    ``raysinga.actors.worker`` needed it)."""
    import importlib  # noqa: PLC0415
    import socket  # noqa: PLC0415
    import sys  # noqa: PLC0415

    found = {"host": socket.gethostname(), "python": sys.executable, "module": "", "why": ""}
    found["missing"] = ""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported by name, not raised on the node
            found.update(module=name, why=f"{type(e).__name__}: {e}")
            if isinstance(e, ModuleNotFoundError) and e.name:
                found["missing"] = e.name
            break
    return found


def pip_name(module: str) -> str:
    """The name pip installs the top-level package of ``module`` by."""
    top = module.split(".")[0]
    return NODE_PACKAGES.get(top, top)


def look(expect: list[dict[str, object]]) -> dict[str, object]:
    """The node's address and, for each of ``expect``, what is wrong with the path it names
    as this node sees it (empty where nothing is). An entry is ``{"path": P}`` plus one of
    ``"token"`` (P must hold exactly that text: a file the driver wrote where storage should
    be shared) or ``"size"`` and ``"head"`` (a data file: its size, and the SHA-256 of its first
    ``HEAD_BYTES``, as the driver read them); ``"write": True`` also asks that P's directory
    be writable here."""
    import hashlib  # noqa: PLC0415
    import os  # noqa: PLC0415
    import socket  # noqa: PLC0415

    found: list[str] = []
    for e in expect:
        path = str(e["path"])
        try:
            if "token" in e:
                with open(path, encoding="utf-8") as f:
                    why = "" if f.read() == e["token"] else "holds another file"
            else:
                with open(path, "rb") as f:
                    head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()
                    size = os.fstat(f.fileno()).st_size
                why = (
                    ""
                    if (size, head) == (e["size"], e["head"])
                    else f"is another file here ({size:,} bytes; the driver's has {e['size']:,})"
                )
            if not why and e.get("write") and not os.access(os.path.dirname(path), os.W_OK):
                why = "cannot be written here"
        except OSError as err:
            why = f"is not there ({err.strerror or err})"
        found.append(why)
    return {"host": socket.gethostname(), "found": found}


HEAD_BYTES = 1 << 20  # how much of a data file is compared: enough to tell two files apart
