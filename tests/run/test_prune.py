"""Old checkpoints are pruned off the training path: a commit returns while its prune runs, and
whatever stages the next checkpoint waits for it."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from raysinga import config
from raysinga.checkpoint import steps
from raysinga.data import identity as data_identity
from raysinga.data.cursor import DataCursor
from raysinga.run import Trainer, local_checkpoint
from raysinga.run import session as session_mod
from raysinga.run.prune import BackgroundPrune
from raysinga.run.session import RunSession


def test_a_failed_prune_is_raised_by_the_next_settle():
    bg = BackgroundPrune()
    ran = []

    def fail() -> None:
        raise OSError("disk gone")

    bg.start(fail)
    with pytest.raises(OSError, match="disk gone"):
        bg.start(lambda: ran.append(1))  # the next one is not started after a failure
    assert ran == []
    bg.start(lambda: ran.append(2))
    bg.close()
    assert ran == [2]
    bg.close()  # twice is harmless


def _trainer(tmp_path, keep_last: int) -> Trainer:
    rng = np.random.default_rng(0)
    x, y = tmp_path / "x.npy", tmp_path / "y.npy"
    np.save(x, rng.normal(size=(64, 4)).astype(np.float32))
    np.save(y, rng.integers(0, 2, 64))
    cfg = config.from_dict(
        {
            "name": "prune",
            "model": {"input_shape": [4], "layers": [{"kind": "dense", "name": "out", "units": 2}]},
            "data": {
                "source": {"kind": "npy", "x": str(x), "y": str(y)},
                "batch_size": 16,
            },
            "updater": {"name": "sgd", "lr": 0.1},
            "train_steps": 10,
            "run_dir": str(tmp_path / "run"),
            "checkpoint": {"keep_last": keep_last},
        }
    )
    return Trainer(cfg, log=lambda line: None)


def test_a_commit_returns_while_its_prune_runs_and_the_next_checkpoint_waits(tmp_path, monkeypatch):
    t = _trainer(tmp_path, keep_last=1)
    entered, release = threading.Event(), threading.Event()
    real = session_mod.prune

    def held_prune(*args, **kwargs):
        entered.set()
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(session_mod, "prune", held_prune)
    ident = data_identity.identity(t.train_data, t.cfg.data.batch_size, t.cfg.data.shuffle)
    with RunSession(t.cfg, t.net.param_shapes(), t.net.dtype, ident, t.hub) as session:
        params, state = local_checkpoint.load_start(session.start, t.net, t.optimizer)

        def save(step: int) -> None:
            local_checkpoint.save(
                session, step, t.net, t.optimizer, params, state, DataCursor(), []
            )

        save(1)  # returns with its prune held
        assert entered.wait(30)
        entered.clear()
        second = threading.Thread(target=save, args=(2,))
        second.start()
        second.join(0.5)
        assert second.is_alive()  # staging step 2 waits for the prune after step 1
        assert steps(session.root) == [1]
        release.set()
        second.join(60)
        assert not second.is_alive()
        assert entered.wait(30)  # step 2's own prune, of step 1
    # the run's end waited for it
    assert steps(session.root) == [2]


def test_a_prune_that_fails_is_raised_by_the_next_checkpoint(tmp_path, monkeypatch):
    t = _trainer(tmp_path, keep_last=1)

    def failing_prune(*args, **kwargs):
        raise OSError("the disk went away")

    monkeypatch.setattr(session_mod, "prune", failing_prune)
    ident = data_identity.identity(t.train_data, t.cfg.data.batch_size, t.cfg.data.shuffle)
    with pytest.raises(OSError, match="the disk went away"):
        with RunSession(t.cfg, t.net.param_shapes(), t.net.dtype, ident, t.hub) as session:
            params, state = local_checkpoint.load_start(session.start, t.net, t.optimizer)
            local_checkpoint.save(session, 1, t.net, t.optimizer, params, state, DataCursor(), [])
            local_checkpoint.save(session, 2, t.net, t.optimizer, params, state, DataCursor(), [])
    assert steps(tmp_path / "run" / "checkpoints") == [1]  # step 2 was never staged
