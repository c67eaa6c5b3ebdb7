"""The fused causal attention of ``attention.cu`` run on the CPU, through the host build of
``test_cuda_on_host.py`` (each block as 256 host threads meeting at every ``__syncthreads``),
and compared with an independent NumPy reference in float64: the output, each row's
log-sum-exp, and dq, dk, dv, for several heads, a sequence shorter than, equal to and not a
multiple of the tile, and head dimensions 16, 32 and 64. Two runs give the same bits."""

from __future__ import annotations

import numpy as np
import pytest
from test_cuda_on_host import CXX, build  # noqa: F401 - build is a fixture

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler on PATH")

# q, k, v are views of one projection (n, t, 3, h, hd); o and do are (n, t, h, hd); dq, dk, dv
# go back into the projection's layout, as the layer keeps them.
MAIN = """
using T = {ctype};
auto head = take<long long>(4);
long long n = head[0], h = head[1], t = head[2], hd = head[3], d = h * hd;
T scale = take<T>(1)[0];
long long tiles = (t + Tile<T>::R - 1) / Tile<T>::R, blocks = n * h * tiles;
auto qkv = take<T>(n * t * 3 * d); auto dout = take<T>(n * t * d);
std::vector<T> o(n * t * d), lse(n * h * t), delta(n * h * t), dqkv(n * t * 3 * d);
const T *q = qkv.data(), *k = q + d, *v = q + 2 * d;
run_blocks(blocks, [&] {{ attn_fwd_{suf}(q, k, v, 3 * d, o.data(), d, lse.data(), n, h, t, hd,
                                       scale); }});
run_blocks(1, [&] {{ attn_bwd_delta_{suf}(dout.data(), o.data(), d, delta.data(), n, h, t, hd); }});
run_blocks(blocks, [&] {{ attn_bwd_dq_{suf}(q, k, v, 3 * d, dout.data(), d, lse.data(),
                                          delta.data(), dqkv.data(), 3 * d, n, h, t, hd,
                                          scale); }});
run_blocks(blocks, [&] {{ attn_bwd_dkv_{suf}(q, k, v, 3 * d, dout.data(), d, lse.data(),
                                           delta.data(), dqkv.data() + d, dqkv.data() + 2 * d,
                                           3 * d, n, h, t, hd, scale); }});
give(o, n * t * d); give(lse, n * h * t); give(dqkv, n * t * 3 * d); return 0;
"""
SUFFIX = {np.float32: ("float", "f32"), np.float64: ("double", "f64")}


def run_attention(build, qkv: np.ndarray, dout: np.ndarray, scale: float):  # noqa: F811
    """``(o, lse, dq, dk, dv)`` of the host-built kernels, shaped as the reference's."""
    n, t, _, h, hd = qkv.shape
    ctype, suf = SUFFIX[qkv.dtype.type]
    host = build("attention.cu", MAIN.format(ctype=ctype, suf=suf), blocks=True)
    raw = host(np.array([n, h, t, hd], np.int64), np.array([scale], qkv.dtype), qkv, dout)
    o, lse, dqkv = np.split(np.frombuffer(raw, qkv.dtype), np.cumsum([n * t * h * hd, n * h * t]))
    dqkv = dqkv.reshape(n, t, 3, h, hd).transpose(2, 0, 3, 1, 4)  # (3, n, h, t, hd)
    return o.reshape(n, t, h, hd).transpose(0, 2, 1, 3), lse.reshape(n, h, t), *dqkv


def reference(qkv: np.ndarray, dout: np.ndarray, scale: float):
    """Causal attention written out with the T x T matrices, in float64."""
    q, k, v = qkv.astype(np.float64).transpose(2, 0, 3, 1, 4)  # each (n, h, t, hd)
    do = dout.astype(np.float64).transpose(0, 2, 1, 3)
    t = q.shape[2]
    s = scale * q @ k.transpose(0, 1, 3, 2)
    s[..., np.triu_indices(t, 1)[0], np.triu_indices(t, 1)[1]] = -np.inf
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    p = e / e.sum(-1, keepdims=True)
    lse = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
    dp = do @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return (
        p @ v,
        lse,
        scale * ds @ k,
        scale * ds.transpose(0, 1, 3, 2) @ q,
        p.transpose(0, 1, 3, 2) @ do,
    )


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference over the largest magnitude (the GPU parity tests' measure)."""
    return float(np.abs(got - want).max() / (np.abs(want).max() or 1.0))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    ("n", "h", "t", "hd"),
    [(1, 1, 1, 16), (2, 3, 37, 32), (1, 2, 70, 64), (1, 2, 32, 16)],  # T = 1, ragged, one tile
)
def test_fused_attention_matches_numpy_and_repeats_its_bits(build, dtype, n, h, t, hd):  # noqa: F811
    rng = np.random.default_rng(t * hd)
    qkv = (rng.standard_normal((n, t, 3, h, hd)) * 1.5).astype(dtype)
    dout = rng.standard_normal((n, t, h, hd)).astype(dtype)
    scale = 1.0 / np.sqrt(hd)
    got = run_attention(build, qkv, dout, scale)
    want = reference(qkv, dout, scale)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want, strict=True):
        assert _relative_error(g, w) < tol, (name, _relative_error(g, w))
    again = run_attention(build, qkv, dout, scale)
    for g, a in zip(got, again, strict=True):
        assert g.tobytes() == a.tobytes()  # no atomics, every sum in a fixed order
