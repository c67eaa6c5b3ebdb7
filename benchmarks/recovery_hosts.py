"""``bench_recovery.py --hosts N``: recovery on emulated hosts that share nothing but a network
(``tests/hosts.py``: Linux namespaces on this machine; needs root and iproute2).

A head that holds no role (Ray's head and the driver) and ``N`` hosts of 2 CPUs; the job runs
one group of two workers (2 CPUs each, so one per host) and two servers (server ``k`` beside
worker ``k``, the stub beside worker 0), checkpointing every 20 steps to a directory every host
mounts. Once step 30 is reported, one of:

- ``worker``: worker 1's process SIGKILLed (on a host without the stub);
- ``server``: server 1's process SIGKILLed (the same host; its copy is kept by the stub);
- ``host``: the host holding worker 1 and server 1 lost whole (every process SIGKILLed, its
  link taken down): noticed by the run's heartbeat, its roles moved to the free host;
- ``host-stub``: the host holding the stub, worker 0 and server 0 lost whole: the copies and
  the log went with the stub, so every role restarts from the newest checkpoint.

A lost host is replaced by a new one for the next run. Each kind runs with every role restarted
(``fault.recovery: restart``) and with the default path, the two alternating; the time is from
the kill to the next step the run completes after it recovered. Goals: a lost host that held a
worker and a server (not the stub) back in at most 3 s with nothing rolled back.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from report import Figure, Report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the emulated hosts are the suite's

KINDS = ("worker", "server", "host", "host-stub")
GOALS = {"host": (3.0, 1)}  # seconds kill to next step, steps redone
KILL_AT = 30

# Runs in the head host: the job, with a line of JSON for every step, the recovery, the roles'
# processes and hosts, and at the end the failures.
DRIVER = """
import json, sys, threading, time
import ray
from raysinga import config
from raysinga.distributed import DistributedTrainer
from raysinga.obs.events import Recovered, TrainStep
cfg = config.load({job!r}, {sets!r})
said = []

def say(**what):
    print(json.dumps(what), flush=True)

def roles(t):
    ips = {{n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}}
    def where(a):
        return ray.get(a.pid.remote()), ips[ray.get(a.describe.remote())["node"]]
    say(roles={{"worker": where(t.workers[0][1]), "server": where(t.servers[1]),
               "stub": where(t.stubs[0])}})

def hook(ev):
    if isinstance(ev, TrainStep):
        say(step=ev.step, t=time.time())
        if ev.step == 5 and not said:
            said.append(1)
            threading.Thread(target=roles, args=(t,), daemon=True).start()
    elif isinstance(ev, Recovered):
        say(recovered=time.time())

