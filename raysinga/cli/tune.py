"""``raysinga tune``: a hyperparameter search of a job with Ray Tune from the command line
(:mod:`raysinga.tune`'s trainable), the replay of one of its trials, and the release of its
checkpoints from the object store.

A search dimension is ``KEY=SAMPLER(ARGS)``: a dotted job key and one of Ray Tune's samplers,
its arguments YAML values (``updater.lr=loguniform(1e-4,1e-1)``, ``data.batch_size=choice(32,64)``).
Every expression, the job with each end of every range, the scheduler and the metric are checked
before Ray starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from raysinga import config
from raysinga.checkpoint.format import MANIFEST
from raysinga.config import ConfigError
from raysinga.tune.lineage import POINTER, load_job, read_pointer

from .tune_search import Search, check_searches


def choose_metric(job: config.JobConfig, metric: str | None, mode: str | None) -> tuple[str, str]:
    """The metric a search optimizes (default: ``valid_loss`` where the job holds out a
    validation split, else ``test_loss``) and its mode (min for losses, max for accuracies)."""
    from raysinga.data import has_split  # noqa: PLC0415

    has = {"valid": job.data.validation is not None, "test": has_split(job.data.source, "test")}
    if metric is None:
        metric = "valid_loss" if has["valid"] else "test_loss"
    split = metric.partition("_")[0]
    if split in has and not has[split]:
        what = "data.validation" if split == "valid" else "a test split"
        known = [m for m, ok in (("valid_loss", has["valid"]), ("test_loss", has["test"])) if ok]
        raise ConfigError(
            f"--metric {metric}: not reported by this job (it has no {what}); "
            f"it reports loss{''.join(', ' + k for k in known)}, ..."
        )
    if mode is None:
        if metric.endswith("loss") or metric.endswith("_bits"):
            mode = "min"
        elif metric.endswith("_accuracy"):
            mode = "max"
        else:
            raise ConfigError(f"--metric {metric}: give --mode min or max")
    return metric, mode


def make_scheduler(args: argparse.Namespace, searches: list[Search], reports: int) -> Any:
    """The Tune scheduler ``--scheduler`` names, over ``reports`` reports per trial."""
    interval = args.perturbation_interval or max(1, reports // 4)
    if args.scheduler == "fifo":
        return None
    if args.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler  # noqa: PLC0415

        return ASHAScheduler(time_attr="training_iteration", max_t=reports, grace_period=1)
    if args.scheduler == "pbt":
        from raysinga.tune import InPlacePBT  # noqa: PLC0415

        # Tune's PBT, exploiting in-place trials (raysinga.tune.in_place) in their process
        return InPlacePBT(
            time_attr="training_iteration",
            perturbation_interval=interval,
            synch=args.synch,
            hyperparam_mutations={s.key: s.domain(mutation=True) for s in searches},
        )
    discrete = [s.text for s in searches if s.sampler in ("choice", "grid")]
    if discrete:
        raise ConfigError(f"--scheduler pb2 searches ranges only, not {', '.join(discrete)}")
    missing = [m for m in ("GPy", "sklearn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"--scheduler pb2 needs {' and '.join(missing)} (pip install GPy scikit-learn)"
        )
    from raysinga.tune.pb2 import InPlacePB2  # noqa: PLC0415

    # Tune's PB2, exploiting in-place trials in their process as InPlacePBT does
    return InPlacePB2(
        time_attr="training_iteration",
        perturbation_interval=interval,
        synch=args.synch,
        hyperparam_bounds={s.key: [s.args[0], s.args[1]] for s in searches},
    )


# ------------------------------------------------------------------------ the command


def run(args: argparse.Namespace) -> int:
    """``raysinga tune``: search, or (``--replay``) replay a trial, or (``--release``) drop a
    search's object-store checkpoints."""
    if args.until is not None and not args.replay:
        raise ValueError("--until goes with --replay")
    if args.replay and args.release:
        raise ValueError("--replay and --release exclude one another")
    job = load_job(args.config, args.set)
    if args.replay:
        return replay_trial(args, job)
    if args.release:
        return release_search(args)
    return search(args, job)


