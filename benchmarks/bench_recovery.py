"""Recovery time after a lost worker, server or node, on a local multi-node Ray cluster.

A head with no CPUs and two 2-CPU nodes (``ray.cluster_utils.Cluster``) on this machine; the
digits MLP with one group of two workers and one server, checkpointing every 20 steps into the
object store and to disk. In each run one role's process is SIGKILLed (or the node holding the
workers and the server is removed) once step 30 is reported; the time is taken from the kill to
the next step the run completes after its restart::

    pip install -e '.[bench,examples]'
    python benchmarks/bench_recovery.py [--runs 5]

Prints, per kind of loss, the median of ``--runs`` of: kill to next completed step, kill to
detection, and the restart itself (stop every role, restore, start again). Goal: under 5 s for
a worker lost and restored from the object store.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

KILL_AT = 30


def job(run_dir: Path):
    from raysinga import config

    examples = Path(__file__).resolve().parents[1] / "examples"
    return config.load(
        examples / "digits_mlp.yaml",
        [
            f"run_dir={run_dir}",
            "train_steps=60",
            "disp_freq=1",
            "test_freq=0",
            "checkpoint_frequency=20",
            "checkpoint.object_store=true",
            "checkpoint.final=false",
            "fault.max_failures=1",
        ],
    )


def one_run(cluster, kind: str, run_dir: Path) -> dict[str, float]:
    import ray

    from raysinga.distributed import DistributedTrainer
    from raysinga.events import Event, Recovered, TrainStep

    t = DistributedTrainer(job(run_dir), log=lambda line: None, gather=False)
    marks: dict[str, float] = {}

    def kill() -> None:
        if kind == "node":
            node_id = ray.get(t.servers[0].describe.remote())["node"]
            (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
            marks["kill"] = time.time()
            cluster.remove_node(node)
            return
        actor = t.workers[0][1] if kind == "worker" else t.servers[0]
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
    if kind == "node":  # give the cluster its node back for the next run
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
    return {
        "to next step": marks["next"] - marks["kill"],
        "detection": ev["time"] - marks["kill"],
        "restart": ev["restore_s"],
        "steps redone": ev["steps_redone"],
        "from object store": float(ev["source"].startswith("object store")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    out: dict[str, list[dict[str, float]]] = {}
    try:
        for kind in ("worker", "server", "node"):
            out[kind] = [one_run(cluster, kind, work / f"{kind}{r}") for r in range(args.runs)]
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(
        f"digits MLP, 1 group x 2 workers + 1 server on a local 2-node cluster; kill at step "
        f"{KILL_AT}; checkpoints every 20 steps (object store and disk); medians of {args.runs}"
    )
    for kind, runs in out.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"  {kind:6} lost: kill to next step {med['to next step']:6.2f} s  (detection "
            f"{med['detection']:5.2f} s, restart {med['restart']:5.2f} s, "
            f"{med['steps redone']:.0f} steps redone; restored from the object store in "
            f"{sum(r['from object store'] for r in runs):.0f} of {len(runs)})"
        )
    worker = statistics.median(r["to next step"] for r in out["worker"])
    print(f"goal: worker loss under 5 s -> {'met' if worker < 5 else 'NOT met'} ({worker:.2f} s)")


if __name__ == "__main__":
    main()
