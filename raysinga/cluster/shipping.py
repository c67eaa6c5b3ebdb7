"""raysinga's own code, handed to the roles of a run on a cluster, and a check that every node
can run them.

A node of a Ray cluster needs Python, Ray and raysinga's dependencies; raysinga itself comes
with the run, as a Ray job brings its code through a runtime environment. The package is
assembled as one directory ``raysinga`` (with ``raysinga.actors``, ``raysinga.kernels`` and the
kernels' ``.cu`` sources, wherever the install keeps them) in a cache keyed by its content, and
handed to Ray as ``py_modules`` when the run joins a cluster. Before any role is spawned, a
small task on each live node imports what the roles import; a node where that fails stops the
run with one line naming the node, the module and what to do.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Imported with this module, not when the nodes are probed: in a Ray job, that lazy import, made
# after the driver had joined the cluster, now and then failed to find the module in the job's
# working directory (tests/examples/test_cluster_job.py; the cause inside Ray is not known).
from . import node_probe

SUFFIXES = (".py", ".cu")
PROBE_S = 120.0  # a node's first Python worker may wait for its runtime environment


class NodeSetupError(RuntimeError):
    """A node of the cluster cannot run raysinga's roles; the message says which and why."""


def package_files() -> list[tuple[Path, Path]]:
    """(source, path inside the assembled ``raysinga``) of every file the roles need."""
    # Found, not imported: shipping needs where the packages are, not what they run.
    roots = {
        Path(rel): Path(importlib.util.find_spec(name).origin).parent
        for rel, name in (
            ("", "raysinga"),
            ("actors", "raysinga.actors"),
            ("kernels", "raysinga.kernels"),
        )
    }
    files = []
    for prefix, root in roots.items():
        for f in sorted(root.rglob("*")):
            rel = f.relative_to(root)
            if f.suffix not in SUFFIXES or "__pycache__" in rel.parts or not f.is_file():
                continue
            if prefix == Path() and rel.parts[0] in ("actors", "kernels"):
                continue  # an installed wheel keeps them inside: taken from their own roots
            files.append((f, prefix / rel))
    return files


def assembled(cache: Path | None = None) -> Path:
    """The directory ``raysinga`` as the roles import it, built once per content in
    ``cache`` (default: the user's cache directory)."""
    files = package_files()
    digest = hashlib.sha256()
    for src, rel in files:
        digest.update(str(rel).encode() + b"\0" + src.read_bytes() + b"\0")

    def fill(tmp: Path) -> None:
        for src, rel in files:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tmp / rel)

    return _built_once((cache or _cache_dir()) / digest.hexdigest()[:20] / "raysinga", fill)


