"""Mistakes that used to cost a whole run: bad data found only at the end, NaN trained on and
checkpointed, a resume past the job's end. Each is refused before step 0, or stops the run
before a checkpoint can take a non-finite state, with one line that says why."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import cli_error

from raysinga import config
from raysinga.checkpoint import Checkpoint, steps
from raysinga.run import Trainer
from raysinga.run.finite import NonFiniteState

JOB = """
name: bad
seed: 1
model:
  input_shape: [8]
  layers:
    - {{kind: dense, name: fc1, units: 16, activation: relu}}
    - {{kind: dense, name: out, units: 3}}
data:
  source: {{kind: npy, x: {x}, y: {y}, test: {{x: {tx}, y: {ty}}}}}
  batch_size: 16
updater: {{name: sgd, lr: 0.05}}
train_steps: {steps}
disp_freq: 5
test_freq: 0
checkpoint_frequency: 5
{topology}
"""
TOPOLOGY = "topology: {preset: sandblaster, n_servers: 1, workers_per_group: 2}"


def data(d: Path, x=None, y=None, tx=None, ty=None) -> dict[str, Path]:
    """Four .npy files of a small 3-class problem, any of them replaced."""
    rng = np.random.default_rng(0)
    arrays = {
        "x": rng.normal(size=(200, 8)).astype(np.float32) if x is None else x,
        "y": rng.integers(0, 3, 200) if y is None else y,
        "tx": rng.normal(size=(50, 8)).astype(np.float32) if tx is None else tx,
        "ty": rng.integers(0, 3, 50) if ty is None else ty,
    }
    out = {}
    for k, a in arrays.items():
        np.save(d / f"{k}.npy", a)
        out[k] = d / f"{k}.npy"
    return out


def job_file(d: Path, files: dict[str, Path], train_steps: int = 20, distributed=False) -> Path:
    f = d / "job.yaml"
    f.write_text(JOB.format(**files, steps=train_steps, topology=TOPOLOGY if distributed else ""))
    return f


def strict_json_lines(path: Path) -> list[dict]:
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("distributed", [False, True], ids=["local", "distributed"])
def test_nan_in_the_features_is_refused_before_step_0(ray_session, tmp_path, distributed):
    """The review's worst case: a distributed run trained on NaN features, logged ``loss nan``
    at every step, exited 0 and committed NaN parameters that passed verification."""
    x = np.random.default_rng(1).normal(size=(200, 8)).astype(np.float32)
    x[123, 4] = np.nan
    f = job_file(tmp_path, data(tmp_path, x=x), distributed=distributed)
    cli_error("train", str(f), "--set", f"run_dir={tmp_path}", named=["x.npy", "row 123"])
    assert steps(tmp_path / "checkpoints") == []


@pytest.mark.parametrize(
    "bad, named",
    [
        ({"tx": np.zeros((50, 9), np.float32)}, "tx.npy"),  # another feature width
        ({"ty": np.full(50, 7)}, "ty.npy"),  # labels beyond the output
    ],
    ids=["width", "labels"],
)
def test_a_test_split_that_does_not_fit_is_refused_before_step_0(tmp_path, bad, named):
    """It used to train every step, then die at the final evaluation with no checkpoint."""
    f = job_file(tmp_path, data(tmp_path, **bad))
    cli_error("train", str(f), "--set", f"run_dir={tmp_path}", "--local", named=named)
    assert not (tmp_path / "checkpoints").exists() or steps(tmp_path / "checkpoints") == []


def test_resume_with_train_steps_below_the_checkpoint_is_refused(tmp_path):
    """It used to exit 0 and write a step-2 holding the state of step 3."""
    f = job_file(tmp_path, data(tmp_path), train_steps=10)
    cfg = config.load(f, [f"run_dir={tmp_path}"])
    Trainer(cfg, log=lambda line: None).fit()
    cli_error(
        "train",
        str(f),
        "--set",
        f"run_dir={tmp_path}",
        "--set",
        "train_steps=5",
        "--resume",
        named=["step 10", "train_steps 5"],
    )
    assert steps(tmp_path / "checkpoints") == [10, 5]


def test_a_resume_says_the_checkpoints_updater_wins(tmp_path):
    f = job_file(tmp_path, data(tmp_path), train_steps=10)
    Trainer(config.load(f, [f"run_dir={tmp_path}"]), log=lambda line: None).fit()
    lines: list[str] = []
    cfg = config.load(f, [f"run_dir={tmp_path}", "train_steps=12", "updater.lr=0.5"])
    Trainer(cfg, log=lines.append, resume=True).fit()
    assert any("updater.lr changed since the checkpoint" in line for line in lines), lines


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("distributed", [False, True], ids=["local", "distributed"])
def test_a_diverging_run_leaves_valid_json_and_no_nan_checkpoint(
    ray_session, tmp_path, distributed
):
    f = job_file(tmp_path, data(tmp_path), train_steps=200, distributed=distributed)
    line = cli_error(
        "train",
        str(f),
        "--set",
        f"run_dir={tmp_path}",
        "--set",
        "updater.lr=1e8",
        named=["at step", "likely the learning rate"],
        status=1,
    )
    assert "loss is" in line or "holds NaN" in line, line
    strict_json_lines(tmp_path / "metrics.jsonl")
    for s in steps(tmp_path / "checkpoints"):
        ck = Checkpoint.open(tmp_path / "checkpoints" / f"step-{s}", verify="full")
        assert all(np.isfinite(ck.array(n)).all() for n in ck.names("param")), s


def test_a_non_finite_state_is_never_checkpointed(tmp_path):
    """Even where the loss was still finite (an update that overflowed after it)."""
    f = job_file(tmp_path, data(tmp_path))
    t = Trainer(config.load(f, [f"run_dir={tmp_path}"]), log=lambda line: None)
    from raysinga.data import identity as data_identity
    from raysinga.data.cursor import DataCursor
    from raysinga.run import local_checkpoint
    from raysinga.run.session import RunSession

    ident = data_identity.identity(t.train_data, t.cfg.data.batch_size, t.cfg.data.shuffle)
    with RunSession(t.cfg, t.net.param_shapes(), t.net.dtype, ident, t.hub) as session:
        params, state = local_checkpoint.load_start(session.start, t.net, t.optimizer)
        params["out/b"][1] = np.inf
        with pytest.raises(NonFiniteState, match="out/b holds NaN or infinite values at step 5"):
            local_checkpoint.save(session, 5, t.net, t.optimizer, params, state, DataCursor(), [])
    assert not (tmp_path / "checkpoints").exists() or steps(tmp_path / "checkpoints") == []


PAIRS_ONLY = """
from raysinga.nn import Layer


class PairsOnly(Layer):
    # right on the job's check, a batch of two; wrong on any other
    def forward(self, p, s, x, ctx):
        return x.reshape(2, -1)

    def backward(self, dy):
        return dy.reshape(-1, *self.in_shape), {}
"""


def test_a_layer_that_breaks_on_the_real_batch_is_named_with_the_layer_before_it(tmp_path):
    (tmp_path / "pairs_only.py").write_text(PAIRS_ONLY)
    f = job_file(tmp_path, data(tmp_path))
    text = f.read_text().replace(
        "    - {kind: dense, name: out",
        '    - {kind: "pairs_only:PairsOnly", name: pairs}\n    - {kind: dense, name: out',
    )
    f.write_text("modules: [pairs_only.py]\n" + text)
    line = cli_error("train", str(f), "--set", f"run_dir={tmp_path}", "--local", status=2)
    assert line == (
        "raysinga: error: model.layers[2] (out, dense) failed on a batch of 16: dense: input "
        "(2, 128) does not match weight (16, 3); its input came from model.layers[1] (pairs, "
        "pairs_only:PairsOnly), which gave (2, 128) float32 where it declares (16,) per sample"
    )
