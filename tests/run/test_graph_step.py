"""CUDA graphs of the single-process GPU step (raysinga.run.graph_step).

On the CPU: the switch (job key and environment variable), a run that asks for graphs on the
CPU (a notice, and the same bits), and the pieces the recorded step is built from that run on
NumPy too (clipping without a read-back, an update whose rate comes from a step-values object).
On a GPU (`gpu`): a recorded run ends bit-identical to the same code run uncaptured, with
dropout, batch norm and a schedule; a shape change and a capture that fails go on uncaptured;
a run with graphs resumes bit-exactly after a SIGKILL.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import sigkill_once

from raysinga import config
from raysinga.config.section import ConfigError
from raysinga.optim.grads import clip_grad_norm, clip_grad_norm_on_device
from raysinga.optim.optimizers import make_optimizer
from raysinga.run import Trainer
from raysinga.run.graph_step import ENV, graphs_mode

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(name: str, tmp_path: Path, *overrides: str, notices: list | None = None):
    cfg = config.load(EXAMPLES / name, [f"run_dir={tmp_path}", *overrides])
    lines = notices if notices is not None else []
    trainer = Trainer(cfg, log=lines.append)
    return trainer, trainer.fit()


# --- the switch ---------------------------------------------------------------------------------


def test_graphs_are_off_by_default_and_the_environment_overrides_the_job(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert graphs_mode(False) == "off" and graphs_mode(True) == "on"
    cases = (("1", "on"), ("0", "off"), ("uncaptured", "uncaptured"), ("strict", "strict"))
    for value, want in (*cases, ("", "on")):
        monkeypatch.setenv(ENV, value)
        assert graphs_mode(True) == want
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(ValueError, match="RAYSINGA_GPU_GRAPHS must be 1, 0, strict or uncaptured"):
        graphs_mode(False)


def test_the_job_key_is_checked_and_named():
    assert config.from_dict(_job()).gpu.graphs is False
    assert config.from_dict({**_job(), "gpu": {"graphs": True}}).gpu.graphs is True
    with pytest.raises(ConfigError, match=r"gpu\.graphs"):
        config.from_dict({**_job(), "gpu": {"graphs": "sometimes"}})
    with pytest.raises(ConfigError, match=r"gpu: unknown key\(s\) \['graph'\]; allowed: graphs"):
        config.from_dict({**_job(), "gpu": {"graph": True}})


def _job() -> dict:
    return {
        "model": {
            "input_shape": [4],
            "layers": [{"kind": "dense", "name": "out", "units": 2}],
            "loss": "softmax_cross_entropy",
        },
        "data": {"source": {"kind": "digits"}, "batch_size": 8},
        "updater": {"name": "sgd", "lr": 0.1},
        "train_steps": 2,
    }


def test_a_cpu_run_that_asks_for_graphs_says_so_and_keeps_its_bits(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSINGA_DEVICE", "cpu")
    monkeypatch.delenv(ENV, raising=False)
    few = ("train_steps=12", "disp_freq=4", "checkpoint.final=false")
    _, plain = _run("digits_cnn.yaml", tmp_path / "a", *few)
    notices: list[str] = []
    trainer, asked = _run(
        "digits_cnn.yaml", tmp_path / "b", *few, "gpu.graphs=true", notices=notices
    )
    assert trainer.graphs is None
    assert any("gpu.graphs applies to GPU runs" in line for line in notices)
    for k in plain.params:
        np.testing.assert_array_equal(plain.params[k], asked.params[k])


# --- what the recorded step is made of, on NumPy ------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_clipping_on_the_device_matches_the_host_rule_bit_for_bit(max_norm):
    rng = np.random.default_rng(3)
    shapes = {"b/w": (5, 7), "a/b": (7,), "c/g": (3, 2, 2)}
    grads = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    host = {k: g.copy() for k, g in grads.items()}
    device = {k: g.copy() for k, g in grads.items()}
    norm = clip_grad_norm(host, max_norm)
    assert float(clip_grad_norm_on_device(device, max_norm)) == norm
    for k in grads:
        np.testing.assert_array_equal(host[k], device[k])


def test_a_nan_norm_clips_nothing_on_the_device_either():
    grads = {"w": np.array([np.nan, 1.0], np.float32)}
    assert np.isnan(clip_grad_norm_on_device(grads, 1.0))
    assert grads["w"][1] == 1.0


class _HostValues:
    """kernels.gpu_graph.StepValues on NumPy: the registry and the refresh, without a device."""

    def __init__(self) -> None:
        self.fns: dict = {}
        self.arrays: dict = {}
        self.step = self.ctx = None

    def floats(self, key, n, fn):
        if key not in self.fns:
            self.fns[key] = fn
            self.arrays[key] = np.asarray(fn(self.step, self.ctx), np.float64).reshape(n)
        return self.arrays[key]

    def refresh(self, step, ctx):
        self.step, self.ctx = step, ctx
        for key, fn in self.fns.items():
            self.arrays[key][...] = fn(step, ctx)


def test_an_update_that_reads_its_rate_from_step_values_follows_the_schedule():
    """What a replay relies on: the rate registered once is recomputed for every step."""
    spec = {"name": "sgd", "lr": {"kind": "step", "lr": 0.5, "gamma": 0.1, "step_size": 2}}
    plain, replayed = make_optimizer(spec), make_optimizer(spec)
    values = _HostValues()
    p1 = np.ones(4, np.float32)
    p2 = p1.copy()
    for step in range(5):
        g = np.full(4, step + 1, np.float32)
        plain.update(step, "w", p1, g)
        values.refresh(step, None)
        replayed.update(step, "w", p2, g, values=values)
        np.testing.assert_array_equal(p1, p2)
    assert values.arrays["optimizer/w"][0] == plain.lr(4)


def test_advance_counts_an_update_a_graph_applied():
    opt = make_optimizer({"name": "adam", "lr": 0.01})
    opt.update(0, "w", np.ones(3, np.float32), np.ones(3, np.float32))
    opt.advance(["w", "b"])
    assert opt.counts == {"w": 2, "b": 1}
    assert opt._step_values(0.01, 3) == (1.0, -(0.01 / (1 - 0.9**3)), (1 - 0.999**3) ** 0.5)


# --- on a GPU -----------------------------------------------------------------------------------


def _pair(tmp_path: Path, name: str, monkeypatch, *overrides: str):
    """The job trained with its steps recorded and replayed, and with the same code uncaptured."""
    monkeypatch.setenv("RAYSINGA_DEVICE", "gpu")
    out = {}
    for mode in ("strict", "uncaptured"):
        monkeypatch.setenv(ENV, mode)
        out[mode] = _run(name, tmp_path / mode, "checkpoint.final=false", *overrides)
    return out["strict"], out["uncaptured"]


def _same(a, b) -> None:
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k], err_msg=k)
    for k in a.state:
        np.testing.assert_array_equal(a.state[k], b.state[k], err_msg=k)
    assert [r.get("loss") for r in a.history] == [r.get("loss") for r in b.history]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("digits_mlp.yaml", ("updater.clip_norm=1.0",)),
        ("digits_cnn.yaml", ()),  # dropout and batch norm
        ("charlm.yaml", ()),
        # the optimizer's kernels write the weights' bf16 copies inside the graph
        ("digits_cnn.yaml", ("precision.compute=bf16", "updater.name=adamw")),
    ],
)
def test_a_recorded_run_ends_bit_identical_to_the_same_code_uncaptured(
    tmp_path, monkeypatch, name, overrides
):
    (graphs, a), (_, b) = _pair(
        tmp_path, name, monkeypatch, "train_steps=50", "disp_freq=10", "test_freq=0", *overrides
    )
    assert graphs.graphs.failed is None and graphs.graphs.replays == 49
    _same(a, b)


@pytest.mark.gpu
def test_a_schedule_changes_the_rate_of_replayed_steps_without_a_new_recording(
    tmp_path, monkeypatch
):
    lr = "updater.lr={kind: step, lr: 0.05, gamma: 0.5, step_size: 10}"
    (graphs, a), (_, b) = _pair(tmp_path, "digits_mlp.yaml", monkeypatch, "train_steps=40", lr)
    assert graphs.graphs.replays == 39
    _same(a, b)


@pytest.mark.gpu
def test_graphs_are_faster_than_the_uncaptured_steps_they_match(tmp_path, monkeypatch):
    """Not a timing test: that replays happen at all (the host never waited per step)."""
    (graphs, a), _ = _pair(tmp_path, "digits_mlp.yaml", monkeypatch, "train_steps=20")
    assert graphs.graphs.recorded and graphs.graphs.readback.depth > 1


@pytest.mark.gpu
def test_a_run_with_graphs_resumes_bit_exactly_after_a_sigkill(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYSINGA_DEVICE", "gpu")
    monkeypatch.setenv(ENV, "strict")
    common = ["train_steps=300", "checkpoint_frequency=50", "test_freq=0", "disp_freq=50"]
    _, want = _run("digits_cnn.yaml", tmp_path / "ref", *common)
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "raysinga.cli", "train", str(EXAMPLES / "digits_cnn.yaml")]
    cmd += ["--local", "--set", f"run_dir={run}", *(x for c in common for x in ("--set", c))]
    sigkill_once(cmd, run / "checkpoints/step-150")
    cfg = config.load(EXAMPLES / "digits_cnn.yaml", [f"run_dir={run}", *common])
    got = Trainer(cfg, log=lambda line: None, resume=True).fit()
    for k in want.params:
        np.testing.assert_array_equal(want.params[k], got.params[k], err_msg=k)


@pytest.mark.gpu
def test_a_cublas_that_cannot_be_used_is_one_line_naming_the_install_before_any_step(monkeypatch):
    """A missing or mismatched cuBLAS imports fine and first fails at the handle's creation:
    inside the first step, before; now when the recorder is made."""
    from nvmath.bindings import cublas

    from raysinga.kernels import gpu_blas
    from raysinga.run.graph_step import StepRecorder

    def missing():
        raise OSError("libcublas.so.12: cannot open shared object file\nmore")

    monkeypatch.setattr(gpu_blas, "_handles", {})
    monkeypatch.setattr(cublas, "create", missing)
    with pytest.raises(RuntimeError) as caught:
        StepRecorder(lambda line: None)
    line = str(caught.value)
    assert "\n" not in line and "libcublas.so.12" in line, line
    assert line.endswith("pip install 'raysinga[gpu]'"), line
