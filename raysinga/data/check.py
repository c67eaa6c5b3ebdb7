"""Data checks before step 0: ``DataError`` and ``check_splits``.

A data mistake found at step 0 costs a second; found at the final evaluation it costs the run,
and NaN in the features costs more, because training goes on, logging ``loss nan``. So both
splits are checked against the model once, before any training: shapes, label kind and range,
finite values, enough samples for a batch. Values are read through ``Dataset.get`` a chunk of
rows at a time, so memory stays bounded; above ``scan_bytes`` an evenly spread sample is read.
No Ray and no kernels here: the module runs anywhere a data set opens.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raysinga.checkpoint.storage import redact
from raysinga.nn.losses import CLASSIFYING

from .errors import DataError
from .sources import Dataset

# A full scan of this much costs a fraction of a second from the page cache.
DEFAULT_SCAN_BYTES = 128 * 2**20
_CHUNK_BYTES = 4 * 2**20  # per get(): large enough to amortise the call, small in memory
# A sample is read as this many evenly spread runs of consecutive rows: consecutive rows share
# pages (.npy) and chunks (Arrow, Parquet), so a run costs about what one row does.
_SAMPLE_RUNS = 32


@dataclass(frozen=True)
class _Where:
    """Where a split's x or y lives, as the job file names it."""

    split: str
    file: str | None
    key: str
    columns: tuple[str, ...] = ()  # x gathered from several scalar columns, one per element

    def error(self, problem: str, row: int | None = None, element: int | None = None) -> DataError:
        key = self.key
        if element is not None and len(self.columns) > 1:
            key = f"column {self.columns[element]!r}"  # name the column that holds the value
        return DataError(problem, file=self.file, key=key, split=self.split, row=row)


def _locate(source: Mapping[str, Any] | None, split: str) -> tuple[_Where, _Where]:
    """Where x and y of ``split`` come from, read off the data set spec (data.source)."""
    spec: Mapping[str, Any] = source or {}
    kind = spec.get("kind")
    if split == "test" and isinstance(spec.get("test"), Mapping):
        spec = {**spec, **spec["test"]}
    if kind == "npy":
        return _Where(split, redact(str(spec["x"])), "x array"), _Where(
            split, redact(str(spec["y"])), "y array"
        )
    if kind == "npz":
        file = redact(str(spec["path"]))
        return (
            _Where(split, file, f"key {spec.get('x_key', 'x')!r}"),
            _Where(split, file, f"key {spec.get('y_key', 'y')!r}"),
        )
    if kind in ("arrow", "parquet"):
        file, x = redact(str(spec["path"])), spec.get("x", "x")
        cols = (x,) if isinstance(x, str) else tuple(x)
        xkey = f"column {cols[0]!r}" if len(cols) == 1 else f"columns {list(cols)}"
        ykey = f"column {spec.get('y', 'y')!r}"
        return _Where(split, file, xkey, cols), _Where(split, file, ykey)
    file = f"built-in data set {kind!r}" if kind else None
    return _Where(split, file, "x"), _Where(split, file, "y")


def check_splits(
    train: Dataset,
    test: Dataset | None,
    *,
    input_shape: Sequence[int],
    output_shape: Sequence[int],
    loss: str,
    batch_size: int,
    scan_bytes: int = DEFAULT_SCAN_BYTES,
    source: Mapping[str, Any] | None = None,
) -> list[str]:
    """Check the loaded splits against the model before training; raise :class:`DataError`.

    ``input_shape``, ``output_shape`` and ``loss`` are the model's (``spec.input_shape``,
    ``Net(spec).output_shape``, ``spec.loss``); ``source`` is the data set spec, to name files.
    Returns lines worth logging: which splits were only sampled because they exceed
    ``scan_bytes``. Shapes, label kinds and sizes of both splits are checked before any value
    is read, so a cheap mistake is found in milliseconds.
    """
    inp, out = tuple(int(d) for d in input_shape), tuple(int(d) for d in output_shape)
    splits = [("train", train)] + ([("test", test)] if test is not None else [])
    located = {name: _locate(source, name) for name, _ in splits}
    for name, ds in splits:
        xw, yw = located[name]
        _check_shape(ds, xw, inp, train.sample_shape if name == "test" else None)
        _check_labels(ds, yw, loss, out)
        if name == "train" and len(ds) < batch_size:
            raise xw.error(
                f"the split has {len(ds)} samples, fewer than data.batch_size {batch_size}: "
                "not one full batch"
            )
        if len(ds) == 0:
            raise xw.error("the split has no samples")
    notes = []
    for name, ds in splits:
        try:
            width = out[-1] if loss == "sequence_cross_entropy" else int(np.prod(out))
            notes += _check_values(ds, *located[name], loss == "mse", width, scan_bytes)
        except DataError as e:  # raised by get() itself, e.g. a null cell in a later chunk
            raise e.at(split=name) from None
    return notes


def _check_shape(
    ds: Dataset, xw: _Where, inp: tuple[int, ...], train_shape: tuple[int, ...] | None
) -> None:
    shape = tuple(ds.sample_shape)
    if shape == inp:
        return
    if train_shape is not None and shape != tuple(train_shape):
        raise xw.error(
            f"samples have shape {list(shape)}, but the train split's have {list(train_shape)} "
            f"and model.input_shape is {list(inp)}; both splits must hold the same features"
        )
    size, want = int(np.prod(shape)), int(np.prod(inp))
    fix = (
        f"set data.source.sample_shape: {list(inp)} (the same {size} values)"
        if size == want
        else f"the model takes {want} values per sample, the data holds {size}"
    )
    raise xw.error(f"samples have shape {list(shape)}, model.input_shape is {list(inp)}; {fix}")


