"""Checkpoints of the single-process trainer (raysinga.run.local_checkpoint): exact resume, a
checkpoint damaged at rest set aside for the next older one, --init-from, bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import checkpoint_tensors as tensors

from raysinga import config
from raysinga.checkpoint import Checkpoint, CheckpointError, steps
from raysinga.run import Trainer

# Batch norm (state), dropout (the RNG), Adam (slots and counts), a schedule with state.
JOB = """
name: local
seed: 3
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 32, activation: relu}
    - {kind: batchnorm, name: bn1}
    - {kind: dropout, name: drop, rate: 0.2}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 32}
updater: {name: adam, lr: {kind: cosine, lr: 0.01, steps: 40, min_lr: 0.0001}}
train_steps: 30
disp_freq: 5
test_freq: 0
checkpoint_frequency: 10
"""


def job(d: Path, *more: str) -> config.JobConfig:
    d.mkdir(parents=True, exist_ok=True)
    f = d / "job.yaml"
    if not f.exists():
        f.write_text(JOB)
    return config.load(f, [f"run_dir={d}", *more])


def train(d: Path, *more: str, lines: list[str] | None = None, **kw):
    log = (lambda line: None) if lines is None else lines.append
    return Trainer(job(d, *more), log=log, **kw).fit()


def flip_a_byte(ck_dir: Path) -> None:
    """Damage the parameter shard in the middle of its data: sizes stay right, so only a full
    hash of the file finds it."""
    f = ck_dir / "shard-0.arrow"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x10
    f.write_bytes(bytes(b))


def truncate(ck_dir: Path) -> None:
    f = ck_dir / "shard-0.arrow"
    f.write_bytes(f.read_bytes()[:-100])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    d = tmp_path_factory.mktemp("straight")
    return d, train(d)


def test_resume_is_bit_exact(straight, tmp_path):
    sd, sres = straight
    train(tmp_path, "train_steps=10")
    res = train(tmp_path, resume=True)
    assert tensors(tmp_path / "checkpoints/step-30") == tensors(sd / "checkpoints/step-30")
    # the result says where the run's newest checkpoint is
    assert (res.checkpoint, res.checkpoint_step) == (str(tmp_path / "checkpoints/step-30"), 30)
    assert res.init_report is None
    again = train(tmp_path, resume=True)  # nothing left to train: the one resumed from
    assert (again.checkpoint, again.checkpoint_step) == (res.checkpoint, 30)
    for k in sres.params:
        assert res.params[k].tobytes() == sres.params[k].tobytes(), k
    want = [(r["step"], r["loss"]) for r in sres.history if r["kind"] == "train"]
    assert [(r["step"], r["loss"]) for r in res.history if r["kind"] == "train"] == want


def test_resume_from_a_chosen_checkpoint_moves_the_newer_ones_aside(straight, tmp_path):
    """``--resume PATH``: the run goes on from that checkpoint, bit-exact; its newer
    checkpoints are kept aside, out of the way of this and later resumes."""
    sd, sres = straight
    shutil.copytree(sd / "checkpoints", tmp_path / "checkpoints")
    lines: list[str] = []
    res = train(tmp_path, resume=str(tmp_path / "checkpoints" / "step-10"), lines=lines)
    for k in sres.params:
        assert res.params[k].tobytes() == sres.params[k].tobytes(), k
    assert steps(tmp_path / "checkpoints") == [30, 20, 10]  # written again by this run
    aside = sorted(p.name.split(".")[0] for p in (tmp_path / "checkpoints").glob("*.abandoned-*"))
    assert aside == ["step-20", "step-30"]
    assert sum("--resume step-10: the newer step-" in x for x in lines) == 2, lines
    with pytest.raises(CheckpointError, match="not a checkpoint of run 'local'"):
        train(tmp_path / "other", resume=str(tmp_path / "checkpoints" / "step-10"))
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        train(tmp_path, resume=str(tmp_path / "checkpoints" / "step-15"))


@pytest.mark.parametrize("damage", [flip_a_byte, truncate], ids=["flipped_byte", "truncated"])
def test_a_damaged_newest_checkpoint_is_set_aside_for_the_one_before(straight, tmp_path, damage):
    """Resume finds step 20 damaged (a flipped byte only a full hash sees, or a truncated file
    that size checks see), moves it aside, resumes from step 10, writes step 20 again, and
    ends where the uninterrupted run ends."""
    sd, _ = straight
    train(tmp_path, "train_steps=20")
    damage(tmp_path / "checkpoints/step-20")
    lines: list[str] = []
    train(tmp_path, resume=True, lines=lines)
    assert any("moved aside to" in line and "step-20" in line for line in lines), lines
    assert any("resuming 'local' at step 10" in line for line in lines), lines
    aside = [p.name for p in (tmp_path / "checkpoints").iterdir() if ".invalid-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("step-20.invalid-")
    assert steps(tmp_path / "checkpoints") == [30, 20, 10]
    assert tensors(tmp_path / "checkpoints/step-30") == tensors(sd / "checkpoints/step-30")


def test_every_checkpoint_damaged_is_a_clear_error(tmp_path):
    train(tmp_path, "train_steps=20")
    for s in (10, 20):
        flip_a_byte(tmp_path / "checkpoints" / f"step-{s}")
    with pytest.raises(
        CheckpointError, match="no checkpoint of run 'local' .* passed verification"
    ):
        train(tmp_path, resume=True)
    assert steps(tmp_path / "checkpoints") == []  # both moved aside, nothing deleted
    assert len(list((tmp_path / "checkpoints").glob("step-*.invalid-*"))) == 2


def test_init_from_loads_what_matches_and_verifies(straight, tmp_path):
    sd, _ = straight
    (tmp_path / "job.yaml").write_text(JOB.replace("name: out", "name: head"))
    lines: list[str] = []
    res = train(
        tmp_path,
        "train_steps=1",
        "updater.lr=0.0",
        lines=lines,
        init_from=str(sd / "checkpoints/step-30"),
    )
    assert any("matched 4, missing 2, unexpected 2" in line for line in lines), lines
    assert res.init_report.missing == ["head/W", "head/b"]  # the report, as an object
    ck = Checkpoint.open(sd / "checkpoints/step-30")
    np.testing.assert_array_equal(res.params["fc1/W"], ck.array("fc1/W"))
    # a prefix stripped, then renamed: fc1/W -> 1/W -> fc1/W; out/ -> head/
    (tmp_path / "renamed").mkdir()
    (tmp_path / "renamed" / "job.yaml").write_text(JOB.replace("name: out", "name: head"))
    lines.clear()
    res = train(
        tmp_path / "renamed",
        "train_steps=1",
        "updater.lr=0.0",
        "init.strip_prefix=fc",
        'init.rename={"1/": "fc1/", "out/": "head/"}',
        lines=lines,
        init_from=str(sd / "checkpoints/step-30"),
    )
    assert any("matched 6, missing 0, unexpected 0" in line for line in lines), lines
    for a, b in (("fc1/W", "fc1/W"), ("head/W", "out/W"), ("head/b", "out/b")):
        np.testing.assert_array_equal(res.params[a], ck.array(b))
    bad = tmp_path / "bad"
    shutil.copytree(sd / "checkpoints/step-30", bad)
    flip_a_byte(bad)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        train(tmp_path / "again", init_from=str(bad))


def test_resume_without_a_checkpoint_and_a_refused_fresh_start(tmp_path):
    with pytest.raises(CheckpointError, match="--resume: no valid checkpoint of run 'local'"):
        train(tmp_path, resume=True)
    train(tmp_path, "train_steps=10", resume="auto")
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        train(tmp_path, "train_steps=10")
    train(tmp_path, "train_steps=10", fresh=True)
    assert steps(tmp_path / "checkpoints") == [10]


def test_object_store_copies_belong_to_their_run_directory(ray_session, tmp_path):
    """A run's object-store copies are keyed by name and checkpoint directory: a run of the
    same name elsewhere, or an earlier run of this directory started over, is not resumed."""
    import ray

    from raysinga.checkpoint import objstore
    from raysinga.run.registry import key as registry_key

    on = ("checkpoint.object_store=true", "name=objstore-local")
    reg = objstore.registry()
    keys = [registry_key("objstore-local", tmp_path / d / "checkpoints") for d in ("a", "b")]

    def kept() -> list[list[int]]:
        return [sorted(e["step"] for e in ray.get(reg.list.remote(k))) for k in keys]

    try:
        train(tmp_path / "a", "train_steps=20", *on)  # a/: steps 10 and 20 in the object store
        train(tmp_path / "b", "train_steps=10", *on)
        lines: list[str] = []
        train(tmp_path / "b", "train_steps=20", *on, resume=True, lines=lines)
        assert any("resuming 'objstore-local' at step 10 from" in line for line in lines), lines
        assert kept() == [[10, 20], [10, 20]]
        shutil.rmtree(tmp_path / "a" / "checkpoints")
        train(tmp_path / "a", "train_steps=10", *on)  # started over: a/'s old copies go
        assert kept() == [[10], [10, 20]]
    finally:
        for k in keys:
            for e in ray.get(reg.list.remote(k)):
                ray.get(reg.delete.remote(k, e["step"]))


# --- resume refuses what would change the meaning of the data cursor or the parameters -------


@pytest.mark.parametrize(
    "change, named",
    [
        ("data.batch_size=16", "data.batch_size is 16 in the job but 32"),
        ("data.shuffle=false", "data.shuffle is False in the job but True"),
        ("data.source.test_fraction=0.3", "training samples of shape"),  # other sample count
        ("data.source.seed=7", "other training samples"),  # same count, other rows
    ],
)
def test_resume_refuses_data_that_moves_the_cursor_onto_other_samples(tmp_path, change, named):
    """Review defect: the cursor counts batches, so a changed batch size, order or data set
    would silently continue on other samples."""
    train(tmp_path, "train_steps=10")
    with pytest.raises(CheckpointError, match=named):
        train(tmp_path, change, resume=True)
    assert steps(tmp_path / "checkpoints") == [10]  # nothing written


def test_a_checkpoint_from_before_the_data_record_is_checked_on_its_job(tmp_path):
    """Checkpoints written before ``run.data`` existed: the batch size of the job they saved."""
    from raysinga.checkpoint import save

    train(tmp_path / "a", "train_steps=10")
    ck = Checkpoint.open(tmp_path / "a/checkpoints/step-10")
    meta = ck.meta
    del meta["run"]["data"]
    arrays = {
        k: {n: np.array(ck.array(n)) for n in ck.names(k)} for k in ("param", "slot", "state")
    }
    save(tmp_path / "b/checkpoints", 10, arrays["param"], arrays["slot"], arrays["state"], meta)
    with pytest.raises(CheckpointError, match="data.batch_size is 16 in the job but 32"):
        train(tmp_path / "b", "data.batch_size=16", resume=True)
    train(tmp_path / "b", "train_steps=12", resume=True)  # unchanged: resumes


def test_resume_refuses_another_dtype(tmp_path):
    """Review defect: resume checked shapes only; the run then failed later in a kernel."""
    train(tmp_path, "train_steps=10")
    with pytest.raises(CheckpointError, match=r"trains in float64 but the checkpoint holds fc1/W"):
        train(tmp_path, "dtype=float64", resume=True)


def test_a_run_dir_in_rays_copy_of_the_working_directory_is_warned_about(tmp_path):
    """Under `ray job submit --working-dir .`, the default run_dir is relative to Ray's
    temporary copy of the working directory: the run says so, once, at its start."""
    copy = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0a1b"
    lines: list[str] = []
    train(copy / "runs" / "local", "train_steps=2", lines=lines)
    warned = [x for x in lines if "temporary copy" in x]
    assert warned == [
        f"raysinga: warning: run_dir {copy / 'runs' / 'local'} is inside Ray's temporary copy "
        "of the job's working directory, which Ray deletes; set it to a lasting place "
        "(--set run_dir=PATH)"
    ]
    lines.clear()
    train(tmp_path / "elsewhere", "train_steps=2", lines=lines)
    assert not [x for x in lines if "temporary copy" in x]


def test_the_job_as_run_is_kept_in_the_runs_record(tmp_path):
    import yaml

    train(tmp_path, "train_steps=2", "updater.lr=0.5")
    kept = yaml.safe_load((tmp_path / "job.resolved.yaml").read_text())
    assert kept["train_steps"] == 2 and kept["updater"]["lr"] == 0.5  # after --set
    assert config.from_dict(kept) == job(tmp_path, "train_steps=2", "updater.lr=0.5")
    train(tmp_path, "train_steps=4", resume=True)  # a later start: the job as it runs now
    assert yaml.safe_load((tmp_path / "job.resolved.yaml").read_text())["train_steps"] == 4
    assert (tmp_path / "job.yaml").read_text() == JOB  # the user's own file is left alone
