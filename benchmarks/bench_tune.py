"""Population-based training of a 256 MiB model end to end, with Tune's own scheduling: what a
user feels of an exploit and of a report, raysinga's in-place trials against Tune's storage
checkpoints, in one run::

    python benchmarks/bench_tune.py [--reports 8] [--width 8154] [--modes ...] [--json FILE]

The model is a dense MLP on the digits (64 -> W -> W -> 10; W = 8154 gives 256.0 MiB of float32
parameters) trained by SGD with momentum, so a checkpoint holds 512 MiB of tensors. Each mode
runs one search: two trials of one CPU each, PBT (asynchronous, ``quantile_fraction=0.5``,
perturbing at every report: the worse trial takes the better one's state, with a learning
rate drawn from a list that is mostly poor, so that it is often the worse again), a report
every ``--every`` steps, ``--reports`` reports a trial. The modes:

- ``raysinga-local`` / ``raysinga-s3``: :func:`raysinga.tune.in_place` trials under
  :class:`raysinga.tune.InPlacePBT` (PBT's choices, made by Tune's PBT code; the exploit in the
  trial's process), ``reuse_actors`` on (what ``raysinga tune`` runs): reports hand Tune
  pointers, tensors go through the object store; Tune's ``storage_path`` on local disk / S3;
- ``tune-local``: Tune's storage path (``raysinga.tune.trainable(handover="tune_storage")``:
  every report's checkpoint directory is the Tune checkpoint, copied to ``storage_path``, and a
  receiving trial starts from the copy) on local disk, with Tune's defaults (a new process per
  exploit);
- ``tune-local-reuse``: the same with ``reuse_actors=True`` (the process is kept, raysinga's
  trainer is built again);
- ``tune-s3``: Tune's storage path with ``storage_path`` on an S3 server on loopback (moto's
  server mode, in a process of its own), Tune's defaults.

Every trial writes its run starts, steps and reports with wall-clock times
(:class:`raysinga.tune.TrialLog`). Measured from them:

- **exploit**: from the end of the receiving trial's last step before its state is replaced (its
  report begins) to the start of its first step with the donor's state (the state loaded in the
  trial's process, :class:`RunStarted`). It holds the receiver's report, Tune's decision, the
  stop and start (or reset) of the trial, the donor's save where PBT asks for it, the transfer
  and the load.
- **report**: the time between the end of a reported step and the end of the next, less the
  median of the steps without a report in the same search: what a report adds to training.
  Reports followed by an exploit or a pause are left out.

Goals: the exploit at least 10x faster than Tune's storage path on the S3 server and at least
2x faster than Tune's on local disk with ``reuse_actors``; one report at least 10x cheaper than
Tune's on the S3 server (ratios of medians, raysinga on the same storage as the peer).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
from report import Figure, Report, add_json_option

MODES = ("raysinga-local", "tune-local", "tune-local-reuse", "raysinga-s3", "tune-s3")
BUCKET = "bench-tune"
KEYS = {"access_key": "testing", "secret_key": "testing"}


def job(width: int, steps: int) -> dict:
    return {
        "name": "bench-tune",
        "seed": 0,
        "model": {
            "input_shape": [64],
            "layers": [
                {"kind": "dense", "name": "fc1", "units": width, "activation": "relu"},
                {"kind": "dense", "name": "fc2", "units": width, "activation": "relu"},
                {"kind": "dense", "name": "out", "units": 10},
            ],
        },
        "data": {"source": {"kind": "digits"}, "batch_size": 64},
        "updater": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "train_steps": steps,
        # one evaluation, at the end: a report is then a checkpoint and its hand-over only
        "test_freq": steps,
        "disp_freq": 1,
    }


@contextlib.contextmanager
def moto_server():
    """An S3 server on loopback in a process of its own (moto's server mode); yields the
    pyarrow filesystem that talks to it, its bucket made."""
    import pyarrow.fs as pafs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        fs = pafs.S3FileSystem(
            endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1", **KEYS
        )
        for _ in range(100):
            try:
                pafs.S3FileSystem(
                    endpoint_override=f"127.0.0.1:{port}",
                    scheme="http",
                    region="us-east-1",
                    allow_bucket_creation=True,
                    **KEYS,
                ).create_dir(BUCKET)
                break
            except OSError:
                time.sleep(0.2)
        yield fs
    finally:
        proc.terminate()
        proc.wait()


def search(mode: str, spec: dict, args: argparse.Namespace, work: Path, s3) -> list[dict]:
    """One PBT search of two trials; returns every trial's logged events, oldest first."""
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    from raysinga import tune as rtune

    log = work / f"{mode}.jsonl"
    ours = mode.startswith("raysinga")
    if ours:
        trainable = rtune.in_place(spec, report_every=args.every, on_event=rtune.TrialLog(str(log)))
    else:
        trainable = rtune.trainable(
            spec,
            report_every=args.every,
            handover="tune_storage",
            on_event=rtune.TrialLog(str(log)),
        )
    # raysinga's trials are exploited in their process (InPlacePBT), Tune's as Tune does it
    pbt = (rtune.InPlacePBT if ours else PopulationBasedTraining)(
        time_attr="training_iteration",
        perturbation_interval=1,
        burn_in_period=1,  # both trials have started by their second report
        quantile_fraction=0.5,
        # resampled from a list that is mostly poor: the receiving trial is often the worse at
        # its next report, and is exploited again (more exploits a search)
        resample_probability=1.0,
        hyperparam_mutations={"updater.lr": [0.0002, 0.0005, 0.02]},
    )
    on_s3 = mode.endswith("s3")
    storage = f"{BUCKET}/{mode}" if on_s3 else str(work / "storage")
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": 1}),
        param_space={"updater.lr": tune.grid_search([0.02, 0.0005])},
        tune_config=tune.TuneConfig(
            scheduler=pbt, metric="loss", mode="min", reuse_actors=ours or mode.endswith("reuse")
        ),
        run_config=tune.RunConfig(
            name=mode,
            storage_path=storage,
            storage_filesystem=s3 if on_s3 else None,
            stop={"step": spec["train_steps"]},
            # PBT restores a donor's checkpoint that the donor may have reported past meanwhile:
            # Tune's storage keeps 3 a trial on local disk; on S3, where reports are slow, it
            # was seen to delete one that an exploit then read (moto keeps every object in
            # memory: 6 reports of 2 trials hold 6 GiB)
            checkpoint_config=tune.CheckpointConfig(num_to_keep=None if on_s3 else 3),
            verbose=0,
        ),
    )
    results = tuner.fit()
    if results.errors:
        raise RuntimeError(f"{mode}: {results.errors}")
    rtune.release(mode)
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        shutil.copy(log, Path(args.logs, log.name))
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return sorted(events, key=lambda e: e["t"])