def _built_once(dest: Path, fill: Callable[[Path], Any]) -> Path:
    """The directory ``dest``, made by ``fill(tmp)`` into a temporary directory beside it
    where it is not there yet, then renamed: whole or not at all (another run may have built
    it meanwhile)."""
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    fill(tmp)
    try:
        tmp.rename(dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(root) / "raysinga" / "code"
    try:
        path.mkdir(parents=True, exist_ok=True)
        return path
    except OSError:  # no writable home: the machine's temporary directory
        return Path(tempfile.gettempdir()) / f"raysinga-code-{os.getuid()}"


def runtime_env(modules: Sequence[str] = (), own: bool = True) -> dict[str, Any] | None:
    """The runtime environment that brings raysinga's code (``own``) and the job's
    ``modules`` (:mod:`raysinga.nn.usercode`) to every role; None where there is nothing to
    bring, or where the job already hands Ray modules of its own (Ray refuses a second list:
    the job's must then hold them, or the nodes must have them installed)."""
    job = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if job:
        with_modules = json.loads(job).get("runtime_env", {}).get("py_modules")
        if with_modules:
            return None
    shipped = ([str(assembled())] if own else []) + user_packages(modules)
    return {"py_modules": shipped} if shipped else None


def role_env(modules: Sequence[str]) -> dict[str, Any] | None:
    """The runtime environment, beyond the job's, that lets the roles import the job's
    ``modules`` where Ray was started by other code than the run (which then could not hand
    them to Ray as it connected, and Ray takes directories to upload only from ``ray.init``):
    their directories on ``PYTHONPATH``, before this process's own. A node where those
    directories are not (another machine) cannot import them: the node check names the module
    (:func:`check_nodes`). None without modules."""
    if not modules:
        return None
    dirs = list(dict.fromkeys(str(Path(m).parent) for m in modules))
    given = os.environ.get("PYTHONPATH")
    return {"env_vars": {"PYTHONPATH": os.pathsep.join([*dirs, *([given] if given else [])])}}


def user_packages(modules: Sequence[str], cache: Path | None = None) -> list[str]:
    """The directories Ray ships for the job's ``modules``: a package directory as it is; a
    ``.py`` file as a package of its own name (its text as ``__init__.py``), built once per
    content in ``cache``, so that it imports by the same name on every node."""
    out = []
    for m in modules:
        p = Path(m)
        if p.is_dir():
            out.append(str(p))
            continue
        text = p.read_bytes()
        base = (cache or _cache_dir()) / ("user-" + hashlib.sha256(text).hexdigest()[:20])
        dest = _built_once(base / p.stem, lambda tmp, t=text: (tmp / "__init__.py").write_bytes(t))
        out.append(str(dest))
    return out


def check_nodes(
    timeout_s: float = PROBE_S,
    skip: frozenset[str] = frozenset(),
    modules: Sequence[str] = (),
    env: dict[str, Any] | None = None,
) -> None:
    """Import what the roles import, and the job's ``modules`` (by name), on every live node
    but ``skip`` (nodes found unreachable), at once; raise NodeSetupError naming the first node
    that cannot, the module and what to do. A node that Ray gives up meanwhile is passed
    over. ``env``: the runtime environment the roles get beyond the job's (:func:`role_env`)."""
    import ray  # noqa: PLC0415
    from ray import cloudpickle  # noqa: PLC0415
    from ray.exceptions import GetTimeoutError, RayError  # noqa: PLC0415
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    cloudpickle.register_pickle_by_value(node_probe)  # the node need not import it to run it
    from raysinga.nn.usercode import module_name  # noqa: PLC0415

    task = ray.remote(num_cpus=0, max_retries=0)(node_probe.probe)
    own = tuple(module_name(m) for m in modules)
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in skip]
    refs = [
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
            **({"runtime_env": env} if env else {}),
        ).remote(node_probe.NEEDED + own)
        for n in nodes
    ]
    for ref, node in zip(refs, nodes, strict=True):
        where = f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]})"
        try:
            found = ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            raise NodeSetupError(
                f"{where} did not start a Python worker within {timeout_s:g} s (its runtime "
                "environment may still be installing; `ray status` shows the node)"
            ) from None
        except RayError as e:
            if not _alive(node["NodeID"]):
                continue  # gone meanwhile: no role will be placed there
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise NodeSetupError(f"{where} cannot run raysinga's roles: {first}") from None
        if found["module"]:
            raise NodeSetupError(
                f"{where} cannot import {found['module']} with {found['python']} "
                f"({found['why']}): {_remedy(found['module'], found.get('missing', ''), own)}"
            )


def _alive(node_id: str) -> bool:
    import ray  # noqa: PLC0415

    return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())


def _remedy(module: str, missing: str = "", own: tuple[str, ...] = ()) -> str:
    """What to do where ``module`` failed to import on a node, ``missing`` the module it
    found missing (empty where it failed otherwise)."""
    if module in own and missing.split(".")[0] in ("", module.split(".")[0]):
        return (
            "the job's `modules` names it, and a run ships it where it starts or joins Ray "
            "(unless --no-ship); where your own code started Ray, give ray.init "
            "runtime_env={'py_modules': [...]} with it, or install it in that node's Python"
        )
    if (missing or module).split(".")[0] == "raysinga":
        return (
            "install raysinga on that node, or let the run ship its code there (the default "
            "when joining a cluster; --no-ship turns it off)"
        )
    if not missing:  # it is there, and failed as it loaded: not a missing package
        return "repair that package in that node's Python, then start the node again"
    return (
        f"{missing} is missing there: pip install {node_probe.pip_name(missing)} in that node's "
        "Python, then start the node again (ray start --address=...); docs/cluster.md lists "
        "what a node needs"
    )
