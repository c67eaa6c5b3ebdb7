"""Sample order: which data set indices make up each part of each batch.

Exact resume rests on this module. The order of an epoch is a pure function of (seed, epoch) and the
data cursor is just the global step, so a restarted run, or any worker of any group, can compute any
slice of any batch with no state carried over. Small data sets use a NumPy permutation (cached per
epoch); data sets too large to materialise use a keyed Feistel network, which maps a position to an
index in O(1) memory.
"""

from __future__ import annotations

import numpy as np

from .hashing import derive_keys, mix64

# Above this many samples the epoch permutation is never materialised (2**26 int64 = 512 MiB).
FEISTEL_THRESHOLD = 2**26
_FEISTEL_ROUNDS = 6
_ORDER_TAG = 0x0DE2  # keeps order keys apart from other uses of (seed, epoch)


class FeistelPermutation:
    """A keyed bijection of ``range(n)`` evaluated pointwise (format-preserving encryption).

    A balanced Feistel network permutes ``range(4**h)`` for the smallest ``4**h >= n``; values
    that land outside ``range(n)`` are encrypted again (cycle walking) until they land inside,
    which keeps the map a bijection of ``range(n)``. The domain is less than ``4 n``, so on
    average fewer than four passes are needed.
    """

    def __init__(self, n: int, keys: list[int]) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        if not keys:
            raise ValueError("a Feistel network needs at least one round key")
        self.n = int(n)
        half_bits = max(1, ((self.n - 1).bit_length() + 1) // 2)
        if self.n >= 2**63:
            raise ValueError(f"n={n} exceeds the int64 index range")
        self._half = np.uint64(half_bits)
        self._mask = np.uint64((1 << half_bits) - 1)
        self._keys = [np.uint64(k) for k in keys]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for k in self._keys:
            left, right = right, left ^ (mix64(right ^ k) & self._mask)
        return (left << self._half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Indices at ``positions`` (each in ``range(n)``) of the permuted sequence, as int64."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            raise IndexError(f"positions must lie in [0, {self.n})")
        out = self._encrypt(pos.astype(np.uint64))
        outside = np.flatnonzero(out >= np.uint64(self.n))
        while outside.size:
            out[outside] = self._encrypt(out[outside])
            outside = outside[out[outside] >= np.uint64(self.n)]
        return out.astype(np.int64)


class BatchPlan:
    """Full batches of ``batch_size`` drawn from ``num_samples`` samples in a per-epoch order.

    The last ``num_samples % batch_size`` samples of each epoch's order are dropped (drop_last), so
    every step sees a full batch and the step count per epoch is fixed; a different epoch drops
    different samples when shuffling.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        feistel_threshold: int = FEISTEL_THRESHOLD,
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if batch_size <= 0 or batch_size > num_samples:
            raise ValueError(
                f"batch_size must be in [1, num_samples={num_samples}] (batches are always full), "
                f"got {batch_size}"
            )
        if seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed}")
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.steps_per_epoch: int = self.num_samples // self.batch_size
        # Above the threshold positions map to indices through a Feistel network, never an array.
        self.uses_feistel = self.shuffle and self.num_samples > feistel_threshold
        self._cached: tuple[int, np.ndarray] | None = None
        self._cached_feistel: tuple[int, FeistelPermutation] | None = None

    def __repr__(self) -> str:
        return (
            f"BatchPlan(num_samples={self.num_samples}, batch_size={self.batch_size}, "
            f"seed={self.seed}, shuffle={self.shuffle})"
        )

    def _feistel(self, epoch: int) -> FeistelPermutation:
        if self._cached_feistel is None or self._cached_feistel[0] != epoch:
            keys = derive_keys(self.seed, epoch, _ORDER_TAG, count=_FEISTEL_ROUNDS)
            self._cached_feistel = (epoch, FeistelPermutation(self.num_samples, keys))
        return self._cached_feistel[1]

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
            perm = rng.permutation(self.num_samples)
            perm.flags.writeable = False  # shared with callers through order()
            self._cached = (epoch, perm)
        return self._cached[1]

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of ``range(num_samples)`` in ``epoch``: a pure function of (seed, epoch).

        Read-only (it is the cached array). Above the Feistel threshold this computes all
        ``num_samples`` indices, so use :meth:`order_slice` or :meth:`indices` there.
        """
        if self.shuffle and not self.uses_feistel:
            if epoch < 0:
                raise ValueError(f"epoch must be >= 0, got {epoch}")
            return self._permutation(epoch)
        return self.order_slice(epoch, 0, self.num_samples)

    def order_slice(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Positions ``[start, stop)`` of :meth:`order` (epoch) as a new array.

        Above the Feistel threshold only these positions are computed.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if not 0 <= start <= stop <= self.num_samples:
            raise ValueError(f"need 0 <= start <= stop <= {self.num_samples}, got {start}, {stop}")
        if not self.shuffle:
            return np.arange(start, stop, dtype=np.int64)
        if self.uses_feistel:
            return self._feistel(epoch)(np.arange(start, stop, dtype=np.int64))
        return self._permutation(epoch)[start:stop].copy()

    def cursor(self, step: int) -> tuple[int, int]:
        """Global step -> (epoch, step_in_epoch)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, in_epoch = divmod(int(step), self.steps_per_epoch)
        return epoch, in_epoch

    def slice_bounds(self, part: int, parts: int) -> tuple[int, int]:
        """``[start, stop)`` of sub-batch ``part`` of ``parts`` within a batch.

        Balanced: sizes differ by at most one and the larger come first (batch 10 over 3 ->
        (0, 4), (4, 7), (7, 10)), so the stub can weight worker gradients by size.
        """
        if not 1 <= parts <= self.batch_size:
            raise ValueError(
                f"parts must be in [1, batch_size={self.batch_size}] so no part is empty, "
                f"got {parts}"
            )
        if not 0 <= part < parts:
            raise ValueError(f"part must be in [0, {parts}), got {part}")
        size, extra = divmod(self.batch_size, parts)
        start = part * size + min(part, extra)
        return start, start + size + (1 if part < extra else 0)

    def indices(self, step: int, part: int = 0, parts: int = 1) -> np.ndarray:
        """Data set indices of sub-batch ``part`` of ``parts`` of the batch at global ``step``."""
        epoch, in_epoch = self.cursor(step)
        start, stop = self.slice_bounds(part, parts)
        base = in_epoch * self.batch_size
        return self.order_slice(epoch, base + start, base + stop)
