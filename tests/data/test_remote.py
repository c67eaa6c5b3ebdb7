"""Arrow IPC and Parquet data sets behind an ``s3://`` URI, against a real S3 server on loopback
(moto's server mode, the ``s3`` fixture): rows equal the local file's, reads are ranged and cached
per node, a changed object is never served stale, and credentials stay out of every message."""

from __future__ import annotations

import itertools
import json
import os
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import S3_BUCKET, s3_requests

from raysinga import config
from raysinga.data import DataError, digits, load_dataset
from raysinga.data import identity as data_identity
from raysinga.data.cache import BlockCache, CacheSpec
from raysinga.run import Trainer

KIB = 1024
BLOCK = 4 * KIB  # small blocks, so that the small files here span many
SECRET_KEY, SECRET = "AKIADATASECRET000001", "d4ta+s3cr3t/NEVER-SHOWN"
_keys = itertools.count()


def _xy(n: int = 1200, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 16)).astype(np.float32), rng.integers(0, 7, size=n)


def _table(x: np.ndarray, y: np.ndarray) -> pa.Table:
    cells = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])
    extra = pa.array(np.arange(len(y), dtype=np.float64))  # a column nobody asks for
    return pa.table({"x": cells, "extra": extra, "y": pa.array(y)})


def _write(kind: str, path, x: np.ndarray, y: np.ndarray, rows_per_chunk: int = 50) -> None:
    t = _table(x, y)
    if kind == "parquet":
        pq.write_table(t, path, row_group_size=rows_per_chunk)
        return
    with pa.ipc.new_file(str(path), t.schema) as w:
        for batch in t.to_batches(max_chunksize=rows_per_chunk):
            w.write_batch(batch)


def _upload(fs, local, key: str) -> None:
    with fs.open_output_stream(f"{S3_BUCKET}/{key}") as f:
        f.write(open(local, "rb").read())


def _uri(port: int, key: str, secret: bool = False) -> str:
    user = f"{SECRET_KEY}:{SECRET.replace('+', '%2B').replace('/', '%2F')}@" if secret else ""
    query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    return f"s3://{user}{S3_BUCKET}/{key}?{query}"


def _pair(s3, tmp_path, kind: str, n: int = 1200, rows_per_chunk: int = 50, **cache):
    """(remote spec, local spec) of the same file, the remote one with its own cache."""
    fs, port = s3
    local = tmp_path / f"data-{next(_keys)}.{kind}"
    _write(kind, local, *_xy(n), rows_per_chunk=rows_per_chunk)
    key = f"data/{local.name}"
    _upload(fs, local, key)
    cache = {"cache_dir": str(tmp_path / "cache"), "block_bytes": BLOCK, **cache}
    return {"kind": kind, "path": _uri(port, key), **cache}, {"kind": kind, "path": str(local)}


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes()


def _gets(seen) -> list[str]:
    return [path for method, path in seen if method == "GET"]


def _blocks(d) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in d.iterdir() if p.name.endswith(".blk")}


@pytest.mark.parametrize("kind", ["arrow", "parquet"])
def test_rows_by_index_equal_the_local_files_also_after_pickling(s3, tmp_path, kind):
    remote_spec, local_spec = _pair(s3, tmp_path, kind)
    remote, local = load_dataset(remote_spec), load_dataset(local_spec)
    assert len(remote) == len(local) == 1200
    assert remote.sample_shape == local.sample_shape == (16,)
    assert remote.num_classes == local.num_classes
    idx = np.random.default_rng(1).permutation(1200)[:250]
    for a, b in zip(remote.get(idx), local.get(idx), strict=True):
        _same(a, b)
    _same(remote.labels(120, 470), local.labels(120, 470))
    # A worker gets the data set pickled: it reopens the object from its URI.
    again = pickle.loads(pickle.dumps(remote))
    for a, b in zip(again.get(idx[::-1]), local.get(idx[::-1]), strict=True):
        _same(a, b)
    # A file:// URI is a local file: memory-mapped, nothing cached.
    as_uri = load_dataset({**remote_spec, "path": f"file://{local_spec['path']}"})
    for a, b in zip(as_uri.get(idx), local.get(idx), strict=True):
        _same(a, b)
    before = _blocks(tmp_path / "cache")
    load_dataset({**remote_spec, "path": f"file://{local_spec['path']}"}).get(idx)
    assert _blocks(tmp_path / "cache") == before


