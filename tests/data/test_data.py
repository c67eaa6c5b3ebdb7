"""Tests of raysinga.data: every source round-trips, reads stay zero-copy, the order is exact."""

from __future__ import annotations

import os
import pickle
import struct
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raysinga.data import (
    ArrayDataset,
    ArrowDataset,
    BatchPlan,
    FeistelPermutation,
    NpyDataset,
    NpzDataset,
    ParquetDataset,
    TeacherDataset,
    digits,
    load_dataset,
)

N, D = 37, 6


def make_xy(n: int = N, d: int = D, classes: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, d)).astype(np.float32), rng.integers(0, classes, size=n)


def mapped_ranges(path: os.PathLike[str] | str) -> list[tuple[int, int]]:
    """Address ranges at which this process has ``path`` memory-mapped (Linux only)."""
    real = os.path.realpath(path)
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == real:
                lo, hi = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def inside_map(a: np.ndarray, path: os.PathLike[str] | str) -> bool:
    start, stop = a.ctypes.data, a.ctypes.data + a.nbytes
    return any(lo <= start and stop <= hi for lo, hi in mapped_ranges(path))


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def check_round_trip(ds, x: np.ndarray, y: np.ndarray, sample_shape=None) -> None:
    idx = np.array([5, 0, N - 1, 5, 17])
    xb, yb = ds.get(idx)
    shape = sample_shape or x.shape[1:]
    assert len(ds) == len(x)
    assert ds.sample_shape == tuple(shape)
    assert xb.dtype == np.float32 and xb.flags.c_contiguous and xb.shape == (5, *shape)
    np.testing.assert_array_equal(xb.reshape(5, -1), x[idx].reshape(5, -1).astype(np.float32))
    if y.dtype.kind == "f":
        assert yb.dtype == np.float32 and ds.num_classes is None
    else:
        assert yb.dtype == np.int64 and ds.num_classes == int(y.max()) + 1
    np.testing.assert_array_equal(yb, y[idx])


# ---- sources ---------------------------------------------------------------------------------


def test_array_dataset_round_trip_and_reshape():
    x, y = make_xy()
    check_round_trip(ArrayDataset(x, y), x, y)
    check_round_trip(ArrayDataset(x, y, sample_shape=(1, 2, 3)), x, y, (1, 2, 3))
    with pytest.raises(ValueError, match="sample_shape"):
        ArrayDataset(x, y, sample_shape=(4, 2))
    with pytest.raises(ValueError, match="same number of rows"):
        ArrayDataset(x, y[:-1])


def test_get_rejects_bad_indices():
    ds = ArrayDataset(*make_xy())
    with pytest.raises(IndexError):
        ds.get(np.array([0, N]))
    with pytest.raises(IndexError):
        ds.get(np.array([-1]))  # refused, never silently wrapped
    with pytest.raises(TypeError):
        ds.get(np.array([0.0]))
    xb, yb = ds.get(np.array([], dtype=np.int64))
    assert xb.shape == (0, D) and yb.shape == (0,)


def test_npy_round_trip_is_zero_copy(tmp_path):
    x, y = make_xy()
    x8 = (x * 10).astype(np.int8)  # stored dtype other than float32 is converted on read
    np.save(tmp_path / "x.npy", x8)
    np.save(tmp_path / "y.npy", y.astype(np.int32))
    ds = NpyDataset(tmp_path / "x.npy", tmp_path / "y.npy", sample_shape=(2, 3))
    check_round_trip(ds, x8, y, (2, 3))
    assert not ds._x.flags.writeable and not ds._x.flags.owndata
    if os.path.exists("/proc/self/maps"):
        assert inside_map(ds._x, tmp_path / "x.npy") and inside_map(ds._y, tmp_path / "y.npy")
    again = pickle.loads(pickle.dumps(ds))  # reopens the files instead of copying the data
    np.testing.assert_array_equal(again.get([3])[0], ds.get([3])[0])


def test_npy_regression_targets(tmp_path):
    x, _ = make_xy()
    t = np.arange(N * 2, dtype=np.float64).reshape(N, 2)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "t.npy", t)
    ds = NpyDataset(tmp_path / "x.npy", tmp_path / "t.npy")
    check_round_trip(ds, x, t)
    assert ds.target_shape == (2,)


