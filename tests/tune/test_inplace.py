"""The in-place class trainable (raysinga.tune.in_place): a real asynchronous population-based
training search on the embedded local Ray, whose exploits keep the receiving trial's process
(the same pid reports before and after), whose reports hand Tune pointers only, and whose
trials' lineages replay bit for bit."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from helpers import tune_job

import raysinga.tune as rtune
from raysinga import config
from raysinga.checkpoint import Checkpoint
from raysinga.tune.events import TrialLog, TrialStarted
from raysinga.tune.inplace import in_place
from raysinga.tune.lineage import FORMAT
from raysinga.tune.pbt import InPlacePBT
from raysinga.tune.release import SHM_ROOT

tune = pytest.importorskip("ray.tune")
from ray import cloudpickle  # noqa: E402 - after the skip where Ray lacks tune

JOB = tune_job("inplace")

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # StartTogether, in the trials


@dataclass(frozen=True)
class StartTogether:
    """A :class:`TrialLog` whose trials take their first step together: each waits at its
    fresh start until ``n`` have started (up to ``wait_s``). Otherwise a trial whose process
    started first could reach its last report before the others report at all, and asynchronous
    PBT, which compares a trial with the others' reports so far, would have nothing to exploit
    (seen on a loaded machine)."""

    log: TrialLog
    started: str  # a directory every trial can write
    n: int
    wait_s: float = 120.0

    def __call__(self, trial: str, ev) -> None:
        self.log(trial, ev)
        if isinstance(ev, TrialStarted) and ev.how == "fresh" and ev.step == 0:
            Path(self.started, trial).touch()
            deadline = time.monotonic() + self.wait_s
            while len(list(Path(self.started).iterdir())) < self.n:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)


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
    (tmp_path / "started").mkdir()
    together = StartTogether(TrialLog(str(tmp_path / "events.jsonl")), str(tmp_path / "started"), 4)
    tuner = tune.Tuner(
        tune.with_resources(
            in_place(JOB, report_every=10, on_event=together),
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


def test_a_checkpoint_on_its_way_to_the_object_store_is_mapped_where_its_trial_wrote_it(
    ray_session, tmp_path
):
    """An exploit that reads a pointer the donor handed out before its node's keeper had the
    checkpoint in the object store maps the committed files in this node's shared memory: no
    wait for the keeper (the key below is never registered, so a wait would last its whole
    timeout) and the tensors as written. Files written on another node, or gone, are not read
    there."""
    import ray  # noqa: PLC0415

    from raysinga.checkpoint import save  # noqa: PLC0415
    from raysinga.tune.trials import _mapped, fetch_newest  # noqa: PLC0415

    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = str(save(tmp_path / "trial", 7, {"fc/W": w}, meta={"step": 7}))
    node = ray.get_runtime_context().get_node_id()
    pointer = {
        "format": FORMAT,
        "key": "tune/never-registered/t0",
        "step": 7,
        "trial": "t0",
        "uri": None,
        "lineage": [],
        "pending": True,
        "shm": {"node": node, "path": path},
    }
    ck, used, where = fetch_newest(pointer, here=True)
    np.testing.assert_array_equal(ck.array("fc/W"), w)
    # still on its way: the pointer that a save of the trial that took it writes says so, and
    # a restore from that save (Tune resumes an exploited trial from it, in any process) maps
    # the files again rather than find no entry for them
    assert where == path and used == pointer
    again, used_again, _ = fetch_newest(used, here=True)
    np.testing.assert_array_equal(again.array("fc/W"), w)
    assert used_again == pointer
    elsewhere = {**pointer, "shm": {"node": "f" * len(node), "path": path}}
    assert _mapped(elsewhere) is None
    assert _mapped({**pointer, "shm": {"node": node, "path": str(tmp_path / "gone")}}) is None


class _FailsLate(tune.Trainable):
    """A trial that counts its iterations; the one with ``fails`` set raises in its second
    step, after the others have reached the perturbation point and wait there for it."""

    def setup(self, config: dict) -> None:
        self.x = 0

    def step(self) -> dict:
        self.x += 1
        if self.config["fails"] and self.iteration == 1:
            time.sleep(3.0)
            raise RuntimeError("this trial fails at its second step")
        return {"score": float(self.x), "done": self.iteration + 1 >= 6}

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        Path(checkpoint_dir, "x").write_text(str(self.x))

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        self.x = int(Path(checkpoint_dir, "x").read_text())


@pytest.mark.slow  # a real Tune search
def test_synchronous_pbt_goes_on_without_a_trial_that_failed_at_the_point(ray_session, tmp_path):
    """Synchronous PBT perturbs when the last live trial reports at the point. The trial that
    would have been last fails instead: the others are perturbed without it and run to the end
    (Tune's PBT leaves them waiting for it until the search's time budget runs out)."""
    scheduler = InPlacePBT(
        time_attr="training_iteration",
        metric="score",
        mode="max",
        perturbation_interval=2,
        hyperparam_mutations={"lr": [0.1, 0.2]},
        synch=True,
    )
    started = time.monotonic()
    results = tune.Tuner(
        _FailsLate,
        param_space={"fails": tune.grid_search([False, False, True]), "lr": 0.1},
        tune_config=tune.TuneConfig(scheduler=scheduler, time_budget_s=90),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="synch", verbose=0),
    ).fit()
    took = time.monotonic() - started
    done = sorted(r.metrics.get("training_iteration", 0) for r in results if r.error is None)
    assert [r.error is not None for r in results].count(True) == 1
    assert done == [6, 6], done
    assert took < 80, f"the search ran into its time budget ({took:.0f} s)"