@pytest.mark.parametrize("kind", ["arrow", "parquet"])
def test_a_read_fetches_only_its_blocks_and_a_warm_cache_fetches_none(s3, tmp_path, kind):
    remote_spec, local_spec = _pair(s3, tmp_path, kind, n=6000, rows_per_chunk=250)
    fs, _ = s3
    key = remote_spec["path"].split("?")[0].split(f"{S3_BUCKET}/")[1]
    size = fs.get_file_info(f"{S3_BUCKET}/{key}").size
    with s3_requests() as cold:
        ds = load_dataset(remote_spec)
        ds.get(np.array([3, 4]))
    # The footer (pyarrow reads a Parquet file's last 64 KiB at once), then x and y of one
    # batch / row group (16 KiB): a few blocks, not the file. An Arrow IPC file's batch
    # headers (24 here) are read alone, once per node, for their row counts.
    tail, headers = (16, 0) if kind == "parquet" else (2, 24)
    assert 1 <= len(_gets(cold)) - headers <= tail + 8, cold
    assert all(path == f"/{S3_BUCKET}/{key}" for _, path in cold)
    cached = sum(_blocks(tmp_path / "cache").values())
    assert cached <= (tail + 8) * BLOCK + 8 * headers < size / 4

    everything = np.arange(len(ds))
    ds.get(everything)  # every block now cached
    with s3_requests() as warm:
        again = load_dataset(remote_spec)
        x, y = again.get(everything)
        again.labels(0, len(again))
    assert _gets(warm) == [], warm
    assert ("HEAD", f"/{S3_BUCKET}/{key}") in warm  # the counter sees what it should
    for a, b in zip((x, y), load_dataset(local_spec).get(everything), strict=True):
        _same(a, b)


def test_the_cache_stays_under_its_bound_and_still_reads_right(s3, tmp_path):
    bound = 5 * BLOCK
    remote_spec, local_spec = _pair(s3, tmp_path, "arrow", cache_bytes=bound)
    remote, local = load_dataset(remote_spec), load_dataset(local_spec)
    cache = tmp_path / "cache"
    rng = np.random.default_rng(2)
    for _ in range(12):
        idx = rng.integers(0, len(remote), size=40)
        for a, b in zip(remote.get(idx), local.get(idx), strict=True):
            _same(a, b)
        assert 0 < sum(_blocks(cache).values()) <= bound
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]  # nothing half-written left


def test_a_block_evicted_by_another_process_is_fetched_again(s3, tmp_path):
    remote_spec, local_spec = _pair(s3, tmp_path, "parquet")
    remote, local = load_dataset(remote_spec), load_dataset(local_spec)
    idx = np.arange(len(remote))
    remote.get(idx)
    for p in (tmp_path / "cache").iterdir():  # what a process with a smaller bound would do
        p.unlink()
    with s3_requests() as seen:
        got = load_dataset(remote_spec).get(idx)
    assert len(_gets(seen)) > 0
    for a, b in zip(got, local.get(idx), strict=True):
        _same(a, b)


