"""The cost of asynchronous checkpoints to distributed training, in one run.

One job on the embedded local Ray, run with a checkpoint every 10 steps and with none. The
model has 256 MiB of float32 parameters (an 8192x8192 layer and a small head) and Adam,
so each checkpoint writes 768 MiB (parameters and two slots)::

    pip install -e '.[bench]'
    python benchmarks/bench_checkpoint_async.py [--steps 40] [--warmup 5] [--rounds 2] [--dir DIR]

Runs of the two kinds alternate (none, every 10, every 10, none, ...) so that a drift of the
machine falls on both. Prints the step time of both and the ratio of each pair of runs (median,
minimum and maximum over the pairs; the goal: at most 1.03; ``--json FILE`` writes them),
and per checkpoint the time training waited for it (at the step boundary, and in the next update
for the servers' in-memory copy of their state) and the time until it was committed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np
from report import Figure, Report, add_json_option

WIDTH, CLASSES, BATCH = 8192, 10, 32
GOAL = 1.03  # the step-time ratio with checkpoints every 10 steps to none, at most


def job(run_dir: Path, data: Path, steps: int, every: int):
    from raysinga import config

    return config.from_dict(
        {
            "name": "bench-async",
            "seed": 0,
            "model": {
                "input_shape": [WIDTH],
                "layers": [
                    {"kind": "dense", "name": "big", "units": WIDTH, "activation": "relu"},
                    {"kind": "dense", "name": "head", "units": CLASSES},
                ],
            },
            "data": {
                "source": {"kind": "npy", "x": str(data / "x.npy"), "y": str(data / "y.npy")},
                "batch_size": BATCH,
            },
            "updater": {"name": "adam", "lr": 1e-4},
            "train_steps": steps,
            "disp_freq": 5,
            "run_dir": str(run_dir),
            "checkpoint_frequency": every,
            "checkpoint": {"final": False, "keep_last": 2},
            "topology": {"preset": "sandblaster", "n_servers": 1, "workers_per_group": 1},
        }
    )


def step_times(history: list[dict], warmup: int) -> list[float]:
    """Wall-clock seconds per step of each logged window after the warm-up, as the driver saw
    it: the time the loop was blocked by a checkpoint counts."""
    return [
        BATCH / r["samples_per_s"] for r in history if r["kind"] == "train" and r["step"] > warmup
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each kind, interleaved")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary dir)")
    add_json_option(ap)
    args = ap.parse_args()

    import ray

    from raysinga.distributed import DistributedTrainer

    work = Path(tempfile.mkdtemp(prefix="bench-async-", dir=args.dir))
    try:  # its runs' checkpoints are GiBs: removed at the end
        rng = np.random.default_rng(0)
        np.save(work / "x.npy", rng.standard_normal((512, WIDTH), dtype=np.float32))
        np.save(work / "y.npy", rng.integers(0, CLASSES, 512).astype(np.int64))
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        times: dict[int, list[float]] = {0: [], 10: []}
        saved: list[dict] = []
        order = [0, 10, 10, 0] * (args.rounds // 2) + [0, 10] * (args.rounds % 2)
        for r, every in enumerate(order):
            t = DistributedTrainer(
                job(work / f"run{r}-every{every}", work, args.steps, every),
                log=lambda line: None,
                gather=False,
            )
            res = t.fit()
            times[every].append(statistics.mean(step_times(res.history, args.warmup)))
            saved += t.saved
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ray.shutdown()

    print(f"256 MiB of parameters + Adam, {args.steps} steps, batch {BATCH}, 1 worker, 1 server")
    report = Report("bench_checkpoint_async", vars(args))
    report.add(Figure("step time without checkpoints", [t * 1e3 for t in times[0]], " ms"), ".1f")
    report.add(Figure("step time, checkpoint every 10", [t * 1e3 for t in times[10]], " ms"), ".1f")
    # Each run with checkpoints against the run without beside it in the interleaved order.
    report.add(
        Figure(
            "step-time ratio, checkpoints every 10 / none",
            [c / b for b, c in zip(times[0], times[10], strict=True)],
            goal=GOAL,
        )
    )
    for s in saved:
        print(
            f"  checkpoint step {s['step']}: training waited {s['blocked'] * 1e3:6.1f} ms, "
            f"committed after {s['seconds']:.2f} s"
        )
    report.write(args.json)


if __name__ == "__main__":
    main()
