"""Replacing a committed checkpoint on local disk (``replace=True``): an atomic exchange, or two
renames where the kernel cannot exchange, and recovery from a crash between them. The S3 side
is in test_s3.py."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_JOB

from raysinga import config
from raysinga.checkpoint import (
    Checkpoint,
    CheckpointError,
    begin,
    commit,
    latest,
    placement,
    prune,
    save,
    steps,
    storage,
    tensors_of,
    write_shard,
)
from raysinga.checkpoint.manage import recover
from raysinga.run import Trainer

OLD, NEW = np.full(5, 1, np.float32), np.full(5, 2, np.float32)


def _w(d: Path) -> bytes:
    return Checkpoint.open(d, verify="full").array("w").tobytes()


def _failing(err: int):
    """A renameat2 that fails with ``err``, as an older kernel or another filesystem does."""

    def fn(*args):
        ctypes.set_errno(err)
        return -1

    return fn


@pytest.fixture(
    params=["exchange", "no_renameat2", "EINVAL", "ENOSYS"],
)
def how(request, monkeypatch):
    if request.param == "no_renameat2":
        monkeypatch.setattr(placement, "_RENAMEAT2", None)
    elif request.param != "exchange":
        monkeypatch.setattr(placement, "_RENAMEAT2", _failing(getattr(errno, request.param)))
    return request.param


def test_replace(tmp_path, how):
    save(tmp_path, 4, {"w": OLD})
    final = save(tmp_path, 4, {"w": NEW}, replace=True)
    assert Path(final.path) == tmp_path / "step-4"
    assert _w(tmp_path / "step-4") == NEW.tobytes()
    assert os.listdir(tmp_path) == ["step-4"]  # neither the old one nor a staging directory


def test_without_replace_a_checkpoint_is_never_overwritten(tmp_path):
    save(tmp_path, 4, {"w": OLD})
    with pytest.raises(CheckpointError, match="already exists"):
        save(tmp_path, 4, {"w": NEW})
    tmp = begin(tmp_path, 4, replace=True)
    shard = write_shard(tmp, 0, tensors_of({"w": NEW}))
    with pytest.raises(CheckpointError, match="already exists"):
        commit(tmp, 4, [shard])
    assert _w(tmp_path / "step-4") == OLD.tobytes()
    save(tmp_path, 5, {"w": NEW}, replace=True)  # nothing to replace: an ordinary commit
    assert steps(tmp_path) == [5, 4]


def test_an_exchange_that_fails_otherwise_is_an_error_and_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(placement, "_RENAMEAT2", _failing(errno.EACCES))
    save(tmp_path, 4, {"w": OLD})
    with pytest.raises(CheckpointError, match="could not write"):
        save(tmp_path, 4, {"w": NEW}, replace=True)
    assert _w(tmp_path / "step-4") == OLD.tobytes()
    assert os.listdir(tmp_path) == ["step-4"]


def _cut_short(root: Path, after: str) -> None:
    """Step 4 (OLD) being replaced by NEW, staged as ``step-4.tmp-x``, with the writer killed
    ``after`` the given rename of the fallback (or of the exchange)."""
    other = root.parent / f"{root.name}-other"
    save(other, 4, {"w": NEW})
    os.rename(other / "step-4", root / "step-4.tmp-x")
    if after == "exchange":
        os.rename(root / "step-4", root / "swap")
        os.rename(root / "step-4.tmp-x", root / "step-4")
        os.rename(root / "swap", root / "step-4.tmp-x")
        return
    os.rename(root / "step-4", root / "step-4.replaced-x")
    if after == "second":
        os.rename(root / "step-4.tmp-x", root / "step-4")


@pytest.mark.parametrize(("after", "want"), [("first", OLD), ("second", NEW), ("exchange", NEW)])
def test_a_replace_cut_short_is_recovered(tmp_path, after, want):
    """Killed between the two renames, step 4 is missing and the old one waits under
    ``step-4.replaced-x``: the writer's ``recover`` (``run_sources.open_run`` calls it) renames
    it back. After the second rename, or after an exchange, only leftovers remain."""
    root = tmp_path / "run"
    save(root, 3, {"w": OLD})
    save(root, 4, {"w": OLD})
    _cut_short(root, after)
    recover(root)
    assert latest(root).checkpoint.step == 4
    assert _w(root / "step-4") == want.tobytes()
    prune(root, keep_last=5)
    assert sorted(os.listdir(root)) == ["step-3", "step-4"]


def test_prune_recovers_before_it_counts(tmp_path):
    """A prune by another process (it takes the writer's lock) finds step 4 missing after a
    replace cut short: it renames it back rather than keeping an older one in its place."""
    root = tmp_path / "run"
    for s in (2, 3, 4):
        save(root, s, {"w": OLD})
    _cut_short(root, "first")
    assert steps(root) == [3, 2]  # what a reader sees before the writer recovers
    assert prune(root, keep_last=1) == [3, 2]
    assert os.listdir(root) == ["step-4"]


JOB = TINY_JOB.format(name="replace")


def _train(d: Path, *more: str, lines: list | None = None, **kw):
    d.mkdir(parents=True, exist_ok=True)
    (d / "job.yaml").write_text(JOB)
    cfg = config.load(d / "job.yaml", [f"run_dir={d}", *more])
    log = (lambda line: None) if lines is None else lines.append
    return Trainer(cfg, log=log, **kw).fit()


def test_resume_after_a_replace_cut_short(tmp_path):
    """End to end: the writer died between the two renames of a replace of step 20; resume
    restores it and goes on from step 20."""
    _train(tmp_path, "train_steps=20")
    ck = tmp_path / "checkpoints"
    shutil.copytree(ck / "step-10", ck / "step-20.tmp-x")  # the staged one, dropped
    os.rename(ck / "step-20", ck / "step-20.replaced-x")
    lines: list[str] = []
    _train(tmp_path, lines=lines, resume=True)
    assert any("step-20: restored from step-20.replaced-x" in line for line in lines), lines
    assert any("resuming 'replace' at step 20" in line for line in lines), lines
    assert steps(ck) == [30, 20, 10]
    assert sorted(os.listdir(ck)) == ["step-10", "step-20", "step-30"]


def test_exchange_swaps_two_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, f in ((a, "1"), (b, "2")):
        d.mkdir()
        (d / f).touch()
    if not placement.exchange(str(a), str(b)):
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this kernel or filesystem")
    assert (os.listdir(a), os.listdir(b)) == (["2"], ["1"])


def test_move_dir(tmp_path):
    ck = save(tmp_path, 4, {"w": OLD})
    dst = storage.resolve(tmp_path / "step-4.invalid-x")
    placement.move_dir(ck, dst)
    assert os.listdir(tmp_path) == ["step-4.invalid-x"] and _w(Path(dst.path)) == OLD.tobytes()
    save(tmp_path, 4, {"w": NEW})
    with pytest.raises(CheckpointError, match="already exists"):
        placement.move_dir(storage.resolve(tmp_path / "step-4"), dst)
