"""The single-process trainer: reaches the accuracy goals, and is exactly reproducible."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from raysinga import ModelSpec, Net, StepContext, config
from raysinga.checkpoint import Checkpoint
from raysinga.data import digits
from raysinga.run import Trainer

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


# Batch norm (state), dropout (the RNG), Adam (slots and update counts), a cosine schedule.
FORK_JOB = """
name: fork
seed: 5
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 48, activation: relu}
    - {kind: batchnorm, name: bn1}
    - {kind: dropout, name: drop, rate: 0.2}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 32}
updater: {name: adam, lr: {kind: cosine, lr: 0.01, steps: 60, min_lr: 0.0001}}
train_steps: 40
disp_freq: 5
test_freq: 0
checkpoint_frequency: 0
"""


def fork_job(d: Path, *more: str):
    d.mkdir(parents=True, exist_ok=True)
    (d / "job.yaml").write_text(FORK_JOB)
    return config.load(d / "job.yaml", [f"run_dir={d}", *more])


def train_records(result, after: int = 0) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["lr"]) for r in result.history if r["kind"] == "train"]


def test_a_run_stopped_by_until_and_forked_on_ends_as_the_straight_run(tmp_path):
    quiet = {"log": lambda line: None}
    straight = Trainer(fork_job(tmp_path / "straight"), **quiet).fit()
    first = Trainer(fork_job(tmp_path / "a"), until=20, **quiet).fit()
    assert first.checkpoint_step == 20 and first.final_eval is None
    assert (tmp_path / "a" / "checkpoints" / "step-20").is_dir()
    lines: list[str] = []
    second = Trainer(
        fork_job(tmp_path / "b", "name=other"), fork_from=first.checkpoint, log=lines.append
    ).fit()
    assert any("forking 'other' at step 20 from" in line for line in lines), lines
    for k in straight.params:
        np.testing.assert_array_equal(second.params[k], straight.params[k])
    for k in straight.state:
        np.testing.assert_array_equal(second.state[k], straight.state[k])
    assert train_records(second) == train_records(straight)  # the history goes on too
    fork = {"kind": "fork", "step": 20, "from": first.checkpoint}
    assert fork in second.history
    ck = Checkpoint.open(second.checkpoint)  # its checkpoints say where it forked from
    assert fork in ck.manifest["meta"]["run"]["history"]
    assert second.final_eval == straight.final_eval


def test_a_fork_runs_under_the_jobs_hyperparameters_a_resume_under_the_checkpoints(tmp_path):
    quiet = {"log": lambda line: None}
    first = Trainer(fork_job(tmp_path / "a"), until=20, **quiet).fit()
    lr = "updater.lr={kind: cosine, lr: 0.002, steps: 60, min_lr: 0.0001}"
    forked = Trainer(fork_job(tmp_path / "b", lr), fork_from=first.checkpoint, **quiet).fit()
    resumed = Trainer(fork_job(tmp_path / "a", lr), resume=True, **quiet).fit()
    straight = Trainer(fork_job(tmp_path / "s"), **quiet).fit()
    lrs = {
        name: [x[2] for x in train_records(r) if x[0] > 20]
        for name, r in (("forked", forked), ("resumed", resumed), ("straight", straight))
    }
    assert lrs["resumed"] == lrs["straight"]  # the checkpoint's schedule
    assert all(f < s / 2 for f, s in zip(lrs["forked"], lrs["straight"], strict=True)), lrs
    assert not np.array_equal(forked.params["fc1/W"], straight.params["fc1/W"])


def test_fork_from_and_until_refuse_what_they_cannot_do(tmp_path):
    cfg = fork_job(tmp_path)
    with pytest.raises(ValueError, match="exclude one another"):
        Trainer(cfg, resume=True, fork_from=str(tmp_path), log=None)
    with pytest.raises(ValueError, match=r"until must lie in \[1, train_steps=40\]"):
        Trainer(cfg, until=41, log=None)


def test_device_losses_and_norms_are_read_back_in_one_copy_in_step_order():
    from raysinga.run.trainer import read_back  # noqa: PLC0415

    f32 = np.float32
    steps = [(3, np.array(0.5, f32), None), (4, np.array(0.25, f32), np.array(2.0)), (5, 1.5, None)]
    assert read_back(np, steps) == [(3, 0.5, None), (4, 0.25, 2.0), (5, 1.5, None)]


@pytest.mark.gpu
def test_the_eager_gpu_step_reads_its_losses_back_only_at_reports(tmp_path, monkeypatch):
    """Graphs off, on a GPU: no step reads its loss or gradient norm back by itself (a read
    waits for the GPU); they are read together at each report, and the guard and the window
    still see every step in order."""
    pytest.importorskip("cupy")
    from raysinga import kernels  # noqa: PLC0415
    from raysinga.run import trainer as T  # noqa: PLC0415

    if not kernels.gpu_available():
        pytest.skip(f"no usable GPU: {kernels.gpu_unavailable_reason()}")
    monkeypatch.setenv("RAYSINGA_DEVICE", "gpu")
    monkeypatch.delenv("RAYSINGA_GPU_GRAPHS", raising=False)
    reads = []
    real = T.read_back

    def counted(xp, steps):
        reads.append([s for s, _, _ in steps])
        return real(xp, steps)

    monkeypatch.setattr(T, "read_back", counted)
    res = run(
        "digits_mlp.yaml", tmp_path, "train_steps=40", "disp_freq=10", "updater.clip_norm=1.0"
    )
    assert reads == [list(range(i, i + 10)) for i in (0, 10, 20, 30)], reads
    train = [r for r in res.history if r["kind"] == "train"]
    assert [r["step"] for r in train] == [10, 20, 30, 40]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in train), train