def test_evicts_least_recently_used_blocks_first(tmp_path):
    cache = BlockCache(CacheSpec(str(tmp_path), max_bytes=3 * 4096, block_bytes=4096))
    for name in "abc":
        cache.get(f"{name}.blk", 4096, lambda n=name: n.encode() * 4096)
    t = 1_000_000_000
    for i, name in enumerate("bac"):  # a is used after b: b is the least recent
        os.utime(tmp_path / f"{name}.blk", ns=(t + i, t + i))
    cache.get("d.blk", 4096, lambda: b"d" * 4096)
    assert sorted(_blocks(tmp_path)) == ["a.blk", "c.blk", "d.blk"]
    with pytest.raises(ValueError, match=r"cache_bytes \(4095\) must hold at least one block"):
        CacheSpec(str(tmp_path), max_bytes=4095, block_bytes=4096)


@pytest.mark.parametrize("kind", ["arrow", "parquet"])
def test_a_rewritten_object_is_not_served_from_stale_blocks(s3, tmp_path, kind):
    remote_spec, _ = _pair(s3, tmp_path, kind)
    fs, _ = s3
    key = remote_spec["path"].split("?")[0].split(f"{S3_BUCKET}/")[1]
    old = load_dataset(remote_spec)
    idx = np.arange(len(old))
    before = old.get(idx)
    digest = data_identity.identity(old, 32, True)["digest"]
    size = fs.get_file_info(f"{S3_BUCKET}/{key}").size

    x, y = _xy(seed=5)  # other values, same shapes: the same size, within the same second
    other = tmp_path / f"other.{kind}"
    _write(kind, other, x, y)
    _upload(fs, other, key)
    if kind == "arrow":
        assert fs.get_file_info(f"{S3_BUCKET}/{key}").size == size
    new = load_dataset(remote_spec)
    got = new.get(idx)
    _same(got[0], x)
    _same(got[1], y.astype(np.int64))
    assert got[0].tobytes() != before[0].tobytes()
    assert data_identity.identity(new, 32, True)["digest"] != digest


def test_identity_is_the_local_files_so_a_run_resumes_across_them(s3, tmp_path):
    remote_spec, local_spec = _pair(s3, tmp_path, "arrow")
    want = data_identity.identity(load_dataset(local_spec), 32, True)
    assert data_identity.identity(load_dataset(remote_spec), 32, True) == want


def test_bad_uris_and_missing_objects_are_named_without_credentials(s3, tmp_path):
    fs, port = s3
    cache = {"cache_dir": str(tmp_path / "cache")}
    secret = [SECRET_KEY, SECRET, SECRET.replace("+", "%2B").replace("/", "%2F")]

    def error(spec, kind, match):
        with pytest.raises(kind, match=match) as e:
            load_dataset({"kind": "parquet", **cache, **spec})
        text = str(e.value)
        assert not [s for s in secret if s in text], text
        return text

    text = error({"path": _uri(port, "no/such.parquet", True)}, FileNotFoundError, "no such object")
    assert f"{S3_BUCKET}/no/such.parquet" in text and "train split" in text
    uri = _uri(port, "k.parquet", True).replace(S3_BUCKET, "no-such-bucket")
    error({"path": uri}, FileNotFoundError, r"s3://no-such-bucket/k\.parquet.*no such object")
    error({"path": "nosuch://bucket/key"}, DataError, "nosuch://bucket/key: cannot open")
    with fs.open_output_stream(f"{S3_BUCKET}/junk.parquet") as f:
        f.write(b"not parquet at all" * 100)
    junk = _uri(port, "junk.parquet", True)
    error({"path": junk}, DataError, r"junk\.parquet\?endpoint_override=\S*: is not a Parquet")
    with pytest.raises(DataError, match=r"junk\.parquet\?\S*: is not an Arrow IPC file") as e:
        load_dataset({"kind": "arrow", "path": _uri(port, "junk.parquet", True), **cache})
    assert not [s for s in secret if s in str(e.value)]
    _upload(fs, _write_tmp(tmp_path), "prefix/inside.parquet")
    error({"path": _uri(port, "prefix", True)}, DataError, "is a directory")
    remote_spec, _ = _pair(s3, tmp_path, "parquet")
    remote_spec["path"] = _uri(port, remote_spec["path"].split(f"{S3_BUCKET}/")[1].split("?")[0])
    error({**remote_spec, "y": "label"}, DataError, r"column 'label'.*no such column")
    error({**remote_spec, "block_bytes": 10}, ValueError, r"block_bytes must lie in")
    error({**remote_spec, "cache_bytes": "1GiB"}, ValueError, "cache_bytes must be an integer")
    blocked = tmp_path / "file"
    blocked.write_text("")
    error({**remote_spec, "cache_dir": str(blocked / "sub")}, DataError, "cache_dir.*writable")