def search(args: argparse.Namespace, job: config.JobConfig) -> int:
    from raysinga import tune as rtune  # noqa: PLC0415

    if args.report_every is not None and args.report_every < 1:
        raise ValueError(f"--report-every must be 1 step or more, got {args.report_every}")
    if args.trials < 1:
        raise ValueError(f"--trials must be 1 or more, got {args.trials}")
    if args.perturbation_interval is not None and args.perturbation_interval < 1:
        raise ValueError("--perturbation-interval must be 1 report or more")
    if args.keep < 1:
        raise ValueError(f"--keep must be 1 checkpoint or more, got {args.keep}")
    if args.synch and args.scheduler not in ("pbt", "pb2"):
        raise ConfigError(f"--synch goes with --scheduler pbt or pb2, not {args.scheduler}")
    searches = check_searches(args.search, job)
    metric, mode = choose_metric(job, args.metric, args.mode)
    # the interval raysinga.tune.trainable would choose, decided here to size the schedulers
    every = args.report_every or job.checkpoint_frequency or job.test_freq
    every = every or -(-job.train_steps // 10)
    if metric.startswith(("test_", "valid_")) and job.test_freq and every % job.test_freq:
        raise ConfigError(
            f"--metric {metric}: the job evaluates every test_freq={job.test_freq} steps, so "
            f"not at every report (every {every} steps); make --report-every a multiple of it, "
            "or --set test_freq=0 (each trial then evaluates at every report)"
        )
    kw = {"keep": args.keep, "checkpoint_dir": args.checkpoint_dir}
    # a trial in one process keeps it across exploits; a distributed trial (a topology) and
    # Tune's storage hand-over run as a function trainable, one run per trial start
    in_place = job.topology is None and args.handover == "object_store"
    if in_place:
        trainable = rtune.in_place(args.config, args.set, report_every=every, **kw)
    else:
        kw["handover"] = args.handover
        trainable = rtune.trainable(args.config, args.set, report_every=every, **kw)
    scheduler = make_scheduler(args, searches, -(-job.train_steps // every))
    name = args.name or f"{job.name}-tune-{time.strftime('%Y%m%d-%H%M%S')}"
    storage = str(Path(args.storage).resolve()) if "://" not in args.storage else args.storage
    import ray  # noqa: PLC0415
    from ray import tune  # noqa: PLC0415

    started = _connect(args.address, job.modules)
    try:
        # synchronous PBT waits at each point for every trial: with fewer CPUs than trials (a
        # trial takes one), Tune's was seen to wait forever
        total = args.trials * math.prod(len(s.args) for s in searches if s.sampler == "grid")
        if args.synch and total > (cpus := int(ray.cluster_resources().get("CPU", 0))):
            raise ConfigError(
                f"--synch: all {total} trials must run at once, and the cluster has {cpus} "
                "CPU(s) (a trial takes one); run fewer trials, or without --synch"
            )
        tuner = tune.Tuner(
            trainable,
            param_space={s.key: s.domain() for s in searches},
            tune_config=tune.TuneConfig(
                scheduler=scheduler,
                metric=metric,
                mode=mode,
                num_samples=args.trials,
                # an in-place trial that Tune pauses and starts again (synchronous PBT, PB2, too
                # few CPUs) goes on in a process already running
                reuse_actors=in_place,
            ),
            run_config=tune.RunConfig(
                name=name,
                storage_path=storage,
                verbose=0 if args.quiet else 1,
                # a trial at its last step is done: PBT must not exploit it (it would restart at
                # that step, report it again, and could be exploited again, without end)
                stop={"step": job.train_steps},
                # a trial the scheduler stops early (ASHA) or that fails leaves the object store
                callbacks=[rtune.ReleaseStopped()],
            ),
        )
        results = tuner.fit()
        failed = print_results(results, [s.key for s in searches], metric, mode)
    finally:
        _disconnect(started)
    if started == "embedded":
        print("raysinga: the embedded Ray is stopped; the trials' checkpoints went with it")
    else:
        where = f" --address {args.address}" if args.address else ""
        print(
            f"raysinga: the trials' newest checkpoints stay in Ray's object store "
            f"(`raysinga tune {args.config} --name {name} --release{where}` drops them)"
        )
    return 1 if failed else 0


def print_results(results: Any, keys: list[str], metric: str, mode: str) -> int:
    """The table of trials and the best of them; returns how many failed."""
    from .runs import table  # noqa: PLC0415

    rows = []
    for r in results:
        pointer = read_pointer(r.checkpoint.path) if r.checkpoint is not None else None
        value = r.metrics.get(metric)
        row = {
            "trial": r.metrics.get("trial_id") or Path(r.path).name,
            metric: "failed" if r.error else "-" if value is None else f"{value:.4f}",
            "step": r.metrics.get("step"),
            "segments": len(pointer["lineage"]) if pointer else None,
            "value": value,
            "checkpoint": r.checkpoint.path if r.checkpoint is not None else None,
            "error": r.error,
        }
        row.update({k: _short(r.config.get(k)) for k in keys})
        rows.append(row)
    rows.sort(key=lambda row: row["trial"])
    cols = [("trial", "trial"), *((k, k) for k in keys), (metric, metric)]
    print(table(rows, [*cols, ("step", "step"), ("segments", "lineage")]))
    for row in rows:
        if row["error"] is not None:
            first = str(row["error"]).strip().splitlines()
            print(f"trial {row['trial']} failed: {first[-1] if first else row['error']!r}")
    scored = [row for row in rows if row["value"] is not None and row["checkpoint"]]
    if scored:
        pick = min if mode == "min" else max
        best = pick(scored, key=lambda row: row["value"])
        print(
            f"best trial {best['trial']} by {metric} ({best['value']:.4f}, {mode}): "
            f"step {best['step']}, Tune checkpoint {best['checkpoint']}"
        )
    return sum(row["error"] is not None for row in rows)


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _connect(address: str | None, modules: tuple[str, ...] | list[str] = ()) -> str | None:
    """Ray as ``raysinga train`` joins or starts it (with the job's ``modules`` shipped),
    saying which; ``"embedded"`` or ``"joined"`` where this command did, None where this
    process already used one."""
    import ray  # noqa: PLC0415

    from raysinga.cluster.connect import connect, joins_cluster  # noqa: PLC0415
    from raysinga.cluster.shipping import runtime_env  # noqa: PLC0415

    if ray.is_initialized():
        return None
    joins = joins_cluster(address)
    print(connect(address, runtime_env(modules, own=joins)))
    return "joined" if joins else "embedded"


def _disconnect(started: str | None) -> None:
    """Stop the embedded Ray this command started (or leave the cluster it joined)."""
    import ray  # noqa: PLC0415

    if started:
        ray.shutdown()


# ------------------------------------------------------------------------ replay, release


def trial_checkpoint(where: str) -> Path:
    """The Tune checkpoint ``where`` names: itself (or its pointer file), or a trial directory's
    final one (the newest ``checkpoint_*`` holding a raysinga pointer)."""
    p = Path(where)
    if p.is_file() or (p / POINTER).is_file():
        return p
    if not p.is_dir():
        raise ValueError(f"--replay {where}: no such trial directory or Tune checkpoint")
    found = [c for c in p.glob("checkpoint_*") if (c / POINTER).is_file()]
    if not found:
        hint = (
            "; give one of its trial directories"
            if any(p.glob(f"*/checkpoint_*/{POINTER}"))
            else ""
        )
        raise ValueError(
            f"--replay {where}: holds no raysinga Tune checkpoint (checkpoint_*/{POINTER}){hint}"
        )
    return max(found, key=lambda c: (int(read_pointer(c)["step"]), c.name))


def replay_trial(args: argparse.Namespace, job: config.JobConfig) -> int:
    """Run a trial's lineage again here and compare it with the trial's checkpoint, where that
    is still in the object store (or has a disk copy)."""
    import numpy as np  # noqa: PLC0415

    from raysinga import tune as rtune  # noqa: PLC0415
    from raysinga.checkpoint import Checkpoint, CheckpointError  # noqa: PLC0415
    from raysinga.cluster.connect import joins_cluster  # noqa: PLC0415

    where = trial_checkpoint(args.replay)
    pointer = read_pointer(where)
    step = int(pointer["step"])
    until = step if args.until is None else args.until
    if not 0 < until <= job.train_steps:
        raise ValueError(f"--until {until}: a step in [1, train_steps={job.train_steps}]")
    lineage = [s for s in pointer["lineage"] if s["start"] < until]
    trial = pointer["trial"]
    print(f"raysinga: replaying trial {trial} ({len(lineage)} segment(s)) to step {until}")
    with tempfile.TemporaryDirectory(prefix="raysinga-replay-") as d:
        result = rtune.replay(lineage, job.raw, d, until=until)
    want, why = None, "--until is not the checkpoint's step"
    here = where if where.is_dir() else where.parent
    if until == step and (here / MANIFEST).is_file():
        # an in-place trial's final result: the checkpoint's files are in Tune's storage
        want = Checkpoint.open(here, verify="full")
    elif until == step:
        import ray  # noqa: PLC0415

        if ray.is_initialized() or joins_cluster(args.address):
            started = _connect(args.address)
            try:
                want = rtune.fetch(pointer)
            except CheckpointError as e:
                why = str(e)
            finally:
                _disconnect(started)
        elif pointer.get("uri"):
            want = Checkpoint.open(pointer["uri"], verify="full")
        else:
            why = "no Ray cluster runs to hold it (the search's embedded Ray stopped with it)"
    if want is None:
        print(f"the trial's checkpoint is not compared: {why}")
        print(f"replayed to step {until}: {_final_metrics(result.history, until)}")
        return 0
    names = list(want.names("param"))
    differ = [n for n in names if not np.array_equal(result.params[n], want.array(n))]
    if differ:
        print(f"replayed to step {until}: the parameters DIFFER from trial {trial}'s: {differ}")
        return 1
    print(
        f"replayed to step {until}: the parameters equal trial {trial}'s at step {step}, "
        f"bit for bit ({len(names)} tensors)"
    )
    return 0


def _final_metrics(history: list[dict[str, Any]], step: int) -> str:
    """The training loss at ``step`` and the evaluation there, where there is one."""
    train = [r for r in history if r.get("kind") == "train"]
    parts = [f"loss {train[-1]['loss']:.4f}"] if train else []
    if train and train[-1]["step"] != step:  # the last one displayed (every disp_freq)
        parts[0] += f" (at step {train[-1]['step']})"
    for r in history:
        if r.get("kind") == "eval" and r["step"] == step:
            parts += [f"{k} {v:.4f}" for k, v in r.items() if k not in ("kind", "step")]
    return "  ".join(parts) or "nothing recorded"


def release_search(args: argparse.Namespace) -> int:
    from raysinga import tune as rtune  # noqa: PLC0415
    from raysinga.cluster.connect import joins_cluster  # noqa: PLC0415

    if not args.name:
        raise ValueError("--release goes with --name NAME, the search's name")
    import ray  # noqa: PLC0415

    if not ray.is_initialized() and not joins_cluster(args.address):
        raise ValueError(
            "--release: no Ray cluster to ask (give --address or RAY_ADDRESS, or run it where "
            "`ray start` runs); an embedded Ray holds no earlier search's checkpoints"
        )
    started = _connect(args.address)
    try:
        gone = rtune.release(args.name)
    finally:
        _disconnect(started)
    print(f"dropped {gone} object-store checkpoint(s) of search {args.name}")
    return 0
