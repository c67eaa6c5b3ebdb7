"""Watch a training run lose a node and recover, on a local multi-node Ray cluster.

A head without CPUs and two worker nodes start on this machine (``ray.cluster_utils.Cluster``).
The digits MLP trains on them (one group of two workers and a parameter server), checkpointing
every 100 steps to disk and into Ray's object store. Once step ``--kill-at`` is reported, the node
holding the workers is removed (at the first progress line at or after that step), with every
process on it::

    python examples/node_loss.py [--kill-at 250] [--elastic] [--set key=value ...]

- Without ``--elastic`` the nodes have two CPUs each: the run restarts every role on the node
  that is left, from the newest checkpoint, redoes the steps since, and ends exactly as an
  unbroken run would.
- With ``--elastic`` they have one CPU each, so only one worker fits after the loss: the run goes
  on with one worker (``fault.min_workers: 1``), the group's batch split over it. A node is added
  back at step ``--return-at``, and the group grows back to two workers at the next check.

At the end it prints the failure and resize events, as ``metrics.jsonl`` has them, and the test
accuracy.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import ray

from raysinga import config
from raysinga.cluster.local import local_cluster
from raysinga.distributed import DistributedTrainer
from raysinga.obs.events import Event, TrainStep

JOB = Path(__file__).resolve().parent / "digits_mlp.yaml"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kill-at", type=int, default=250, help="remove the node after this step")
    ap.add_argument("--elastic", action="store_true", help="one CPU a node: shrink, grow back")
    ap.add_argument("--return-at", type=int, default=500, help="--elastic: add a node here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    cpus = 1 if args.elastic else 2
    work = tempfile.mkdtemp(prefix="raysinga-node-loss-")
    sets = [f"run_dir={work}", "disp_freq=50", "checkpoint_frequency=100"]
    sets.append("checkpoint.object_store=true")
    if args.elastic:
        sets += ["fault.min_workers=1", "fault.grow_check_s=1"]
    cfg = config.load(JOB, [*sets, *args.set])

    with local_cluster(cpus, cpus) as (cluster, _):
        trainer = DistributedTrainer(cfg, log=lambda line: print(line, flush=True))
        removed, added = [], []

        def hook(ev: Event) -> None:
            if not isinstance(ev, TrainStep):
                return
            step = ev.step
            if not removed and step >= args.kill_at:
                worker = trainer.workers[0][-1]  # the last worker: with --elastic, alone there
                node_id = ray.get(worker.describe.remote())["node"]
                (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
                print(f"--- removing node {node_id[:12]} and every process on it", flush=True)
                cluster.remove_node(node)
                removed.append(node_id)
            elif args.elastic and removed and not added and step >= args.return_at:
                print(f"--- adding a node with {cpus} CPU(s)", flush=True)
                added.append(cluster.add_node(num_cpus=cpus))

        trainer.hub.subscribe(hook)
        result = trainer.fit()
    events = [r for r in result.history if r.get("kind") in ("failure", "resize")]
    print("--- events")
    for e in events:
        print(json.dumps(e))
    accuracy = result.final_eval["test_accuracy"]
    print(f"final test accuracy: {accuracy:.4f}")
    print(f"the run is in {work} (raysinga plot {work} marks the events); delete it when done")
    return {"events": events, "accuracy": accuracy, "run_dir": work}


if __name__ == "__main__":
    main()