def test_a_data_check_failure_names_the_uri_without_credentials(s3, tmp_path):
    fs, port = s3
    local = _write_tmp(tmp_path)  # 16 features, where the job's model takes 64
    _upload(fs, local, "narrow/train.parquet")
    source = {"kind": "parquet", "path": _uri(port, "narrow/train.parquet", secret=True)}
    with pytest.raises(DataError, match=r"narrow/train\.parquet") as e:
        _train(tmp_path / "narrow", {**source, "cache_dir": str(tmp_path / "cache")}, [])
    text = str(e.value)
    assert "16" in text and "64" in text, text
    for s in (SECRET_KEY, SECRET, SECRET.replace("+", "%2B").replace("/", "%2F")):
        assert s not in text, text


def _write_tmp(tmp_path):
    path = tmp_path / "tiny.parquet"
    _write("parquet", path, *_xy(20))
    return path


# ------------------------------------------------------------------------- training from S3

JOB = """
name: {name}
seed: 3
model:
  input_shape: [64]
  layers:
    - {{kind: dense, name: fc1, units: 16, activation: relu}}
    - {{kind: dense, name: out, units: 10}}
data: {{source: {source}, batch_size: 32}}
updater: {{name: adam, lr: 0.01}}
train_steps: 40
disp_freq: 10
test_freq: 20
checkpoint_frequency: 20
"""


def _train(d, source: dict, lines: list[str]):
    job = d.parent / f"{d.name}.yaml"  # beside the run: every file in it is the run's
    job.write_text(JOB.format(name=d.name, source=json.dumps(source)))
    cfg = config.load(job, [f"run_dir={d}"])
    return Trainer(cfg, log=lines.append).fit()


@pytest.mark.parametrize("kind", ["arrow", "parquet"])
def test_training_from_s3_is_bit_identical_to_the_local_file(s3, tmp_path, kind):
    fs, port = s3
    sources = []
    for split in ("train", "test"):
        ds = digits(split)
        x, y = ds.get(np.arange(len(ds)))
        local = tmp_path / f"{split}.{kind}"
        _write(kind, local, x, y, rows_per_chunk=97)
        _upload(fs, local, f"digits-{kind}/{split}")
        sources.append((str(local), _uri(port, f"digits-{kind}/{split}", secret=True)))
    (train_local, train_s3), (test_local, test_s3) = sources
    local_source = {"kind": kind, "path": train_local, "test": {"path": test_local}}
    cache = {"cache_dir": str(tmp_path / "cache"), "block_bytes": 16 * KIB}
    s3_source = {"kind": kind, "path": train_s3, "test": {"path": test_s3}, **cache}
    lines: list[str] = []
    want = _train(tmp_path / "local", local_source, [])
    got = _train(tmp_path / "s3", s3_source, lines)
    assert set(got.params) == set(want.params)
    for name in want.params:
        _same(got.params[name], want.params[name])
    evals = [[r for r in res.history if r.get("kind") == "eval"] for res in (got, want)]
    assert len(evals[0]) == 2 and evals[0] == evals[1]  # the test split read from S3 too
    # the keys appear in no line the run printed and no file it wrote
    texts = {"log": "\n".join(lines)}
    for f in (tmp_path / "s3").rglob("*"):
        if f.is_file():
            texts[str(f)] = f.read_bytes().decode("latin-1")
    assert any(f"{S3_BUCKET}/digits-{kind}/train" in t for t in texts.values())
    for where, text in texts.items():
        for s in (SECRET_KEY, SECRET, SECRET.replace("+", "%2B").replace("/", "%2F")):
            assert s not in text, f"{s!r} in {where}"


