"""Checkpoints on S3, against a real S3-compatible server on loopback (moto's server mode).

Nothing is mocked inside the process under test: pyarrow's S3 client speaks HTTP to moto, so
this exercises what an object store changes: no directory rename (a checkpoint is written in
place, the manifest last), prefixes as directories, and no O_EXCL for the run lock.
"""

from __future__ import annotations

import itertools
import logging
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

pytest.importorskip("moto.server")
pafs = pytest.importorskip("pyarrow.fs")

from moto.server import ThreadedMotoServer  # noqa: E402

from raysinga.checkpoint import (  # noqa: E402
    Checkpoint,
    CheckpointError,
    RunLock,
    TensorInfo,
    begin,
    commit,
    latest,
    prune,
    save,
    steps,
    tensors_of,
    write_shard,
)
from raysinga.checkpoint.format import DTYPES  # noqa: E402
from raysinga.checkpoint.storage import Location  # noqa: E402

BUCKET = "raysinga-test"
KEYS = {"access_key": "testing", "secret_key": "testing"}


@pytest.fixture(scope="module")
def s3():
    """(filesystem, port): an S3FileSystem talking to a moto server on 127.0.0.1."""
    saved = {k: os.environ.get(k) for k in ("AWS_EC2_METADATA_DISABLED", "NO_PROXY", "no_proxy")}
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1"
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        _, port = server.get_host_and_port()
        opts = dict(
            endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1", **KEYS
        )
        pafs.S3FileSystem(allow_bucket_creation=True, **opts).create_dir(BUCKET)
        yield pafs.S3FileSystem(**opts), port
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
