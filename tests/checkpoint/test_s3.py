"""Checkpoints on S3, against a real S3-compatible server on loopback (moto's server mode).

Nothing is mocked inside the process under test: pyarrow's S3 client speaks HTTP to moto, so
this exercises what an object store changes: no directory rename (a checkpoint is written in
place, the manifest last), prefixes as directories, and no O_EXCL for the run lock.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import S3_BUCKET, S3_KEYS, TINY_JOB
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

pytest.importorskip("moto.server")
pafs = pytest.importorskip("pyarrow.fs")

from raysinga.checkpoint import (  # noqa: E402
    Checkpoint,
    CheckpointError,
    RunLock,
    TensorInfo,
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
from raysinga.checkpoint.format import DTYPES  # noqa: E402
from raysinga.checkpoint.lock import LEASE_S  # noqa: E402
from raysinga.checkpoint.manage import recover  # noqa: E402
from raysinga.checkpoint.storage import Location  # noqa: E402

BUCKET, KEYS = S3_BUCKET, S3_KEYS


_runs = itertools.count()


def _run(fs: pafs.FileSystem, name: str) -> Location:
    """A fresh run directory in the bucket."""
    return Location(fs, f"{BUCKET}/{name}-{next(_runs)}")


def _same(got: np.ndarray, want: np.ndarray) -> None:
    """Bit-identical: dtype, shape and bytes (NaNs and signed zeros included)."""
    want = np.asarray(want)
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
    assert got.tobytes() == want.tobytes()


def _arrays(max_tensors: int = 3):
    shapes = st.one_of(
        st.just(()),  # 0-d
        hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4),  # includes empty
    )
    tensor = st.builds(lambda d, s: (d, s), st.sampled_from(DTYPES), shapes).flatmap(
        lambda ds: hnp.arrays(np.dtype(ds[0]), ds[1])
    )
    names = st.text("abcdefghij_", min_size=1, max_size=6)
    return st.dictionaries(names, tensor, min_size=1, max_size=max_tensors)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    params=_arrays(),
    slots=_arrays(2),
    step=st.integers(0, 2**40),
    compression=st.sampled_from([None, "zstd", "lz4"]),
)
def test_roundtrip_is_bit_identical(s3, params, slots, step, compression):
    fs, _ = s3
    run = _run(fs, "prop")
    state = {"rng": np.array([7, 8], np.uint64)}
    meta = {"cursor": [1, 2], "seed": 42}
    slots = {f"{k}.m": v for k, v in slots.items()}  # names are unique across kinds
    loc = save(run, step, params, slots, state, meta, compression=compression)
    assert loc.path == f"{run.path}/step-{step}"
    ck = Checkpoint.open(Location(fs, loc.path))
    assert ck.step == step and ck.meta == meta
    for kind, want in (("param", params), ("slot", slots), ("state", state)):
        got = ck.arrays(kind)
        assert set(got) == set(want)
        for name, a in want.items():
            _same(got[name], a)
    # Nothing but the checkpoint is left behind: no staging directory, no lock.
    left = {i.base_name for i in fs.get_file_info(pafs.FileSelector(run.path))}
    assert left == {f"step-{step}"}


def test_uri_string(s3):
    """A plain ``s3://`` URI; pyarrow takes the credentials from the URI's user info (it
    rejects ``access_key``/``secret_key`` query parameters)."""
    _, port = s3
    query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    run = f"s3://testing:testing@{BUCKET}/run2-{next(_runs)}"
    w = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "b": np.float64(0.5)}
    save(f"{run}?{query}", 3, w, meta={"lr": 0.1})
    save(f"{run}?{query}", 5, {k: v * 2 for k, v in w.items()})
    ck = Checkpoint.open(f"{run}/step-3?{query}")
    _same(ck.array("w"), w["w"])
    _same(ck.array("b"), np.asarray(w["b"]))
    assert ck.meta == {"lr": 0.1}
    assert steps(f"{run}?{query}") == [5, 3]
    assert latest(f"{run}?{query}").checkpoint.step == 5


def test_several_shards_written_in_place(s3):
    """The low-level API: shards from several writers, then one commit."""
    fs, _ = s3
    run = _run(fs, "shards")
    a = np.arange(10, dtype=np.int64)
    tmp = begin(run, 7)
    assert tmp.path == f"{run.path}/step-7"  # object stores: no staging directory
    s0 = write_shard(tmp, 0, [(TensorInfo("a", "param", (10,), "int64", 0, 6), a[:6])])
    s1 = write_shard(tmp, 1, [(TensorInfo("a", "param", (10,), "int64", 6, 10), a[6:])], "zstd")
    # Before the commit the directory holds shards but no manifest: not a checkpoint yet.
    with pytest.raises(CheckpointError, match="no manifest"):
        Checkpoint.open(tmp)
    assert latest(run).checkpoint is None
    final = commit(tmp, 7, [s1, s0], {"k": "v"})
    assert final.path == tmp.path
    _same(Checkpoint.open(final).array("a"), a)


def test_latest_and_prune(s3):
    fs, _ = s3
    run = _run(fs, "prune")
    for s in (1, 2, 3, 4, 5):
        save(run, s, {"w": np.full(3, s, np.float32)})
    # An interrupted write of step 6: shards in place, never committed.
    tmp = begin(run, 6)
    write_shard(tmp, 0, tensors_of({"w": np.zeros(3, np.float32)}))
    assert steps(run) == [6, 5, 4, 3, 2, 1]
    got = latest(run)
    assert got.checkpoint.step == 5
    assert [d for d, _ in got.skipped] == [f"s3://{run.path}/step-6"]
    assert "no manifest" in got.skipped[0][1]

    assert sorted(prune(run, keep_last=2, keep_every=2)) == [1, 3]
    assert steps(run) == [5, 4, 2]  # the unfinished step 6 is gone and took no keep slot
    assert not fs.get_file_info(f"{run.path}/step-6").type == pafs.FileType.Directory
    assert not fs.get_file_info(f"{run.path}/step-1").type == pafs.FileType.Directory
    _same(latest(run).checkpoint.array("w"), np.full(3, 5, np.float32))

    # The interrupted step can be written again; a committed one is never overwritten.
    tmp = begin(run, 6)
    write_shard(tmp, 0, tensors_of({"w": np.zeros(3, np.float32)}))
    save(run, 6, {"w": np.full(3, 6, np.float32)})
    assert latest(run).checkpoint.step == 6
    with pytest.raises(CheckpointError, match="already exists"):
        save(run, 6, {"w": np.zeros(3, np.float32)})
    _same(latest(run).checkpoint.array("w"), np.full(3, 6, np.float32))


def test_failed_save_leaves_nothing(s3):
    fs, _ = s3
    run = _run(fs, "fail")
    with pytest.raises(CheckpointError, match="dtype"):
        save(run, 1, {"ok": np.ones(2, np.float32), "bad": np.ones(2, np.complex64)})
    assert steps(run) == []
    assert fs.get_file_info(f"{run.path}/.writer.lock").type == pafs.FileType.NotFound


def test_corrupt_shard_is_named(s3):
    fs, _ = s3
    run = _run(fs, "corrupt")
    save(run, 1, {"w": np.arange(100, dtype=np.float32)})
    save(run, 2, {"w": np.arange(100, dtype=np.float32) + 1})
    shard = f"{run.path}/step-2/shard-0.arrow"
    with fs.open_input_stream(shard) as f:
        blob = bytearray(f.read())
    blob[len(blob) // 2] ^= 0x01  # one flipped bit, same size: only the checksum can tell
    with fs.open_output_stream(shard) as f:
        f.write(bytes(blob))
    with pytest.raises(CheckpointError, match=r"s3://.*step-2/shard-0\.arrow: checksum mismatch"):
        Checkpoint.open(Location(fs, f"{run.path}/step-2"))
    got = latest(run)
    assert got.checkpoint.step == 1
    assert "shard-0.arrow" in got.skipped[0][1]

    # A truncated shard is caught by its size, even without hashing.
    with fs.open_output_stream(shard) as f:
        f.write(bytes(blob[:-10]))
    with pytest.raises(CheckpointError, match=r"shard-0\.arrow: size"):
        Checkpoint.open(Location(fs, f"{run.path}/step-2"), verify="fast")


def test_run_lock_refuses_second_writer(s3):
    fs, _ = s3
    run = _run(fs, "lock")
    holder = RunLock(run).acquire()
    try:
        with pytest.raises(CheckpointError, match="another writer holds") as e:
            save(run, 1, {"w": np.ones(2, np.float32)})
        assert f"s3://{run.path}/.writer.lock" in str(e.value)  # says what to remove
        with pytest.raises(CheckpointError, match="another writer holds"):
            RunLock(run).acquire()
        assert steps(run) == []
    finally:
        holder.release()
    save(run, 1, {"w": np.ones(2, np.float32)})  # free again once released
    assert fs.get_file_info(f"{run.path}/.writer.lock").type == pafs.FileType.NotFound
    assert latest(run).checkpoint.step == 1


# --------------------------------------------------------------------------- resuming a run on S3

JOB = TINY_JOB.format(name="s3run")


def _train(port: int, run: Location, d, *more: str, lines: list | None = None, **kw):
    """The single-process trainer with its checkpoints in ``run`` on the moto server."""
    from raysinga import config  # noqa: PLC0415 - the trainer is needed by these tests only
    from raysinga.run.trainer import Trainer  # noqa: PLC0415

    d.mkdir(parents=True, exist_ok=True)
    (d / "job.yaml").write_text(JOB)
    query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    uri = f"s3://{KEYS['access_key']}:{KEYS['secret_key']}@{run.path}?{query}"
    cfg = config.load(d / "job.yaml", [f"run_dir={d}", f"checkpoint.dir={uri}", *more])
    log = (lambda line: None) if lines is None else lines.append
    return Trainer(cfg, log=log, **kw).fit()


def _names(fs: pafs.FileSystem, run: Location) -> set[str]:
    return {i.base_name for i in fs.get_file_info(pafs.FileSelector(run.path))}


def test_resume_after_a_writer_died_mid_write(s3, tmp_path):
    """A writer killed while writing step 30 in place leaves ``step-30/`` with shards and no
    manifest: resume removes it (an object store cannot move a directory) and goes on from
    step 20."""
    fs, port = s3
    run = _run(fs, "died")
    _train(port, run, tmp_path, "train_steps=20")
    tmp = begin(run, 30)
    write_shard(tmp, 0, tensors_of({"w": np.zeros(3, np.float32)}))
    assert steps(run) == [30, 20, 10]
    lines: list[str] = []
    _train(port, run, tmp_path, lines=lines, resume=True)
    assert any("resuming 's3run' at step 20" in line for line in lines), lines
    assert steps(run) == [30, 20, 10]
    assert not any(".invalid-" in n for n in _names(fs, run))
    ck = latest(run).checkpoint
    assert ck.step == 30 and ck.meta["run"]["steps"] == [30]


def _flip_a_byte(fs: pafs.FileSystem, ck: str) -> None:
    with fs.open_input_stream(f"{ck}/shard-0.arrow") as f:
        blob = bytearray(f.read())
    blob[len(blob) // 2] ^= 0x10
    with fs.open_output_stream(f"{ck}/shard-0.arrow") as f:
        f.write(bytes(blob))


def _truncate(fs: pafs.FileSystem, ck: str) -> None:
    with fs.open_input_stream(f"{ck}/shard-0.arrow") as f:
        blob = f.read()
    with fs.open_output_stream(f"{ck}/shard-0.arrow") as f:
        f.write(blob[:-100])


@pytest.mark.parametrize("damage", [_flip_a_byte, _truncate], ids=["flipped_byte", "truncated"])
def test_a_damaged_checkpoint_on_s3_is_set_aside(s3, tmp_path, damage):
    """A committed checkpoint damaged at rest (a flipped byte only the full hash sees, or a
    truncated shard the size checks see) is copied to ``step-20.invalid-<id>/`` and deleted;
    the run resumes from step 10."""
    fs, port = s3
    run = _run(fs, "damaged")
    _train(port, run, tmp_path, "train_steps=20")
    damage(fs, f"{run.path}/step-20")
    lines: list[str] = []
    _train(port, run, tmp_path, lines=lines, resume=True)
    assert any("moved aside to" in line and "step-20" in line for line in lines), lines
    assert any("resuming 's3run' at step 10" in line for line in lines), lines
    aside = [n for n in _names(fs, run) if ".invalid-" in n]
    assert len(aside) == 1 and aside[0].startswith("step-20.invalid-")
    assert sorted(
        i.base_name for i in fs.get_file_info(pafs.FileSelector(f"{run.path}/{aside[0]}"))
    ) == ["manifest.msgpack", "params.meta", "shard-0.arrow", "shard-1.arrow"]
    assert steps(run) == [30, 20, 10]
    assert Checkpoint.open(Location(fs, f"{run.path}/step-20")).meta["run"]["steps"] == [20]


# --------------------------------------------------------------------------- replacing a checkpoint


def _w(loc: Location) -> bytes:
    return Checkpoint.open(loc, verify="full").array("w").tobytes()


OLD, NEW = np.full(5, 1, np.float32), np.full(5, 2, np.float32)


def test_replace_on_s3(s3):
    """A committed step is overwritten only when asked; the new one is staged beside it, then
    copied in, and nothing else is left."""
    fs, _ = s3
    run = _run(fs, "replace")
    save(run, 4, {"w": OLD})
    with pytest.raises(CheckpointError, match="already exists"):
        save(run, 4, {"w": NEW})
    tmp = begin(run, 4, replace=True)
    assert tmp.path.startswith(f"{run.path}/step-4.tmp-")
    shard = write_shard(tmp, 0, tensors_of({"w": NEW}))
    with pytest.raises(CheckpointError, match="already exists"):
        commit(tmp, 4, [shard])  # staged for a replace, committed without: still refused
    assert _w(Location(fs, f"{run.path}/step-4")) == OLD.tobytes()
    final = save(run, 4, {"w": NEW}, replace=True)
    assert final.path == f"{run.path}/step-4" and _w(final) == NEW.tobytes()
    save(run, 5, {"w": NEW}, replace=True)  # nothing to replace: an ordinary commit
    prune(run, keep_last=5)  # removes the refused attempt's staging directory
    assert _names(fs, run) == {"step-4", "step-5"}


def _staged(fs: pafs.FileSystem, run: Location, step: int, w: np.ndarray) -> Location:
    """A whole checkpoint of ``step`` staged for a replace, as ``commit`` leaves it before it
    copies: ``step-<step>.tmp-x`` with its manifest."""
    other = _run(fs, "other")
    save(other, step, {"w": w})
    tmp = Location(fs, f"{run.path}/step-{step}.tmp-x")
    placement.copy_dir(other.join(f"step-{step}"), tmp)
    return tmp


def _delete(fs: pafs.FileSystem, ck: Location, *names: str) -> None:
    for n in names:
        fs.delete_file(f"{ck.path}/{n}")


# The states a replace of step-4 (OLD by NEW) passes through, and what step-4 must hold after.
CRASHES = {
    "staging": (lambda fs, ck, tmp: _delete(fs, tmp, "manifest.msgpack"), OLD),
    "staged": (lambda fs, ck, tmp: None, OLD),
    "uncommitting": (lambda fs, ck, tmp: _delete(fs, ck, "manifest.msgpack"), NEW),
    "uncommitted": (lambda fs, ck, tmp: fs.delete_dir(ck.path), NEW),
    "copying": (
        lambda fs, ck, tmp: (
            _delete(fs, ck, "manifest.msgpack", "params.meta"),
            fs.copy_file(f"{tmp.path}/shard-0.arrow", f"{ck.path}/shard-0.arrow"),
        ),
        NEW,
    ),
    "copied": (lambda fs, ck, tmp: placement.copy_dir(tmp, ck), NEW),
    "cleaning": (
        lambda fs, ck, tmp: (placement.copy_dir(tmp, ck), _delete(fs, tmp, "manifest.msgpack")),
        NEW,
    ),
}


@pytest.mark.parametrize("state", list(CRASHES))
def test_a_replace_cut_short_on_s3_is_recovered(s3, state):
    """Each state a crash can leave (made by hand) is recovered by the writer's ``recover``
    (``run_sources.open_run`` calls it) to a whole checkpoint of step 4, old or new."""
    fs, _ = s3
    run = _run(fs, "cut")
    save(run, 3, {"w": OLD})
    ck = save(run, 4, {"w": OLD})
    tmp = _staged(fs, run, 4, NEW)
    make, want = CRASHES[state]
    make(fs, ck, tmp)
    recover(run)
    assert _w(ck) == want.tobytes()
    assert latest(run).checkpoint.step == 4
    prune(run, keep_last=5)
    assert _names(fs, run) == {"step-3", "step-4"}


def test_a_leftover_staging_directory_goes_with_its_step(s3):
    """A replace whose staging directory outlived it (its last delete failed) leaves it beside
    the new step; when prune deletes that step, the leftover goes too (rather than stand as
    the step's only copy and be copied back by ``recover``)."""
    fs, _ = s3
    run = _run(fs, "leftover")
    ck = save(run, 4, {"w": OLD})
    placement.copy_dir(_staged(fs, run, 4, NEW), ck)
    save(run, 5, {"w": NEW})
    assert prune(run, keep_last=1) == [4]
    assert recover(run) == [] and _names(fs, run) == {"step-5"}


def test_copy_dir_streams_what_copy_object_refuses(s3, monkeypatch):
    """S3 copies at most 5 GiB per CopyObject: larger files go through this process."""
    fs, _ = s3
    run = _run(fs, "stream")
    ck = save(run, 4, {"w": NEW})
    monkeypatch.setattr(placement, "COPY_OBJECT_MAX", 100)
    monkeypatch.setattr(placement, "_COPY_PIECE", 7)
    placement.move_dir(ck, run.join("step-6"))
    assert _w(run.join("step-6")) == NEW.tobytes() and _names(fs, run) == {"step-6"}


class _Crash(BaseException):
    """The process dies here: no handler runs."""


class _Dying(pafs.FileSystemHandler):
    """A filesystem that passes every call to ``fs`` and dies at its ``n``-th change."""

    def __init__(self, fs: pafs.FileSystem, n: int) -> None:
        self.fs, self.n = fs, n

    def _change(self) -> None:
        self.n -= 1
        if self.n < 0:
            raise _Crash

    def get_type_name(self):
        return "dying"

    def normalize_path(self, path):
        return path

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def open_input_stream(self, path):
        return self.fs.open_input_stream(path)

    def open_input_file(self, path):
        return self.fs.open_input_file(path)

    def create_dir(self, path, recursive):
        self._change()
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self._change()
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self._change()
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise NotImplementedError

    def delete_file(self, path):
        self._change()
        self.fs.delete_file(path)

    def move(self, src, dest):
        self._change()
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        self._change()
        self.fs.copy_file(src, dest)

    def open_output_stream(self, path, metadata):
        self._change()
        return self.fs.open_output_stream(path)

    def open_append_stream(self, path, metadata):
        raise NotImplementedError


@pytest.mark.slow
def test_a_replace_killed_at_every_change_is_recovered(s3):
    """The writer dies before each change a replace makes to the bucket in turn (writing the
    staged manifest, uncommitting, every copy, every delete): ``recover`` then finds step 4
    whole, the old one until the old manifest is gone, the new one after; and a caller's
    cleanup of the staging directory never takes the only whole copy."""
    fs, _ = s3
    got = []  # what step 4 holds after recovery, by where the writer died
    for n in itertools.count():
        run = _run(fs, "killed")
        save(run, 4, {"w": OLD})
        tmp = begin(run, 4, replace=True)
        shard = write_shard(tmp, 0, tensors_of({"w": NEW}))
        dying = Location(pafs.PyFileSystem(_Dying(fs, n)), tmp.path)
        try:
            commit(dying, 4, [shard], replace=True)
        except _Crash:
            pass
        else:
            break
        storage.remove_dir(tmp)  # what a caller's error handler does
        recover(run)
        got.append(_w(run.join("step-4")))
        prune(run, keep_last=5)
        assert _names(fs, run) == {"step-4"}, n
    k = got.index(NEW.tobytes())
    assert n > 5 and 0 < k and got == [OLD.tobytes()] * k + [NEW.tobytes()] * (n - k)
    assert _w(run.join("step-4")) == NEW.tobytes() and _names(fs, run) == {"step-4"}


def test_resume_finishes_a_replace_cut_short(s3, tmp_path):
    """End to end: step 20 of a run was being replaced by another state of step 20 (here, a
    run with another seed) when the writer died, its old manifest already gone; resume
    finishes the copy and goes on from the new step 20."""
    fs, port = s3
    run, other = _run(fs, "rep"), _run(fs, "rep-other")
    _train(port, run, tmp_path / "a", "train_steps=20")
    _train(port, other, tmp_path / "b", "train_steps=20", "seed=5")
    placement.copy_dir(other.join("step-20"), run.join("step-20.tmp-x"))
    fs.delete_file(f"{run.path}/step-20/manifest.msgpack")
    lines: list[str] = []
    _train(port, run, tmp_path / "a", lines=lines, resume=True)
    assert any("step-20: finished its replace" in line for line in lines), lines
    assert any("resuming 's3run' at step 20" in line for line in lines), lines
    assert any("checkpoint's seed 5" in line for line in lines), lines
    assert steps(run) == [30, 20, 10]
    assert not any(".tmp-" in n for n in _names(fs, run))


# --------------------------------------------------------------------------- the lease


def test_a_live_writer_elsewhere_renewing_its_lease_is_refused(s3):
    """A holder on another machine renews its lease: a second writer sees the renewal and is
    refused within a lease period, the lock left as it was."""
    fs, _ = s3
    run = _run(fs, "lease")
    holder = RunLock(run, lease_s=1.5)
    holder.host = "another-machine"
    holder.acquire()
    try:
        t0 = time.monotonic()
        with pytest.raises(CheckpointError, match="renews its lease"):
            RunLock(run, lease_s=1.5).acquire()
        assert time.monotonic() - t0 < 3.0
    finally:
        holder.release()
    assert fs.get_file_info(f"{run.path}/.writer.lock").type == pafs.FileType.NotFound


@pytest.mark.slow
def test_a_writer_killed_on_s3_is_resumed_without_touching_the_lock(s3, tmp_path):
    """A writer SIGKILLed mid-run leaves its lock on S3. A writer of this machine takes a dead
    process's lock over at once; one left by a writer on another machine (its host rewritten
    so) is taken over once its lease runs out, and the run resumes."""
    fs, port = s3
    run = _run(fs, "killed")
    d = tmp_path / "w"
    d.mkdir()
    (d / "job.yaml").write_text(JOB)
    query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    uri = f"s3://{KEYS['access_key']}:{KEYS['secret_key']}@{run.path}?{query}"
    writer = subprocess.Popen(
        [sys.executable, "-m", "raysinga.cli", "train", str(d / "job.yaml"), "--local"]
        + [
            "--set",
            f"run_dir={d}",
            "--set",
            f"checkpoint.dir={uri}",
            "--set",
            "train_steps=100000",
        ],
        env={**os.environ, "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not steps(run) or steps(run)[0] < 20:
        assert time.monotonic() < deadline and writer.poll() is None
        time.sleep(0.1)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    lock = f"{run.path}/.writer.lock"
    left = json.loads(fs.open_input_stream(lock).read())
    assert left["pid"] == writer.pid  # the dead writer's lease is still there
    with fs.open_output_stream(lock) as f:  # as a writer on another machine leaves it
        f.write(json.dumps({**left, "host": "another-machine"}).encode())
    lines: list[str] = []
    t0 = time.monotonic()
    end = steps(run)[0] + 10
    _train(port, run, tmp_path / "r", f"train_steps={end}", lines=lines, resume=True)
    waited = time.monotonic() - t0
    assert any("waiting up to" in line for line in lines), lines
    assert any("resuming 's3run' at step" in line for line in lines), lines
    assert waited < LEASE_S + 30, waited
    assert latest(run).checkpoint.step == end
    assert fs.get_file_info(lock).type == pafs.FileType.NotFound


# --------------------------------------------------------------------------- no secrets at rest


@pytest.mark.slow
def test_credentials_in_the_uri_are_kept_out_of_every_file_log_and_inspect_output(s3, tmp_path):
    """A run whose ``checkpoint.dir`` carries its keys in the URI (user info): the keys reach
    no file of the run (local or on S3), no line it prints, no ``inspect --json`` output."""
    fs, port = s3
    run = _run(fs, "secret")
    key, secret = "AKIASECRETKEYID00001", "s3cr3t+v4lue/NEVER-WRITTEN"
    quoted = secret.replace("+", "%2B").replace("/", "%2F")
    query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    uri = f"s3://{key}:{quoted}@{run.path}?{query}"
    d = tmp_path / "run"
    d.mkdir()
    (d / "job.yaml").write_text(JOB)
    env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1"}
    cli = [sys.executable, "-m", "raysinga.cli"]
    sets = ["--set", f"run_dir={d}", "--set", f"checkpoint.dir={uri}", "--set", "tensorboard=true"]
    outs = [
        subprocess.run(
            [*cli, "train", str(d / "job.yaml"), "--local", *sets, *more],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        for more in ([], ["--set", "train_steps=40", "--resume"])
    ]
    ck = uri.replace("?", "/step-40?")
    outs += [
        subprocess.run([*cli, c, ck, *j], env=env, capture_output=True, text=True, timeout=300)
        for c, j in (("inspect", ["--json"]), ("inspect", []), ("verify", []))
    ]
    for o in outs:
        assert o.returncode == 0, o.stdout + o.stderr
    texts = {f"output {i}": o.stdout + o.stderr for i, o in enumerate(outs)}
    for f in d.rglob("*"):
        if f.is_file():
            texts[str(f)] = f.read_bytes().decode("latin-1")
    for info in fs.get_file_info(pafs.FileSelector(run.path, recursive=True)):
        if info.type == pafs.FileType.File:
            texts[info.path] = fs.open_input_stream(info.path).read().decode("latin-1")
    assert any(run.path in t for t in texts.values())  # the location itself is named
    # the run's record beside its checkpoints, as written at the end of the resumed run
    record = f"{run.path}/record"
    local = (d / "metrics.jsonl").read_bytes()
    assert fs.open_input_stream(f"{record}/metrics.jsonl").read() == local
    events = fs.get_file_info(pafs.FileSelector(f"{record}/tensorboard"))
    assert len(events) == len(list((d / "tensorboard").iterdir())) >= 1
    for where, text in texts.items():
        for s in (key, secret, quoted):
            assert s not in text, f"{s!r} in {where}"


def test_a_record_in_shared_storage_is_plotted_from_its_uri(s3, tmp_path):
    pytest.importorskip("matplotlib")
    from raysinga import cli

    fs, port = s3
    run = _run(fs, "plotted")
    _train(port, run, tmp_path / "w", "train_steps=20")
    assert fs.get_file_info(f"{run.path}/record/metrics.jsonl").type == pafs.FileType.File
    query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    uri = f"s3://{KEYS['access_key']}:{KEYS['secret_key']}@{run.path}?{query}"
    out = tmp_path / "plots"
    assert cli.main(["plot", uri, "-o", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["loss.png", "metrics.jsonl", "throughput.png"]