def _label_dtype(ds: Dataset) -> np.dtype:
    """The labels' dtype as stored (a float64 file reads as float32): from the data set when it
    says, else from one row."""
    dtype = getattr(ds, "label_dtype", None)
    return np.dtype(dtype) if dtype is not None else ds.get(np.arange(min(len(ds), 1)))[1].dtype


def _check_labels(ds: Dataset, yw: _Where, loss: str, out: tuple[int, ...]) -> None:
    dtype = _label_dtype(ds)
    classes = dtype.kind != "f"  # not ds.num_classes: that reads every label, unchecked yet
    if loss in CLASSIFYING and not classes:
        raise yw.error(
            f"labels are {dtype} values, but loss {loss} needs integer class "
            "labels 0..k-1; store y as integers (y.astype(np.int64)), or set model.loss: mse "
            "for regression"
        )
    if loss != "mse":
        return
    if classes:
        raise yw.error(
            f"y holds {dtype} class labels, but loss mse needs float targets shaped like the "
            f"net's output {list(out)}; for classes use loss softmax_cross_entropy, for "
            "regression store y as float32"
        )
    target = tuple(ds.target_shape)
    if target != out and not (target == () and out == (1,)):
        raise yw.error(
            f"targets have shape {list(target)} per sample, but the net outputs {list(out)}; "
            "loss mse compares them element by element"
        )


def _runs(n: int, rows: int) -> list[tuple[int, int]]:
    """``rows`` of ``range(n)`` as evenly spread runs of consecutive rows (all when it fits)."""
    if rows >= n:
        return [(0, n)]
    runs = min(_SAMPLE_RUNS, rows)
    length = rows // runs
    starts = np.unique(np.linspace(0, n - length, num=runs).astype(np.int64))
    return [(int(s), int(s) + length) for s in starts]


def _chunks(runs: list[tuple[int, int]], step: int) -> Iterator[tuple[int, int]]:
    for lo, hi in runs:
        for a in range(lo, hi, step):
            yield a, min(hi, a + step)


def _check_values(
    ds: Dataset, xw: _Where, yw: _Where, regression: bool, width: int, scan_bytes: int
) -> list[str]:
    """Read the split (or a sample of it) chunk by chunk: finite values, labels in range."""
    if getattr(ds, "generated", False):  # valid by construction, but maybe not for this net
        if ds.num_classes is not None and ds.num_classes > width:
            raise yw.error(
                f"the data has {ds.num_classes} classes, but the net has {width} outputs; "
                f"give the last layer {ds.num_classes} units"
            )
        return []
    n = len(ds)
    y_bytes = 4 * int(np.prod(ds.target_shape)) if regression else 8
    row_bytes = 4 * int(np.prod(ds.sample_shape)) + y_bytes
    runs = _runs(n, max(1, scan_bytes // row_bytes))
    sampled = runs != [(0, n)]
    # A cheap label read (a label array or column, without the samples) checks every label of
    # a split too large to scan whole: a label out of range breaks a step, wherever it is.
    labels_apart = sampled and not regression and hasattr(ds, "labels")
    step = max(1, _CHUNK_BYTES // row_bytes)
    for a, b in _chunks(runs, step):
        x, y = ds.get(np.arange(a, b, dtype=np.int64))
        _check_finite(x, a, xw, "sample")
        if regression:
            _check_finite(y, a, yw, "target")
        elif not labels_apart:
            _check_range(y, a, yw, width)
    notes = []
    if sampled:
        scanned = sum(hi - lo for lo, hi in runs)
        notes.append(
            f"data check: scanned {scanned:,} of {n:,} rows of {xw.split} in {len(runs)} evenly "
            f"spread runs (sampled beyond data.scan_bytes = {scan_bytes:,} bytes; the split "
            f"holds about {n * row_bytes:,})"
        )
    if labels_apart:
        label_runs = _runs(n, max(1, scan_bytes // 8))
        for a, b in _chunks(label_runs, _CHUNK_BYTES // 8):
            _check_range(ds.labels(a, b), a, yw, width)
        if label_runs != [(0, n)]:
            checked = sum(hi - lo for lo, hi in label_runs)
            notes.append(f"data check: labels of {checked:,} of {n:,} rows of {xw.split} checked")
    return notes


def _check_finite(a: np.ndarray, start: int, w: _Where, what: str) -> None:
    flat = a.reshape(len(a), -1)
    ok = np.isfinite(flat)
    if ok.all():
        return
    row = int(np.flatnonzero(~ok.all(axis=1))[0])
    element = int(np.flatnonzero(~ok[row])[0])
    raise w.error(
        f"{flat[row, element]} in element {element} of the {what} (the first non-finite value); "
        "it makes every loss NaN: fix or drop such rows",
        row=start + row,
        element=element,
    )


def _check_range(y: np.ndarray, start: int, w: _Where, width: int) -> None:
    bad = (y < 0) | (y >= width)
    if not bad.any():
        return
    row = int(np.flatnonzero(bad)[0])
    value = y[row].item()
    fix = (
        "labels are class indices 0..k-1"
        if value < 0
        else "give the last layer more units, or renumber the classes 0..k-1"
    )
    raise w.error(
        f"label {value} is outside [0, {width}), the net's {width} outputs; {fix}", row=start + row
    )
