"""Data mistakes, each refused before step 0 with one error that says where: the split, the file
(as the job gives it), the key or column and, for a bad value, the row. The files are written
here, in every format the mistake can be made in; each case checks both the exception's type and
that its message names those parts, because a user reads the message, not the attributes."""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import cli_error

from raysinga.data import DataError, check_splits, digits, has_split, load_dataset

RNG = np.random.default_rng(0)
X = RNG.normal(size=(200, 8)).astype(np.float32)
Y = RNG.integers(0, 3, 200)
TX = RNG.normal(size=(50, 8)).astype(np.float32)
TY = RNG.integers(0, 3, 50)
FORMATS = ("npy", "npz", "arrow", "parquet")
NPY_NAMES = {("train", "x"): "x", ("train", "y"): "y", ("test", "x"): "tx", ("test", "y"): "ty"}


def changed(a: np.ndarray, row: int, value, col: int | None = None) -> np.ndarray:
    b = a.copy()
    if col is None:
        b[row] = value
    else:
        b[row, col] = value
    return b


def column(a: np.ndarray) -> pa.Array:
    """One Arrow column: a fixed-size list per row for 2-D arrays, else scalars."""
    if a.ndim == 2:
        return pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), a.shape[1])
    return pa.array(a)


def write(d: Path, fmt: str, arrays: dict[str, np.ndarray]) -> dict:
    """Train and test files of ``fmt`` in ``d``, and the data set spec that names them."""
    x, y, tx, ty = (arrays[k] for k in ("x", "y", "tx", "ty"))
    if fmt == "npy":
        for name, a in zip(("x", "y", "tx", "ty"), (x, y, tx, ty), strict=True):
            np.save(d / f"{name}.npy", a)
        p = {k: str(d / f"{k}.npy") for k in ("x", "y", "tx", "ty")}
        return {"kind": "npy", "x": p["x"], "y": p["y"], "test": {"x": p["tx"], "y": p["ty"]}}
    for split, (a, b) in (("train", (x, y)), ("test", (tx, ty))):
        path = d / f"{split}.{fmt}"
        if fmt == "npz":
            np.savez(path, x=a, y=b)
        elif fmt == "arrow":
            table = pa.table({"x": column(a), "y": column(b)})
            with pa.ipc.new_file(path, table.schema) as w:
                for batch in table.to_batches(max_chunksize=64):
                    w.write_batch(batch)
        else:
            pq.write_table(pa.table({"x": column(a), "y": column(b)}), path, row_group_size=64)
    return {"kind": fmt, "path": str(d / f"train.{fmt}"), "test": {"path": str(d / f"test.{fmt}")}}


def named(spec: dict, fmt: str, split: str, which: str) -> tuple[str, str]:
    """The file and the key or column an error about ``which`` of ``split`` must name."""
    if fmt == "npy":
        return spec["test"][which] if split == "test" else spec[which], f"{which} array"
    file = spec["test"]["path"] if split == "test" else spec["path"]
    return file, f"key '{which}'" if fmt == "npz" else f"column '{which}'"


def check(spec: dict, loss="softmax_cross_entropy", out=(3,), batch=16, scan=2**27) -> list[str]:
    """What a trainer does before step 0: open both splits (the test split where the spec has
    one), check them against the model."""
    train = load_dataset(spec, "train")
    test = load_dataset(spec, "test") if has_split(spec, "test") else None
    return check_splits(
        train,
        test,
        input_shape=(8,),
        output_shape=out,
        loss=loss,
        batch_size=batch,
        scan_bytes=scan,
        source=spec,
    )


# File surgery, applied to the file that holds the bad split's x or y.
def to_directory(p: Path) -> None:
    p.unlink()
    p.mkdir()


def to_garbage(p: Path) -> None:
    p.write_bytes(b"this is not what the name says " * 8)


def to_empty(p: Path) -> None:
    p.write_bytes(b"")


def truncated(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:200])


def to_stream(p: Path) -> None:
    """The same rows in Arrow's stream format, which has no random access."""
    data = p.read_bytes()  # read, not mapped: p is rewritten below
    table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
    with pa.ipc.new_stream(p, table.schema) as w:
        w.write_table(table)


def case(
    ident: str,
    fmts: str | tuple[str, ...],
    split: str,
    which: str,
    *,
    row: int | None = None,
    bad: dict | None = None,
    after: Callable[[Path], None] | None = None,
    spec: dict | None = None,
    key: str | None = None,
    also: tuple[str, ...] = (),
    exc: type[Exception] = DataError,
    **model,
) -> list:
    """One bad-data case per format in ``fmts``: the data of ``split`` is bad in ``which`` (x or
    y), at ``row`` for a bad value; ``key`` overrides the key or column the message must name."""
    values = (split, which, row, bad or {}, after, spec or {}, key, also, exc, model)
    fmts = (fmts,) if isinstance(fmts, str) else fmts
    return [pytest.param(fmt, *values, id=f"{ident}-{fmt}") for fmt in fmts]