@pytest.mark.slow
def test_a_distributed_run_reads_s3_in_each_worker_as_it_reads_the_local_file(
    s3, tmp_path, ray_session
):
    from raysinga.distributed import DistributedTrainer  # noqa: PLC0415

    fs, port = s3
    paths = {}
    for split in ("train", "test"):
        ds = digits(split)
        local = tmp_path / f"{split}.arrow"
        _write("arrow", local, *ds.get(np.arange(len(ds))), rows_per_chunk=97)
        _upload(fs, local, f"dist/{split}")
        paths[split] = (str(local), _uri(port, f"dist/{split}", secret=True))
    cache = {"cache_dir": str(tmp_path / "cache"), "block_bytes": 16 * KIB}
    topology = "topology={workers_per_group: 2, n_servers: 2, slice_bytes: 4096}"
    results = []
    for i, extra in enumerate(({}, cache)):
        source = {"kind": "arrow", "path": paths["train"][i], "test": {"path": paths["test"][i]}}
        source.update(extra)
        d = tmp_path / f"run{i}"
        job = tmp_path / f"run{i}.yaml"
        job.write_text(JOB.format(name=f"run{i}", source=json.dumps(source)))
        cfg = config.load(job, [f"run_dir={d}", topology])
        results.append(DistributedTrainer(cfg, log=lambda line: None).fit())
    got, want = results[1], results[0]
    for name in want.params:
        _same(got.params[name], want.params[name])
    evals = [[r for r in res.history if r.get("kind") == "eval"] for res in (got, want)]
    assert len(evals[0]) == 2 and evals[0] == evals[1]
    assert _blocks(tmp_path / "cache"), "the workers read through the node's block cache"
    for f in (tmp_path / "run1").rglob("*"):
        if f.is_file():
            text = f.read_bytes().decode("latin-1")
            for secret in (SECRET_KEY, SECRET, SECRET.replace("+", "%2B").replace("/", "%2F")):
                assert secret not in text, f


# ------------------------------------------------------------------------- Ray Data sources


def _ray_items(n: int, scale: float = 1.0) -> list[dict]:
    return [{"x": np.full((2, 3), i * scale, np.float32), "y": i % 4, "id": i} for i in range(n)]


