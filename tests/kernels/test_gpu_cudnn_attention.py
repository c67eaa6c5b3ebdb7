"""cuDNN's flash attention for bf16 runs (``kernels/gpu_cudnn_attention.py``): under
``precision.compute: bf16`` the attention layer on CuPy takes it and matches the same layer on
NumPy with its products' operands rounded to bf16 (the CPU's emulation), to bf16's precision;
two runs give the same bits (cuDNN's deterministic backward); a head width cuDNN does not take
keeps the products path."""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu_attention import _run

from raysinga import kernels
from raysinga.kernels import precision

pytestmark = pytest.mark.gpu  # (skipped without a usable GPU: tests/conftest.py)


@pytest.mark.parametrize(
    ("n", "t", "dim", "heads", "fused"),
    [(2, 1, 64, 4, True), (3, 37, 96, 3, True), (2, 256, 768, 12, True), (2, 40, 192, 2, False)],
)  # head dims 16, 32, 64 (T = 1, ragged, gpt_small's); 96 is not one cuDNN's kernels take
def test_bf16_attention_on_the_gpu_matches_the_emulated_products(n, t, dim, heads, fused):
    from raysinga.kernels import gpu_cudnn_attention  # noqa: PLC0415
    from raysinga.nn.kinds import LAYERS  # noqa: PLC0415

    if fused and gpu_cudnn_attention.frontend_error():
        pytest.fail(f"cuDNN's frontend is part of raysinga[gpu]: {gpu_cudnn_attention.refusals()}")
    cp = kernels.cupy_module()
    rng = np.random.default_rng(t)
    layer = LAYERS["attention"]("L", heads=heads)
    layer.build((t, dim))
    shapes = layer.param_shapes()
    params = {k: (rng.normal(size=s) * 0.1).astype(np.float32) for k, s in shapes.items()}
    x, r = (rng.normal(size=(n, t, dim)).astype(np.float32) for _ in range(2))
    with precision.using("bf16"):
        want = _run(layer, params, x, r.copy())
        dev = {k: cp.asarray(v) for k, v in params.items()}
        got = _run(layer, dev, cp.asarray(x), cp.asarray(r))
        assert layer._fused == fused, gpu_cudnn_attention.refusals()
        again = _run(layer, dev, cp.asarray(x), cp.asarray(r))
    for g, a, w in zip(got, again, want, strict=True):
        assert g.tobytes() == a.tobytes()  # deterministic
        err = np.abs(g - w).max() / (np.abs(w).max() or 1.0)
        assert err < 3e-2, err  # bf16 operands: 8 bits of mantissa, sums in float32
