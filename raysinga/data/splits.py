"""The splits a run reads: training, validation (held out of the training split by
``data.validation``) and test (the source's held-out split).

The validation rows are the first ``round(fraction * n)`` positions of a keyed permutation of the
training split's rows (:class:`~raysinga.data.order.FeistelPermutation`, O(1) memory at any
size), the training rows the rest: a pure function of (n, fraction, seed), so every worker of
every run that shares the setting sees the same two splits without exchanging a row list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .hashing import derive_keys
from .kinds import has_split, load_dataset
from .order import FeistelPermutation
from .sources import Dataset, check_indices

_SPLIT_TAG = 0x5A11  # keeps the validation permutation's keys apart from the sample order's
_ROUNDS = 6


class Subset(Dataset):
    """Rows ``perm(offset + i)`` of ``base`` for ``i`` in ``range(size)``."""

    def __init__(self, base: Dataset, perm: FeistelPermutation, offset: int, size: int) -> None:
        self.base, self._perm, self._offset, self._size = base, perm, offset, size
        self.sample_shape = base.sample_shape
        self.target_shape = base.target_shape
        self.label_dtype = base.label_dtype
        self.generated = base.generated

    @property
    def num_classes(self) -> int | None:  # type: ignore[override]
        return self.base.num_classes

    def rows(self, indices: Any) -> np.ndarray:
        """The base data set's rows of ``indices`` of this subset."""
        return self._perm(check_indices(indices, self._size) + self._offset)

    def __len__(self) -> int:
        return self._size

    def get(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.base.get(self.rows(indices))


def hold_out(train: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """``(training rows, validation rows)`` of ``train``: ``round(fraction * n)`` rows (at
    least one) held out, and at least one left to train on."""
    n = len(train)
    if n < 2:
        raise ValueError(f"data.validation: the training split has {n} row; nothing to hold out")
    m = min(max(1, round(fraction * n)), n - 1)
    perm = FeistelPermutation(n, derive_keys(seed, _SPLIT_TAG, count=_ROUNDS))
    return Subset(train, perm, m, n - m), Subset(train, perm, 0, m)


@dataclass(frozen=True)
class Splits:
    train: Dataset
    valid: Dataset | None
    test: Dataset | None

    def held_out(self) -> dict[str, Dataset]:
        """The splits an evaluation measures, by the prefix of their metrics."""
        return {k: d for k, d in (("valid", self.valid), ("test", self.test)) if d is not None}


def open_splits(source: Mapping[str, Any], validation: Mapping[str, Any] | None) -> Splits:
    """The splits of ``data.source`` with ``data.validation`` (None: no validation split)."""
    train = load_dataset(source, split="train")
    test = load_dataset(source, split="test") if has_split(source, "test") else None
    if validation is None:
        return Splits(train, None, test)
    train, valid = hold_out(train, validation["fraction"], validation.get("seed", 0))
    return Splits(train, valid, test)
