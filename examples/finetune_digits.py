"""Fine-tuning with parameter reuse (SINGA's "parameter reuse"): a deeper net starts from a
trained one's checkpoint, with new layers on top.

A base run trains the digits MLP (``fc1``, ``fc2``, ``out``) on Ray and checkpoints it. A second
run builds a net that keeps ``fc1`` and ``fc2`` and puts two new layers on top (``fc3`` and a new
head ``cls``). It starts from the base checkpoint with ``init_from``: parameters are matched by
name and shape, so ``fc1`` and ``fc2`` come from the checkpoint, the new layers start from their
initialisation, and the base head ``out`` is left unused. The match report and both accuracies
are printed::

    python examples/finetune_digits.py [--base-steps 600] [--steps 300]

The same from the command line: ``raysinga train JOB --init-from RUN_DIR/checkpoints/step-N``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from raysinga import config
from raysinga.distributed import DistributedTrainer

JOB = Path(__file__).resolve().parent / "digits_mlp.yaml"
NEW_LAYERS = (
    "model.layers=["
    "{kind: dense, name: fc1, units: 128, activation: relu}, "
    "{kind: dense, name: fc2, units: 64, activation: relu}, "
    "{kind: dense, name: fc3, units: 32, activation: relu}, "
    "{kind: dense, name: cls, units: 10}]"
)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-steps", type=int, default=600)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="raysinga-finetune-"))

    base_cfg = config.load(
        JOB,
        [
            "name=base",
            f"run_dir={work / 'base'}",
            f"train_steps={args.base_steps}",
            f"test_freq={args.base_steps}",
        ],
    )
    base = DistributedTrainer(base_cfg).fit()
    assert base.checkpoint is not None, "the base run left no checkpoint"

    tuned_cfg = config.load(
        JOB,
        [
            "name=tuned",
            f"run_dir={work / 'tuned'}",
            f"train_steps={args.steps}",
            f"test_freq={args.steps}",
            # a fresh schedule for the new run: a smaller rate, the reused layers are trained
            f"updater.lr={{kind: cosine, lr: 0.02, steps: {args.steps}, min_lr: 0.001}}",
            NEW_LAYERS,
        ],
    )
    tuned = DistributedTrainer(tuned_cfg, init_from=base.checkpoint).fit()
    out = {
        "base_checkpoint": base.checkpoint,
        "base_accuracy": base.final_eval["test_accuracy"],
        "tuned_accuracy": tuned.final_eval["test_accuracy"],
        "report": str(tuned.init_report),  # what of the base checkpoint matched
    }
    print(f"base ({args.base_steps} steps): test accuracy {out['base_accuracy']:.4f}")
    print(f"tuned (+{args.steps} steps, two new layers): test accuracy {out['tuned_accuracy']:.4f}")
    print(f"both runs are in {work} (e.g. raysinga plot {work / 'tuned'}); delete it when done")
    return out


if __name__ == "__main__":
    main()
