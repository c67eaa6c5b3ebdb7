"""One population-based-training exploit of a 256 MiB model: raysinga's object-store hand-over
against Tune's storage checkpoints on local disk, in one run::

    python benchmarks/bench_tune.py [--rounds 5] [--width 8154] [--dir DIR] [--json FILE]

The model is a dense MLP on the digits (64 -> W -> W -> 10; W = 8154 gives 256.0 MiB of float32
parameters) trained by SGD with momentum, so a checkpoint holds 512 MiB of tensors. Two Ray
actors on this node play the two trials (one CPU each, as ``tune.with_resources(..., {"cpu":
1})`` gives a trial). Each round, for each hand-over (their order alternating from round to
round), with the same code a trial of ``raysinga.tune.trainable`` runs:

- the donor trains one step of a fresh run and commits its checkpoint in ``/dev/shm``, as every
  trial does at a report; then it hands it over as ``_Reporter.report`` does
  (``_Reporter.hand_over`` and ``tune_checkpoint``) and Tune's function-trainable session
  persists the reported directory (``StorageContext.persist_current_checkpoint``, a pyarrow
  copy into ``storage_path`` on local disk, as ``tune.report`` does):

  - ``object_store`` (the default): the node's keeper actor packs the checkpoint (every file
    read and hashed) into the object store and the registry records it; Tune persists only the
    pointer, a few hundred bytes;
  - ``tune_storage`` (``handover="tune_storage"``): Tune persists the checkpoint directory.

- the receiver is given the persisted ``tune.Checkpoint`` (as ``tune.get_checkpoint()`` returns
  it after an exploit) and does what a trial does: ``start_from`` (``fetch_newest`` from the
  object store, mapped zero-copy; or the persisted directory opened with every byte hashed:
  on a local ``storage_path``, ``as_directory()`` gives that directory itself, no download, the
  best case of Tune's path), then ``Trainer(cfg, fork_from=...)`` under a new learning rate
  until its first step is done.

Timed, with wall-clock stamps taken in the two processes: the exploit, from the end of the
donor's step (its checkpoint save starts) to the donor's report being done, plus from the
receiver's start to its first step done (Trainer set-up, the data opened, the checkpoint's
tensors copied into the run, one step). The gap between the two, Tune's scheduling (a PBT
exploit stops the receiving trial and starts it again), is the same for both hand-overs and
left out. Also printed: the donor's report alone and the receiver's
fetch alone. The storage copy is read warm (just written, as in an exploit right after the
report), and every round ends with the copies removed, the objects released, ``sync``.

Goal: the exploit through the object store at least 5x faster than through Tune's storage
(the per-round ratio's median).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import tempfile
import time
from pathlib import Path

import ray
from report import Figure, Report, add_json_option, fs_type

SHM = "/dev/shm/raysinga-bench-tune"
MODES = ("object_store", "tune_storage")
STEP = 1  # the donor's step whose checkpoint is handed over
LABELS = {
    "exploit": "exploit (donor's save to receiver's first step)",
    "save": "donor: checkpoint commit in /dev/shm",
    "report": "donor: hand-over and Tune's persist",
    "fetch": "receiver: checkpoint in hand",
    "receiver": "receiver: start to first step done",
}


def job(width: int) -> dict:
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
        "train_steps": 100,
        "test_freq": 0,
        "disp_freq": 1,
    }


def trial_job(spec: dict, name: str, lr: float, run_dir: str):
    from raysinga.tune.lineage import job_for

    return job_for(
        spec,
        {"updater.lr": lr},
        name=name,
        run_dir=run_dir,
        **{"checkpoint.dir": f"{SHM}/{name}", "checkpoint.keep_last": 1},
        **{"checkpoint.object_store": False},
    )


class Trial:
    """One process playing a trial: donor or receiver, as the round asks."""

    def __init__(self, spec: dict, work: str) -> None:
        self.spec, self.work = spec, work

    def donate(self, mode: str, name: str, index: int) -> dict:
        """Train one step, commit, hand over and persist as a trial's report does; returns the
        persisted Tune checkpoint's path and the time stamps."""
        from ray import tune
        from ray.train._internal.storage import StorageContext

        from raysinga.obs.events import CheckpointCommitted, TrainStep
        from raysinga.run import Trainer
        from raysinga.tune.lineage import segment
        from raysinga.tune.trials import _Reporter, tune_checkpoint

        out: dict = {}
        lineage = [segment(name, {"updater.lr": 0.01}, 0, None)]
        reporter = _Reporter(f"tune/bench/{name}", name, lineage, 1, False, handover=mode)
        storage = StorageContext(
            self.work + "/storage", "bench", trial_dir_name=name, current_checkpoint_index=index
        )

        def on_event(ev) -> None:
            if isinstance(ev, TrainStep) and ev.step == STEP:
                out["step_done"] = time.time()
            elif isinstance(ev, CheckpointCommitted):
                out["committed"] = time.time()
                pointer = reporter.hand_over(ev.step, ev.path)
                with tempfile.TemporaryDirectory(dir=Path(ev.path).parent) as d:
                    tune_checkpoint(d, pointer, ev.path, mode)
                    ck = storage.persist_current_checkpoint(tune.Checkpoint.from_directory(d))
                out["reported"], out["path"] = time.time(), ck.path

        cfg = trial_job(self.spec, name, 0.01, f"{self.work}/{name}")
        Trainer(cfg, log=None, on_event=on_event, until=STEP).fit()
        shutil.rmtree(f"{SHM}/{name}", ignore_errors=True)
        return out

    def take_over(self, path: str, name: str) -> dict:
        """Start from the persisted Tune checkpoint at ``path`` as a trial does after an
        exploit, under a new learning rate, until its first step is done."""
        from ray import tune

        from raysinga.obs.events import TrainStep
        from raysinga.run import Trainer
        from raysinga.tune.trials import start_from

        out: dict = {"start": time.time()}
        with contextlib.ExitStack() as stack:
            source, pointer, _ = start_from(tune.Checkpoint(path), stack, lambda line: None)
            out["fetched"] = time.time()
            first = int(pointer["step"]) + 1

            def on_event(ev) -> None:
                if isinstance(ev, TrainStep) and ev.step == first:
                    out["first_step"] = time.time()

            cfg = trial_job(self.spec, name, 0.02, f"{self.work}/{name}")
            Trainer(cfg, log=None, on_event=on_event, fork_from=source, until=first).fit()
            del source
        gc.collect()
        shutil.rmtree(f"{SHM}/{name}", ignore_errors=True)
        return out


