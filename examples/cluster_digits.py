"""Train the digits MLP on an existing Ray cluster, submitted as a Ray job.

From the repository root, with the virtual environment active (``. .venv/bin/activate``)::

    ray start --head
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python examples/cluster_digits.py
    ray stop

Ray turns token authentication on for clusters started with ``ray start``; the job client finds
the token in ``~/.ray/auth_token`` only when ``RAY_AUTH_MODE=token`` is set. Extra arguments are
``--set key=value`` overrides of ``examples/digits_mlp.yaml``.

The run's record and checkpoints go to ``~/raysinga-runs/digits-mlp`` on the driver's machine
(the head, under ``ray job submit``), not to the job file's default ``runs/digits-mlp``: the job
runs in Ray's temporary copy of the working directory, deleted after it. Each submission starts
over there (``--fresh``). ``--set run_dir=PATH`` puts them elsewhere; on several machines, see
``docs/cluster.md`` for ``checkpoint.dir``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from raysinga import config
from raysinga.distributed import DistributedTrainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    lasting = f"run_dir={Path.home() / 'raysinga-runs' / 'digits-mlp'}"
    cfg = config.load(Path(__file__).with_name("digits_mlp.yaml"), [lasting, *args.set])
    # joins the job's cluster through RAY_ADDRESS
    result = DistributedTrainer(cfg, fresh=True).fit()
    print(f"run record and checkpoints in {Path(cfg.run_path).resolve()}")
    print(f"final test accuracy: {result.final_eval['test_accuracy']:.4f}")


if __name__ == "__main__":
    main()
