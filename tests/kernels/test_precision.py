"""The compute precisions' rounding (kernels.precision: bfloat16 round to nearest, ties to even;
TF32 ties away) against references written from their definitions, over random values, exact
ties, the largest finite values, subnormals, infinities and NaN; and the bfloat16 casts against
``ml_dtypes``' over every upper half of a float32 word with each kind of lower half."""

from __future__ import annotations

import numpy as np
import pytest

from raysinga.kernels import precision as P


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


def _bf16_reference(x: np.ndarray) -> np.ndarray:
    """Round to nearest even on the bits: add 0x7FFF and the lowest kept bit, keep the top 16
    (an expression of our own, independent of the library cast under test)."""
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def test_bf16_rounding_is_to_nearest_even():
    x = _values()
    got = P.bf16_bits(x)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], _bf16_reference(x)[~nan])
    quiet = (x[nan].view(np.uint32) >> 16 | 0x40).astype(np.uint16)  # as the CUDA kernels
    assert np.array_equal(got[nan], quiet)
    back = P.from_bf16_bits(_bf16_reference(x)).view(np.uint32)
    assert np.array_equal(back, _bf16_reference(x).astype(np.uint32) << 16)  # exact
    assert np.array_equal(P.round_bf16(x)[~nan], P.from_bf16_bits(got)[~nan])


def test_bf16_casts_give_the_bits_of_ml_dtypes_for_every_upper_half():
    """Every 16-bit upper half (every sign, exponent and kept mantissa: NaN, infinities and
    subnormals included) with the lower halves where rounding turns: 0, 1, just under, at and
    just over the tie, and the largest; and every bfloat16 word back to float32."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF], np.uint32)
    words = (high[:, None] | lows[None, :]).reshape(-1)
    x = words.view(np.float32)
    with np.errstate(invalid="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)  # ml_dtypes makes every NaN one word; the CUDA kernels keep its top
    want[nan] = (words[nan] >> np.uint32(16) | np.uint32(0x40)).astype(np.uint16)
    assert np.array_equal(P.bf16_bits(x), want)
    assert np.array_equal(P.bf16_bits(x.reshape(-1, 7)), want.reshape(-1, 7))  # any shape
    back = np.arange(1 << 16, dtype=np.uint16)
    wanted = back.view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(P.from_bf16_bits(back).view(np.uint32), wanted.view(np.uint32))
    strided = np.arange(64, dtype=np.float32).reshape(8, 8)[:, ::2]  # not contiguous
    assert np.array_equal(P.bf16_bits(strided), P.bf16_bits(strided.copy()))


def test_words_of_is_a_new_c_contiguous_array_of_the_bf16_words():
    x = np.arange(12, dtype=np.float32).reshape(3, 4).T * np.float32(1.01)  # Fortran order
    words = P.words_of(x)
    assert words.dtype == np.uint16 and words.flags.c_contiguous and words.shape == (4, 3)
    assert (words == P.bf16_bits(np.ascontiguousarray(x)).reshape(4, 3)).all()


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


def test_a_weights_copy_serves_its_views_and_nothing_else():
    """The copies of a run's weights: one for each float32 array of two or more axes; a view of
    a weight (its transpose, a slice, a column) gets the same view of the copy, so a matrix
    product's operand reads the rounded weight; anything else, or a weight changed without the
    copy rewritten, is not the copy's business (operand rounds it, or reads the stale copy)."""
    rng = np.random.default_rng(3)
    params = {
        "w": rng.standard_normal((6, 5)).astype(np.float32),
        "b": rng.standard_normal(5).astype(np.float32),  # one axis: no copy
        "t": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "d": rng.standard_normal((3, 3)),  # float64: no copy
    }
    copies = P.WeightCopies(params)
    assert set(copies.words) == {"w", "t"}
    w, t = params["w"], params["t"]
    for view in (w, w.T, w[1:4], w[:, 2:], w[::2, 1::2], t[1], t[:, 1:].transpose(0, 2, 1)):
        words = copies.view_of(view)
        assert words is not None and words.shape == view.shape
        assert np.array_equal(words, P.bf16_bits(view).reshape(view.shape))
    for other in (params["b"], params["d"], w.copy(), rng.standard_normal((6, 5)).astype("f4")):
        assert copies.view_of(other) is None
    with P.using("bf16"), P.copies_in_use(copies):
        assert np.array_equal(P.operand(w.T), P.round_bf16(w.T))
        w[0, 0] += 1.0  # changed behind the copy's back: whoever changes a weight rewrites it
        assert P.operand(w)[0, 0] != P.round_bf16(w)[0, 0]
        copies.refresh(["w"])
        assert np.array_equal(P.operand(w), P.round_bf16(w))
    with P.using("tf32"), P.copies_in_use(copies):
        assert P.copy_of(w) is None  # copies are bf16's


def test_the_optimizer_writes_the_copy_of_each_weight_it_updates():
    """A weight with a copy has it rewritten by the update (a pass of its own on the CPU; in
    the fused kernel on a GPU); one without is updated as before."""
    from raysinga.optim.optimizers import make_optimizer

    rng = np.random.default_rng(4)
    for spec in ({"name": "sgd", "lr": 0.1, "momentum": 0.9}, {"name": "rmsprop", "lr": 0.01}):
        opt = make_optimizer(spec)
        w = rng.standard_normal((4, 3)).astype(np.float32)
        copies = P.WeightCopies({"w": w})
        opt.bf16_copies = copies.words
        for step in range(3):
            opt.update(step, "w", w, rng.standard_normal((4, 3)).astype(np.float32))
            assert np.array_equal(copies.words["w"], P.bf16_bits(w).reshape(w.shape)), spec
