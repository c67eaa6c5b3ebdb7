"""The in-place class trainable (raysinga.tune.in_place): a real asynchronous population-based
training search on the embedded local Ray, whose exploits keep the receiving trial's process
(the same pid reports before and after), whose reports hand Tune pointers only, and whose
trials' lineages replay bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import tune_job

import raysinga.tune as rtune
from raysinga import config
from raysinga.checkpoint import Checkpoint
from raysinga.tune.events import TrialLog
from raysinga.tune.inplace import in_place
from raysinga.tune.pbt import InPlacePBT
from raysinga.tune.release import SHM_ROOT

tune = pytest.importorskip("ray.tune")

JOB = tune_job("inplace")


def test_a_job_with_a_topology_or_bad_arguments_is_refused_before_any_trial():
    with pytest.raises(config.ConfigError, match="set topology: null"):
        in_place({**JOB, "topology": {"workers_per_group": 1}})
    with pytest.raises(ValueError, match="report_every must be a positive"):
        in_place(JOB, report_every=-1)
    with pytest.raises(ValueError, match="keep must be a positive"):
        in_place(JOB, keep=0)


@pytest.mark.slow
def test_pbt_exploits_in_place_and_a_lineage_replays_bit_exact(ray_session, tmp_path):
    pbt = InPlacePBT(
        time_attr="training_iteration",
        perturbation_interval=1,
        # no perturbation at the first two reports: every trial has started by then, so that
        # asynchronous PBT does not pause the first to report for one still starting (Tune's
        # PBT pauses a trial while another waits), and the trials' processes stay theirs
        burn_in_period=2,
        hyperparam_mutations={"updater.lr": tune.loguniform(1e-3, 2e-1)},
        quantile_fraction=0.25,
        resample_probability=0.5,
    )
    tuner = tune.Tuner(
        tune.with_resources(
            in_place(JOB, report_every=10, on_event=TrialLog(str(tmp_path / "events.jsonl"))),
            {"cpu": 1},
        ),
        param_space={"updater.lr": tune.grid_search([0.0002, 0.002, 0.02, 0.08])},
        tune_config=tune.TuneConfig(
            scheduler=pbt, metric="test_loss", mode="min", reuse_actors=True
        ),
        run_config=tune.RunConfig(name="inplace", storage_path=str(tmp_path / "tune"), verbose=0),
    )
    results = tuner.fit()
    assert not results.errors, results.errors
    assert len(results) == 4
    finals = [rtune.read_pointer(r.checkpoint.path) for r in results]
    assert [p["step"] for p in finals] == [60] * 4, finals
    assert any(len(p["lineage"]) > 1 for p in finals), "PBT exploited no trial"
    # no process started after the first four, and each exploit kept the receiving trial's
    # process: the same pid reported before and after it
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    first = {}
    for e in events:
        first.setdefault(e["trial"], e["pid"])
    assert {e["pid"] for e in events} == set(first.values()) and len(first) == 4
    # every exploit started the receiving trial's next run in the process of its last report
    # (Tune may also pause a trial where another waits, and start it again in any process it
    # reuses: such runs say "restore")
    last: dict[str, dict] = {}
    exploits = 0
    for e in events:
        if e["kind"] == "report":
            last[e["trial"]] = e
        elif e["kind"] == "run" and e["how"] == "exploit":
            exploits += 1
            assert e["pid"] == last[e["trial"]]["pid"], f"{e['trial']} restarted for an exploit"
    assert exploits, "no exploit in place"
    print(f"{exploits} exploits in place")
    # reports handed Tune pointers: the only checkpoint files in storage are the final copies
    shards = list((tmp_path / "tune").rglob("shard-0.arrow"))
    assert len(shards) == 4 and all(
        Path(r.checkpoint.path) in {s.parent for s in shards} for r in results
    )
    assert not list(Path(SHM_ROOT, "inplace").glob("*"))
    # the trial with the longest lineage, replayed here, ends on its final state bit for bit
    best = max(results, key=lambda r: len(rtune.read_pointer(r.checkpoint.path)["lineage"]))
    pointer = rtune.read_pointer(best.checkpoint.path)
    want = rtune.fetch(pointer)
    stored = Checkpoint.open(best.checkpoint.path)  # the final copy Tune keeps
    got = rtune.replay(pointer["lineage"], JOB, tmp_path / "replay", until=pointer["step"])
    for name in want.names("param"):
        np.testing.assert_array_equal(got.params[name], want.array(name))
        np.testing.assert_array_equal(got.params[name], stored.array(name))
    import ray  # noqa: PLC0415

    from raysinga.checkpoint import objstore  # noqa: PLC0415

    held = [e["run"] for e in ray.get(objstore.registry().list.remote()) if "/inplace/" in e["run"]]
    assert all(held.count(k) <= 2 for k in held), sorted(held)
    assert rtune.release("inplace") >= 4
