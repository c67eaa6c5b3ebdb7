"""What crosses between roles under ``topology.wire`` and the blocks of a group summed by
hosts (:mod:`actors.exchange.wire`)."""

from __future__ import annotations

import numpy as np

from raysinga.actors.common.buffers import Layout
from raysinga.actors.exchange.squeeze import Squeezed, unsqueeze
from raysinga.actors.exchange.wire import (
    TAIL_BYTES,
    apply_delta,
    blocks,
    cut,
    decode,
    delta_frame,
    deltas,
    encode,
    frame,
    parts_of,
    rounded,
    squeezed,
    wire_bytes,
)
from raysinga.kernels.precision import round_bf16


def arrays(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for n in (5, 1, 300)]


def test_float32_crosses_as_it_is():
    a = arrays()
    got = decode(encode(a, "f32"))
    assert all(x is y for x, y in zip(got, a, strict=True))  # no copy of ours


def test_bf16_rounds_to_nearest_even_and_comes_back_exactly_as_float32():
    a = arrays()
    a[0][:3] = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, np.nan]  # two ties, and a NaN
    words = encode(a, "bf16")
    assert [w.dtype for w in words] == [np.uint16] * 3
    got = decode(words)
    assert all(g.dtype == np.float32 for g in got)
    assert got[0][0] == 1.0 and got[0][1] == 1.0 + 4 * 2.0**-8  # ties to even
    assert np.isnan(got[0][2])
    for g, x in zip(got, a, strict=True):
        np.testing.assert_array_equal(g, round_bf16(x))


def test_a_reader_beside_the_server_rounds_as_one_across_a_link():
    a = arrays(1)
    names = {f"p{i}": x for i, x in enumerate(a)}
    assert rounded(names, "f32") is names
    near = rounded(names, "bf16")
    far = decode(encode(a, "bf16"))
    for i, x in enumerate(far):
        assert near[f"p{i}"].tobytes() == x.tobytes()


def test_bytes_on_the_wire_and_blocks():
    lay = Layout.of({"a": ((10,), "float32"), "b": ((3,), "float32")})
    assert wire_bytes(lay, "f32") == 52 and wire_bytes(lay, "bf16") == 26
    assert blocks(4, 2) == [[0, 1], [2, 3]]
    assert blocks(3, 1) == [[0], [1], [2]]


def test_the_part_sent_last_is_halved_down_to_the_tail_size():
    lay = Layout.of({"a": ((130_000,), "float32"), "b": ((30_000,), "float32")})
    parts = parts_of(lay, 160_000)  # 640,000 bytes: 4 parts of 160,000 before the halving
    sizes = [4 * sum(b - a for _, a, b in part) for part in parts]
    assert sizes == [160_000] * 3 + [80_000, 40_000, 40_000]  # in the order they are sent
    assert min(sizes) >= TAIL_BYTES
    flat = [(name, i) for part in parts[::-1] for name, a, b in part for i in range(a, b)]
    assert flat == [(e.name, i) for e in lay.entries for i in range(int(np.prod(e.shape)))]
    assert parts[-1] == [("a", 0, 10_000)]  # the layout's start, sent last


def test_parts_cut_a_servers_slices_into_equal_parts_from_the_last_array_on():
    lay = Layout.of({"a": ((1000,), "float32"), "b": ((3,), "float32"), "c": ((10, 50), "float32")})
    parts = parts_of(lay, 1600)  # 400 float32 each at most: 1503 elements in 4 parts
    assert len(parts) == 4
    flat = [(name, i) for part in parts[::-1] for name, a, b in part for i in range(a, b)]
    want = [(e.name, i) for e in lay.entries for i in range(int(np.prod(e.shape)))]
    assert flat == want  # every element once; the parts from the layout's end, each in order
    assert parts[0] == [("c", 124, 500)] and parts[-1] == [("a", 0, 375)]
    counts = [sum(b - a for _, a, b in part) for part in parts]
    assert max(counts) - min(counts) <= 1 and max(counts) <= 400
    assert parts_of(lay, 1 << 20) == [[("a", 0, 1000), ("b", 0, 3), ("c", 0, 500)]]
    assert parts_of(Layout.of({}), 1600) == [[]]
    arrays = {
        e.name: np.arange(np.prod(e.shape), dtype=np.float32).reshape(e.shape) for e in lay.entries
    }
    got = np.concatenate([x for part in parts[::-1] for x in cut(arrays, part)])
    assert got.tobytes() == np.concatenate([v.reshape(-1) for v in arrays.values()]).tobytes()


def test_which_wires_compress_the_sums_and_which_the_values_differences():
    """``*+zstd`` compresses every array that crosses; ``*+delta`` only the values'
    differences: its sums cross as the words they are."""
    a = arrays()
    for wire, sums, diffs in [
        ("f32", False, False),
        ("bf16", False, False),
        ("f32+zstd", True, True),
        ("bf16+zstd", True, True),
        ("f32+delta", False, True),
        ("bf16+delta", False, True),
    ]:
        assert (squeezed(wire), deltas(wire)) == (sums, diffs), wire
        framed = frame(a, wire)
        assert all(isinstance(f, Squeezed) == sums for f in framed), wire
        if not sums:
            words = encode(a, wire)
            assert [f.tobytes() for f in framed] == [w.tobytes() for w in words], wire


def test_a_values_difference_brings_a_reader_to_every_bit_of_the_new_values():
    """A difference (exclusive or of the words) of values one SGD step apart compresses to
    under 0.7 of their bytes, and the reader's old words with it make the new ones exactly."""
    rng = np.random.default_rng(1)
    old = (rng.standard_normal(1 << 16) * 0.05).astype(np.float32)
    new = (old - np.float32(0.01) * rng.standard_normal(old.size).astype(np.float32) * 1e-2).astype(
        np.float32
    )
    for wire in ("f32+delta", "bf16+delta"):
        (d,) = delta_frame([new], [old], wire)
        words = encode([new], wire)[0]
        assert d.nbytes < 0.7 * words.nbytes, wire
        dst = np.empty_like(old)
        base = decode(encode([old], wire))[0]
        apply_delta(dst, unsqueeze(d.payload, d.dtype, d.shape), base)
        assert dst.tobytes() == decode([words])[0].tobytes(), wire