@needs_proc
def test_npy_reads_only_requested_rows_of_a_large_file(tmp_path):
    path = tmp_path / "big.npy"
    rows, width = 2**18, 1024  # 1 GiB of float32, sparse on disk
    big = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, width))
    picks = np.array([7, 100_000, rows - 1])
    big[picks] = np.arange(3, dtype=np.float32)[:, None] + 1
    del big
    np.save(tmp_path / "y.npy", np.zeros(rows, dtype=np.int64))
    before = resident_bytes()
    ds = NpyDataset(path, tmp_path / "y.npy", num_classes=1)
    xb, _ = ds.get(picks[::-1])
    grown = resident_bytes() - before
    np.testing.assert_array_equal(xb[:, 0], [3, 2, 1])
    assert grown < 64 * 2**20, f"get() of 3 rows made {grown} bytes resident"


def test_npy_fortran_order_is_refused(tmp_path):
    x, y = make_xy()
    np.save(tmp_path / "x.npy", np.asfortranarray(x))
    np.save(tmp_path / "y.npy", y)
    with pytest.raises(ValueError, match="Fortran order"):
        NpyDataset(tmp_path / "x.npy", tmp_path / "y.npy")
    np.savez(tmp_path / "f.npz", x=np.asfortranarray(x), y=y)
    with pytest.raises(ValueError, match="Fortran order"):
        NpzDataset(tmp_path / "f.npz")


def test_npy_rejects_non_npy_and_object_arrays(tmp_path):
    (tmp_path / "junk.npy").write_bytes(b"not an array at all")
    np.save(tmp_path / "y.npy", np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="magic"):
        NpyDataset(tmp_path / "junk.npy", tmp_path / "y.npy")
    np.save(tmp_path / "o.npy", np.array([None, 1, "a"], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="pickle"):
        NpyDataset(tmp_path / "o.npy", tmp_path / "y.npy")


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_npy_header_versions_are_read_by_numpy_and_stay_mapped(tmp_path, version):
    """numpy.lib.format reads the header; the payload stays a view of the memory map."""
    x, y = make_xy()
    with open(tmp_path / "x.npy", "wb") as f:
        np.lib.format.write_array(f, x, version=version)
    np.save(tmp_path / "y.npy", y)
    ds = NpyDataset(tmp_path / "x.npy", tmp_path / "y.npy")
    check_round_trip(ds, x, y)
    if os.path.exists("/proc/self/maps"):
        assert inside_map(ds._x, tmp_path / "x.npy")


def test_npy_oversized_header_is_refused_naming_the_file(tmp_path):
    """A header beyond numpy's max_header_size is refused before ast.literal_eval sees it."""
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), " + " " * 20000 + "}\n"
    blob = b"\x93NUMPY\x02\x00" + struct.pack("<I", len(header)) + header.encode() + bytes(8)
    (tmp_path / "x.npy").write_bytes(blob)
    np.save(tmp_path / "y.npy", np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match=r"x\.npy \(x array\): not a readable \.npy file.*large"):
        NpyDataset(tmp_path / "x.npy", tmp_path / "y.npy")


def test_labels_read_alone_match_get(tmp_path):
    x, y = make_xy()
    write_arrow(tmp_path / "d.arrow", pa.table({"x": fixed_list(x), "y": y}), chunk=8)
    pq.write_table(pa.table({"x": fixed_list(x), "y": y}), tmp_path / "d.parquet", row_group_size=5)
    sets = [
        ArrayDataset(x, y),
        ArrowDataset(tmp_path / "d.arrow"),
        ParquetDataset(tmp_path / "d.parquet"),
    ]
    for ds in sets:
        for start, stop in [(0, N), (3, 21), (7, 8), (N - 1, N), (9, 9)]:
            np.testing.assert_array_equal(ds.labels(start, stop), y[start:stop])
        assert ds.label_dtype == y.dtype


@pytest.mark.parametrize("compressed", [False, True])
def test_npz_round_trip(tmp_path, compressed):
    x, y = make_xy()
    path = tmp_path / "d.npz"
    (np.savez_compressed if compressed else np.savez)(path, images=x, labels=y)
    ds = NpzDataset(path, x_key="images", y_key="labels")
    check_round_trip(ds, x, y)
    if os.path.exists("/proc/self/maps"):
        # Stored members are views into the mapped zip; compressed ones had to be inflated.
        assert inside_map(ds._x, path) is (not compressed)
    with pytest.raises(ValueError, match="images"):
        NpzDataset(path, x_key="pixels", y_key="labels")


def write_arrow(path, table: pa.Table, chunk: int) -> None:
    with pa.ipc.new_file(path, table.schema) as w:
        for batch in table.to_batches(max_chunksize=chunk):
            w.write_batch(batch)