CASES = [
    *case("nan-in-x", FORMATS, "train", "x", row=123, bad={"x": changed(X, 123, np.nan, 4)}),
    *case("inf-in-test-x", FORMATS, "test", "x", row=7, bad={"tx": changed(TX, 7, -np.inf, 0)}),
    *case(
        "inf-in-y-regression",
        ("npy", "parquet"),
        "train",
        "y",
        row=42,
        bad={"y": changed(X[:, 0].astype(np.float64), 42, np.inf), "ty": TX[:, 0]},
        loss="mse",
        out=(1,),
    ),
    *case("test-width", FORMATS, "test", "x", bad={"tx": np.zeros((50, 9), np.float32)}),
    *case(
        "train-width",
        ("npy", "arrow"),
        "train",
        "x",
        bad={"x": X[:, :6], "tx": TX[:, :6]},
        also=("[6]", "[8]"),
    ),
    *case("label-beyond-output", FORMATS, "test", "y", row=5, bad={"ty": changed(TY, 5, 7)}),
    *case("negative-label", ("npy", "arrow"), "train", "y", row=9, bad={"y": changed(Y, 9, -1)}),
    *case(
        "float-labels-cross-entropy",
        ("npy", "npz", "parquet"),
        "train",
        "y",
        bad={"y": Y.astype(np.float64)},
        also=("float64", "softmax_cross_entropy"),
    ),
    *case("class-labels-mse", ("npy", "arrow"), "train", "y", loss="mse", out=(1,), also=("mse",)),
    *case(
        "target-shape-mse",
        "npy",
        "train",
        "y",
        bad={"y": np.zeros((200, 2)), "ty": np.zeros((50, 2))},
        loss="mse",
        out=(1,),
        also=("[2]", "[1]"),
    ),
    *case("string-labels", FORMATS, "train", "y", bad={"y": np.array(["cat", "dog"] * 100)}),
    *case("missing-npz-key", "npz", "train", "x", spec={"x_key": "images"}, key="key 'images'"),
    *case(
        "missing-test-npz-key",
        "npz",
        "test",
        "y",
        spec={"test": {"y_key": "labels"}},
        key="key 'labels'",
        also=("['x', 'y']",),
    ),
    *case(
        "missing-column",
        ("arrow", "parquet"),
        "train",
        "y",
        spec={"y": "label"},
        key="column 'label'",
        also=("['x', 'y']",),
    ),
    *case("directory", FORMATS, "train", "x", after=to_directory, also=("directory",)),
    *case("not-a-zip", "npz", "test", "x", after=to_garbage, also=("not an .npz",)),
    *case("garbage-npy", "npy", "train", "y", after=to_garbage, also=(".npy",)),
    *case("truncated-npy", "npy", "test", "x", after=truncated, also=("truncated",)),
    *case("empty-file", FORMATS, "train", "x", after=to_empty, also=("empty",)),
    *case("arrow-stream", "arrow", "train", "x", after=to_stream, also=("new_file",)),
    *case(
        "zero-rows",
        ("arrow", "parquet"),
        "train",
        "x",
        bad={"x": X[:0], "y": Y[:0]},
        key="",  # a file without rows: no column is to blame
        also=("no rows",),
    ),
    *case("too-few-for-a-batch", ("npy", "parquet"), "train", "x", batch=500, also=("500",)),
    *case("empty-test-split", "npy", "test", "x", bad={"tx": TX[:0], "ty": TY[:0]}),
    *case("one-scalar-per-row", "npy", "train", "x", bad={"x": X[:, 0], "tx": TX[:, 0]}),
    *case("missing-file", FORMATS, "test", "y", after=Path.unlink, exc=FileNotFoundError),
]
CASES += case("missing-x-column", "arrow", "test", "x", spec={"test": {"x": "px"}}, key="'px'")