def settle() -> None:
    """Let write-back of the previous round finish, so that no one pays for another's."""
    os.sync()
    time.sleep(0.5)


def one_exploit(donor, receiver, mode: str, r: int, work: Path) -> dict[str, float]:
    from raysinga.checkpoint import objstore
    from raysinga.tune.trials import _keeper

    settle()
    name = f"r{r}-{mode}"
    d = ray.get(donor.donate.remote(mode, f"{name}-donor", r))
    t = ray.get(receiver.take_over.remote(d["path"], f"{name}-receiver"))
    key = f"tune/bench/{name}-donor"
    ray.get([objstore.registry().delete.remote(key, STEP), _keeper().delete.remote(key, STEP)])
    shutil.rmtree(work / "storage", ignore_errors=True)
    donor_s, receiver_s = d["reported"] - d["step_done"], t["first_step"] - t["start"]
    return {
        "exploit": donor_s + receiver_s,
        "report": d["reported"] - d["committed"],
        "save": d["committed"] - d["step_done"],
        "fetch": t["fetched"] - t["start"],
        "receiver": receiver_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--width", type=int, default=8154, help="the MLP's two hidden widths")
    ap.add_argument("--dir", default=None, help="Tune's storage_path (default: a temporary dir)")
    ap.add_argument("--verbose", action="store_true", help="print every round's times")
    add_json_option(ap)
    args = ap.parse_args()

    spec = job(args.width)
    w = args.width
    n_params = 64 * w + w + w * w + w + 10 * w + 10
    work = Path(tempfile.mkdtemp(prefix="bench-tune-", dir=args.dir)).resolve()
    print(
        f"MLP 64-{w}-{w}-10: {n_params:,} parameters, {n_params * 4 / (1 << 20):.1f} MiB "
        f"(checkpoint {2 * n_params * 4 / (1 << 20):.0f} MiB with momentum); Tune storage under "
        f"{work} ({fs_type(work)}); {os.cpu_count()} CPUs; {args.rounds} rounds",
        flush=True,
    )
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    times: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    try:
        actor = ray.remote(num_cpus=1)(Trial)
        donor, receiver = actor.remote(spec, str(work)), actor.remote(spec, str(work))
        one_exploit(donor, receiver, "object_store", -1, work)  # warm-up, not timed
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                got = one_exploit(donor, receiver, mode, r, work)
                for k, v in got.items():
                    times[mode].setdefault(k, []).append(v)
                if args.verbose:
                    print(
                        f"  round {r} {mode}: "
                        + ", ".join(f"{k} {v:.3f} s" for k, v in got.items())
                    )
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(SHM, ignore_errors=True)

    report = Report("bench_tune", {**vars(args), "parameters": n_params, "cpus": os.cpu_count()})
    for mode in MODES:
        print(f"\n{mode}:")
        for k, label in LABELS.items():
            report.add(Figure(f"{mode} {label}", times[mode][k], " s"))
    print()
    ours, theirs = times["object_store"]["exploit"], times["tune_storage"]["exploit"]
    speed = [t / o for t, o in zip(theirs, ours, strict=True)]
    report.add(
        Figure("exploit speed-up of the object store over Tune storage", speed, "x", 5.0, "higher")
    )
    saved = [t - o for t, o in zip(theirs, ours, strict=True)]
    report.add(Figure("time saved per exploit", saved, " s"))
    report.write(args.json)


if __name__ == "__main__":
    main()