def measure(events: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """Exploit times, report costs and plain step times of one search's events."""
    by_trial: dict[str, list[dict]] = {}
    for e in events:
        by_trial.setdefault(e["trial"], []).append(e)
    exploits, reports, steps = [], [], []
    for evs in by_trial.values():
        forked = ""  # where the trial's state last came from (TRIAL@STEP)
        last_step: dict | None = None  # the end of the trial's newest step
        pending: dict | None = None  # a start whose kind (exploit or not) its report tells
        reported: set[int] = set()
        for e in evs:
            if e["kind"] == "report":
                if pending is not None and e["forked_from"] != forked:  # took another's state
                    exploits.append(pending["t"] - pending["from"])
                pending, forked = None, e["forked_from"]
                reported.add(e["step"])
            elif e["kind"] == "start" and last_step is not None:
                pending = {"t": e["t"], "from": last_step["t"]}
                last_step = None
            elif e["kind"] == "step":
                if last_step is not None and last_step["step"] + 1 == e["step"]:
                    gap = e["t"] - last_step["t"]
                    (reports if last_step["step"] in reported else steps).append(gap)
                last_step = e
    plain = statistics.median(steps) if steps else 0.0
    return exploits, [r - plain for r in reports], steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reports", type=int, default=6, help="reports a trial")
    ap.add_argument("--every", type=int, default=2, help="steps between reports")
    ap.add_argument("--width", type=int, default=8154, help="the MLP's two hidden widths")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--dir", default=None, help="where local storage goes (default: /tmp)")
    ap.add_argument("--logs", default=None, help="keep the trials' event logs (JSON lines) here")
    add_json_option(ap)
    args = ap.parse_args()

    w = args.width
    n_params = 64 * w + w + w * w + w + 10 * w + 10
    spec = job(w, args.every * args.reports)
    work = Path(tempfile.mkdtemp(prefix="bench-tune-", dir=args.dir)).resolve()
    print(
        f"MLP 64-{w}-{w}-10: {n_params:,} parameters, {n_params * 4 / (1 << 20):.1f} MiB "
        f"(checkpoint {2 * n_params * 4 / (1 << 20):.0f} MiB with momentum); 2 trials, "
        f"{args.reports} reports of {args.every} steps each; {os.cpu_count()} CPUs; "
        "S3: moto's server mode on 127.0.0.1",
        flush=True,
    )
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=4 << 30,
        include_dashboard=False,
        log_to_driver=False,
    )
    # the machine may be shared: its load, before and after, goes into the results
    load = {"load_before": os.getloadavg()[0]}
    got: dict[str, tuple[list[float], list[float], list[float]]] = {}
    try:
        with moto_server() as s3:
            for mode in args.modes:
                t0 = time.perf_counter()
                got[mode] = measure(search(mode, spec, args, work, s3))
                e, r, _ = got[mode]
                print(
                    f"  {mode}: {len(e)} exploits, {len(r)} reports measured "
                    f"({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    report = Report(
        "bench_tune",
        {
            **vars(args),
            "parameters": n_params,
            "cpus": os.cpu_count(),
            "s3": "moto server mode on 127.0.0.1",
            **load,
            "load_after": os.getloadavg()[0],
        },
    )
    for mode, (e, r, s) in got.items():
        print(f"\n{mode}:")
        if e:
            report.add(
                Figure(f"{mode}: exploit, last report to first step with the donor's", e, " s")
            )
        if r:
            report.add(Figure(f"{mode}: one report, added to training", r, " s"))
        report.add(Figure(f"{mode}: one step without a report", s, " s"))
    print()
    med = {
        m: (statistics.median(e) if e else None, statistics.median(r) if r else None)
        for m, (e, r, _) in got.items()
    }

    def ratio(name: str, theirs: float | None, ours: float | None, goal: float | None) -> None:
        if theirs is None or ours is None:
            print(f"{name}: not measured")
            return
        report.add(Figure(name, [theirs / max(ours, 1e-3)], "x", goal, "higher"))

    ratio(
        "exploit: raysinga's speed-up over Tune's storage on S3",
        med.get("tune-s3", (None,))[0],
        med.get("raysinga-s3", (None,))[0],
        10.0,
    )
    ratio(
        "exploit: raysinga's speed-up over Tune on local disk with reuse_actors",
        med.get("tune-local-reuse", (None,))[0],
        med.get("raysinga-local", (None,))[0],
        2.0,
    )
    ratio(
        "exploit: raysinga's speed-up over Tune on local disk, Tune's defaults",
        med.get("tune-local", (None,))[0],
        med.get("raysinga-local", (None,))[0],
        None,
    )
    ratio(
        "report: raysinga's saving over Tune's storage on S3",
        med.get("tune-s3", (None, None))[1],
        med.get("raysinga-s3", (None, None))[1],
        10.0,
    )
    report.write(args.json)


if __name__ == "__main__":
    main()
