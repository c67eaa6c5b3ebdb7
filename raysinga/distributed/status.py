"""A live run's status, for ``raysinga status``: every role with its node, its state
(``stepping``, ``recovering``, ``spare``; the run's, once it finished or stopped) and the
group's last step time; the run's state and
step, its latest checkpoint and the recoveries so far.

Made from what the run already knows: the events the controller emits (:mod:`raysinga.obs.events`)
and what the roles said of themselves when they started (their nodes). The driver writes it to
``<run_dir>/status.json`` (atomically: a reader never sees half of it) at each event that
changes it; ``raysinga status RUN_DIR`` reads it, on the driver's node or wherever the run
directory is seen. On Ray it also puts the same into the cluster's key-value store (Ray's GCS,
namespace :data:`NAMESPACE`), where ``raysinga status NAME --address HOST:PORT`` reads it from
any machine that reaches the cluster (:func:`read_live`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raysinga.actors.traffic import HostNames
from raysinga.obs.events import (
    CheckpointCommitted,
    Event,
    Recovered,
    RoleLost,
    RunStarted,
    StateChanged,
    TrainStep,
)

FILE = "status.json"
NAMESPACE = "raysinga"  # of the cluster's key-value store: each run's status under status/NAME
CONNECT_S = 5.0  # how long ``--address`` waits for the cluster's GCS to answer at all


class RunStatus:
    """The driver's subscriber that keeps ``status.json`` up to date. ``roles()``: the run's
    role group now (None before there is one), ``spares()``: the spares' nodes by kind."""

    def __init__(
        self,
        run: str,
        run_dir: Path,
        roles: Callable[[], Any],
        spares: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> None:
        self.path = Path(run_dir) / FILE
        self.roles, self.spares = roles, spares
        self.address = HostNames()
        self.status: dict[str, Any] = {
            "run": run,
            "pid": os.getpid(),
            "state": "starting",
            "step": 0,
            "total": None,
            "step_ms": None,
            "samples_per_s": None,
            "checkpoint": None,
            "recoveries": [],
            "recovering": [],
            "roles": [],
            "updated": time.time(),
        }

    def __call__(self, ev: Event) -> None:
        st = self.status
        if isinstance(ev, RunStarted):
            st.update(state="starting", step=ev.step, total=ev.total)
        elif isinstance(ev, StateChanged):
            st.update(state=ev.state, step=max(st["step"], ev.step))
        elif isinstance(ev, TrainStep):
            st.update(step=ev.step, total=ev.total, samples_per_s=ev.samples_per_s)
            st["step_ms"] = (ev.ms or {}).get("total")
        elif isinstance(ev, RoleLost):
            st["state"] = "recovering"
            lost = {"role": ev.role, "index": ev.index, "group": ev.group, "step": ev.step}
            st["recovering"].append({**lost, "error": ev.error})
        elif isinstance(ev, Recovered):
            info = ev.info
            st["recoveries"].append(
                {k: info.get(k) for k in ("step", "role", "index", "group", "recovery")}
            )
            st["recovering"] = []
        elif isinstance(ev, CheckpointCommitted):
            st["checkpoint"] = {"step": ev.step, "path": ev.path}
        else:
            return
        self.write()

    def write(self) -> None:
        st = self.status
        st["roles"] = self._roles()
        st["updated"] = time.time()
        text = json.dumps(st, indent=1, default=str)
        tmp = self.path.with_name(f".{FILE}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
            os.replace(tmp, self.path)
        except OSError:  # a status not written costs the run nothing
            tmp.unlink(missing_ok=True)
        _publish(st["run"], text)

    def _roles(self) -> list[dict[str, Any]]:
        """Every role with its node and state, and the group's last step time."""
        roles = self.roles()
        if roles is None:
            return []
        st = self.status
        lost = {(r["role"], r["index"], r["group"]) for r in st["recovering"]}
        ended = st["state"] if st["state"] in ("finished", "stopped") else None
        out: list[dict[str, Any]] = []

        def add(kind: str, index: int, group: int | None, info: dict[str, Any]) -> None:
            down = (kind, index, group) in lost or (kind, index, None) in lost
            node = info.get("node")
            out.append(
                {
                    "role": kind,
                    "index": index,
                    "group": group,
                    "node": self.address(node) if node else None,
                    "pid": info.get("pid"),
                    "state": ended or ("recovering" if down else "stepping"),
                    "step_ms": st["step_ms"],
                }
            )

        for k, info in enumerate(roles.server_infos):
            add("server", k, None, info)
        for g, row in enumerate(roles.worker_infos):
            for i, info in enumerate(row):
                add("worker", i, g, info)
        for g, info in enumerate(roles.stub_infos):
            add("stub", g, g, info)
        if ended:  # the spares end with the run: they took no part in it
            return out
        for sp in self.spares() if self.spares else []:
            where = self.address(sp["node"]) if sp.get("node") else None
            out.append({"index": None, "group": None, **sp, "node": where, "state": "spare"})
        return out


def _key(run: str) -> bytes:
    return f"status/{run}".encode()


def _publish(run: str, text: str) -> None:
    """``text`` as run ``run``'s status in the cluster's key-value store, where this process
    is connected to a Ray cluster (one small call to Ray's GCS); nothing otherwise."""
    try:
        import ray  # noqa: PLC0415
        from ray.experimental import internal_kv  # noqa: PLC0415 - as Ray Tune's registry

        if ray.is_initialized():
            internal_kv._internal_kv_put(_key(run), text.encode(), namespace=NAMESPACE)
    except Exception:  # noqa: BLE001 - a status not published costs the run nothing
        pass


def read_live(run: str, address: str) -> dict[str, Any]:
    """The status run ``run``'s driver last put into the key-value store of the Ray cluster
    at ``address`` (its GCS, ``HOST:PORT``); ValueError in one line where the cluster cannot
    be reached or no run of that name reported to it."""
    import socket  # noqa: PLC0415

    import ray  # noqa: PLC0415
    from ray.experimental import internal_kv  # noqa: PLC0415

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--address {address!r}: not HOST:PORT (the cluster's GCS address)")
    try:  # Ray itself would retry an address where nothing answers for minutes
        socket.create_connection((host, int(port)), timeout=CONNECT_S).close()
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise ValueError(f"--address {address}: no Ray cluster reached there ({why})") from None
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except Exception as e:  # noqa: BLE001 - Ray raises several kinds; the first line says
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--address {address}: no Ray cluster reached there ({why})") from None
    try:
        raw = internal_kv._internal_kv_get(_key(run), namespace=NAMESPACE)
        if raw is None:
            names = internal_kv._internal_kv_list(b"status/", namespace=NAMESPACE)
            known = sorted(n.decode()[len("status/") :] for n in names)
            raise ValueError(
                f"no run named {run!r} reported to the cluster at {address} (runs that did: "
                f"{', '.join(known) or 'none'})"
            )
        return json.loads(raw)
    finally:
        ray.shutdown()


def read(run_dir: str | Path) -> dict[str, Any]:
    """The status a run's driver last wrote in ``run_dir``; ValueError in one line where there
    is none."""
    path = Path(run_dir) / FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{path}: no status here (a run on Ray writes it into its run directory as it goes)"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a run's status ({e})") from None


def render(st: dict[str, Any]) -> str:
    """One screen of a run's status, as ``raysinga status`` prints it."""
    age = time.time() - float(st.get("updated", 0))
    ms = st.get("step_ms")
    head = (
        f"run {st['run']}: {st['state']}, step {st['step']}/{st.get('total') or '?'}"
        + (f", {ms:,.1f} ms per step" if ms else "")
        + (f", {st['samples_per_s']:,.0f} samples/s" if st.get("samples_per_s") else "")
        + f" (as of {age:.0f} s ago)"
    )
    ck = st.get("checkpoint")
    where = f"step {ck['step']} at {ck['path']}" if ck else "none"
    lines = [head, f"latest checkpoint: {where}"]
    rec = st.get("recoveries") or []
    lines.append(
        f"recoveries: {len(rec)}"
        + "".join(
            f"\n  step {r['step']}: {r['role']} {r.get('index')} {r.get('recovery') or ''}".rstrip()
            for r in rec
        )
    )
    lines.append(
        f"{'role':<8} {'index':>5} {'group':>5}  {'node':<16} {'pid':>7}  {'state':<11} last step"
    )
    for r in st.get("roles") or []:
        step = f"{r['step_ms']:,.1f} ms" if r.get("step_ms") else "-"
        lines.append(
            f"{r['role']:<8} {_dash(r.get('index')):>5} {_dash(r.get('group')):>5}  "
            f"{r.get('node') or '?':<16} {_dash(r.get('pid')):>7}  {r['state']:<11} {step}"
        )
    return "\n".join(lines)


def _dash(v: Any) -> str:
    return "-" if v is None else str(v)
