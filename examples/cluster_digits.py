"""Train the digits MLP on an existing Ray cluster, submitted as a Ray job.

From the repository root, with the virtual environment active (``. .venv/bin/activate``)::

    ray start --head
    RAY_AUTH_MODE=token ray job submit --working-dir . -- python examples/cluster_digits.py
    ray stop

Ray turns token authentication on for clusters started with ``ray start``; the job client finds
the token in ``~/.ray/auth_token`` only when ``RAY_AUTH_MODE=token`` is set. Extra arguments are
``--set key=value`` overrides of ``examples/digits_mlp.yaml``.
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
    cfg = config.load(Path(__file__).with_name("digits_mlp.yaml"), args.set)
    result = DistributedTrainer(cfg).fit()  # joins the job's cluster through RAY_ADDRESS
    print(f"final test accuracy: {result.final_eval['test_accuracy']:.4f}")


if __name__ == "__main__":
    main()
