"""Fork one checkpoint into several runs with different learning rates, as Ray tasks.

A base run trains the digits MLP on Ray; its final checkpoint is put into Ray's object store,
owned by raysinga's checkpoint registry. The checkpoint directory is then deleted, and one Ray
task per learning rate starts a run from the ObjectRef (its parameters, matched by name), reading
the tensors zero-copy from shared memory: none of them touches the disk. Each reports its test
accuracy::

    python examples/fork_lr.py [--lrs 0.002 0.02 0.1] [--base-steps 200] [--steps 300]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import ray

from raysinga import config
from raysinga.checkpoint import objstore
from raysinga.distributed import DistributedTrainer
from raysinga.run import Trainer

JOB = Path(__file__).resolve().parent / "digits_mlp.yaml"


@ray.remote(num_cpus=1)
def fork(refs: list, lr: float, steps: int, work: str) -> dict:
    """One fork: a single-process run from the checkpoint behind ``refs[0]``.

    The ref travels inside a list: a bare ObjectRef argument would be fetched and copied into
    the task's arguments; this way the task maps the shared object itself.
    """
    cfg = config.load(
        JOB,
        [
            f"name=fork-lr{lr:g}",
            f"run_dir={work}/fork-lr{lr:g}",
            "topology=null",
            f"train_steps={steps}",
            f"updater.lr={lr}",
            "test_freq=0",
            f"disp_freq={steps}",
            "checkpoint.final=false",  # a pure in-memory experiment
        ],
    )
    result = Trainer(cfg, init_from=refs[0], log=lambda line: None).fit()
    return {"lr": lr, **(result.final_eval or {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lrs", type=float, nargs="+", default=[0.002, 0.02, 0.1])
    ap.add_argument("--base-steps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--address", default=None, help="Ray cluster (default: embedded local Ray)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fork-lr-"))
    try:
        base = config.load(
            JOB,
            [
                "name=fork-base",
                f"run_dir={work}/base",
                f"train_steps={args.base_steps}",
                f"disp_freq={args.base_steps}",
                "test_freq=0",
            ],
        )
        DistributedTrainer(base, address=args.address, gather=False).fit()
        path = work / "base" / "checkpoints" / f"step-{args.base_steps}"
        ref = objstore.publish(path, "fork-base")
        shutil.rmtree(work / "base")  # from here on the checkpoint exists only in memory
        print(f"base run: step {args.base_steps} in the object store; its directory is gone")

        results = ray.get([fork.remote([ref], lr, args.steps, str(work)) for lr in args.lrs])
        for r in sorted(results, key=lambda r: r["lr"]):
            print(
                f"fork lr {r['lr']:<8g} {args.steps} steps from step {args.base_steps}: "
                f"test accuracy {r['test_accuracy']:.4f}"
            )
        ray.get(objstore.registry().delete.remote("fork-base", args.base_steps))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
