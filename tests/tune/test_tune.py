"""raysinga as a Ray Tune trainable: a real population-based training run on the embedded local
Ray hands every exploited checkpoint over through the object store (no checkpoint directory on
disk), and a trial's lineage replays bit-identically."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import tune_job

from raysinga.checkpoint import Checkpoint, CheckpointError
from raysinga.tune import trials as rtune
from raysinga.tune.release import SHM_ROOT, ReleaseStopped, release

tune = pytest.importorskip("ray.tune")

JOB = tune_job("pbt")


def test_lineage_continues_or_branches():
    fresh = rtune.continue_lineage(None, "a", {"updater": {"lr": 0.1}})
    assert fresh == [{"trial": "a", "params": {"updater.lr": 0.1}, "start": 0, "from": None}]
    pointer = {"trial": "a", "step": 20, "lineage": fresh}
    assert rtune.continue_lineage(pointer, "a", {"updater.lr": 0.1}) == fresh  # a restart
    got = rtune.continue_lineage(pointer, "b", {"updater.lr": 0.2})
    assert got[-1] == {
        "trial": "b",
        "params": {"updater.lr": 0.2},
        "start": 20,
        "from": {"trial": "a", "step": 20},
    }
    schedule = {"updater.lr": {"kind": "cosine", "lr": 0.1, "steps": 60}}
    assert rtune.flat_overrides(schedule) == schedule  # a schedule is one value


def test_bad_arguments_are_refused_before_any_trial(tmp_path):
    with pytest.raises(ValueError, match="report_every must be a positive"):
        rtune.trainable(JOB, report_every=-1)
    with pytest.raises(ValueError, match="keep must be a positive"):
        rtune.trainable(JOB, keep=0)
    with pytest.raises(CheckpointError, match="not a raysinga Tune checkpoint"):
        rtune.read_pointer(tmp_path)


@pytest.mark.slow
def test_pbt_hands_checkpoints_over_in_memory_and_a_lineage_replays_bit_exact(
    ray_session, tmp_path
):
    from ray.tune.schedulers import PopulationBasedTraining  # noqa: PLC0415

    pbt = PopulationBasedTraining(
        time_attr="training_iteration",
        perturbation_interval=2,
        hyperparam_mutations={"updater.lr": tune.loguniform(1e-3, 2e-1)},
        quantile_fraction=0.25,
        resample_probability=0.5,
        # synchronous: at each perturbation point the worst trial exploits the best, whatever
        # the order the trials reported in. Asynchronous PBT copies a trial only where that one
        # was in the upper quantile at its own last report, which the order decides: it can end
        # a run of 6 reports without one exploit.
        synch=True,
    )
    tuner = tune.Tuner(
        tune.with_resources(rtune.trainable(JOB, report_every=10), {"cpu": 1}),
        param_space={"updater.lr": tune.grid_search([0.0005, 0.002, 0.02, 0.08])},
        tune_config=tune.TuneConfig(scheduler=pbt, metric="test_loss", mode="min"),
        run_config=tune.RunConfig(name="pbt", storage_path=str(tmp_path / "tune"), verbose=0),
    )
    results = tuner.fit()
    assert not results.errors, results.errors
    assert len(results) == 4
    # every trial ran to the end; some went on from another trial's checkpoint
    finals = [rtune.read_pointer(r.checkpoint.path) for r in results]
    seen = [
        {k: r.metrics.get(k) for k in ("trial_id", "training_iteration", "step", "forked_from")}
        | {"checkpoint": (p["trial"], p["step"], [s["start"] for s in p["lineage"]])}
        for r, p in zip(results, finals, strict=True)
    ]
    assert [p["step"] for p in finals] == [60] * 4, seen
    forked = [p for p in finals if len(p["lineage"]) > 1]
    assert forked, "PBT exploited no trial"
    assert all(p["uri"] is None for p in finals)  # no disk copy: the exploits read objects
    # no checkpoint directory anywhere on disk, none left in shared memory
    assert not list((tmp_path / "tune").rglob("step-*"))
    assert not list(Path(SHM_ROOT, "pbt").glob("*"))
    # the trial with the longest lineage, replayed here, ends on its final state bit for bit
    pointer = max(finals, key=lambda p: len(p["lineage"]))
    want = rtune.fetch(pointer)
    got = rtune.replay(pointer["lineage"], JOB, tmp_path / "replay", until=pointer["step"])
    for name in want.names("param"):
        np.testing.assert_array_equal(got.params[name], want.array(name))
    import ray  # noqa: PLC0415

    from raysinga.checkpoint import objstore  # noqa: PLC0415

    held = [e["run"] for e in ray.get(objstore.registry().list.remote()) if "/pbt/" in e["run"]]
    # keep=2 per trial, counting what each earlier start of a restored trial left
    assert all(held.count(k) <= 2 for k in held), sorted(held)
    assert release("pbt") >= 4  # the final checkpoints, one per trial


def _one_trial(trainable, tmp_path, name: str, stop: int):
    """A search of one trial, stopped by Tune after its report at step ``stop``: the pointer
    of that report."""
    tuner = tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=tune.RunConfig(
            name=name, storage_path=str(tmp_path / "tune"), stop={"step": stop}, verbose=0
        ),
    )
    (result,) = tuner.fit()
    assert result.error is None, result.error
    return result.checkpoint


def _straight(job: dict, tmp_path, trainer):
    from raysinga import config  # noqa: PLC0415

    cfg = config.from_dict({**job, "run_dir": str(tmp_path / "straight")})
    return trainer(cfg, log=lambda line: None).fit()


@pytest.mark.slow
def test_tune_storage_handover_forks_from_the_directory_tune_persisted(ray_session, tmp_path):
    """handover="tune_storage" (what benchmarks/bench_tune.py times against): the checkpoint
    directory is the Tune checkpoint, in storage_path, no object is made, and a trial that
    starts from it goes on bit-identically to the run straight through."""
    import contextlib  # noqa: PLC0415

    from raysinga.run.trainer import Trainer  # noqa: PLC0415

    with pytest.raises(ValueError, match="handover must be one of"):
        rtune.trainable(JOB, handover="disk")
    trainable = rtune.trainable(JOB, report_every=10, handover="tune_storage")
    tune_ck = _one_trial(trainable, tmp_path, "pbt-disk", 30)
    ck = Checkpoint.open(tune_ck.path)  # a whole raysinga checkpoint, pointer beside it
    assert ck.step == 30 and rtune.read_pointer(tune_ck.path)["step"] == 30
    assert release("pbt-disk") == 0  # nothing went into the object store
    with contextlib.ExitStack() as stack:  # what a trial Tune starts from it does
        source, pointer, where = rtune.start_from(tune_ck, stack, print)
        assert source.step == 30 and Path(where).is_dir()
        cfg = rtune.job_for(JOB, pointer["lineage"][-1]["params"], run_dir=str(tmp_path / "b"))
        got = Trainer(cfg, log=None, fork_from=source).fit()
    want = _straight(JOB, tmp_path, Trainer)
    for name in want.params:
        np.testing.assert_array_equal(got.params[name], want.params[name])


@pytest.mark.slow
def test_a_distributed_trial_hands_its_checkpoint_to_servers_through_the_object_store(
    ray_session, tmp_path
):
    """A one-worker, one-server trial's checkpoint, read by another run's servers from the
    object store (as a trial that PBT copies it into does), goes on bit-identically."""
    from raysinga.distributed import DistributedTrainer  # noqa: PLC0415

    job = {**JOB, "train_steps": 40, "topology": {"workers_per_group": 1, "n_servers": 1}}
    tune_ck = _one_trial(rtune.trainable(job, report_every=10), tmp_path, "pbt-dist", 20)
    pointer = rtune.read_pointer(tune_ck.path)
    assert pointer["step"] == 20 and pointer["uri"] is None
    source, _, ref = rtune.fetch_newest(pointer)
    assert source.step == 20 and not isinstance(ref, str)  # an ObjectRef, not a path
    assert not list(tmp_path.rglob("step-*"))
    cfg = rtune.job_for(job, {}, run_dir=str(tmp_path / "b"))
    got = DistributedTrainer(cfg, log=lambda line: None, fork_from=ref).fit()
    want = _straight(job, tmp_path, DistributedTrainer)
    for name in want.params:
        assert got.params[name].tobytes() == want.params[name].tobytes(), name
    # Tune stopped the trial at step 20, before its run freed its placement group, which Ray
    # keeps while the Tune job (this process) lives: release removes it (ray_session checks
    # that every CPU comes back)
    release("pbt-dist")
    from ray.util import placement_group_table  # noqa: PLC0415

    left = [
        g["name"]
        for g in placement_group_table().values()
        if (g["name"] or "").startswith("raysinga-tune:pbt-dist/") and g["state"] != "REMOVED"
    ]
    assert not left, left


@pytest.mark.slow
def test_asha_stops_trials_and_their_checkpoints_leave_the_object_store(ray_session, tmp_path):
    from ray.tune.schedulers import ASHAScheduler  # noqa: PLC0415

    from raysinga.checkpoint import objstore  # noqa: PLC0415

    releaser = ReleaseStopped()
    asha = ASHAScheduler(
        time_attr="training_iteration", max_t=6, grace_period=1, reduction_factor=2
    )
    tuner = tune.Tuner(
        rtune.trainable(JOB, report_every=10, keep=1),
        # one at a time, the best first: each later trial meets the rungs the better ones set
        param_space={"updater.lr": tune.grid_search([0.05, 0.01, 0.0003, 0.0001])},
        tune_config=tune.TuneConfig(
            scheduler=asha, metric="test_loss", mode="min", max_concurrent_trials=1
        ),
        run_config=tune.RunConfig(
            name="asha", storage_path=str(tmp_path), verbose=0, callbacks=[releaser]
        ),
    )
    results = tuner.fit()
    assert not results.errors, results.errors
    steps = {r.metrics["trial_id"]: r.metrics["step"] for r in results}
    stopped = {t for t, s in steps.items() if s < 60}
    assert stopped, f"ASHA stopped no trial: {steps}"
    import ray  # noqa: PLC0415

    held = [e for e in ray.get(objstore.registry().list.remote()) if "/asha/" in e["run"]]
    # the stopped trials hold nothing; each finished one its final checkpoint only (keep=1)
    assert sorted(e["run"].rsplit("/", 1)[1] for e in held) == sorted(set(steps) - stopped)
    assert all(e["step"] == 60 for e in held)
    release("asha")
