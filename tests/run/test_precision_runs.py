"""``precision.compute`` in a run (kernels.precision): the job key and its rules, a bf16 and a
TF32 run on the CPU (emulated: said in one line), their checkpoints (float32 master state, the
policy recorded) and an exact resume of a bf16 run."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest

from raysinga import config
from raysinga.checkpoint import Checkpoint, steps
from raysinga.config.section import ConfigError
from raysinga.kernels import precision
from raysinga.run import Trainer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FEW = ("train_steps=120", "disp_freq=40", "test_freq=0", "checkpoint_frequency=60")


def _run(tmp_path: Path, *overrides: str, name: str = "digits_mlp.yaml", **kw):
    lines: list[str] = []
    cfg = config.load(EXAMPLES / name, [f"run_dir={tmp_path}", *FEW, *overrides])
    return Trainer(cfg, log=lines.append, **kw).fit(), lines


def test_the_policy_is_checked_and_named(tmp_path):
    with pytest.raises(ConfigError, match=r"precision\.compute"):
        config.load(EXAMPLES / "digits_mlp.yaml", ["precision.compute=fp8"])
    with pytest.raises(ConfigError, match="precision.compute: bf16 .*dtype must be float32"):
        config.load(EXAMPLES / "digits_mlp.yaml", ["precision.compute=bf16", "dtype=float64"])


@pytest.fixture(scope="module")
def f32_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("f32"))[0]


@pytest.mark.parametrize("policy", ["bf16", "tf32"])
def test_a_reduced_precision_run_on_the_cpu_is_emulated_and_trains(tmp_path, f32_run, policy):
    res, lines = _run(tmp_path, f"precision.compute={policy}")
    assert any(f"precision.compute: {policy} on the CPU is emulated" in line for line in lines)
    assert precision.compute() == "f32"  # the process's policy is put back after the run
    # not the float32 run's bits, but its training: losses within a few percent
    assert any(not np.array_equal(res.params[k], f32_run.params[k]) for k in res.params), (
        "the policy changed nothing"
    )
    ours = [r["loss"] for r in res.history if r["kind"] == "train"]
    theirs = [r["loss"] for r in f32_run.history if r["kind"] == "train"]
    assert ours[-1] == pytest.approx(theirs[-1], rel=0.05)
    ck = Checkpoint.open(tmp_path / "checkpoints" / f"step-{steps(tmp_path / 'checkpoints')[-1]}")
    assert {ck.array(n).dtype for n in ck.names("param")} == {np.dtype(np.float32)}
    assert ck.meta["run"]["precision"] == {"compute": policy}


def test_a_bf16_run_resumes_bit_exactly(tmp_path):
    straight, _ = _run(tmp_path / "a", "precision.compute=bf16", name="digits_cnn.yaml")
    _run(tmp_path / "b", "precision.compute=bf16", name="digits_cnn.yaml", until=60)
    resumed, _ = _run(tmp_path / "b", "precision.compute=bf16", name="digits_cnn.yaml", resume=True)
    for k in straight.params:
        assert straight.params[k].tobytes() == resumed.params[k].tobytes(), k
    for k in straight.state:
        assert straight.state[k].tobytes() == resumed.state[k].tobytes(), k


def test_the_weights_bf16_copies_change_no_bit_of_a_run(tmp_path, monkeypatch):
    """Under bf16 the optimizer writes each weight's bf16 copy as it updates it, and the matrix
    products read the copies in place of casting the weights at each use: the same operands,
    so the run ends with the bits of one that casts every time (copies turned off)."""
    from raysinga.run import trainer

    over = ("precision.compute=bf16", "train_steps=40", "checkpoint_frequency=0")
    used, _ = _run(tmp_path / "copies", *over, name="digits_cnn.yaml")
    seen = []
    real = precision.WeightCopies

    class Counted(real):
        def view_of(self, x):
            words = super().view_of(x)
            seen.append(words is not None)
            return words

    monkeypatch.setattr(precision, "WeightCopies", Counted)
    counted, _ = _run(tmp_path / "counted", *over, name="digits_cnn.yaml")
    assert any(seen), "no matrix product read a copy"

    @contextlib.contextmanager
    def no_copies(params, optimizer):
        yield None

    monkeypatch.setattr(trainer, "weight_copies", no_copies)
    cast, _ = _run(tmp_path / "cast", *over, name="digits_cnn.yaml")
    for k in used.params:
        assert used.params[k].tobytes() == cast.params[k].tobytes(), k
        assert counted.params[k].tobytes() == cast.params[k].tobytes(), k
