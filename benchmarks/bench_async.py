"""Asynchronous groups (Downpour) of the digits MLP: final test accuracy and samples/s for 1, 2,
4, 8 and 16 groups, in one run.

``examples/digits_mlp.yaml`` (batch 64, lr 0.05 cosine, momentum 0.9) with ``topology.preset:
downpour``, one worker per group, each worker reserving ``--cpus`` divided by the largest group
count (so every count fits the embedded Ray's logical CPUs with the same fraction), 300 steps
per group. ``updater.async_lr: groups`` (the default: every update's learning rate divided by
the number of groups); ``--also-none`` runs ``async_lr: none`` (the schedule's rate for every
update) too::

    pip install -e '.[bench,examples,plot]'
    python benchmarks/bench_async.py [--groups 1 2 4 8 16] [--steps 300] [--rounds 1]
        [--also-none] [--out DIR] [--json FILE]

Prints, per rule and group count, the final test accuracy and the samples/s of all groups
together (the median of the display windows after the first, which holds the start), each as
the median with the minimum and maximum of ``--rounds`` rounds (default 1: a round of all five
counts takes minutes). A run the divergence guard stops (``none`` at many groups) is reported
as the step it stopped at. Goal: a final test accuracy of at least 0.95 for every group count with
``async_lr: groups`` (``none`` is measured for reference). Saves ``async_loss_<rule>.png`` in
``--out`` (default the working directory): the training loss of the first round against the
samples seen by all groups (group 0's step x groups x batch), one line per group count.
``--json FILE`` writes every figure and round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from report import Figure, Report, add_json_option

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits_mlp.yaml"
GOAL_ACCURACY = 0.95  # final test accuracy of every group count with async_lr: groups
DISP = 10  # steps between training records: the points of the loss curves


def run(n_groups: int, steps: int, worker_cpus: float, rule: str) -> dict:
    """One Downpour run: its final test accuracy, samples/s and (samples seen, loss) points;
    or, where the divergence guard stopped it, the step it stopped at."""
    from raysinga import config
    from raysinga.distributed import DistributedTrainer
    from raysinga.run import Diverged

    with tempfile.TemporaryDirectory() as d:
        topology = (
            f"{{preset: downpour, n_groups: {n_groups}, workers_per_group: 1, "
            f"worker: {{cpus: {worker_cpus}}}}}"
        )
        cfg = config.load(
            EXAMPLE,
            [
                f"run_dir={d}",
                f"train_steps={steps}",
                f"disp_freq={DISP}",
                "test_freq=0",
                f"topology={topology}",
                f"updater.async_lr={rule}",
            ],
        )
        t0 = time.perf_counter()
        try:
            res = DistributedTrainer(cfg, log=lambda line: None).fit()
        except Diverged as e:
            return {"diverged": e.step, "wall_s": time.perf_counter() - t0}
        wall = time.perf_counter() - t0
    train = [r for r in res.history if r["kind"] == "train"]
    batch = cfg.data.batch_size
    # the first window holds the groups' start (their first steps and the servers' first pulls)
    rates = [r["samples_per_s"] for r in train[1:]] or [train[-1]["samples_per_s"]]
    return {
        "accuracy": res.final_eval["test_accuracy"],
        "samples_per_s": statistics.median(rates),
        "wall_s": wall,
        "curve": [(r["step"] * n_groups * batch, r["loss"]) for r in train],
    }


def plot(curves: dict[int, list[tuple[int, float]]], rule: str, steps: int, out: Path) -> Path:
    from raysinga.obs.plots import loss_scale, pyplot

    plt = pyplot("bench_async")
    fig, ax = plt.subplots(figsize=(9, 5), layout="constrained")
    for g, points in curves.items():
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, "-", label=f"{g} group{'s' if g != 1 else ''}")
    ax.set_yscale(loss_scale([y for pts in curves.values() for _, y in pts]))
    ax.set_xlabel("samples seen (all groups)")
    ax.set_ylabel("training loss")
    ax.set_title(f"digits MLP, Downpour, {steps} steps per group, updater.async_lr: {rule}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    path = out / f"async_loss_{rule}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=300, help="training steps per group")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cpus", type=float, default=8, help="the embedded Ray's logical CPUs")
    ap.add_argument("--also-none", action="store_true", help="also run updater.async_lr: none")
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for the PNG plots")
    add_json_option(ap)
    args = ap.parse_args()
    import ray

    args.out.mkdir(parents=True, exist_ok=True)
    worker_cpus = args.cpus / max(args.groups)
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    rules = ["groups", "none"] if args.also_none else ["groups"]
    runs: dict[tuple[str, int], list[dict]] = {(r, g): [] for r in rules for g in args.groups}
    for _ in range(args.rounds):
        for rule in rules:
            for g in args.groups:
                runs[rule, g].append(run(g, args.steps, worker_cpus, rule))
    print(
        f"digits MLP (examples/digits_mlp.yaml, batch 64), Downpour, 1 worker per group "
        f"({worker_cpus:g} CPU of {args.cpus:g} logical), {args.steps} steps per group, "
        f"{args.rounds} round{'s' if args.rounds != 1 else ''}, {os.cpu_count()} cores"
    )
    settings = {**vars(args), "out": str(args.out), "worker_cpus": worker_cpus}
    report = Report("bench_async", settings)
    for rule in rules:
        goal = GOAL_ACCURACY if rule == "groups" else None
        for g in args.groups:
            name = f"async_lr {rule}, {g:2d} group{'s' if g != 1 else ''}"
            stopped = [r["diverged"] for r in runs[rule, g] if "diverged" in r]
            if stopped:  # the guard stopped them: no accuracy to give
                report.add(Figure(f"{name}, stopped as diverged at step", stopped), ".0f")
                if goal is not None:  # which fails the goal
                    n = len(runs[rule, g])
                    ended = Figure(
                        f"{name}, runs ended", [n - len(stopped)], goal=n, better="higher"
                    )
                    report.add(ended, ".0f")
            rs = [r for r in runs[rule, g] if "diverged" not in r]
            if not rs:
                continue
            acc = [r["accuracy"] for r in rs]
            report.add(Figure(f"{name}, final test accuracy", acc, goal=goal, better="higher"))
            sps = [r["samples_per_s"] for r in rs]
            report.add(Figure(f"{name}, samples/s", sps, better="higher"), ",.0f")
            report.add(
                Figure(f"{name}, wall time of the run", [r["wall_s"] for r in rs], " s"), ".1f"
            )
        curves = {g: runs[rule, g][0]["curve"] for g in args.groups if "curve" in runs[rule, g][0]}
        print(f"  loss against samples seen: {plot(curves, rule, args.steps, args.out)}")
    accs = [f for f in report.figures if f.goal is not None]
    if accs:
        every = all(f.met for f in accs)
        print(
            f"goal: final test accuracy at least {GOAL_ACCURACY} for every group count "
            f"(async_lr groups): {'met' if every else 'NOT met'}"
        )
    report.write(args.json)


if __name__ == "__main__":
    main()
