"""raysinga from Python, as a Ray user calls it from their own code (``docs/api.md`` walks it).

1. Build a job from a dict, train it distributed on Ray with its checkpoints also put into Ray's
   object store, and read the result: final metrics, where the newest checkpoint is.
2. Look the run's newest checkpoint up in the object-store registry by its documented key and
   read its tensors inside another Ray task, zero-copy from shared memory.
3. Start a single-process run from that checkpoint (fine-tuning), with a rename, and read the
   match report from the result::

    python examples/api_tour.py [--steps 200]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import ray

from raysinga import config
from raysinga.checkpoint import objstore
from raysinga.distributed import DistributedTrainer
from raysinga.run import Trainer
from raysinga.run import registry as run_registry


def job(run_dir: Path, steps: int) -> dict:
    return {
        "name": "tour",
        "seed": 0,
        "model": {
            "input_shape": [64],
            "layers": [
                {"kind": "dense", "name": "fc1", "units": 64, "activation": "relu"},
                {"kind": "dense", "name": "out", "units": 10},
            ],
        },
        "data": {"source": {"kind": "digits"}, "batch_size": 64},
        "updater": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train_steps": steps,
        "test_freq": steps,
        "disp_freq": steps,
        "run_dir": str(run_dir),
        "checkpoint": {"object_store": True},
        "topology": {"workers_per_group": 2},
    }


@ray.remote(num_cpus=0)
def norms(run_key: str) -> dict[str, float]:
    """Another Ray task: the run's newest checkpoint from the object store, its tensors
    read-only views of the shared object (no disk, no copy)."""
    ck = objstore.fetch(run_key)
    return {name: float((a.astype("float64") ** 2).sum() ** 0.5) for name, a in ck.arrays().items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="raysinga-tour-"))

    # 1. a job from a dict, trained on Ray
    cfg = config.from_dict(job(work / "base", args.steps))
    result = DistributedTrainer(cfg, log=lambda line: None).fit()
    print(f"test accuracy {result.final_eval['test_accuracy']:.4f}")
    print(f"newest checkpoint: step {result.checkpoint_step} at {result.checkpoint}")

    # 2. the registry's key of the run: its name and checkpoint directory
    run_key = run_registry.key(cfg.name, cfg.checkpoint_dir)
    got = ray.get(norms.remote(run_key))
    print(
        f"read in another task from {run_key!r}: "
        + ", ".join(f"|{k}| {v:.2f}" for k, v in got.items())
    )

    # 3. fine-tune from it in one process: a new head, the old fc1 loaded as "hidden"
    tuned = job(work / "tuned", args.steps)
    tuned.update(name="tour-tuned", topology=None, checkpoint={})
    tuned["model"]["layers"][0]["name"] = "hidden"
    tuned["init"] = {"rename": {"fc1/": "hidden/"}}
    fine = Trainer(
        config.from_dict(tuned), init_from=result.checkpoint, log=lambda line: None
    ).fit()
    print(f"fine-tuned from {result.checkpoint}: {fine.init_report}".splitlines()[0])
    print(f"fine-tuned test accuracy {fine.final_eval['test_accuracy']:.4f}")
    return {
        "accuracy": result.final_eval["test_accuracy"],
        "checkpoint": result.checkpoint,
        "norms": got,
        "report": fine.init_report,
        "tuned_accuracy": fine.final_eval["test_accuracy"],
    }


if __name__ == "__main__":
    main()
