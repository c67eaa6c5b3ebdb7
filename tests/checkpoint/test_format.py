"""Checkpoint format: round trips, zero-copy reads, errors, latest() and prune()."""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from pathlib import Path

import msgpack
import numpy as np
import pyarrow as pa
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from raysinga.checkpoint import (
    Checkpoint,
    CheckpointError,
    TensorInfo,
    begin,
    commit,
    filehash,
    latest,
    prune,
    save,
    sink,
    steps,
    write_shard,
    writer,
)
from raysinga.checkpoint.format import DTYPES, MANIFEST
from raysinga.checkpoint.manifest import seal

REPO = Path(__file__).resolve().parents[2]

SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)

segment = st.text("abcXYZ_019.", min_size=1, max_size=6)
names = st.lists(segment, min_size=1, max_size=3).map("/".join)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)


@st.composite
def tensor_sets(draw):
    """{name: (kind, array)} with unique names, every supported dtype, 0-d and empty shapes."""
    keys = draw(st.lists(names, min_size=1, max_size=6, unique=True))
    out = {}
    for k in keys:
        dtype = np.dtype(draw(st.sampled_from(DTYPES)))
        arr = draw(hnp.arrays(dtype, draw(shapes)))
        out[k] = (draw(st.sampled_from(["param", "slot", "state"])), arr)
    return out


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert got.tobytes() == want.tobytes()  # bit-identical: NaN payloads, -0.0


def check_all(ck: Checkpoint, tensors: dict) -> None:
    assert sorted(ck.names(None)) == sorted(tensors)
    for name, (kind, arr) in tensors.items():
        assert ck.info(name).kind == kind
        assert name in ck.names(kind)
        assert_same(ck.array(name), arr)


@SETTINGS
@given(tensors=tensor_sets(), compression=st.sampled_from([None, "zstd", "lz4"]))
def test_save_round_trip(tensors, compression):
    by_kind = {k: {n: a for n, (kk, a) in tensors.items() if kk == k} for k in ("param", "slot")}
    state = {n: a for n, (kk, a) in tensors.items() if kk == "state"}
    meta = {"cursor": [1, 2], "seed": 7, "name": "run"}
    with tempfile.TemporaryDirectory() as d:
        loc = save(d, 5, by_kind["param"], by_kind["slot"], state, meta, compression)
        assert loc.path == os.path.join(os.path.abspath(d), "step-5")
        for verify in ("full", "fast"):
            ck = Checkpoint.open(loc.path, verify=verify)
            assert ck.step == 5 and ck.meta == meta
            check_all(ck, tensors)
            assert set(ck.arrays()) == set(by_kind["param"])


@SETTINGS
@given(
    tensors=tensor_sets(),
    compression=st.sampled_from([None, "zstd", "lz4"]),
    nshards=st.integers(1, 3),
    data=st.data(),
)
def test_multi_shard_round_trip_with_slices(tensors, compression, nshards, data):
    per_shard: list[list] = [[] for _ in range(nshards)]
    for name, (kind, arr) in tensors.items():
        flat = arr.reshape(-1)
        cuts = data.draw(st.sets(st.integers(1, max(1, arr.size - 1)), max_size=3))
        bounds = [0, *sorted(c for c in cuts if 0 < c < arr.size), arr.size]
        for a, b in zip(bounds, bounds[1:], strict=False):
            shard = data.draw(st.integers(0, nshards - 1))
            info = TensorInfo(name, kind, arr.shape, str(arr.dtype), a, b, version=3)
            per_shard[shard].append((info, flat[a:b]))
    with tempfile.TemporaryDirectory() as d:
        tmp = begin(d, 11)
        records = [write_shard(tmp, i, per_shard[i], compression) for i in range(nshards)]
        final = commit(tmp, 11, records[::-1], {"k": "v"})
        assert steps(d) == [11]
        assert not [x for x in os.listdir(d) if ".tmp-" in x]
        ck = Checkpoint.open(final)
        check_all(ck, tensors)
        assert {i.version for i in ck.infos} == {3}


