"""Built-in data sets: scikit-learn's digits, and a synthetic teacher-network task of any size."""

from __future__ import annotations

import functools
import importlib.util
import math
from pathlib import Path

import numpy as np

from .hashing import derive_keys, uniform_bits
from .sources import ArrayDataset, Dataset, check_indices, resolve_sample_shape

SPLITS = ("train", "test")


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, read from the CSV file it ships: importing scikit-learn itself
    takes seconds, and a worker spawned to replace a lost one should not wait for that."""
    path = _digits_csv()
    if path is not None:
        data = np.loadtxt(path, delimiter=",")  # as sklearn.datasets.load_digits reads it
        pixels, target = data[:, :-1], data[:, -1]
    else:  # a scikit-learn that keeps it elsewhere
        from sklearn.datasets import load_digits  # noqa: PLC0415 - optional dependency

        loaded = load_digits()
        pixels, target = loaded.data, loaded.target
    x = (pixels / 16.0).astype(np.float32)  # pixels are 0..16
    x.flags.writeable = False
    y = target.astype(np.int64)
    y.flags.writeable = False
    return x, y


def _digits_csv() -> Path | None:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the digits data set needs scikit-learn: pip install 'raysinga[examples]'"
        )
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


def digits(
    split: str = "train",
    test_fraction: float = 0.2,
    seed: int = 0,
    sample_shape: tuple[int, ...] | None = None,
) -> ArrayDataset:
    """The 1797 8x8 digit images of scikit-learn (pixels in [0, 1], 10 classes), split in two.

    The split is stratified and a pure function of ``seed``: within each class a seeded permutation
    picks ``round(test_fraction * class_size)`` test images, so train and test never overlap and
    every run, worker and resume sees the same sets. ``sample_shape=(1, 8, 8)`` suits conv nets.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    x, y = _digits_arrays()
    test = np.zeros(len(y), dtype=bool)
    for c in range(10):
        members = np.flatnonzero(y == c)
        rng = np.random.default_rng(np.random.SeedSequence([seed, c]))
        test[rng.permutation(members)[: int(math.floor(test_fraction * len(members) + 0.5))]] = True
    idx = np.flatnonzero(test if split == "test" else ~test)
    return ArrayDataset(x[idx], y[idx], sample_shape=sample_shape, num_classes=10)


_TEACHER_TAG = 0x7EAC
_X_BITS = 13  # inputs are odd integers in (-2**13, 2**13), scaled to unit variance
_W_MAX = 127


class TeacherDataset(Dataset):
    """Classification data labelled by a fixed random MLP teacher, generated on the fly.

    Sample ``i`` has inputs hashed from (seed, offset + i), so ``get`` of any index of a data set of
    any size (``n=10**12``) costs only the requested rows and does not depend on which other
    indices come with it. The label is the argmax of ``relu(x W1) W2`` over the teacher's integer
    weights, computed exactly: every term and partial sum is an integer below 2**53 in float64, so
    BLAS summation order, batch grouping and the machine cannot change a label. With ``noise`` > 0
    that fraction of samples (chosen by hash) gets a uniformly random label instead.

    ``offset`` shifts the sample stream: ``TeacherDataset(m, ..., offset=n)`` is a held-out set for
    ``TeacherDataset(n, ...)`` (same teacher, disjoint samples).
    """

    def __init__(
        self,
        n: int,
        dim: int,
        num_classes: int,
        seed: int = 0,
        hidden: int = 64,
        noise: float = 0.0,
        offset: int = 0,
        sample_shape: tuple[int, ...] | None = None,
    ) -> None:
        if n < 1 or offset < 0 or n + offset >= 2**63:
            raise ValueError(f"need n >= 1, offset >= 0 and n + offset < 2**63, got {n}, {offset}")
        if not 1 <= dim <= 2**32:
            raise ValueError(f"dim must be in [1, 2**32] (exact integer teacher), got {dim}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        if not 2 <= hidden <= 2**20:
            raise ValueError(f"hidden must be in [2, 2**20] (exact integer teacher), got {hidden}")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise is a probability in [0, 1], got {noise}")
        self.n, self.dim, self.hidden, self.noise = int(n), int(dim), int(hidden), float(noise)
        self.offset, self.seed = int(offset), int(seed)
        self.num_classes = int(num_classes)
        self.label_dtype = np.dtype(np.int64)
        self.generated = True  # rows cost a hash and two matmuls each: not worth a scan
        self.sample_shape = resolve_sample_shape((self.dim,), sample_shape)
        self._x_key, self._flip_key, self._label_key = derive_keys(seed, _TEACHER_TAG, count=3)
        rng = np.random.default_rng(np.random.SeedSequence([seed, _TEACHER_TAG]))
        self._w1 = rng.integers(-_W_MAX, _W_MAX + 1, size=(dim, hidden)).astype(np.float64)
        a = rng.integers(-_W_MAX, _W_MAX + 1, size=(hidden, num_classes))
        # Zero column sums: the common positive part of relu activations favours no class.
        self._w2 = (a - np.roll(a, 1, axis=0)).astype(np.float64)
        # Scale hidden activations (bounded by dim * 2**20) down to below 2**24 so that the
        # second product (< hidden * 2**24 * 2**8) stays exact too.
        self._shift = 2.0 ** -max(0, (self.dim << (_X_BITS + 7)).bit_length() - 24)

    def __len__(self) -> int:
        return self.n

    def _inputs(self, rows: np.ndarray) -> np.ndarray:
        bits = uniform_bits(self._x_key, rows, self.dim, _X_BITS)
        return bits.astype(np.float64) * 2.0 - (2**_X_BITS - 1)

    def get(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = check_indices(indices, self.n) + self.offset
        q = self._inputs(rows)
        hid = np.floor(np.maximum(q @ self._w1, 0.0) * self._shift)
        labels = np.argmax(hid @ self._w2, axis=1).astype(np.int64)
        if self.noise > 0.0:
            u = uniform_bits(self._flip_key, rows, 1, 53)[:, 0].astype(np.float64) * 2.0**-53
            flip = u < self.noise
            rand = uniform_bits(self._label_key, rows, 1, 64)[:, 0] % np.uint64(self.num_classes)
            labels[flip] = rand[flip].astype(np.int64)
        x = (q * (math.sqrt(3.0) / 2**_X_BITS)).astype(np.float32)
        return x.reshape(len(rows), *self.sample_shape), labels
