"""Joining the Ray cluster a run uses, or starting an embedded one: ``RAY_ADDRESS``, an
address given, or the cluster ``ray start`` runs on this machine, as Ray finds it; an address
nothing answers at fails at once instead of retrying for ever."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

from raysinga.kernels.cpu_threads import BLAS_ENV

from . import reaper


class ConnectError(RuntimeError):
    """The cluster named cannot be reached or joined."""


def joins_cluster(address: str | None = None) -> bool:
    """Whether :func:`connect` joins a running cluster (``address``, ``RAY_ADDRESS``, or the
    one ``ray start`` runs on this machine) rather than starting an embedded local Ray
    (``local``, as Ray spells it, asks for the embedded one even where a cluster runs)."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        return address != "local"
    try:  # where ray.init() finds the cluster `ray start` left its address for
        from ray._private.services import find_bootstrap_address  # noqa: PLC0415

        return bool(find_bootstrap_address(None))
    except Exception:  # noqa: BLE001 - Ray's internals moved: as if there were none
        return False


def connect(address: str | None = None, runtime_env: dict[str, Any] | None = None) -> str:
    """Join the cluster at ``address`` / ``RAY_ADDRESS`` (else the one ``ray start`` runs on
    this machine, as Ray does), or start an embedded local one; ``runtime_env``: what every
    task and actor of this driver gets. Nothing where Ray is already initialized. Returns
    the line that says which Ray the run uses."""
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        return f"raysinga: Ray: the one this process already uses ({_gcs_address()})"
    embedded = not joins_cluster(address)
    why = (
        "the address given"
        if address
        else "RAY_ADDRESS"
        if os.environ.get("RAY_ADDRESS")
        else "the cluster `ray start` runs on this machine"
    )
    address = "local" if embedded else address or os.environ.get("RAY_ADDRESS")
    if address and not embedded:
        _check_reachable(address)
    kwargs: dict[str, Any] = {"include_dashboard": False} if embedded else {}
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    before = reaper.children(os.getpid()) if embedded else set()
    try:
        with _process_env(BLAS_ENV if embedded else {}):
            ray.init(address=address, log_to_driver=True, **kwargs)
    except ConnectionError as e:
        # The port answered, so the likeliest cause is the token of a cluster with token
        # authentication on, which a driver given an address sends only with RAY_AUTH_MODE
        # set (Ray logs "InvalidAuthToken" but does not put it in the exception).
        hint = (
            "; where the cluster has token authentication on, set RAY_AUTH_MODE=token (and its "
            "token: ~/.ray/auth_token)"
            if not os.environ.get("RAY_AUTH_MODE")
            else ""
        )
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConnectError(f"cannot join the Ray cluster at {address}: {first}{hint}") from e
    if embedded:  # its processes end with this one, even killed outright
        reaper.follow(reaper.children(os.getpid()) - before)
        return f"raysinga: Ray: started an embedded local Ray ({_gcs_address()})"
    return f"raysinga: Ray: joined the cluster at {_gcs_address()} ({why})"


def _gcs_address() -> str:
    import ray  # noqa: PLC0415

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - Ray's API moved: the line goes without it
        return "address unknown"


@contextlib.contextmanager
def _process_env(env: dict[str, str]):
    """``env`` in this process's environment, for the processes started meanwhile (the
    embedded Ray's, whose workers inherit it), where it does not set those names itself."""
    added = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail at once on a ``host:port`` nothing answers at: Ray itself retries for ever."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", "local", ray:// client addresses: Ray's to resolve
    try:
        host = host.strip("[]") or "127.0.0.1"  # "[::1]:6379": an IPv6 literal
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConnectError(
            f"cannot reach the Ray cluster at {address}: {e.strerror or e} (is `ray start "
            "--head` running there? --address and RAY_ADDRESS take the head's host:port)"
        ) from None


def host_answers(address: tuple[str, int], timeout_s: float) -> bool:
    """Whether a host answers a TCP connection to ``address`` within ``timeout_s``. A host
    that is up answers from its kernel however busy its processes are (a refusal is an answer
    too); a machine gone, or cut off, does not."""
    try:
        socket.create_connection(address, timeout=timeout_s).close()
        return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def unreachable_nodes(timeout_s: float = 1.0) -> dict[str, str]:
    """The nodes Ray counts alive whose hosts do not answer a connection to their raylet
    within ``timeout_s`` (Ray's id -> address): machines gone or cut off that Ray has not
    given up yet (it takes about a minute with its defaults). Tried all at once."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    import ray  # noqa: PLC0415

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    addresses = [(n["NodeManagerAddress"], int(n["NodeManagerPort"])) for n in nodes]
    with ThreadPoolExecutor(max(1, min(16, len(nodes)))) as pool:
        answers = list(pool.map(lambda a: host_answers(a, timeout_s), addresses))
    return {n["NodeID"]: a[0] for n, a, ok in zip(nodes, addresses, answers, strict=True) if not ok}
