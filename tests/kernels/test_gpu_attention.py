"""The fused attention on a GPU (``kernels/gpu_attention.py``): the attention layer on CuPy takes
the fused pass and matches the same layer on NumPy (which multiplies out the T x T scores) in
float32 and float64, gives the same bits twice, and heads wider than the kernels take keep the
products path."""

from __future__ import annotations

import numpy as np
import pytest

from raysinga import kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not kernels.gpu_available(),
        reason=f"no usable GPU: {kernels.gpu_unavailable_reason()}",
    ),
]


def _run(layer, params, x, r):
    from raysinga.nn.layers import StepContext  # noqa: PLC0415

    y = layer.forward(params, {}, x, StepContext(train=True))
    dx, grads = layer.backward(r)
    return [kernels.to_numpy(a) for a in (y, dx, *(grads[k] for k in sorted(grads)))]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    ("n", "t", "dim", "heads", "fused"),
    [(2, 1, 64, 4, True), (3, 37, 96, 3, True), (2, 256, 768, 12, True), (2, 40, 256, 2, False)],
)  # head dims 16, 32, 64 (T = 1, ragged, gpt_small's), and 128: past the kernels' tiles
def test_the_attention_layer_on_the_gpu_matches_numpy(n, t, dim, heads, fused, dtype):
    from raysinga.nn.kinds import LAYERS  # noqa: PLC0415

    cp = kernels.cupy_module()
    rng = np.random.default_rng(t)
    layer = LAYERS["attention"]("L", heads=heads)
    layer.build((t, dim))
    params = {k: (rng.normal(size=s) * 0.1).astype(dtype) for k, s in layer.param_shapes().items()}
    x, r = (rng.normal(size=(n, t, dim)).astype(dtype) for _ in range(2))
    want = _run(layer, params, x, r.copy())
    dev = {k: cp.asarray(v) for k, v in params.items()}
    got = _run(layer, dev, cp.asarray(x), cp.asarray(r))
    assert layer._fused == fused
    again = _run(layer, dev, cp.asarray(x), cp.asarray(r))
    # Each side is within ~3e-6 of float64 in float32 at T = 256 (the CPU layer measured so).
    tol = 2e-5 if dtype == np.float32 else 1e-12
    for g, a, w in zip(got, again, want, strict=True):
        assert g.tobytes() == a.tobytes()  # deterministic: no atomics
        err = np.abs(g - w).max() / (np.abs(w).max() or 1.0)
        assert err < tol, err
