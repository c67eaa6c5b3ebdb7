"""The single-process trainer: reaches the accuracy goals, and is exactly reproducible."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from raysinga import ModelSpec, Net, StepContext, config
from raysinga.data import digits
from raysinga.trainer import Trainer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(name: str, tmp_path: Path, *overrides: str):
    cfg = config.load(EXAMPLES / name, [f"run_dir={tmp_path}", *overrides])
    return Trainer(cfg, log=lambda line: None).fit()


def test_digits_mlp_example_reaches_95_percent(tmp_path):
    res = run("digits_mlp.yaml", tmp_path)
    assert res.final_eval["test_accuracy"] >= 0.95
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(res.history)
    last = [json.loads(line) for line in lines[-2:]]
    # the final evaluation, then the final checkpoint, committed and recorded
    assert [r["kind"] for r in last] == ["eval", "checkpoint"]
    assert last[0]["step"] == last[1]["step"] == 1500
    assert last[1]["seconds"] > 0 and last[1]["blocked_ms"] > 0
    assert (tmp_path / "checkpoints" / "step-1500").is_dir()


@pytest.mark.slow
def test_digits_cnn_example_reaches_97_percent(tmp_path):
    assert run("digits_cnn.yaml", tmp_path).final_eval["test_accuracy"] >= 0.97


def test_two_runs_are_bit_identical(tmp_path):
    # The CNN has dropout and batch norm: both must be deterministic too.
    a = run("digits_cnn.yaml", tmp_path / "a", "train_steps=30", "disp_freq=10")
    b = run("digits_cnn.yaml", tmp_path / "b", "train_steps=30", "disp_freq=10")
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k])
    for k in a.state:
        np.testing.assert_array_equal(a.state[k], b.state[k])
    assert [r.get("loss") for r in a.history] == [r.get("loss") for r in b.history]


def test_any_partition_of_a_batch_gives_the_same_gradient():
    """What a worker group relies on: parts of a batch, each with the group's batch size as the
    loss denominator, sum to the whole batch's gradient (dropout included)."""
    spec = ModelSpec.from_dict(
        {
            "input_shape": [64],
            "layers": [
                {"kind": "dense", "name": "fc1", "units": 32, "activation": "relu"},
                {"kind": "dropout", "name": "drop", "rate": 0.5},
                {"kind": "dense", "name": "out", "units": 10},
            ],
        }
    )
    net = Net(spec, dtype="float64")
    params = net.init_params(0)
    x, y = digits("train").get(np.arange(12))
    x = x.astype(np.float64)
    _, whole, _ = net.loss_and_grads(params, {}, x, y, StepContext(True, seed=1, step=3))
    total = {k: np.zeros_like(v) for k, v in whole.items()}
    for lo, hi in [(0, 5), (5, 9), (9, 12)]:
        ctx = StepContext(True, seed=1, step=3, sample_offset=lo)
        _, g, _ = net.loss_and_grads(params, {}, x[lo:hi], y[lo:hi], ctx, denom=12)
        for k in total:
            total[k] += g[k]
    for k in whole:
        np.testing.assert_allclose(total[k], whole[k], rtol=1e-12, atol=1e-15)


def test_model_and_data_mismatch_is_a_clear_error(tmp_path):
    with pytest.raises(
        ValueError, match=r"samples have shape \[1, 8, 8\], model.input_shape is \[64\]"
    ):
        run("digits_mlp.yaml", tmp_path, "data.source.sample_shape=[1, 8, 8]")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_diverging_loss_stops_with_advice(tmp_path):
    with pytest.raises(FloatingPointError, match="lower updater.lr"):
        run("digits_mlp.yaml", tmp_path, "updater.lr=1e6", "updater.momentum=0.99")
