"""raysinga as a Ray Tune trainable: a real population-based training run on the embedded local
Ray hands every exploited checkpoint over through the object store (no checkpoint directory on
disk), and a trial's lineage replays bit-identically."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from raysinga import tune as rtune
from raysinga.checkpoint import Checkpoint, CheckpointError

tune = pytest.importorskip("ray.tune")

JOB = {
    "name": "pbt",
    "seed": 3,
    "model": {
        "input_shape": [64],
        "layers": [
            {"kind": "dense", "name": "fc1", "units": 32, "activation": "relu"},
            {"kind": "dropout", "name": "drop", "rate": 0.1},
            {"kind": "dense", "name": "out", "units": 10},
        ],
    },
    "data": {"source": {"kind": "digits"}, "batch_size": 32},
    "updater": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
    "train_steps": 60,
    "disp_freq": 10,
}


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
    assert [p["step"] for p in finals] == [60] * 4, finals
    forked = [p for p in finals if len(p["lineage"]) > 1]
    assert forked, "PBT exploited no trial"
    assert all(p["uri"] is None for p in finals)  # no disk copy: the exploits read objects
    # no checkpoint directory anywhere on disk, none left in shared memory
    assert not list((tmp_path / "tune").rglob("step-*"))
    assert not list(Path(rtune.SHM_ROOT, "pbt").glob("*"))
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
    assert rtune.release("pbt") >= 4  # the final checkpoints, one per trial


def test_tune_storage_handover_forks_from_the_directory_tune_persisted(ray_session, tmp_path):
    """handover="tune_storage" (what benchmarks/bench_tune.py times against): the checkpoint
    directory is the Tune checkpoint, in storage_path, and no object is made."""
    from ray.tune.schedulers import PopulationBasedTraining  # noqa: PLC0415

    with pytest.raises(ValueError, match="handover must be one of"):
        rtune.trainable(JOB, handover="disk")
    pbt = PopulationBasedTraining(
        time_attr="training_iteration",
        perturbation_interval=2,
        hyperparam_mutations={"updater.lr": tune.loguniform(1e-3, 2e-1)},
        quantile_fraction=0.5,
        synch=True,  # both trials meet at each perturbation, however fast either runs
    )
    tuner = tune.Tuner(
        tune.with_resources(
            rtune.trainable(JOB, report_every=10, handover="tune_storage"), {"cpu": 1}
        ),
        param_space={"updater.lr": tune.grid_search([0.0005, 0.08])},
        tune_config=tune.TuneConfig(scheduler=pbt, metric="test_loss", mode="min"),
        run_config=tune.RunConfig(name="pbt-disk", storage_path=str(tmp_path / "tune"), verbose=0),
    )
    results = tuner.fit()
    assert not results.errors, results.errors
    finals = [rtune.read_pointer(r.checkpoint.path) for r in results]
    assert [p["step"] for p in finals] == [60, 60], finals
    assert any(len(p["lineage"]) > 1 for p in finals), "PBT exploited no trial"
    for r in results:  # every reported checkpoint is a whole raysinga checkpoint on disk
        ck = Checkpoint.open(r.checkpoint.path)
        assert ck.step == 60 and ck.names("param")
    assert rtune.release("pbt-disk") == 0  # nothing went into the object store


def test_a_distributed_trial_forks_through_the_object_store(ray_session, tmp_path):
    """Two trials of a one-worker, one-server job; PBT copies the better into the other, whose
    servers read the tensors from the object store."""
    from ray.tune.schedulers import PopulationBasedTraining  # noqa: PLC0415

    pbt = PopulationBasedTraining(
        time_attr="training_iteration",
        perturbation_interval=2,
        hyperparam_mutations={"updater.lr": [0.001, 0.01, 0.05]},
        quantile_fraction=0.5,
        synch=True,  # both trials meet at each perturbation, however their roles start
    )
    job = {**JOB, "train_steps": 80, "topology": {"workers_per_group": 1, "n_servers": 1}}
    tuner = tune.Tuner(
        rtune.trainable(job, report_every=10),
        param_space={"updater.lr": tune.grid_search([0.0003, 0.05])},
        tune_config=tune.TuneConfig(scheduler=pbt, metric="test_loss", mode="min"),
        run_config=tune.RunConfig(name="pbt-dist", storage_path=str(tmp_path), verbose=0),
    )
    results = tuner.fit()
    assert not results.errors, results.errors
    finals = [rtune.read_pointer(r.checkpoint.path) for r in results]
    assert [p["step"] for p in finals] == [80, 80]
    assert any(len(p["lineage"]) > 1 for p in finals), "PBT exploited no trial"
    assert not list(tmp_path.rglob("step-*"))
    rtune.release("pbt-dist")


def test_asha_stops_trials_and_their_checkpoints_leave_the_object_store(ray_session, tmp_path):
    from ray.tune.schedulers import ASHAScheduler  # noqa: PLC0415

    from raysinga.checkpoint import objstore  # noqa: PLC0415

    release = rtune.ReleaseStopped()
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
            name="asha", storage_path=str(tmp_path), verbose=0, callbacks=[release]
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
    rtune.release("asha")
