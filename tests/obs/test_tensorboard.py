"""TensorBoard event files: read back by TensorBoard's own reader, equal to metrics.jsonl, and
rewritten (not appended to) when a run resumes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import tensorboard_scalars

from raysinga import config
from raysinga.obs.tensorboard import record_scalars
from raysinga.run import Trainer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def fit(run_dir: Path, *overrides: str, resume: bool = False):
    cfg = config.load(
        EXAMPLES / "digits_mlp.yaml",
        [f"run_dir={run_dir}", "tensorboard=true", "disp_freq=10", "test_freq=30", *overrides],
    )
    return Trainer(cfg, log=lambda line: None, resume=resume).fit()


def expected(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as scalars by tag, rounded to float32 as event files store them."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for tag, v in record_scalars(rec).items():
            out.setdefault(tag, []).append((rec["step"], float(np.float32(v))))
    return out


def test_a_run_writes_what_metrics_jsonl_holds(tmp_path):
    fit(tmp_path, "train_steps=60", "checkpoint_frequency=30")
    got = tensorboard_scalars(tmp_path)
    assert got == expected(tmp_path)
    assert [s for s, _ in got["train/loss"]] == list(range(10, 70, 10))
    assert [s for s, _ in got["eval/test_accuracy"]] == [30, 60]
    assert [s for s, _ in got["checkpoint/seconds"]] == [30, 60]


def test_a_resumed_run_rewrites_its_events_once(tmp_path):
    fit(tmp_path, "train_steps=60", "checkpoint_frequency=30")
    fit(tmp_path, "train_steps=90", "checkpoint_frequency=30", resume=True)
    assert len(list((tmp_path / "tensorboard").iterdir())) == 1
    got = tensorboard_scalars(tmp_path)
    assert got == expected(tmp_path)
    assert [s for s, _ in got["train/loss"]] == list(range(10, 100, 10))


def test_off_by_default(tmp_path):
    cfg = config.load(EXAMPLES / "digits_mlp.yaml", [f"run_dir={tmp_path}", "train_steps=5"])
    Trainer(cfg, log=lambda line: None).fit()
    assert not (tmp_path / "tensorboard").exists()


def test_the_switch_must_be_a_boolean():
    with pytest.raises(config.ConfigError, match=r"^tensorboard: expected true or false"):
        config.load(EXAMPLES / "digits_mlp.yaml", ["tensorboard=yes please"])


def test_only_metrics_become_scalars():
    rec = {"kind": "failure", "step": 250, "role": "server", "index": 0, "group": None}
    rec |= {"time": 1.7e9, "died": 1.7e9, "detection_s": 0.06, "restore_s": 3.5, "ok": True}
    assert record_scalars(rec) == {"failure/detection_s": 0.06, "failure/restore_s": 3.5}
    train = {"kind": "train", "step": 10, "loss": 0.5, "ms": {"compute": 1.0}}
    assert record_scalars(train) == {"train/loss": 0.5}