@pytest.mark.parametrize(
    ("fmt", "split", "which", "row", "bad", "after", "extra", "key", "also", "exc", "model"),
    CASES,
)
def test_bad_data_is_refused_naming_where(
    tmp_path, fmt, split, which, row, bad, after, extra, key, also, exc, model
):
    spec = write(tmp_path, fmt, {"x": X, "y": Y, "tx": TX, "ty": TY, **bad})
    for k, v in extra.items():
        spec[k] = {**spec[k], **v} if isinstance(v, dict) else v
    file, default_key = named(spec, fmt, split, which)
    if after is not None:
        after(Path(file))
        if fmt != "npy":  # the whole file is broken, not one key or column of it
            default_key = ""
    with pytest.raises(exc) as info:
        check(spec, **model)
    message = str(info.value)
    assert type(info.value) is exc, message  # not a KeyError or ArrowInvalid passed through
    assert file in message, message
    assert f"{split} split" in message, message
    if exc is DataError:
        assert info.value.split == split and info.value.file == file, message
        assert (default_key if key is None else key) in message, message
        assert info.value.row == row, message
    if row is not None:
        assert f"row {row}:" in message, message
    for text in also:
        assert text in message, message
    assert "Traceback" not in message and "\n" not in message


def test_non_finite_in_a_named_scalar_column_names_that_column(tmp_path):
    """x gathered from scalar columns: the message names the column holding the NaN."""
    path = tmp_path / "cols.parquet"
    cols = {f"f{j}": changed(X, 61, np.nan, 5)[:, j] for j in range(8)}
    pq.write_table(pa.table({**cols, "y": Y}), path, row_group_size=50)
    spec = {"kind": "parquet", "path": str(path), "x": [f"f{j}" for j in range(8)]}
    with pytest.raises(DataError, match=r"cols\.parquet \(column 'f5'\): row 61: nan") as info:
        check(spec)
    assert info.value.row == 61 and info.value.split == "train"


def test_a_null_in_a_later_chunk_is_found_at_its_row(tmp_path):
    """Chunks past the first open only when read: the scan reads them, and the row counts
    from the start of the file, not of the chunk."""
    y = pa.array([None if i == 150 else int(v) for i, v in enumerate(Y)], pa.int64())
    table = pa.table({"x": column(X), "y": y})
    path = tmp_path / "nulls.arrow"
    with pa.ipc.new_file(path, table.schema) as w:
        for batch in table.to_batches(max_chunksize=64):
            w.write_batch(batch)
    spec = {"kind": "arrow", "path": str(path)}
    with pytest.raises(DataError, match=r"nulls\.arrow \(column 'y'\): row 150: null"):
        check(spec)


@pytest.mark.parametrize("fmt", FORMATS)
def test_above_scan_bytes_a_sample_is_scanned_and_said(tmp_path, fmt):
    spec = write(tmp_path, fmt, {"x": X, "y": Y, "tx": TX, "ty": TY})
    notes = check(spec, scan=1000)  # rows take 40 bytes: 25 of 200 rows fit
    train_note = next(n for n in notes if "of train" in n)
    assert "scanned 25 of 200 rows" in train_note and "data.scan_bytes = 1,000" in train_note
    assert any("of test" in n for n in notes)
    assert check(spec) == []  # all of it fits the default: no note


def test_a_sampled_scan_still_finds_a_bad_first_row_and_any_bad_label(tmp_path):
    """The sample always starts at row 0; labels are read apart from the samples, so the label
    check covers rows the sample skipped (a label out of range breaks a step wherever it is)."""
    spec = write(tmp_path, "npy", {"x": changed(X, 0, np.nan, 0), "y": Y, "tx": TX, "ty": TY})
    with pytest.raises(DataError, match="row 0:"):
        check(spec, scan=1000)
    spec = write(tmp_path, "arrow", {"x": X, "y": changed(Y, 197, 3), "tx": TX, "ty": TY})
    with pytest.raises(DataError, match=r"row 197: label 3 is outside \[0, 3\)"):
        check(spec, scan=1000)


def test_error_parts_are_attributes():
    err = DataError("nan in element 2", file="a.npy", key="x array", split="test", row=5)
    assert isinstance(err, ValueError)
    assert str(err) == "test split, a.npy (x array): row 5: nan in element 2"
    moved = DataError("null value", file="b.arrow", key="column 'y'", row=3).at(
        split="train", row_offset=64
    )
    assert (moved.split, moved.row) == ("train", 67) and "row 67:" in str(moved)
    again = pickle.loads(pickle.dumps(err))  # as a worker's error crosses Ray
    assert type(again) is DataError and str(again) == str(err) and again.row == 5