def fixed_list(x: np.ndarray) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])


def test_arrow_list_column_round_trip_zero_copy(tmp_path):
    x, y = make_xy()
    path = tmp_path / "d.arrow"
    write_arrow(path, pa.table({"img": fixed_list(x), "label": y}), chunk=8)
    ds = ArrowDataset(path, x="img", y="label", sample_shape=(3, 2))
    check_round_trip(ds, x, y, (3, 2))
    assert len(ds._offsets) == 6  # 37 rows in batches of 8
    xs, _ = ds._views(2)
    assert not xs[0].flags.owndata
    if os.path.exists("/proc/self/maps"):
        assert inside_map(xs[0], path)
    assert pickle.loads(pickle.dumps(ds)).get([4])[1] == y[4]


def test_arrow_scalar_columns_and_nested_lists(tmp_path):
    x, y = make_xy()
    cols = {f"f{j}": x[:, j] for j in range(D)}
    path = tmp_path / "s.arrow"
    write_arrow(path, pa.table({**cols, "y": y.astype(np.int16)}), chunk=10)
    check_round_trip(ArrowDataset(path, x=[f"f{j}" for j in range(D)], y="y"), x, y)
    nested = pa.FixedSizeListArray.from_arrays(fixed_list(x.reshape(N * 2, 3)), 2)
    path = tmp_path / "n.arrow"
    write_arrow(path, pa.table({"x": nested, "y": x[:, 0].astype(np.float64)}), chunk=9)
    ds = ArrowDataset(path)
    check_round_trip(ds, x.reshape(N, 2, 3), x[:, 0])
    with pytest.raises(ValueError, match="holds"):
        ArrowDataset(path, x="nope")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, N - 1), max_size=50))
def test_arrow_any_index_set_matches_reference(tmp_path_factory, idx):
    path = tmp_path_factory.getbasetemp() / "hyp.arrow"
    x, y = make_xy()
    if not path.exists():
        write_arrow(path, pa.table({"x": fixed_list(x), "y": y}), chunk=5)
    xb, yb = ArrowDataset(path, cache_chunks=2).get(np.array(idx, dtype=np.int64))
    np.testing.assert_array_equal(xb, x[idx].reshape(len(idx), D))
    np.testing.assert_array_equal(yb, y[idx])


def test_parquet_reads_only_needed_row_groups(tmp_path):
    x, y = make_xy()
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"x": fixed_list(x), "y": y}), path, row_group_size=4)
    ds = ParquetDataset(path, cache_chunks=2)
    check_round_trip(ds, x, y)
    read = []
    original = ds._file.read_row_group
    ds._file.read_row_group = lambda i, columns: read.append(i) or original(i, columns=columns)
    ds._cache.clear()
    ds.get(np.array([13, 12, 35]))  # rows 12..15 are group 3, row 35 is group 8
    assert sorted(read) == [3, 8]
    for i in range(N):
        ds.get([i])
    assert len(ds._cache) <= 2
    assert pickle.loads(pickle.dumps(ds)).get([30])[1] == y[30]


# ---- order -----------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [2**26, 1])  # NumPy permutation, then Feistel network
def test_order_is_a_pure_permutation_of_seed_and_epoch(threshold):
    a = BatchPlan(1000, 32, seed=7, feistel_threshold=threshold)
    b = BatchPlan(1000, 32, seed=7, feistel_threshold=threshold)
    assert a.uses_feistel is (threshold == 1)
    o0 = a.order(0)
    np.testing.assert_array_equal(np.sort(o0), np.arange(1000))
    assert not np.array_equal(o0, a.order(1))
    np.testing.assert_array_equal(b.order(1), a.order(1))
    np.testing.assert_array_equal(b.order(0), o0)  # after another epoch was cached
    assert not np.array_equal(o0, BatchPlan(1000, 32, seed=8, feistel_threshold=threshold).order(0))


def test_feistel_and_numpy_orders_differ_and_unshuffled_is_identity():
    assert not np.array_equal(
        BatchPlan(100, 10, 0).order(0), BatchPlan(100, 10, 0, True, 1).order(0)
    )
    np.testing.assert_array_equal(BatchPlan(100, 10, 0, shuffle=False).order(3), np.arange(100))


@pytest.mark.parametrize("n", [1, 3, 5, 7, 99, 257, 1001, 4097, 65537])
def test_feistel_is_a_bijection(n):
    out = FeistelPermutation(n, [11, 22, 33, 44])(np.arange(n))
    np.testing.assert_array_equal(np.sort(out), np.arange(n))


