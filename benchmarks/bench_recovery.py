"""Recovery after a lost worker, stub, server or node, on a local multi-node Ray cluster: the
restart path (every role restarted from the newest checkpoint) against the default path
(``fault.recovery: replace``: a lost worker or stub replaced alone, a lost server rebuilt from
its copy and the stub's log of the steps since, where that can be done), in one run.

A head with no CPUs and two 2-CPU nodes (``ray.cluster_utils.Cluster``) on this machine; the
digits MLP (``--job``: another, such as ``examples/digits_cnn.yaml``, whose workers hold batch
norm's statistics) with one group of two workers and one server, checkpointing every 20 steps
into the object store and to disk. In each run one role's process is SIGKILLed (``node-all``:
the node holding every role is removed) once step 30 is reported; the time is taken from the kill to
the next step the run completes after it recovered. ``node``: three 1-CPU nodes and two
servers; the node holding worker 1 and server 1 (not the stub, which keeps server 1's copy) is
removed, and the third node has room for its roles::

    pip install -e '.[bench,examples]'
    python benchmarks/bench_recovery.py [--runs 5] [--job JOB] [--kinds worker,stub] [--json FILE]
    python benchmarks/bench_recovery.py --device gpu [--kinds worker,stub,server]
    python benchmarks/bench_recovery.py --hosts 3 [--runs 3]    # as root: emulated hosts

``--hosts N``: on emulated hosts that share nothing but a network (a head and N hosts of 2
CPUs); the kinds there are ``worker``, ``server``, ``host`` and ``host-stub``
(``benchmarks/recovery_hosts.py`` says what each loses, and its goal).

``--device gpu``: one node of 4 CPUs and one GPU, which the two workers and the server share
(``topology.worker.gpus=0.25``, ``topology.server.gpus=0.25``; the stub is on the CPU). The
goals there: a worker lost costs at most 0.5 s, a server 1 s, kill to next step, with no step
rolled back (spares wait with their CUDA context and kernels loaded).

Prints, per kind of loss and path, the median (min-max) of ``--runs`` of: kill to next
completed step, and the steps redone and rolled back; then each goal, met or not: a worker lost
costs at most 1 s and 1 step redone, a stub 1.5 s and 1 step, a server at most 2.5 s with no
rollback (its group redoes at most the interrupted step), and each at least 3x less than the
restart path (the restart path's time over the default path's, per pair of runs). Times are
judged on their medians, steps on the most of any run. ``--json FILE`` writes every figure and run.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from report import Figure, Report, add_json_option

KILL_AT = 30
KINDS = ("worker", "stub", "server", "node", "node-all")
NODES = {"node": (1, 1, 1)}  # the nodes of a kind's cluster (default two of 2 CPUs)
# seconds, steps redone (a rebuilt server's group may redo the step it was interrupted in)
GOALS = {"worker": (1.0, 1), "stub": (1.5, 1), "server": (2.5, 1)}
GPU_GOALS = {"worker": (0.5, 1), "stub": (1.5, 1), "server": (1.0, 1)}
GPU_KINDS = ("worker", "stub", "server")
# the roles' shares of the one GPU of ``--device gpu``
GPU_SHARES = ("topology.worker.gpus=0.25", "topology.server.gpus=0.25")


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def job(path: str, run_dir: Path, recovery: str, *more: str):
    from raysinga import config

    return config.load(
        path,
        [
            f"run_dir={run_dir}",
            "train_steps=60",
            "disp_freq=1",
            "test_freq=0",
            "checkpoint_frequency=20",
            "checkpoint.object_store=true",
            "checkpoint.final=false",
            "fault.max_failures=1",
            f"fault.recovery={recovery}",
            *more,
        ],
    )


def one_run(
    cluster, path: str, kind: str, recovery: str, run_dir: Path, device: str = "cpu"
) -> dict[str, float]:
    import ray

    from raysinga.distributed import DistributedTrainer
    from raysinga.obs.events import Event, Recovered, TrainStep

    more = ("topology.n_servers=2",) if kind == "node" else ()
    more += GPU_SHARES if device == "gpu" else ()
    t = DistributedTrainer(job(path, run_dir, recovery, *more), log=None, gather=False)
    marks: dict[str, float] = {}

    def kill() -> None:
        if kind.startswith("node"):
            victim = t.workers[0][1] if kind == "node" else t.servers[0]
            node_id = ray.get(victim.describe.remote())["node"]
            (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
            marks["kill"] = time.time()
            cluster.remove_node(node)
            return
        actor = {"worker": t.workers[0][1], "stub": t.stubs[0], "server": t.servers[0]}[kind]
        pid = ray.get(actor.pid.remote())
        marks["kill"] = time.time()
        os.kill(pid, signal.SIGKILL)

    def hook(ev: Event) -> None:
        if isinstance(ev, TrainStep) and ev.step == KILL_AT and "kill" not in marks:
            threading.Thread(target=kill, daemon=True).start()
        elif isinstance(ev, Recovered):
            marks["recovered"] = time.time()
        elif "recovered" in marks and "next" not in marks and isinstance(ev, TrainStep):
            marks["next"] = time.time()

    t.hub.subscribe(hook)
    t.fit()
    if len(t.failures) != 1:
        raise RuntimeError(f"expected one failure, the run had {t.failures}")
    ev = t.failures[0]
    if kind.startswith("node"):  # give the cluster its node back for the next run
        cluster.add_node(num_cpus=NODES.get(kind, (2,))[0])
        cluster.wait_for_nodes()
    return {
        "to next step": marks["next"] - marks["kill"],
        "steps redone": ev["steps_redone"],
        "rolled back": ev.get("rolled_back", ev["steps_redone"]),
        "replaced": float(ev.get("recovery") in ("replaced", "rebuilt and replayed")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--job",
        default=str(EXAMPLES / "digits_mlp.yaml"),
        help="the job (its topology is used as it is, with 2 servers for `node`)",
    )
    ap.add_argument("--kinds", default=None, help="comma-separated: " + ", ".join(KINDS))
    ap.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="gpu: workers and server share one GPU (kinds: " + ", ".join(GPU_KINDS) + ")",
    )
    ap.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="N: on a head and N emulated hosts of 2 CPUs (root; benchmarks/recovery_hosts.py)",
    )
    add_json_option(ap)
    args = ap.parse_args()
    if args.hosts:
        if args.hosts < 3:
            ap.error("--hosts: at least 3 (two for the workers, one with room for a lost one's)")
        import recovery_hosts

        recovery_hosts.main(args)
        return
    gpu = args.device == "gpu"
    kinds = (args.kinds or ",".join(GPU_KINDS if gpu else KINDS)).split(",")
    bad = [k for k in kinds if k not in (GPU_KINDS if gpu else KINDS)]
    if bad:
        ap.error(f"--kinds: {', '.join(bad)} not among {', '.join(GPU_KINDS if gpu else KINDS)}")
    goals = GPU_GOALS if gpu else GOALS

    from raysinga.cluster.local import local_cluster

    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    out: dict[tuple[str, str], list[dict[str, float]]] = {}
    for kind in kinds:
        nodes = (4,) if gpu else NODES.get(kind, (2, 2))
        with local_cluster(*nodes, node_gpus=1 if gpu else 0) as (cluster, _):
            for r in range(args.runs):  # the two paths alternate, so both see the same noise
                for path in ("restart", "replace"):
                    run_dir = work / f"{kind}-{path}{r}"
                    run = one_run(cluster, args.job, kind, path, run_dir, args.device)
                    out.setdefault((kind, path), []).append(run)
    where = (
        "a local 1-node cluster of 4 CPUs and 1 GPU (workers and server on it, 0.25 of it each)"
        if gpu
        else "a local 2-node cluster (2 cores; node: three 1-CPU nodes, 2 servers)"
    )
    print(
        f"{Path(args.job).name}, 1 group x 2 workers + 1 server on {where}; kill at step "
        f"{KILL_AT}; checkpoints every 20 steps (object store and disk); {args.runs} runs of each"
    )
    name = "bench_recovery_gpu" if gpu else "bench_recovery"
    report = Report(name, {**vars(args), "kinds": ",".join(kinds)})
    for (kind, path), runs in out.items():
        label = f"{kind} lost, {path}"
        replaced = sum(r["replaced"] for r in runs)
        goal = goals.get(kind) if path == "replace" else None
        report.add(
            Figure(
                f"{label}: kill to next step",
                [r["to next step"] for r in runs],
                " s",
                goal and goal[0],
            ),
            ".2f",
        )
        for key, most in (("steps redone", goal and goal[1]), ("rolled back", goal and 0)):
            vals = [r[key] for r in runs]
            report.add(
                Figure(f"{label}: {key}, the most of any run", vals, value=max(vals), goal=most),
                ".0f",
            )
        print(f"  replaced in place in {replaced:.0f} of {len(runs)} runs")
    for kind in goals:
        if (kind, "replace") not in out:
            continue
        new, old = out[(kind, "replace")], out[(kind, "restart")]
        gains = [o["to next step"] / n["to next step"] for o, n in zip(old, new, strict=True)]
        report.add(
            Figure(f"{kind} lost: restart path's time / default path's", gains, "x", 3.0, "higher"),
            ".1f",
        )
    report.write(args.json)


if __name__ == "__main__":
    main()