def test_params_meta_names_the_right_shard_past_ten(tmp_path):
    """shard-10 sorts before shard-2 as text: params.meta must label every line by number."""
    tmp = begin(tmp_path, 1)
    records = [
        write_shard(tmp, k, [(TensorInfo(f"t{k}", "param", (2,), "float32", 0, 2), np.ones(2))])
        for k in range(12)
    ]
    ck = Checkpoint.open(commit(tmp, 1, records))
    lines = (Path(ck.location.path) / "params.meta").read_text().splitlines()[1:]
    assert [ln.split("\t")[0] for ln in lines] == [f"t{k}" for k in range(12)]
    for ln in lines:
        name, shard = ln.split("\t")[0], ln.split("\t")[6]
        assert shard == f"shard-{name[1:]}" == f"shard-{ck.info(name).shard}", ln


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_writes_across_staging_buffer_edges(tmp_path, monkeypatch, direct):
    monkeypatch.setattr(sink, "DIRECT", direct)
    stage = sink.STAGE
    sizes = [0, 1, 4095, stage - 700, stage, stage + 3, 2 * stage + 5]
    rng = np.random.default_rng(1)
    tensors = {f"t{i}": rng.integers(0, 255, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    for step, (name, arr) in enumerate(tensors.items()):  # one tensor per file: every tail
        ck = Checkpoint.open(save(tmp_path, step, {name: arr}), verify="full")
        assert_same(ck.array(name), arr)
    ck = Checkpoint.open(save(tmp_path, 99, tensors), verify="full")  # and all in one
    for name, arr in tensors.items():
        assert_same(ck.array(name), arr)
    assert ck.verify_tensors() == sum(sizes)


def _image_tensors(rng, sizes, dtypes):
    return [
        (TensorInfo(f"t{i}", "param", (n,), dt, 0, n, 2), rng.standard_normal(n).astype(dt))
        for i, (n, dt) in enumerate(zip(sizes, dtypes, strict=True))
    ]


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_shard_written_from_an_image_is_the_same_file(tmp_path, monkeypatch, direct):
    """A shard image (tensors copied to their file offsets, the file written straight from it)
    gives byte for byte the file a plain write gives, also when reused with new values."""
    monkeypatch.setattr(sink, "DIRECT", direct)
    stage = sink.STAGE
    rng = np.random.default_rng(4)
    sizes = [stage // 4 + 3, 0, 5, 2 * stage // 4 + 1, 1]
    tensors = _image_tensors(rng, sizes, ["float32", "float32", "float64", "float32", "int8"])
    image = writer.ShardImage(tensors)
    in_place = []  # whether each tensor was hashed in the file's pass
    took = sink.ShardSink.took
    monkeypatch.setattr(
        sink.ShardSink, "took", lambda self, span: in_place.append(took(self, span)) or in_place[-1]
    )
    for step in (1, 2):
        plain = write_shard(begin(tmp_path / "plain", step), 0, tensors)
        assert in_place == [bool(n) for n in sizes]  # staged: also in the file's pass
        in_place.clear()
        placed = image.place(tensors)
        assert all(a is not b for (_, a), (_, b) in zip(placed, tensors, strict=True) if b.size)
        in_place.clear()
        via = write_shard(begin(tmp_path / "image", step), 0, placed, image=image)
        assert in_place == [bool(n) for n in sizes]
        in_place.clear()
        assert via == plain
        files = [
            next(Path(tmp_path, d).glob(f"step-{step}.tmp-*/shard-0.arrow"))
            for d in ("plain", "image")
        ]
        assert files[0].read_bytes() == files[1].read_bytes()
        for _, a in tensors:
            a += 1  # a new step: the image is refilled


def test_shard_image_refuses_other_tensors(tmp_path):
    rng = np.random.default_rng(5)
    tensors = _image_tensors(rng, [10, 20], ["float32", "float32"])
    image = writer.ShardImage(tensors)
    assert image.fits(_image_tensors(rng, [10, 20], ["float32", "float32"]))
    other = _image_tensors(rng, [10, 21], ["float32", "float32"])
    assert not image.fits(other)
    with pytest.raises(ValueError, match="laid out for 80"):
        image.place(other)
    big = _image_tensors(rng, [10, 5000], ["float32", "float32"])
    with pytest.raises(ValueError, match="too small"):
        write_shard(begin(tmp_path, 1), 0, big, image=image)
    with pytest.raises(ValueError, match="uncompressed"):
        write_shard(begin(tmp_path, 2), 0, tensors, "zstd", image=image)


def test_uncompressed_read_is_a_read_only_memory_map(tmp_path):
    w = np.arange(1 << 16, dtype=np.float32).reshape(256, 256)
    loc = save(tmp_path, 1, {"layer/W": w})
    arr = Checkpoint.open(loc).array("layer/W")
    assert_same(arr, w)
    assert not arr.flags.writeable
    with pytest.raises(ValueError):
        arr[0, 0] = 1.0
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, pa.Buffer)
    addr = arr.__array_interface__["data"][0]
    shard = os.path.realpath(os.path.join(loc.path, "shard-0.arrow"))
    with open("/proc/self/maps") as f:
        maps = [line.split() for line in f]
    hits = [
        m
        for m in maps
        if len(m) >= 6
        and m[5] == shard
        and int(m[0].split("-")[0], 16) <= addr
        and addr + arr.nbytes <= int(m[0].split("-")[1], 16)
    ]
    assert hits, "the array does not lie inside a mapping of the shard file"


def test_compressed_read_is_not_mapped_but_equal(tmp_path):
    w = np.arange(4096, dtype=np.int64)
    loc = save(tmp_path, 1, {"w": w}, compression="zstd")
    assert_same(Checkpoint.open(loc).array("w"), w)


def _evict(path: Path) -> bool:
    """Drop a file from the page cache; False where the file system keeps it (tmpfs)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        return bool(filehash._absent_pieces(m, path.stat().st_size))


@pytest.fixture
def small_pieces(monkeypatch):
    """Read-ahead in 64 KiB pieces from 128 KiB on, so that small files exercise it."""
    monkeypatch.setattr(filehash, "READ_PIECE", 64 << 10)
    monkeypatch.setattr(filehash, "READ_AHEAD_MIN", 128 << 10)


@pytest.mark.parametrize("readers", [0, 1, 4])
def test_read_ahead_hash_equals_the_plain_hash(tmp_path, small_pieces, readers):
    data = np.random.default_rng(6).integers(0, 256, (1 << 20) + 4097, np.uint8).tobytes()
    f = tmp_path / "blob"
    f.write_bytes(data)
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert filehash._absent_pieces(m, len(data)) == []  # just written: all cached
    cold = _evict(f)
    assert filehash.hash_local_file(str(f), readers) == (len(data), xxhash.xxh3_64_hexdigest(data))
    if cold:
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as m:
            assert filehash._absent_pieces(m, len(data)) == []  # read back in whole


@pytest.mark.parametrize("where", [0, 0.37, 0.999])
def test_cold_full_verify_with_read_ahead_finds_a_flipped_byte(tmp_path, small_pieces, where):
    w = np.random.default_rng(7).standard_normal(1 << 18).astype(np.float32)
    loc = save(tmp_path, 1, {"w": w})
    shard = Path(loc.path) / "shard-0.arrow"
    raw = bytearray(shard.read_bytes())
    raw[int(where * (len(raw) - 1))] ^= 0x10
    shard.write_bytes(raw)
    _evict(shard)
    with pytest.raises(CheckpointError, match="shard-0.arrow.*checksum mismatch"):
        Checkpoint.open(loc, verify="full")


# --- errors -------------------------------------------------------------------------------------


def test_directory_without_manifest(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        Checkpoint.open(tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        Checkpoint.open(tmp_path / "nope")


def test_bad_verify_argument(tmp_path):
    loc = save(tmp_path, 0, {"w": np.ones(2)})
    with pytest.raises(ValueError):
        Checkpoint.open(loc, verify="none")


def test_newer_format_version(tmp_path):
    loc = save(tmp_path, 0, {"w": np.ones(2)})
    path = os.path.join(loc.path, MANIFEST)
    with open(path, "rb") as f:
        m = msgpack.unpackb(msgpack.unpackb(f.read())["body"])
    m["version"] = 2
    with open(path, "wb") as f:
        f.write(seal(m))
    with pytest.raises(CheckpointError, match="newer") as e:
        Checkpoint.open(loc)
    assert MANIFEST in str(e.value)


def test_manifest_of_another_format(tmp_path):
    loc = save(tmp_path, 0, {"w": np.ones(2)})
    path = os.path.join(loc.path, MANIFEST)
    with open(path, "rb") as f:
        m = msgpack.unpackb(msgpack.unpackb(f.read())["body"])
    m["format"] = "something-else"
    with open(path, "wb") as f:
        f.write(seal(m))
    with pytest.raises(CheckpointError, match="not a raysinga checkpoint"):
        Checkpoint.open(loc)


@pytest.mark.parametrize(
    "shape,why",
    [
        # a size past int64 (Python ints): the one slice [0, 2) leaves most of it uncovered
        ([2**62, 2**62], rf"{MANIFEST}: malformed manifest: .*\[2, {2**124}\) is missing"),
        ([-1], "malformed manifest"),
        ([1.5], "malformed manifest"),
        ("3", "malformed manifest"),
        ([1], f"{MANIFEST}: malformed manifest"),  # slice [0, 2) does not fit
    ],
)
def test_crafted_manifest_with_bad_shape(tmp_path, shape, why):
    loc = save(tmp_path, 0, {"w": np.ones(2)})
    path = os.path.join(loc.path, MANIFEST)
    with open(path, "rb") as f:
        m = msgpack.unpackb(msgpack.unpackb(f.read())["body"])
    m["tensors"][0]["shape"] = shape
    with open(path, "wb") as f:
        f.write(seal(m))
    with pytest.raises(CheckpointError, match=why):
        Checkpoint.open(loc)


def test_unencodable_metadata(tmp_path):
    with pytest.raises(CheckpointError, match="msgpack"):
        save(tmp_path, 0, {"w": np.ones(2)}, meta={"x": object()})
    assert os.listdir(tmp_path) == []  # no step dir, no temp dir, lock released


@pytest.mark.parametrize("dtype", ["complex64", "object", "datetime64[s]"])
def test_unsupported_dtype(tmp_path, dtype):
    with pytest.raises(CheckpointError, match="dtype"):
        save(tmp_path, 0, {"w": np.zeros(3, dtype=dtype)})
    assert os.listdir(tmp_path) == []


def test_big_endian_is_stored_little_endian(tmp_path):
    w = np.arange(5, dtype=">i4")
    loc = save(tmp_path, 0, {"w": w})
    got = Checkpoint.open(loc).array("w")
    assert got.dtype == np.dtype("int32")
    np.testing.assert_array_equal(got, w)


def test_unsupported_compression(tmp_path):
    with pytest.raises(CheckpointError, match="compression"):
        save(tmp_path, 0, {"w": np.ones(2)}, compression="gzip")
    assert os.listdir(tmp_path) == []


def test_same_step_twice(tmp_path):
    save(tmp_path, 3, {"w": np.ones(2)})
    with pytest.raises(CheckpointError, match="already exists"):
        save(tmp_path, 3, {"w": np.zeros(2)})
    np.testing.assert_array_equal(Checkpoint.open(tmp_path / "step-3").array("w"), np.ones(2))
    assert sorted(os.listdir(tmp_path)) == ["step-3"]


@pytest.mark.parametrize("step", [-1, 1.0, "2"])
def test_bad_step(tmp_path, step):
    with pytest.raises(CheckpointError, match="step"):
        save(tmp_path, step, {"w": np.ones(2)})


def test_same_name_in_two_kinds_is_refused(tmp_path):
    """A name stored twice would make the checkpoint unreadable; the writer must refuse it."""
    with pytest.raises(CheckpointError, match="twice"):
        save(tmp_path, 0, {"w": np.ones(2)}, slots={"w": np.zeros(2)})
    assert steps(tmp_path) == []


@pytest.mark.parametrize(
    "name,kind", [("", "param"), ("a\tb", "param"), ("a\nb", "param"), ("w", "weird")]
)
def test_bad_tensor_entries(tmp_path, name, kind):
    tmp = begin(tmp_path, 0)
    with pytest.raises(CheckpointError):
        write_shard(tmp, 0, [(TensorInfo(name, kind, (2,), "float32", 0, 2), np.ones(2, "f4"))])


def test_slice_size_mismatch(tmp_path):
    tmp = begin(tmp_path, 0)
    with pytest.raises(CheckpointError, match="values for slice"):
        write_shard(tmp, 0, [(TensorInfo("w", "param", (4,), "float32", 0, 2), np.ones(3, "f4"))])


def test_shards_must_be_numbered_from_zero(tmp_path):
    tmp = begin(tmp_path, 0)
    rec = write_shard(tmp, 1, [(TensorInfo("w", "param", (2,), "f4", 0, 2), np.ones(2, "f4"))])
    with pytest.raises(CheckpointError, match="numbered"):
        commit(tmp, 0, [rec])


def test_missing_slice_is_refused_at_open(tmp_path):
    tmp = begin(tmp_path, 0)
    rec = write_shard(tmp, 0, [(TensorInfo("w", "param", (4,), "f4", 0, 2), np.ones(2, "f4"))])
    with pytest.raises(CheckpointError, match=r"tensor 'w': .*\[2, 4\) is missing"):
        Checkpoint.open(commit(tmp, 0, [rec]))
    with pytest.raises(KeyError):
        Checkpoint.open(save(tmp_path, 1, {"w": np.ones(2)})).array("nope")


# --- latest / prune -----------------------------------------------------------------------------


def _flip_data_byte(step_dir, marker: bytes) -> None:
    """Flip one byte of a tensor's payload, leaving the Arrow structure intact."""
    path = os.path.join(step_dir, "shard-0.arrow")
    with open(path, "rb") as f:
        blob = bytearray(f.read())
    i = blob.index(marker)
    blob[i] ^= 0xFF
    with open(path, "wb") as f:
        f.write(blob)


MARK = bytes(range(7, 71))


def _run(root, steps_, **kw):
    for s in steps_:
        save(root, s, {"w": np.frombuffer(MARK, np.uint8).copy(), "s": np.int64(s)}, **kw)


def test_latest_skips_a_corrupt_newest(tmp_path):
    _run(tmp_path, [1, 2, 3])
    _flip_data_byte(tmp_path / "step-3", MARK)
    shutil.copytree(tmp_path / "step-2", tmp_path / "step-9.tmp-abcdef")
    os.makedirs(tmp_path / "not-a-step")
    got = latest(tmp_path)
    assert got.checkpoint is not None and got.checkpoint.step == 2
    assert int(got.checkpoint.array("s")) == 2
    assert len(got.skipped) == 1
    where, why = got.skipped[0]
    assert where.endswith("step-3")
    assert "shard-0.arrow" in why and "checksum" in why


def test_latest_of_empty_and_missing_dirs(tmp_path):
    assert latest(tmp_path).checkpoint is None
    assert latest(tmp_path).skipped == []
    assert latest(tmp_path / "missing").checkpoint is None


def test_latest_when_all_are_corrupt(tmp_path):
    _run(tmp_path, [1, 2])
    for s in (1, 2):
        os.truncate(tmp_path / f"step-{s}" / "params.meta", 3)
    got = latest(tmp_path, verify="fast")
    assert got.checkpoint is None
    assert [w.rsplit("/", 1)[1] for w, _ in got.skipped] == ["step-2", "step-1"]
    assert all("params.meta" in why for _, why in got.skipped)


def test_prune_keep_last_and_keep_every(tmp_path):
    _run(tmp_path, range(1, 11))
    (tmp_path / "step-3.tmp-0123456789ab").mkdir()
    (tmp_path / "step-12.tmp-x").mkdir()
    (tmp_path / "other.tmp-x").mkdir()
    deleted = prune(tmp_path, keep_last=3, keep_every=4)
    assert sorted(deleted) == [1, 2, 3, 5, 6, 7]
    assert steps(tmp_path) == [10, 9, 8, 4]
    assert sorted(os.listdir(tmp_path)) == ["other.tmp-x", "step-10", "step-4", "step-8", "step-9"]
    assert prune(tmp_path, keep_last=1) == [9, 8, 4]
    assert steps(tmp_path) == [10]
    assert prune(tmp_path, keep_last=1) == []


def test_prune_keeps_the_newest_valid_one(tmp_path):
    _run(tmp_path, range(1, 6))
    os.truncate(tmp_path / "step-5" / "shard-0.arrow", 10)  # caught by a size check
    _flip_data_byte(tmp_path / "step-4", MARK)  # caught only by the checksum
    _flip_data_byte(tmp_path / "step-3", MARK)
    deleted = prune(tmp_path, keep_last=2)
    assert sorted(deleted) == [1, 3]
    assert steps(tmp_path) == [5, 4, 2]
    assert Checkpoint.open(tmp_path / "step-2").step == 2


@pytest.mark.parametrize(
    "kw", [{"keep_last": 0}, {"keep_last": -1}, {"keep_last": 2, "keep_every": 0}]
)
def test_prune_bad_arguments(tmp_path, kw):
    _run(tmp_path, [1, 2])
    with pytest.raises(ValueError):
        prune(tmp_path, **kw)
    assert steps(tmp_path) == [2, 1]
