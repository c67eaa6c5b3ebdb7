"""Errors that say which role failed: worker 1 of group 0, server 2, the stub of group 1.

Each actor method runs under :func:`reports_role`, so an exception raised inside an actor reaches
the driver as a :class:`RoleError` carrying the role, index and the remote traceback, whatever
chain of actors it passed through on the way.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class RoleError(RuntimeError):
    """An exception raised by the code of one role (a bug, bad data, a failed write ...)."""

    def __init__(self, role: str, index: int, group: int | None, message: str, tb: str) -> None:
        super().__init__(role, index, group, message, tb)
        self.role, self.index, self.group, self.message, self.tb = role, index, group, message, tb

    @property
    def where(self) -> str:
        g = f" of group {self.group}" if self.group is not None and self.role == "worker" else ""
        return f"{self.role} {self.index}{g}"

    def __str__(self) -> str:
        return f"{self.where} failed: {self.message}\n--- traceback in {self.where} ---\n{self.tb}"


class ActorLost(RuntimeError):
    """A role's process or node is gone (killed, crashed, node removed)."""

    def __init__(self, role: str, index: int, group: int | None, detail: str) -> None:
        super().__init__(role, index, group, detail)
        self.role, self.index, self.group, self.detail = role, index, group, detail

    def __str__(self) -> str:
        g = f" of group {self.group}" if self.group is not None and self.role == "worker" else ""
        return f"{self.role} {self.index}{g} was lost: {self.detail}"


def unwrap(e: BaseException) -> BaseException:
    """The RoleError or ActorLost inside Ray's wrappers, or ``e`` itself.

    Ray re-raises a remote exception as an instance of a class deriving from both RayTaskError and
    the original class, whose text is Ray's rendering; the original sits in ``.cause``.
    """
    for _ in range(16):
        cause = getattr(e, "cause", None)
        if cause is not None and cause is not e:
            e = cause
        elif isinstance(e, (RoleError, ActorLost)) or e.__cause__ is None:
            return e
        else:
            e = e.__cause__
    return e


def reports_role(method: F) -> F:
    """Re-raise any exception of ``method`` as a RoleError naming ``self``'s role and index."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (RoleError, ActorLost):
            raise
        except Exception as e:
            inner = unwrap(e)
            if isinstance(inner, (RoleError, ActorLost)) or _object_lost(inner):
                raise inner from None
            raise RoleError(
                self.role,
                self.index,
                getattr(self, "group", None),
                f"{type(e).__name__}: {e}",
                traceback.format_exc(),
            ) from None

    return wrapper  # type: ignore[return-value]


def _object_lost(e: BaseException) -> bool:
    """An object lost with its owner or node: a loss (the driver recovers), not a bug."""
    from ray.exceptions import ObjectLostError  # noqa: PLC0415

    return isinstance(e, ObjectLostError)


def lost_server(e: BaseException, servers: list[Any]) -> int | None:
    """Where ``e`` is an object lost (an argument a server owned), the index of the first of
    ``servers`` that is gone; else None."""
    import ray  # noqa: PLC0415
    from ray.exceptions import RayActorError  # noqa: PLC0415

    if not _object_lost(e):
        return None
    checks = [s.describe.remote() for s in servers]
    ray.wait(checks, num_returns=len(checks), timeout=10)
    for k, ref in enumerate(checks):
        try:
            ray.get(ref, timeout=0)
        except RayActorError:
            return k
        except Exception:  # noqa: BLE001 - not answering yet: not known to be lost
            continue
    return None


def get_all(
    refs: list[Any],
    role: str,
    group: int | None = None,
    timeout: float | None = None,
    indices: list[int] | None = None,
) -> list[Any]:
    """``ray.get`` of one call per ``role`` instance, naming who failed.

    ``indices[i]`` is the role index behind ``refs[i]`` (default: its position). An exception in
    a role's code arrives as its RoleError; a dead process or node as ActorLost naming the first
    instance whose call died.
    """
    import ray  # noqa: PLC0415
    from ray.exceptions import RayActorError, RayTaskError  # noqa: PLC0415

    try:
        return ray.get(refs, timeout=timeout)
    except RayTaskError as e:
        inner = unwrap(e)
        if isinstance(inner, (RoleError, ActorLost)) or _object_lost(inner):
            raise inner from None  # an object lost: an argument whose owner or node died
        text = str(e)  # Ray's own rendering carries the remote traceback
        i = _failed_index(refs)
        raise RoleError(
            role, indices[i] if indices else i, group, text.splitlines()[-1], text
        ) from None
    except RayActorError as e:
        i = _failed_index(refs)
        raise ActorLost(role, indices[i] if indices else i, group, str(e).splitlines()[0]) from None


def _failed_index(refs: list[Any]) -> int:
    """The position of the first call in ``refs`` that ended in an error (calls still
    running are not it: a server still waiting on a lost stub did not fail)."""
    import ray  # noqa: PLC0415

    unique = list(dict.fromkeys(refs))
    ended, _ = ray.wait(unique, num_returns=len(unique), timeout=0)
    ended_ids = {r.hex() for r in ended}
    for i, r in enumerate(refs):
        if r.hex() not in ended_ids:
            continue
        try:
            ray.get(r, timeout=0)
        except Exception:  # noqa: BLE001 - looking for the one that failed
            return i
    return 0


@contextlib.contextmanager
def cancelled_on_failure(calls: list[Any]) -> Iterator[None]:
    """Where one of a step's calls fails (a role lost), cancel the others: a live worker's
    call may still wait for an argument whose owner was on a host that went silent, and would
    hold every later call to that worker behind it until Ray gives the owner up (a minute or
    more on a real network, measured on emulated hosts)."""
    try:
        yield
    except Exception:
        cancel(calls)
        settle(calls)
        raise


def settle(calls: list[Any], timeout_s: float = 60.0) -> None:
    """Fetch, on a thread of their own, the results of ``calls`` (refs) that a failure left
    behind, once they end (within ``timeout_s``), and drop them: a call that ends in an error
    nobody fetched makes Ray print its traceback as an unhandled error. Those errors are the
    loss already reported (the lost role's death, its peers' serve loops aborted by the
    recovery), not news."""
    import threading  # noqa: PLC0415

    import ray  # noqa: PLC0415

    refs = list(dict.fromkeys(calls))
    if not refs:
        return

    def fetch() -> None:
        with contextlib.suppress(Exception):
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            for ref in ready:
                with contextlib.suppress(Exception):
                    ray.get(ref)

    threading.Thread(target=fetch, name="raysinga-settle", daemon=True).start()


def cancel(calls: list[Any]) -> None:
    """Cancel ``calls`` (refs), those not yet run; a role's running call ends when the
    recovery aborts it (:class:`.doorbell.Abortable`)."""
    import ray  # noqa: PLC0415

    for ref in calls:
        with contextlib.suppress(Exception):
            ray.cancel(ref)
