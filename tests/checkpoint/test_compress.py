"""Compressed shards: a record batch that compression does not shrink is stored raw, so a
compressed shard is never larger than the uncompressed one; every Arrow reader reads the mix."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from raysinga.checkpoint import Checkpoint, TensorInfo, begin, commit, write_shard
from raysinga.checkpoint.ipc_limits import decompressed_sizes


def _pairs(tensors: dict[str, np.ndarray]) -> list[tuple[TensorInfo, np.ndarray]]:
    return [
        (TensorInfo(n, "param", a.shape, str(a.dtype), 0, a.size), a) for n, a in tensors.items()
    ]


def _shard(root, compression, tensors) -> tuple[bytes, str]:
    tmp = begin(root / str(compression), 1)
    shard = write_shard(tmp, 0, _pairs(tensors), compression)
    path = commit(tmp, 1, [shard]).path
    with open(f"{path}/shard-0.arrow", "rb") as f:
        return f.read(), path


def _random(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        **{f"l{i}/W": rng.standard_normal((64, 60 + i)).astype(np.float32) for i in range(5)},
        "l0/b": rng.standard_normal(7).astype(np.float64),
        "scalar": np.asarray(rng.standard_normal(), np.float32),
        "empty": np.zeros((0, 3), np.int32),
    }


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_random_weights_are_never_larger_compressed(tmp_path, compression):
    raw, _ = _shard(tmp_path, None, _random())
    packed, path = _shard(tmp_path, compression, _random())
    # Each record batch is the shorter of its two messages: the file is at most the raw one.
    assert len(packed) <= len(raw)
    ck = Checkpoint.open(path)
    for n, a in _random().items():
        assert ck.array(n).tobytes() == a.tobytes()
    if compression == "lz4":  # LZ4 finds nothing in random floats: every batch stays raw
        assert packed == raw
        assert decompressed_sizes(packed) == [0] * len(_random())


def test_batches_that_shrink_are_compressed_and_the_rest_stored_raw(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {
        "zeros": np.zeros(50_000, np.float32),  # shrinks a hundredfold
        "noise": rng.standard_normal(20_000).astype(np.float32),  # does not shrink under LZ4
        "ramp": np.arange(30_000, dtype=np.int64),
    }
    raw, _ = _shard(tmp_path, None, tensors)
    packed, path = _shard(tmp_path, "lz4", tensors)
    declared = decompressed_sizes(packed)  # 0 for a batch without a compression field
    assert declared[0] > 200_000 and declared[1] == 0 and declared[2] > 240_000
    assert len(packed) < len(raw) - 300_000
    # Any Arrow reader reads a file mixing both kinds of batches.
    r = pa.ipc.open_file(pa.py_buffer(packed))
    got = [r.get_batch(i) for i in range(r.num_record_batches)]
    for b, (name, a) in zip(got, tensors.items(), strict=True):
        b.validate(full=True)
        assert b.column("name")[0].as_py() == name
        assert b.column("data")[0].as_py() == a.tobytes()
    ck = Checkpoint.open(path)
    for n, a in tensors.items():
        assert ck.array(n).tobytes() == a.tobytes()


def test_a_compressed_shard_without_records_is_an_arrow_file(tmp_path):
    packed, path = _shard(tmp_path, "zstd", {})
    assert pa.ipc.open_file(pa.py_buffer(packed)).num_record_batches == 0
    assert Checkpoint.open(path).names() == []