def _slow_first_blocks(ray_data, items: list[dict], blocks: int):
    """A Dataset whose earlier blocks take longer: unordered, its rows would come out of order."""

    def delay(batch):
        import time  # noqa: PLC0415 - runs in a Ray task

        time.sleep(0.4 * (blocks - 1 - int(batch["id"][0]) * blocks // len(items)))
        return batch

    ds = ray_data.from_items(items, override_num_blocks=blocks)
    return ds.map_batches(delay, batch_size=None)


def test_a_ray_dataset_is_written_in_its_order_and_read_as_a_source(ray_session, tmp_path):
    from raysinga.data import from_ray_dataset  # noqa: PLC0415

    ray_data = pytest.importorskip("ray.data")
    items = _ray_items(80)
    ds = _slow_first_blocks(ray_data, items, blocks=4)
    path = tmp_path / "sets" / "train.arrow"
    test = ray_data.from_items(_ray_items(12, scale=-1.0))
    spec = from_ray_dataset(
        ds, path, test=test, test_path=tmp_path / "test.arrow", rows_per_batch=16
    )
    assert spec == {
        "kind": "arrow",
        "path": str(path),
        "x": "x",
        "y": "y",
        "test": {"path": str(tmp_path / "test.arrow")},
    }
    train = load_dataset(spec)
    assert len(train) == 80 and train.sample_shape == (2, 3)
    x, y = train.get(np.arange(80))
    _same(x, np.stack([it["x"] for it in items]))
    _same(y, np.arange(80, dtype=np.int64) % 4)
    with pa.memory_map(str(path)) as f:
        reader = pa.ipc.open_file(f)
        assert [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)] == [16] * 5
        assert reader.schema.names == ["x", "y"]  # only the columns asked for
    xt, _ = load_dataset(spec, "test").get(np.arange(12))
    _same(xt, np.stack([it["x"] for it in _ray_items(12, scale=-1.0)]))
    assert ds.context.execution_options.preserve_order is False  # left as it was

    # Written again from the same rows: the same bytes, so the file in place is kept.
    before = path.stat()
    assert from_ray_dataset(_slow_first_blocks(ray_data, items, 4), path, rows_per_batch=16) == {
        k: v for k, v in spec.items() if k != "test"
    }
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # Other rows replace it.
    from_ray_dataset(ray_data.from_items(_ray_items(80, scale=2.0)), path, rows_per_batch=16)
    _same(load_dataset(spec).get(np.arange(80))[0], 2 * x)
    assert sorted(p.name for p in path.parent.iterdir()) == ["train.arrow"]


def test_a_ray_dataset_written_to_s3_is_read_back_through_the_cache(ray_session, s3, tmp_path):
    from raysinga.data import from_ray_dataset  # noqa: PLC0415

    ray_data = pytest.importorskip("ray.data")
    fs, port = s3
    uri = _uri(port, "ray/train.arrow", secret=True)
    spec = from_ray_dataset(ray_data.from_items(_ray_items(40)), uri, rows_per_batch=8)
    assert spec["path"] == uri
    listed = fs.get_file_info(pafs_selector(f"{S3_BUCKET}/ray"))
    assert [i.base_name for i in listed] == ["train.arrow"]  # the temporary object is gone
    ds = load_dataset({**spec, "cache_dir": str(tmp_path / "cache")})
    _same(ds.get(np.arange(40))[0], np.stack([it["x"] for it in _ray_items(40)]))


def pafs_selector(path: str):
    import pyarrow.fs as pafs  # noqa: PLC0415

    return pafs.FileSelector(path)


def test_a_ray_dataset_that_cannot_be_written_leaves_no_file(ray_session, tmp_path):
    from raysinga.data import from_ray_dataset  # noqa: PLC0415

    ray_data = pytest.importorskip("ray.data")
    path = tmp_path / "train.arrow"
    items = _ray_items(10)
    with pytest.raises(DataError, match=r"no column\(s\) \['label'\]; it holds \['id', 'x', 'y'\]"):
        from_ray_dataset(ray_data.from_items(items), path, y="label")
    words = [{"x": float(i), "y": f"class-{i}"} for i in range(6)]
    with pytest.raises(DataError, match="column 'y' of the Ray Dataset holds object values"):
        from_ray_dataset(ray_data.from_items(words), path)
    with pytest.raises(DataError, match="has no rows"):
        from_ray_dataset(ray_data.from_items(items).filter(lambda r: False), path)

    def fail(batch):
        if int(batch["id"][0]) >= 5:
            raise RuntimeError("the pipeline broke")
        return batch

    broken = ray_data.from_items(items, override_num_blocks=2).map_batches(fail, batch_size=None)
    with pytest.raises(Exception, match="the pipeline broke"):
        from_ray_dataset(broken, path, rows_per_batch=2)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match="expected a ray.data.Dataset, got list"):
        from_ray_dataset(items, path)
    with pytest.raises(ValueError, match="test and test_path go together"):
        from_ray_dataset(ray_data.from_items(items), path, test=ray_data.from_items(items))
    with pytest.raises(ValueError, match="rows_per_batch must be a positive integer"):
        from_ray_dataset(ray_data.from_items(items), path, rows_per_batch=0)
