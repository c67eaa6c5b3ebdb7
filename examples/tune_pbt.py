"""Population-based training of the character-level GRU with Ray Tune, against a random
search of the same budget.

Both searches run the same raysinga trainable (``raysinga.tune.in_place``: SINGA's char-RNN of
``examples/chargru.yaml``, in one process per trial, on the first million characters of the
standard library's source, under a constant learning rate drawn log-uniformly) with the same
number of trials and steps and the same first draws. The random search only draws; population-
based training (PBT) also, at every report, copies the state of a trial in the top quarter by
validation loss into each trial in the bottom quarter, handed over through Ray's object store
into the receiving trial's own process (``raysinga.tune.InPlacePBT``), which goes on with its
learning rate perturbed (times 0.8 or 1.2, or drawn again). Prints each
search's best trial at the end (validation loss in bits per character) and draws every trial's
validation loss over the steps for both searches (needs matplotlib, the ``plot`` extra)::

    python examples/tune_pbt.py [--trials 8] [--steps 600] [--report-every 50] [--plot PNG]

Two runs with the defaults on 2 CPU cores (8 min 41 s and 9 min 28 s for both searches), the
validation loss of each search's best trial at the end, in bits per character:

    seed 0: PBT 1.9407 (15 exploits), random search 2.0373
    seed 1: PBT 1.9799 (19 exploits), random search 2.1301   (--seed 1)

PBT's whole population ended near its best (median 1.9605 and 1.9817), the random search's
median at 2.5479 and 2.5144: its draws near 1e-4 learn slowly, and one near 3e-2 diverged
(7.89 and 8.15 bits at the end, above the 6.6 of a uniform guess). PBT copied better trials
into those. The best trials' last learning rates: PBT's 0.0026 and 0.00076 (after
perturbations), the random search's 0.0038 and 0.0019 (its draws, constant).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import tempfile
from pathlib import Path

import ray
from ray import tune
from ray.tune.search import BasicVariantGenerator

from raysinga import tune as rtune

JOB = Path(__file__).resolve().parent / "chargru.yaml"
LR = (1e-4, 3e-2)  # wide enough that some draws are poor
# a smaller corpus than the job file's (the whole library), every 20th file held out for the
# validation pass of each report
DATA = ["data.source.max_chars=1000000", "data.source.valid_every=20"]


def search(name: str, pbt: bool, args: argparse.Namespace, storage: str) -> tune.ResultGrid:
    """``args.trials`` trials of ``args.steps`` steps each, with PBT or without a scheduler."""
    scheduler = None
    if pbt:
        scheduler = rtune.InPlacePBT(
            time_attr="training_iteration",
            perturbation_interval=1,
            hyperparam_mutations={"updater.lr": tune.loguniform(*LR)},
            quantile_fraction=0.25,
            resample_probability=0.25,
        )
        random.seed(args.seed)  # PBT's own draws (which trial, which perturbation)
    trainable = rtune.in_place(
        JOB,
        # one process per trial, on the CPU Tune gives it (the job file's topology asks for more)
        ["topology=null", f"train_steps={args.steps}", *DATA]
        + [f"{k}={args.report_every}" for k in ("test_freq", "disp_freq")],
        report_every=args.report_every,
    )
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": 1}),
        param_space={"updater.lr": tune.loguniform(*LR)},
        tune_config=tune.TuneConfig(
            metric="test_loss",
            mode="min",
            num_samples=args.trials,
            scheduler=scheduler,
            search_alg=BasicVariantGenerator(random_state=args.seed),  # the same first draws
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(name=name, storage_path=storage, verbose=0),
    )
    try:
        return tuner.fit()
    finally:
        rtune.release(name)  # the trials' checkpoints in the object store


def curves(results: tune.ResultGrid) -> list[tuple[list[int], list[float]]]:
    """Every trial's (steps, validation loss in bits per character) as it reported them."""
    out = []
    for r in results:
        df = r.metrics_dataframe
        out.append((df["step"].tolist(), (df["test_loss"] / math.log(2)).tolist()))
    return out


def plot(path: str, runs: dict[str, tune.ResultGrid]) -> None:
    import matplotlib  # noqa: PLC0415 - the `plot` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), sharey=True)
    for ax, (name, results) in zip(axes, runs.items(), strict=True):
        for steps, bits in curves(results):
            ax.plot(steps, bits, marker=".", alpha=0.8)
        ax.set_title(f"{name}: {len(results)} trials")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss, bits per character")
    axes[0].set_ylim(top=4.5)  # the poorest draws' first reports would squash the rest
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--steps", type=int, default=600, help="steps of each trial")
    ap.add_argument("--report-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="tune_pbt.png", help="where to draw the curves (PNG)")
    args = ap.parse_args()

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    runs: dict[str, tune.ResultGrid] = {}
    with tempfile.TemporaryDirectory(prefix="tune-pbt-") as storage:
        for name, pbt in (("pbt", True), ("random", False)):
            runs[name] = search(name, pbt, args, storage)
            if runs[name].errors:
                raise SystemExit(f"{name}: {runs[name].errors[0]}")
    print(f"budget: {args.trials} trials x {args.steps} steps each, per search")
    for name, results in runs.items():
        best = results.get_best_result(metric="test_loss", mode="min", scope="last").metrics
        finals = sorted(r.metrics["test_loss"] / math.log(2) for r in results)
        print(
            f"{name}: best trial validation loss {best['test_loss'] / math.log(2):.4f} bits per "
            f"character (last learning rate {best['lr']:.2g}); the population's at the end: "
            f"median {statistics.median(finals):.4f}, worst {finals[-1]:.4f}"
        )
    try:
        plot(args.plot, runs)
        print(f"plot: {args.plot}")
    except ImportError:
        print("plot: skipped (pip install -e '.[plot]' for matplotlib)")


if __name__ == "__main__":
    main()
