"""Data for raysinga: data sets readable by index, and the deterministic batch order.

Everything a trainer or worker needs is importable from here::

    ds = load_dataset({"kind": "npy", "x": "x.npy", "y": "y.npy"})
    plan = BatchPlan(len(ds), batch_size=256, seed=0)
    x, y = ds.get(plan.indices(step, part=rank, parts=world))

Before step 0 a trainer runs ``check_splits(train, test, ...)``: both splits against the model
(shapes, labels, finite values), so a data mistake is one line naming the file, not a lost run.
A Ray Data ``Dataset`` becomes a source through ``from_ray_dataset(ds, path)``, which writes it
once, in order, as an Arrow IPC file and returns the spec that reads it.

A worker never receives data from the driver: from the data set spec, the seed and the global step
it computes its own sub-batch, which is what makes a resumed run see exactly the same samples.
The data cursor (:mod:`.cursor`) says where in that order a run stands. No Ray, no kernels:
plain NumPy and Arrow.
"""

from __future__ import annotations

from .arrow import ArrowDataset, ParquetDataset
from .builtin import TeacherDataset, digits
from .check import DEFAULT_SCAN_BYTES, check_splits
from .cursor import DataCursor
from .errors import DataError
from .kinds import has_split, load_dataset
from .order import FEISTEL_THRESHOLD, BatchPlan, FeistelPermutation
from .ray_dataset import from_ray_dataset
from .sources import ArrayDataset, Dataset, NpyDataset, NpzDataset
from .text import TextDataset

__all__ = [
    "DEFAULT_SCAN_BYTES",
    "FEISTEL_THRESHOLD",
    "ArrayDataset",
    "ArrowDataset",
    "BatchPlan",
    "DataCursor",
    "DataError",
    "Dataset",
    "FeistelPermutation",
    "NpyDataset",
    "NpzDataset",
    "ParquetDataset",
    "TeacherDataset",
    "TextDataset",
    "check_splits",
    "digits",
    "from_ray_dataset",
    "has_split",
    "load_dataset",
]