t = DistributedTrainer(cfg, address={address!r}, log=None, gather=False, on_event=hook)
t.fit()
say(failures=t.failures)
"""


def job_sets(run_dir: str, recovery: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        "train_steps=60",
        "disp_freq=1",
        "test_freq=0",
        "checkpoint_frequency=20",
        "checkpoint.final=false",
        "fault.max_failures=1",
        f"fault.recovery={recovery}",
        "topology.n_servers=2",
        "topology.worker.cpus=2",
    ]


def one_run(lab, made: list, job: str, kind: str, recovery: str, run: str) -> dict[str, float]:
    import hosts  # noqa: PLC0415

    head = made[0]
    code = DRIVER.format(job=job, sets=job_sets(f"/mnt/shared/{run}", recovery),
                         address=f"{head.address}:6379")  # fmt: skip
    p = head.popen([str(hosts.VENV / "bin" / "python"), "-u", "-c", code])
    marks: dict[str, float] = {}
    roles: dict[str, list] = {}
    failures: list[dict] = []
    out = []
    for line in p.stdout:
        out.append(line)
        at = line.find('{"')
        if at < 0:
            continue
        try:  # Ray's forwarded log lines may come before or after it on the same line
            rec, _ = json.JSONDecoder().raw_decode(line[at:])
        except ValueError:
            continue
        if "roles" in rec:
            roles = rec["roles"]
        elif "step" in rec and rec["step"] >= KILL_AT and roles and "kill" not in marks:
            marks["kill"] = time.time()
            _lose(lab, made, kind, roles)
        elif "recovered" in rec:
            marks["recovered"] = rec["recovered"]
        elif "step" in rec and "recovered" in marks and "next" not in marks:
            marks["next"] = rec["t"]
        elif "failures" in rec:
            failures = rec["failures"]
    p.wait()
    if p.returncode != 0 or len(failures) != 1 or "next" not in marks:
        raise RuntimeError(f"{kind}, {recovery}: {failures}\n{''.join(out[-40:])}")
    ev = failures[0]
    return {
        "to next step": marks["next"] - marks["kill"],
        "steps redone": ev["steps_redone"],
        "rolled back": ev.get("rolled_back", ev["steps_redone"]),
        "replaced": float(ev.get("recovery") in ("replaced", "rebuilt and replayed")),
        **{k: ev[k] for k in ("stop_s", "respawn_s", "rebuild_s", "rewire_s") if k in ev},
    }


def _lose(lab, made: list, kind: str, roles: dict[str, list]) -> None:
    """What the kind loses; a lost host is replaced by a new one joining the cluster."""
    by_ip = {h.address: h for h in made if not h.lost}
    if kind in ("worker", "server"):
        pid, ip = roles[kind]
        by_ip[ip].kill(pid, signal.SIGKILL)
        return
    victim = by_ip[roles["stub" if kind == "host-stub" else "worker"][1]]
    victim.lose()

    def replace() -> None:  # after the run has gone on: a new machine joins for the next run
        time.sleep(15)
        new = lab.host(f"h{len(made) + 1}", shared=True)
        new.ray_start(2, head=made[0])
        made.append(new)

    threading.Thread(target=replace).start()


def main(args, report_name: str = "bench_recovery_hosts") -> None:
    import hosts  # noqa: PLC0415

    why = hosts.unavailable()
    if why:
        raise SystemExit(f"bench_recovery.py --hosts: {why}")
    kinds = (args.kinds or ",".join(KINDS)).split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise SystemExit(f"--kinds: {', '.join(bad)} not among {', '.join(KINDS)} with --hosts")
    out: dict[tuple[str, str], list[dict[str, float]]] = {}
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-hosts-"))
    with hosts.lab(root) as lab:
        made = hosts.ray_cluster(lab, [0] + [2] * args.hosts)
        job = "/mnt/shared/job.yaml"
        made[0].path(job).write_text(Path(args.job).read_text())
        for kind in kinds:
            for r in range(args.runs):  # the two paths alternate, so both see the same noise
                for path in ("restart", "replace"):
                    while threading.active_count() > 1:  # a new host still joining
                        time.sleep(0.5)
                    hosts.wait_nodes(made[0], len([h for h in made if not h.lost]))
                    run = one_run(lab, made, job, kind, path, f"{kind}-{path}{r}")
                    out.setdefault((kind, path), []).append(run)
                    print(f"  {kind}, {path}, run {r}: {run}", flush=True)
        while threading.active_count() > 1:  # a new host joining after the last run
            time.sleep(0.5)
    write_report(out, args, kinds, report_name)


def write_report(
    out: dict[tuple[str, str], list[dict[str, float]]], args, kinds: list[str], report_name: str
) -> None:
    """The figures of the runs in ``out`` (by kind and path), printed and written to
    ``args.json``."""
    print(
        f"{Path(args.job).name}, 1 group x 2 workers + 2 servers on emulated hosts (a head and "
        f"{args.hosts} hosts of 2 CPUs, 2 cores in all); kill at step {KILL_AT}; checkpoints "
        f"every 20 steps to a shared directory; {args.runs} runs of each"
    )
    report = Report(report_name, {**vars(args), "kinds": ",".join(kinds)})
    for (kind, path), runs in out.items():
        label = f"{kind} lost, {path}"
        goal = GOALS.get(kind) if path == "replace" else None
        vals = [r["to next step"] for r in runs]
        report.add(Figure(f"{label}: kill to next step", vals, " s", goal and goal[0]), ".2f")
        for key, most in (("steps redone", goal and goal[1]), ("rolled back", goal and 0)):
            vals = [r[key] for r in runs]
            report.add(
                Figure(f"{label}: {key}, the most of any run", vals, value=max(vals), goal=most),
                ".0f",
            )
    for kind in kinds:
        if (kind, "replace") in out and (kind, "restart") in out:
            new, old = out[(kind, "replace")], out[(kind, "restart")]
            gains = [o["to next step"] / n["to next step"] for o, n in zip(old, new, strict=True)]
            report.add(Figure(f"{kind} lost: restart path's time / default path's", gains, "x"))
    report.write(args.json)