def test_huge_plan_never_materialises_the_order():
    plan = BatchPlan(10**12, 256, seed=3)
    assert plan.uses_feistel
    start = time.perf_counter()
    batches = [plan.indices(10**9 + s) for s in range(3)]
    assert time.perf_counter() - start < 1.0
    allidx = np.concatenate(batches)
    assert allidx.min() >= 0 and allidx.max() < 10**12 and len(np.unique(allidx)) == 768
    np.testing.assert_array_equal(BatchPlan(10**12, 256, seed=3).indices(10**9), batches[0])


def test_slice_bounds_are_balanced():
    plan = BatchPlan(100, 10, 0)
    assert [plan.slice_bounds(p, 3) for p in range(3)] == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError):
        plan.slice_bounds(0, 11)
    with pytest.raises(ValueError):
        plan.slice_bounds(3, 3)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    data=st.data(),
    seed=st.integers(0, 2**32),
    feistel=st.booleans(),
)
def test_parts_concatenate_to_the_batch(n, data, seed, feistel):
    batch = data.draw(st.integers(1, n))
    parts = data.draw(st.integers(1, batch))
    step = data.draw(st.integers(0, 50))
    plan = BatchPlan(n, batch, seed, feistel_threshold=1 if feistel else 2**26)
    bounds = [plan.slice_bounds(p, parts) for p in range(parts)]
    sizes = [b - a for a, b in bounds]
    assert bounds[0][0] == 0 and bounds[-1][1] == batch and sorted(sizes, reverse=True) == sizes
    assert max(sizes) - min(sizes) <= 1
    whole = plan.indices(step)
    np.testing.assert_array_equal(
        np.concatenate([plan.indices(step, p, parts) for p in range(parts)]), whole
    )
    epoch, k = plan.cursor(step)
    np.testing.assert_array_equal(whole, plan.order(epoch)[k * batch : (k + 1) * batch])


def test_cursor_arithmetic_and_errors():
    plan = BatchPlan(103, 10, 0)  # drop_last: 10 full batches per epoch
    assert plan.steps_per_epoch == 10
    assert [plan.cursor(s) for s in (0, 9, 10, 25)] == [(0, 0), (0, 9), (1, 0), (2, 5)]
    with pytest.raises(ValueError):
        plan.cursor(-1)
    for bad in (0, -4, 104):
        with pytest.raises(ValueError, match="batch_size"):
            BatchPlan(103, bad, 0)


# ---- built-in data sets ----------------------------------------------------------------------


def test_teacher_is_deterministic_and_independent_of_grouping():
    a = TeacherDataset(10**12, 12, 4, seed=5)
    idx = np.array([3, 10**12 - 1, 0, 3, 987_654_321_012])
    xa, ya = a.get(idx)
    xb, yb = TeacherDataset(10**12, 12, 4, seed=5).get(idx)
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)
    for j, i in enumerate(idx):
        xi, yi = a.get(np.array([i]))
        np.testing.assert_array_equal(xi[0], xa[j])
        assert yi[0] == ya[j]
    assert xa.dtype == np.float32 and ya.dtype == np.int64 and xa.shape == (5, 12)
    assert not np.array_equal(TeacherDataset(10**12, 12, 4, seed=6).get(idx)[0], xa)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=40), st.integers(1, 39))
def test_teacher_rows_do_not_depend_on_the_query(idx, cut):
    ds = TeacherDataset(10**6 + 1, 30, 7, seed=1, noise=0.2)
    idx = np.array(idx)
    x, y = ds.get(idx)
    x1, y1 = ds.get(idx[:cut])
    x2, y2 = ds.get(idx[cut:])
    np.testing.assert_array_equal(np.concatenate([x1, x2]), x)
    np.testing.assert_array_equal(np.concatenate([y1, y2]), y)


def test_teacher_labels_offset_and_noise():
    clean = TeacherDataset(4000, 20, 10, seed=2)
    x, y = clean.get(np.arange(4000))
    counts = np.bincount(y, minlength=10)
    assert counts.min() > 100, f"teacher labels badly unbalanced: {counts}"
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05
    held_out = TeacherDataset(100, 20, 10, seed=2, offset=3900)
    np.testing.assert_array_equal(held_out.get(np.arange(100))[1], y[3900:])
    noisy = TeacherDataset(4000, 20, 10, seed=2, noise=0.5).get(np.arange(4000))[1]
    assert 0.35 < float(np.mean(noisy != y)) < 0.55  # half relabelled, 1/10 of those unchanged


