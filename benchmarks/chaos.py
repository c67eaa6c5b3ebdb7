"""A job under chaos: role processes SIGKILLed at seeded random instants (found through Ray's
state API, see :mod:`raysinga.distributed.chaos`), some aimed at the driver's recovery windows;
then the same job uninterrupted, and the two runs' final parameters compared bit for bit::

    python benchmarks/chaos.py --kills 20 --seed 1
    python benchmarks/chaos.py examples/digits_mlp.yaml --kills 5 --steps 2000 --address auto
    python benchmarks/chaos.py --nodes 2 --node-share 0.25
    python benchmarks/chaos.py --device gpu --kills 10

``--device gpu``: the two workers and the server share one GPU (a quarter of it each; the
local Ray is given the machine's cores and one GPU), so every kill of a worker or a server is
one of a GPU role.

``--json FILE`` writes the figures (kill to next step, kills survived, bit-identical or not,
failures recovered without restarting every role: goal at least 3/4 of the kills).

Prints the seed, every kill (when, whom, what the driver was doing), every failure record (the
path taken, steps redone and rolled back, seconds to recover), the seconds from each kill to
the next step the run reported (median, min, max), and whether the runs ended bit-identical.
Without ``--address`` it starts a local Ray with the machine's cores, or with ``--nodes N`` a local
cluster of a head without CPUs and N nodes of 2 CPUs, where ``--node-share`` of the kills remove
the chosen role's whole node (a node of the same size then joins). Exits 1 when a kill was
not survived or the parameters differ.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from report import Figure, Report, add_json_option

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# Of the kills, the share whose failure is recovered without restarting every role, at least.
ALONE = 0.75


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", nargs="?", default=str(EXAMPLES / "digits_cnn.yaml"))
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--in-recovery", type=int, default=3, help="kills aimed at recoveries")
    ap.add_argument("--gap", type=float, nargs=2, default=(1.0, 4.0), metavar=("MIN", "MAX"))
    ap.add_argument("--steps", type=int, default=6000, help="train_steps of the job")
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--address", default=None, help="a Ray cluster to attach to")
    ap.add_argument("--nodes", type=int, default=0, help="instead: a local cluster of N nodes")
    ap.add_argument("--node-share", type=float, default=0.0, help="kills that remove a node")
    ap.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="gpu: the workers and the server share one GPU",
    )
    add_json_option(ap)
    args = ap.parse_args()

    import ray

    from raysinga import config
    from raysinga.cluster.local import local_cluster
    from raysinga.distributed import DistributedTrainer
    from raysinga.distributed.chaos import Chaos

    cluster = None
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as d:
        if args.address:
            ray.init(address=args.address, log_to_driver=False)
            stack.callback(ray.shutdown)
        elif args.nodes:
            gpus = 1 if args.device == "gpu" else 0
            cluster, _ = stack.enter_context(local_cluster(*[2] * args.nodes, node_gpus=gpus))
        else:
            gpus = {"num_gpus": 1} if args.device == "gpu" else {}
            ray.init(address="local", num_cpus=os.cpu_count(), log_to_driver=False, **gpus)
            stack.callback(ray.shutdown)

        def job(name: str) -> config.JobConfig:
            over = [
                f"run_dir={Path(d) / name}",
                f"train_steps={args.steps}",
                f"checkpoint_frequency={args.checkpoint_every}",
                "disp_freq=1",
                "test_freq=0",
                f"fault.max_failures={2 * args.kills + 1}",
            ]
            if args.device == "gpu":
                over += ["topology.worker.gpus=0.25", "topology.server.gpus=0.25"]
            cfg = config.load(args.job, over)
            if "lr" in cfg.updater and isinstance(cfg.updater["lr"], dict):  # a schedule
                over.append(f"updater.lr.steps={args.steps}")
                cfg = config.load(args.job, over)
            return cfg

        t = DistributedTrainer(job("chaos"), log=None)
        chaos = Chaos(
            t,
            args.seed,
            args.kills,
            tuple(args.gap),
            args.in_recovery,
            print,
            cluster,
            args.node_share,
        )
        t0 = time.perf_counter()
        with chaos:
            got = _compared(t.fit())
        chaos_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        want = _compared(DistributedTrainer(job("straight"), log=None).fit())
        straight_s = time.perf_counter() - t0

    report = chaos.report()
    print(f"\n{Path(args.job).name}: {args.steps} steps, checkpoint every {args.checkpoint_every}")
    print(f"seed {report['seed']}: {len(report['kills'])} of {args.kills} kills made")
    print("failures (step, role, path, restored from, steps redone, rolled back, seconds):")
    for f in report["failures"]:
        print(
            f"  step {f['step']:5d}  {f['role']:6s}  {f['recovery']:20s}  "
            f"from {f['restored_from']:5d}  redone {f['steps_redone']:3d}  "
            f"rolled back {f.get('rolled_back', f['steps_redone']):3d}  {f['restore_s']:.2f} s"
        )
    redone = sum(f["steps_redone"] for f in report["failures"])
    print(f"steps redone in all: {redone}")
    times = report["to_next_step_s"]
    if times:
        print(
            f"kill to next step: median {statistics.median(times):.2f} s "
            f"(min {min(times):.2f}, max {max(times):.2f}; {len(times)} kills)"
        )
    survived = len(times)
    print(f"kills survived (a step reported after): {survived} of {len(report['kills'])}")
    same = want.keys() == got.keys() and all(want[k].tobytes() == got[k].tobytes() for k in want)
    print(
        "final parameters and worker state bit-identical to an uninterrupted run: "
        + ("yes" if same else "NO")
    )
    print(f"wall time: under chaos {chaos_s:.1f} s, uninterrupted {straight_s:.1f} s")
    alone = [f for f in report["failures"] if f["recovery"] != "restarted"]
    settings = {**vars(args), "job": Path(args.job).name}
    figures = Report("chaos_gpu" if args.device == "gpu" else "chaos", settings)
    if times:
        figures.figures.append(Figure("kill to next step", times, " s"))
    for name, count, goal in (
        ("kills survived", survived, args.kills),
        ("final parameters and worker state bit-identical (1: yes)", int(same), 1),
        ("failures recovered without restarting every role", len(alone), ALONE * args.kills),
        ("steps redone in all", redone, None),
    ):
        figures.figures.append(Figure(name, [count], goal=goal, better="higher"))
    figures.figures.append(Figure("wall time under chaos", [chaos_s], " s"))
    figures.figures.append(Figure("wall time uninterrupted", [straight_s], " s"))
    figures.write(args.json)
    ok = same and survived == len(report["kills"]) == args.kills
    return 0 if ok else 1


def _compared(result) -> dict:
    """What the two runs must agree on: the parameters and group 0's first worker's state
    (batch norm's running statistics)."""
    return {**result.params, **{f"state:{k}": v for k, v in result.state.items()}}


if __name__ == "__main__":
    sys.exit(main())
