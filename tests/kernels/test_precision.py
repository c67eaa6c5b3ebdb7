"""The compute precisions' rounding (kernels.precision), against ml_dtypes' bfloat16 (round to
nearest, ties to even) and a TF32 reference written from its definition, over random values,
exact ties, the largest finite values, subnormals, infinities and NaN."""

from __future__ import annotations

import numpy as np
import pytest

from raysinga.kernels import precision as P

# the test extra installs it; a machine with only the project's runtime skips this module
ml_dtypes = pytest.importorskip("ml_dtypes")


def _values() -> np.ndarray:
    rng = np.random.default_rng(0)
    random = rng.standard_normal(100_000).astype(np.float32) * np.float32(1e3)
    bits = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    base = np.arange(0x3F800, 0x3FFFF, dtype=np.uint32)  # in [1, 2): bf16's and TF32's ties
    ties = np.concatenate([base << 16 | np.uint32(0x8000), base << 13 | np.uint32(0x1000)])
    ties = ties.view(np.float32)
    special = np.array(
        [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, -np.nan, 3.4e38, -3.4e38, 1e-40, -1e-45],
        np.float32,
    )
    return np.concatenate([random, bits, ties, -ties, special])


def test_bf16_rounding_is_ml_dtypes_bfloat16():
    x = _values()
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.bfloat16)
    got = P.bf16_bits(x)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want.view(np.uint16)[~nan])
    assert np.isnan(P.from_bf16_bits(got[nan])).all()
    assert np.array_equal(P.round_bf16(x)[~nan], want.astype(np.float32)[~nan])


def test_tf32_rounding_keeps_ten_mantissa_bits_to_nearest_ties_away():
    x = _values()
    got = P.round_tf32(x)
    finite = np.isfinite(x)
    # the reference: exact arithmetic on the magnitude, in float64
    m, e = np.frexp(np.abs(x[finite]).astype(np.float64))
    scaled = m * 2.0**11  # 11 significant bits: TF32's 10 stored and the implicit one
    want = np.sign(x[finite]) * np.ldexp(np.floor(scaled + 0.5), e - 11)
    normal = np.abs(x[finite]) >= np.finfo(np.float32).tiny
    overflow = np.abs(want) > np.finfo(np.float32).max
    keep = normal & ~overflow
    assert np.array_equal(got[finite][keep], want[keep].astype(np.float32))
    assert np.array_equal(got[~finite], x[~finite], equal_nan=True)
    assert (got.view(np.uint32)[finite] & np.uint32(0x1FFF) == 0).all()


@pytest.mark.parametrize("policy", ["f32", "tf32", "bf16"])
def test_operand_follows_the_policy_and_leaves_float64_alone(policy):
    x = np.float32(1) + np.arange(8, dtype=np.float32) * np.float32(2**-12)
    with P.using(policy):
        got = P.operand(x)
        assert P.operand(x.astype(np.float64)).dtype == np.float64
    want = {"f32": x, "tf32": P.round_tf32(x), "bf16": P.round_bf16(x)}[policy]
    assert np.array_equal(got, want) and P.compute() == "f32"


def test_an_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="precision.compute must be one of f32, tf32, bf16"):
        P.use("fp8")
