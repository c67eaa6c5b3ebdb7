"""The validation split (``data.validation``) and the best checkpoint kept by its metric
(``checkpoint.keep_best``), in the single-process trainer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from raysinga import config
from raysinga.checkpoint import Checkpoint
from raysinga.config import ConfigError
from raysinga.data import digits
from raysinga.data.splits import hold_out, open_splits
from raysinga.run import Trainer

JOB = """
name: best
seed: 0
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 32, activation: relu}
    - {kind: dense, name: out, units: 10}
data:
  source: {kind: digits}
  batch_size: 32
  validation: 0.2
updater: {name: sgd, lr: 1.5}
train_steps: 100
disp_freq: 50
checkpoint_frequency: 10
checkpoint: {keep_last: 1, keep_best: valid_loss}
"""


def job(tmp_path: Path, *more: str) -> config.JobConfig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    f = tmp_path / "job.yaml"
    f.write_text(JOB)
    return config.load(f, [f"run_dir={tmp_path / 'run'}", *more])


def steps_on_disk(run: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*"))


# --- the split --------------------------------------------------------------------------------


def test_validation_rows_are_a_fixed_disjoint_part_of_the_training_split():
    base = digits("train")
    train, valid = hold_out(base, 0.2, seed=0)
    n = len(base)
    assert len(valid) == round(0.2 * n) and len(train) + len(valid) == n
    rows_t, rows_v = train.rows(np.arange(len(train))), valid.rows(np.arange(len(valid)))
    assert sorted(np.concatenate([rows_t, rows_v]).tolist()) == list(range(n))  # a partition
    assert sorted(rows_v.tolist()) != list(range(len(valid)))  # spread, not the first rows
    x, y = valid.get(np.array([0, 5]))
    bx, by = base.get(rows_v[[0, 5]])
    np.testing.assert_array_equal(x, bx)
    np.testing.assert_array_equal(y, by)
    again = hold_out(digits("train"), 0.2, seed=0)[1]
    np.testing.assert_array_equal(again.rows(np.arange(len(again))), rows_v)
    other = hold_out(base, 0.2, seed=1)[1]
    assert not np.array_equal(other.rows(np.arange(len(other))), rows_v)
    assert train.num_classes == 10 and train.sample_shape == base.sample_shape


def test_open_splits_without_validation_is_the_source_as_it_was():
    splits = open_splits({"kind": "digits"}, None)
    assert splits.valid is None and set(splits.held_out()) == {"test"}
    assert len(splits.train) == len(digits("train"))


@pytest.mark.parametrize(
    "value, named",
    [
        (0, "0 < f < 1"),
        (1.0, "0 < f < 1"),
        (True, "0 < f < 1"),
        ("a tenth", "0 < f < 1"),
        ({"fraction": 0.1, "seed": -1}, "data.validation.seed"),
        ({"fraction": 0.1, "rows": 3}, "unknown key"),
    ],
)
def test_a_bad_validation_setting_is_refused_by_name(tmp_path, value, named):
    with pytest.raises(ConfigError, match="data.validation") as e:
        job(tmp_path, f"data.validation={json.dumps(value)}")
    assert named in str(e.value)


def test_keep_best_names_a_metric_that_exists(tmp_path):
    with pytest.raises(ConfigError, match="keep_best: expected an evaluation metric"):
        job(tmp_path, "checkpoint.keep_best=accuracy")
    with pytest.raises(ConfigError, match="needs a validation split"):
        job(tmp_path, "data.validation=null")
    # a test split the source does not have, and a metric the loss does not measure
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((100, 64)).astype(np.float32))
    np.save(tmp_path / "y.npy", rng.integers(0, 10, 100))
    cfg = job(
        tmp_path,
        f"data.source={{kind: npy, x: {tmp_path / 'x.npy'}, y: {tmp_path / 'y.npy'}}}",
        "checkpoint.keep_best=test_loss",
    )
    with pytest.raises(ValueError, match="keep_best: test_loss needs a test split"):
        Trainer(cfg, log=None)
    cfg = job(tmp_path, "checkpoint.keep_best=valid_bits")
    with pytest.raises(ValueError, match="has no bits; use valid_loss"):
        Trainer(cfg, log=None)


# --- the best checkpoint ----------------------------------------------------------------------


def best_of(history: list[dict], metric: str, steps: list[int]) -> int:
    scores = {r["step"]: r[metric] for r in history if r["kind"] == "eval"}
    return min(steps, key=lambda s: (scores[s], s))


def test_the_best_checkpoint_by_validation_loss_outlives_keep_last(tmp_path):
    lines: list[str] = []
    res = Trainer(job(tmp_path), log=lines.append).fit()
    evals = [r for r in res.history if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == list(range(10, 101, 10))  # at every checkpoint
    assert all("valid_loss" in r and "test_loss" in r for r in evals)
    best = best_of(res.history, "valid_loss", list(range(10, 101, 10)))
    assert best != 100  # this job's validation loss is lowest mid-run: the case tested here
    assert steps_on_disk(tmp_path / "run") == [best, 100]
    assert res.best["step"] == best and res.best["metric"] == "valid_loss"
    assert res.best["value"] == min(r["valid_loss"] for r in evals)
    ck = Checkpoint.open(res.best["path"], verify="full")
    assert ck.step == best and ck.meta["run"]["best"]["step"] == best
    assert any(f"valid_loss {res.best['value']:.4f}" in line for line in lines)


def test_a_resumed_run_keeps_the_best_checkpoint_of_before_the_resume(tmp_path):
    whole = Trainer(job(tmp_path / "whole"), log=None).fit()
    first = Trainer(job(tmp_path, "train_steps=50"), log=None).fit()
    best_first = best_of(first.history, "valid_loss", list(range(10, 51, 10)))
    assert steps_on_disk(tmp_path / "run") == sorted({best_first, 50})
    res = Trainer(job(tmp_path), log=None, resume=True).fit()
    assert res.best == {**whole.best, "path": res.best["path"]}  # the same, found across it
    assert steps_on_disk(tmp_path / "run") == sorted({whole.best["step"], 100})


def test_keep_best_by_accuracy_keeps_the_highest(tmp_path):
    res = Trainer(job(tmp_path, "checkpoint.keep_best=test_accuracy"), log=None).fit()
    evals = {r["step"]: r["test_accuracy"] for r in res.history if r["kind"] == "eval"}
    top = max(evals.values())
    assert res.best["value"] == top
    assert res.best["step"] == min(s for s, v in evals.items() if v == top)
    assert res.best["step"] in steps_on_disk(tmp_path / "run")


def test_keep_best_set_only_on_a_resume_names_a_checkpoint_that_is_there(tmp_path):
    # evaluated every 10 steps before, but with only the newest checkpoint kept
    Trainer(
        job(tmp_path, "train_steps=50", "test_freq=10", "checkpoint={keep_last: 1}"), log=None
    ).fit()
    assert steps_on_disk(tmp_path / "run") == [50]
    res = Trainer(job(tmp_path), log=None, resume=True).fit()
    on_disk = steps_on_disk(tmp_path / "run")
    assert res.best["step"] in on_disk and Path(res.best["path"]).is_dir()
    assert on_disk == sorted({best_of(res.history, "valid_loss", [50, *range(60, 101, 10)]), 100})
