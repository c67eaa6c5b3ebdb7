"""The reader refuses what the format forbids at open: slices that overlap, leave gaps or
disagree on dtype, a compressed shard that would decompress past what its manifest allows, and
a tensor entry without a checksum. Every crafted checkpoint here is otherwise valid (its files
match its manifest), so only the rule under test can refuse it."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import msgpack
import numpy as np
import pyarrow as pa
import pytest
import xxhash
from helpers import run_cli

from raysinga.checkpoint import (
    Checkpoint,
    CheckpointError,
    TensorInfo,
    begin,
    commit,
    save,
    write_shard,
    writer,
)
from raysinga.checkpoint.format import MANIFEST
from raysinga.checkpoint.manifest import seal


def _sliced(root: Path, slices: list[tuple[int, int, str]], size: int = 10):
    """Tensor ``w`` of ``size`` elements stored as the given (start, stop, dtype) slices, one
    shard each, committed by the real writer."""
    tmp = begin(root, 1)
    records = []
    for k, (a, b, dt) in enumerate(slices):
        info = TensorInfo("w", "param", (size,), dt, a, b)
        records.append(write_shard(tmp, k, [(info, np.arange(a, b).astype(dt))]))
    return commit(tmp, 1, records)


def _rewrite_manifest(loc, change) -> None:
    """Apply ``change`` to the decoded manifest and seal it again, as a crafted one would be."""
    path = os.path.join(loc.path, MANIFEST)
    with open(path, "rb") as f:
        m = msgpack.unpackb(msgpack.unpackb(f.read())["body"])
    change(m)
    with open(path, "wb") as f:
        f.write(seal(m))


@pytest.mark.parametrize(
    "slices,why",
    [
        ([(0, 4), (2, 6), (8, 10)], r"\[0, 4\), \[2, 6\), \[8, 10\).*\[2, 6\) overlaps \[0, 4\)"),
        ([(0, 4), (6, 10)], r"\[0, 4\), \[6, 10\).*\[4, 6\) is missing"),
        ([(2, 10)], r"\[2, 10\).*\[0, 2\) is missing"),
        ([(0, 7)], r"\[0, 7\).*\[7, 10\) is missing"),
        ([(0, 10), (3, 3)], r"\[3, 3\) overlaps \[0, 10\)"),
    ],
)
def test_slices_must_tile_the_tensor_exactly(tmp_path, slices, why):
    loc = _sliced(tmp_path, [(a, b, "float32") for a, b in slices])
    for verify in ("full", "fast"):
        with pytest.raises(CheckpointError, match=rf"{MANIFEST}: .*tensor 'w'.*{why}"):
            Checkpoint.open(loc, verify=verify)


def test_slices_that_tile_the_tensor_are_read(tmp_path):
    loc = _sliced(tmp_path, [(6, 10, "int64"), (0, 3, "int64"), (3, 6, "int64"), (10, 10, "int64")])
    ck = Checkpoint.open(loc)
    np.testing.assert_array_equal(ck.array("w"), np.arange(10))
    np.testing.assert_array_equal(ck.flat_range("w", 2, 8), np.arange(2, 8))


def test_a_duplicate_slice_in_the_manifest_is_refused(tmp_path):
    loc = save(tmp_path, 1, {"w": np.arange(4, dtype=np.float32)})
    _rewrite_manifest(loc, lambda m: m["tensors"].append(dict(m["tensors"][0])))
    with pytest.raises(CheckpointError, match=r"tensor 'w'.*\[0, 4\) is listed twice"):
        Checkpoint.open(loc)


def test_slices_with_different_dtypes_are_refused(tmp_path, monkeypatch):
    # The writer refuses this; a writer that did not (another library, an older version)
    # must not get its slices cast silently on read.
    monkeypatch.setattr(writer, "_check_unique", lambda shards: None)
    loc = _sliced(tmp_path, [(0, 5, "float32"), (5, 10, "float64")])
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"tensor 'w'.*dtype.*float32.*float64"):
        Checkpoint.open(loc)


def _zeros_frame(n: int) -> bytes:
    """A zstd frame of ``n`` zero bytes, built by hand from RLE blocks (4 bytes per 128 KiB):
    a few KB that decompress to ``n`` bytes, without ever holding them."""
    block = 128 << 10
    assert n % block == 0
    k = n // block
    head = struct.pack("<IBQ", 0xFD2FB528, 0xE0, n)  # single segment, 8-byte content size
    rle = [struct.pack("<I", int(i == k - 1) | 1 << 1 | block << 3)[:3] + b"\0" for i in range(k)]
    return head + b"".join(rle)


def test_a_compressed_shard_is_refused_before_it_decompresses_past_its_manifest(tmp_path):
    """A crafted shard whose tensor's compressed buffer claims 1 GiB (of zeros, in 32 KiB) while
    the manifest says 64 KiB: refused without Arrow allocating the claim."""
    w = np.random.default_rng(0).standard_normal(1 << 14).astype(np.float32)
    loc = save(tmp_path, 1, {"w": w}, compression="zstd")
    shard = Path(loc.path) / "shard-0.arrow"
    blob = bytearray(shard.read_bytes())
    packed = pa.Codec("zstd").compress(w.tobytes(), asbytes=True)  # Arrow's own bytes for it
    at = blob.index(packed)
    assert struct.unpack_from("<q", blob, at - 8) == (w.nbytes,)  # its uncompressed length
    claim = 1 << 30
    bomb = struct.pack("<q", claim) + _zeros_frame(claim)
    skip = len(packed) + 8 - len(bomb) - 8  # the rest: a zstd skippable frame, same length
    assert skip >= 0
    bomb += struct.pack("<II", 0x184D2A50, skip) + b"\0" * skip
    blob[at - 8 : at + len(packed)] = bomb
    shard.write_bytes(blob)

    def reseal(m):
        m["files"][0]["xxh3"] = xxhash.xxh3_64_hexdigest(bytes(blob))

    _rewrite_manifest(loc, reseal)
    default = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default)  # counts what the reader allocates, peak included
    pa.set_memory_pool(pool)
    try:
        for verify in ("full", "fast"):
            with pytest.raises(
                CheckpointError, match=r"shard-0.arrow: .*1073741\d+ bytes.*manifest allows"
            ):
                Checkpoint.open(loc, verify=verify)
    finally:
        pa.set_memory_pool(default)
    assert pool.max_memory() < 1 << 20


def test_a_tensor_without_a_checksum_is_a_checkpoint_error(tmp_path):
    loc = save(tmp_path, 1, {"w": np.ones(3, np.float32), "b": np.zeros(2, np.int8)})
    _rewrite_manifest(loc, lambda m: m["tensors"][1].pop("xxh3"))
    name = Checkpoint.open(loc).manifest["tensors"][1]["name"]
    with pytest.raises(CheckpointError, match=rf"tensor '{name}'.*no checksum"):
        Checkpoint.open(loc).verify_tensors()
    r = run_cli("verify", loc.path)
    assert r.returncode == 1
    assert r.stderr.startswith("raysinga: error: ") and "Traceback" not in r.stderr, r.stderr
    assert f"tensor '{name}'" in r.stderr and "no checksum" in r.stderr
