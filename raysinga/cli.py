"""The ``raysinga`` command line.

Errors a user can fix (a bad job file, a missing data set) print one line naming the problem and
exit with status 2; nothing else of the library imports this module.
"""

from __future__ import annotations

import argparse
import sys

from . import config as config_mod


def _train(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config, args.set)
    if cfg.topology is None or args.local:
        from .trainer import Trainer  # noqa: PLC0415 - keeps `raysinga --help` fast

        result = Trainer(cfg).fit()
    else:
        from .distributed import DistributedTrainer  # noqa: PLC0415 - imports Ray

        result = DistributedTrainer(cfg, address=args.address).fit()
    final = result.final_eval
    if final is not None and "test_accuracy" in final:
        print(f"final test accuracy: {final['test_accuracy']:.4f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="raysinga",
        description="Distributed deep-learning training with SINGA's architecture on Ray.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    t = sub.add_parser(
        "train",
        help="train from a YAML job file",
        description="Train the model a YAML job file describes and report test accuracy.",
    )
    t.add_argument("config", metavar="CONFIG", help="YAML job file, e.g. examples/digits_mlp.yaml")
    t.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a job-file value, e.g. --set updater.lr=0.05 (repeatable; YAML values)",
    )
    t.add_argument(
        "--local",
        action="store_true",
        help="train in this process without Ray (the exact single-process reference)",
    )
    t.add_argument(
        "--address",
        metavar="ADDR",
        default=None,
        help="Ray cluster to join (default: RAY_ADDRESS, else start an embedded local Ray)",
    )
    t.set_defaults(func=_train)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (config_mod.ConfigError, ValueError, FileNotFoundError) as e:
        print(f"raysinga: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a role failed, or the cluster cannot hold the topology
        print(f"raysinga: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("raysinga: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
