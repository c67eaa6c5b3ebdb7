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

The file names the driver (its pid and host). A reader on the driver's host that finds that
process gone shows the run's driver dead; anywhere, a run whose step reports stopped coming
for far longer than they used to come is shown as silent (:func:`driver`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raysinga.actors.exchange.traffic import HostNames
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
ENDED = ("finished", "stopped")
# A running run reports every disp_freq steps; one silent for this many such intervals (and at
# least SILENT_MIN_S: an evaluation or a slow checkpoint comes between two reports) is shown as
# silent, its driver perhaps dead.
SILENT_TIMES = 10
SILENT_MIN_S = 60.0


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
        self.reported: float | None = None  # when the last step report came
        self.status: dict[str, Any] = {
            "run": run,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "pid_started": _started(os.getpid()),  # tells the driver from a later process
            "state": "starting",
            "step": 0,
            "total": None,
            "step_ms": None,
            "report_s": None,  # the seconds between the last two step reports
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
            now = time.time()
            if self.reported is not None:
                st["report_s"] = round(now - self.reported, 3)
            self.reported = now
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
        ended = st["state"] if st["state"] in ENDED else None
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


def driver(st: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """What a reader can tell of the driver of the run whose status is ``st``: ``state`` is
    ``ended`` (the run finished or stopped), ``dead`` (its process, on this reader's host, is
    gone), ``silent`` (running, but its step reports are overdue by far: it may have died, or
    hang, where this reader cannot look) or ``alive`` (nothing says otherwise); ``why`` says
    how it is known."""
    now = time.time() if now is None else now
    pid, host = st.get("pid"), st.get("host")
    who = f"pid {pid} on {host or 'an unnamed host'}"
    if st.get("state") in ENDED:
        return {"state": "ended", "why": None}
    if isinstance(pid, int) and host == socket.gethostname():
        if not _running(pid, st.get("pid_started")):
            return {"state": "dead", "why": f"its driver ({who}) is gone"}
    age = now - float(st.get("updated", now))
    every = max(st.get("report_s") or 0.0, (st.get("step_ms") or 0.0) / 1e3)
    if st.get("state") == "running" and age > max(SILENT_MIN_S, SILENT_TIMES * every):
        why = (
            f"no report from its driver ({who}) for {age:.0f} s, where one came every "
            f"{every:.3g} s: it may have died"
        )
        return {"state": "silent", "why": why}
    return {"state": "alive", "why": None}


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` from the process's state on (None: no such file)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot); None where there is no /proc."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def _running(pid: int, started: int | None) -> bool:
    """Whether process ``pid`` of this host runs and is the one that started at ``started``
    (a gone process's pid may be given to another); a zombie counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process, there all the same
        pass
    fields = _stat(pid)
    if fields is None:  # no /proc (macOS), or gone this instant
        return not Path("/proc/self/stat").exists()
    return fields[0] != "Z" and (started is None or int(fields[19]) == started)


def render(st: dict[str, Any], now: float | None = None) -> str:
    """One screen of a run's status, as ``raysinga status`` prints it."""
    now = time.time() if now is None else now
    age = now - float(st.get("updated", 0))
    ms = st.get("step_ms")
    facts = (
        f"step {st['step']}/{st.get('total') or '?'}"
        + (f", {ms:,.1f} ms per step" if ms else "")
        + (f", {st['samples_per_s']:,.0f} samples/s" if st.get("samples_per_s") else "")
    )
    seen = driver(st, now)
    if seen["state"] in ("dead", "silent"):
        head = (
            f"run {st['run']}: {seen['state']}: {seen['why']}; "
            f"it last reported {st['state']}, {facts}"
            + (f", {age:.0f} s ago" if seen["state"] == "dead" else "")  # silent: said already
        )
    else:
        head = f"run {st['run']}: {st['state']}, {facts} (as of {age:.0f} s ago)"
    ck = st.get("checkpoint")
    where = f"step {ck['step']} at {ck['path']}" if ck else "none"
    lines = [head]
    if st.get("pid"):
        lines.append(f"driver: pid {st['pid']} on {st.get('host') or '?'}")
    lines.append(f"latest checkpoint: {where}")
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
        # Ray ends a driver's actors with it
        state = "gone" if seen["state"] == "dead" else r["state"]
        lines.append(
            f"{r['role']:<8} {_dash(r.get('index')):>5} {_dash(r.get('group')):>5}  "
            f"{r.get('node') or '?':<16} {_dash(r.get('pid')):>7}  {state:<11} {step}"
        )
    return "\n".join(lines)


def _dash(v: Any) -> str:
    return "-" if v is None else str(v)
