"""Counter-based hashing: random numbers that are a pure function of (key, counter).

The sample order of a huge data set and the synthetic teacher data must be computable for any index
on any worker without replaying a sequential RNG, so both are built from one stateless mixer
(SplitMix64's finaliser, a bijection on 64-bit words with good avalanche). Everything here is
integer arithmetic on uint64 arrays, hence bit-identical on every machine.
"""

from __future__ import annotations

import numpy as np

from raysinga.kernels.common import GOLDEN, mix64_array

_GOLDEN = np.uint64(GOLDEN)

# The mixer behind dropout masks too: one implementation, in kernels.common.
mix64 = mix64_array


def derive_keys(*words: int, count: int = 1) -> list[int]:
    """``count`` 64-bit keys derived from non-negative integers (seed, epoch, tag, ...).

    SeedSequence does the derivation so that nearby seeds (0, 1, 2) give unrelated keys.
    """
    if any(w < 0 for w in words):
        raise ValueError(f"seed words must be non-negative integers, got {words}")
    state = np.random.SeedSequence(list(words)).generate_state(count, dtype=np.uint64)
    return [int(s) for s in state]


def uniform_bits(key: int, rows: np.ndarray, width: int, bits: int) -> np.ndarray:
    """``bits``-bit unsigned integers of shape (len(rows), width), a pure function of (key, row, j).

    Each row is hashed on its own, so a row's values do not depend on which rows come with it.
    """
    if not 1 <= bits <= 64:
        raise ValueError(f"bits must be in [1, 64], got {bits}")
    # SplitMix64 streams: row r starts at mix64(r ^ key) and steps by the golden gamma.
    row_key = mix64(np.asarray(rows).astype(np.uint64) ^ np.uint64(key))[:, None]
    cols = np.arange(1, width + 1, dtype=np.uint64)[None, :]
    return mix64(row_key + cols * _GOLDEN) >> np.uint64(64 - bits)