def test_checks_are_cheap(tmp_path):
    """The digits and a 100 MB file, read whole, check in well under a second (the budget
    here leaves room for a loaded machine)."""
    train, test = digits("train"), digits("test")
    start = time.perf_counter()
    check_splits(
        train,
        test,
        input_shape=(64,),
        output_shape=(10,),
        loss="softmax_cross_entropy",
        batch_size=64,
        source={"kind": "digits"},
    )
    assert time.perf_counter() - start < 0.5
    rows = 100 * 2**20 // 256
    x = np.lib.format.open_memmap(tmp_path / "x.npy", "w+", np.float32, (rows, 64))
    x[:] = 0.5
    x.flush()
    del x
    np.save(tmp_path / "y.npy", np.arange(rows) % 10)
    spec = {"kind": "npy", "x": str(tmp_path / "x.npy"), "y": str(tmp_path / "y.npy")}
    ds = load_dataset(spec)
    start = time.perf_counter()
    notes = check_splits(
        ds,
        None,
        input_shape=(64,),
        output_shape=(10,),
        loss="softmax_cross_entropy",
        batch_size=64,
        source=spec,
    )
    assert notes == []  # whole: 100 MB is below the default scan_bytes
    assert time.perf_counter() - start < 2.0


# ---- through the command line ----------------------------------------------------------------

JOB = """
name: bad-data
seed: 1
model:
  input_shape: [8]
  layers:
    - {{kind: dense, name: fc1, units: 16, activation: relu}}
    - {{kind: dense, name: out, units: {units}}}
  loss: {loss}
data:
  source: {source}
  batch_size: {batch}
updater: {{name: sgd, lr: 0.05}}
train_steps: 5
disp_freq: 5
test_freq: 0
"""


def train_cli(tmp_path: Path, spec: dict, *named: str, loss="softmax_cross_entropy", batch=16):
    """``raysinga train JOB --local`` on ``spec``: one error line naming each of ``named``, and
    not a step trained."""
    job = tmp_path / "job.yaml"
    units = 1 if loss == "mse" else 3
    source = json.dumps(spec)  # JSON is YAML
    job.write_text(JOB.format(units=units, loss=loss, source=source, batch=batch))
    run = tmp_path / "run"
    cli_error("train", str(job), "--set", f"run_dir={run}", "--local", named=list(named))
    assert not (run / "metrics.jsonl").exists() or "loss" not in (run / "metrics.jsonl").read_text()


@pytest.mark.parametrize(
    ("fmt", "bad", "after", "extra", "says"),
    [
        ("npz", {}, None, {"x_key": "images"}, ["train.npz", "'images'", "['x', 'y']"]),
        ("npy", {}, to_directory, {}, ["x.npy", "directory"]),
        ("npz", {}, to_garbage, {}, ["train.npz", "not an .npz"]),
        ("arrow", {}, to_empty, {}, ["train.arrow", "empty"]),
        ("npy", {"y": np.array(["cat", "dog"] * 100)}, None, {}, ["y.npy", "<U3"]),
        ("parquet", {}, None, {"y": "label"}, ["train.parquet", "'label'"]),
    ],
    ids=["npz-key", "directory", "not-a-zip", "empty-arrow", "string-labels", "missing-column"],
)
def test_the_command_line_names_data_that_does_not_open(tmp_path, fmt, bad, after, extra, says):
    """Opening errors: one ``raysinga: error:`` line, no traceback (ValueError reaches the CLI)."""
    spec = write(tmp_path, fmt, {"x": X, "y": Y, "tx": TX, "ty": TY, **bad})
    spec.update(extra)
    if after is not None:
        after(Path(named(spec, fmt, "train", "x")[0]))
    train_cli(tmp_path, spec, *says)


@pytest.mark.parametrize(
    ("bad", "model", "says"),
    [
        ({"x": changed(X, 123, np.nan, 4)}, {}, ["/x.npy", "row 123"]),
        ({"tx": changed(TX, 7, np.inf, 2)}, {}, ["/tx.npy", "row 7", "test split"]),
        ({"tx": np.zeros((50, 9), np.float32)}, {}, ["/tx.npy", "[9]"]),
        ({"ty": changed(TY, 5, 7)}, {}, ["/ty.npy", "row 5"]),
        ({"y": Y.astype(np.float64)}, {}, ["/y.npy", "float64"]),
        ({}, {"loss": "mse"}, ["/y.npy", "mse"]),
        (
            {"y": changed(X[:, 0], 42, np.inf), "ty": TX[:, 0]},
            {"loss": "mse"},
            ["/y.npy", "row 42"],
        ),
        ({}, {"batch": 500}, ["/x.npy", "500"]),
    ],
    ids=[
        "nan-in-x",
        "inf-in-test-x",
        "test-width",
        "test-label-beyond-output",
        "float-labels",
        "class-labels-mse",
        "inf-in-y-mse",
        "too-few-for-a-batch",
    ],
)
def test_the_command_line_refuses_data_that_does_not_fit_before_step_0(tmp_path, bad, model, says):
    """Found by check_splits once the trainers call it: before step 0, not at the final
    evaluation, and never trained on."""
    spec = write(tmp_path, "npy", {"x": X, "y": Y, "tx": TX, "ty": TY, **bad})
    train_cli(tmp_path, spec, *says, **model)