def test_digits_split_is_stratified_and_deterministic():
    train, test = digits("train"), digits("test", sample_shape=(1, 8, 8))
    assert len(train) + len(test) == 1797 and abs(len(test) - 0.2 * 1797) < 10
    assert train.num_classes == test.num_classes == 10 and test.sample_shape == (1, 8, 8)
    xt, yt = train.get(np.arange(len(train)))
    xs, ys = test.get(np.arange(len(test)))
    assert xt.dtype == np.float32 and xt.min() == 0.0 and xt.max() == 1.0
    assert xs.shape == (len(test), 1, 8, 8)
    full_counts = np.bincount(yt, minlength=10) + np.bincount(ys, minlength=10)
    assert np.all(np.abs(np.bincount(ys, minlength=10) - 0.2 * full_counts) <= 0.5)  # stratified
    from sklearn.datasets import load_digits

    full = load_digits()
    rows = np.hstack([full.data / 16, full.target[:, None]])
    ours = np.vstack([np.hstack([xt, yt[:, None]]), np.hstack([xs.reshape(-1, 64), ys[:, None]])])
    np.testing.assert_allclose(ours[np.lexsort(ours.T)], rows[np.lexsort(rows.T)], rtol=1e-6)
    np.testing.assert_array_equal(
        digits("test", seed=0).get([0])[0], test.get([0])[0].reshape(1, 64)
    )
    assert not np.array_equal(digits("test", seed=1).get(np.arange(50))[1], ys[:50])


def test_digits_without_sklearn_names_the_extra(monkeypatch):
    import importlib.util

    from raysinga.data import builtin as data_builtin

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a)
    )
    data_builtin._digits_arrays.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"raysinga\[examples\]"):
            digits()
    finally:
        data_builtin._digits_arrays.cache_clear()


# ---- load_dataset ----------------------------------------------------------------------------


def test_load_dataset_builds_every_kind(tmp_path):
    x, y = make_xy()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    np.save(tmp_path / "tx.npy", x[:5])
    np.save(tmp_path / "ty.npy", y[:5])
    np.savez(tmp_path / "d.npz", x=x, y=y)
    write_arrow(tmp_path / "d.arrow", pa.table({"img": fixed_list(x), "y": y}), chunk=16)
    pq.write_table(pa.table({"img": fixed_list(x), "y": y}), tmp_path / "d.parquet")
    p = str(tmp_path)
    specs = [
        {"kind": "npy", "x": f"{p}/x.npy", "y": f"{p}/y.npy", "sample_shape": [2, 3]},
        {"kind": "npz", "path": f"{p}/d.npz"},
        {"kind": "arrow", "path": f"{p}/d.arrow", "x": "img", "y": "y"},
        {"kind": "parquet", "path": f"{p}/d.parquet", "x": "img"},
    ]
    for spec in specs:
        check_round_trip(load_dataset(spec), x, y, (2, 3) if "sample_shape" in spec else None)
    spec = {**specs[0], "test": {"x": f"{p}/tx.npy", "y": f"{p}/ty.npy"}}
    test = load_dataset(spec, split="test")
    assert len(test) == 5 and test.sample_shape == (2, 3)
    assert len(load_dataset({"kind": "digits"}, "test")) == len(digits("test"))
    teacher = {"kind": "teacher", "n": 1000, "dim": 8, "num_classes": 3, "n_test": 50}
    assert len(load_dataset(teacher)) == 1000 and len(load_dataset(teacher, "test")) == 50


@pytest.mark.parametrize(
    ("spec", "split", "message"),
    [
        ({"kind": "csv"}, "train", "unknown kind 'csv'.*allowed kinds.*npy"),
        ({"x": "a.npy"}, "train", "no 'kind'"),
        ({"kind": "npy", "x": "a.npy"}, "train", r"needs key\(s\) \['y'\]"),
        ({"kind": "teacher", "n": 5, "dim": 2, "num_classes": 2, "sed": 1}, "train", "'sed'"),
        ({"kind": "npy", "x": "a", "y": "b"}, "test", "no 'test' entry"),
        ({"kind": "npy", "x": "a", "y": "b", "test": {"z": 1}}, "test", "unknown key"),
        ({"kind": "digits"}, "validation", "split must be one of"),
    ],
)
def test_load_dataset_errors_name_the_problem(spec, split, message):
    with pytest.raises(ValueError, match=message):
        load_dataset(spec, split)
