"""Matrix products through raysinga's own cuBLAS handle (kernels.gpu_blas) and the pieces of a
recorded step (kernels.gpu_graph), on a GPU: products of every view a layer hands over match
CuPy's, a product recorded in a CUDA graph replays on new inputs, and step values, staged inputs
and the read-back ring carry each replay's own values."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy  # noqa: PLC0415 - only where a GPU is usable (conftest skips otherwise)

    return cupy


def _views(cp, rng, dtype):
    a = lambda *s: cp.asarray(rng.normal(size=s).astype(dtype))  # noqa: E731
    n, t, h, hd = 2, 5, 3, 4
    proj = a(n, t, 3, h, hd)
    q, k, v = (proj[:, :, j].transpose(0, 2, 1, 3) for j in range(3))
    seq = a(6, 7, 3)
    return [
        (a(5, 3), a(3, 4)),
        (a(3, 5).T, a(3, 4)),
        (a(5, 3), a(4, 3).T),
        (seq[:, 2], a(3, 4)),
        (a(2, 3, 5, 4), a(4, 6)),
        (a(2, 3, 5, 4), a(2, 3, 4, 6)),
        (q, k.transpose(0, 1, 3, 2)),
        (a(n, h, t, t), v),
        (a(6, 8)[:, ::2], a(4, 3)),  # copied first
        (a(64, 300), a(300, 200)),
    ]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_products_match_cupys(cp, dtype):
    from raysinga.kernels import gpu_blas  # noqa: PLC0415

    rng = np.random.default_rng(0)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for a, b in _views(cp, rng, dtype):
        got = gpu_blas.matmul(a, b)
        np.testing.assert_allclose(cp.asnumpy(got), cp.asnumpy(cp.matmul(a, b)), rtol=tol, atol=tol)
    # into a strided out, as attention's merged heads
    probs, v = _views(cp, rng, dtype)[7]
    merged = cp.full((2, 5, 3, 4), np.nan, dtype)
    gpu_blas.matmul(probs, v, out=merged.transpose(0, 2, 1, 3))
    want = cp.matmul(probs, v).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(cp.asnumpy(merged), cp.asnumpy(want), rtol=tol, atol=tol)


def test_a_recorded_product_replays_on_new_inputs_with_the_same_bits(cp):
    from raysinga.kernels import gpu_blas  # noqa: PLC0415
    from raysinga.kernels.gpu_graph import StepGraph  # noqa: PLC0415

    rng = np.random.default_rng(1)
    x = cp.asarray(rng.normal(size=(256, 128)).astype(np.float32))
    w = cp.asarray(rng.normal(size=(128, 64)).astype(np.float32))
    graph = StepGraph()
    eager = graph.run(lambda: gpu_blas.matmul(x, w.T.T) * 2)
    graph.record(lambda: gpu_blas.matmul(x, w.T.T) * 2)
    graph.replay()
    graph.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(graph.kept), cp.asnumpy(eager))
    x[...] = cp.asarray(rng.normal(size=(256, 128)).astype(np.float32))
    cp.cuda.get_current_stream().synchronize()  # the graph's stream does not wait for this one
    graph.replay()
    graph.synchronize()
    again = gpu_blas.matmul(x, w) * 2
    np.testing.assert_array_equal(cp.asnumpy(graph.kept), cp.asnumpy(again))


def test_step_values_staging_and_readback_carry_each_replays_own_values(cp):
    from raysinga.kernels.gpu_graph import Readback, Staging, StepGraph, StepValues  # noqa: PLC0415

    graph = StepGraph()
    values = StepValues()
    staging = Staging([np.zeros((4,), np.float32)])
    out = cp.zeros(2, np.float64)

    def body(buf):
        scale = values.floats("scale", 1, lambda step, ctx: [step * 10.0])
        out[0] = (buf.astype(np.float64) * scale).sum()
        out[1] = scale[0]

    ring = Readback(width=2, depth=8)
    with graph.stream:
        values.refresh(1, None)
        (buf,) = staging.load([np.full(4, 1.0, np.float32)])
    graph.run(lambda: body(buf))
    with graph.stream:
        ring.push(1, out)
    graph.record(lambda: body(buf))
    for step in range(2, 6):
        with graph.stream:
            values.refresh(step, None)
            staging.load([np.full(4, float(step), np.float32)])
            graph.replay()
            ring.push(step, out)
    got = ring.drain()
    assert [s for s, _ in got] == [1, 2, 3, 4, 5]
    for step, (total, scale) in got:
        assert scale == step * 10.0 and total == 4 * step * step * 10.0


def test_bf16_products_read_the_weights_copies_with_the_same_bits(cp):
    """Under bf16 a product whose operand is (a view of) a weight with a copy reads the copy's
    view in place of casting it, and gives the bits of the cast; the fused optimizer kernels
    write the copy as they update the weight. Equal bits are what cuBLAS promises for the same
    call on the same GPU and library, no more: the cast of a transposed weight is laid out as
    the copy's transposed view, so that both make one call (a contiguous cast was another, with
    no promise of the same sums)."""
    from raysinga.kernels import gpu_blas
    from raysinga.kernels import precision as P
    from raysinga.optim.optimizers import make_optimizer

    rng = np.random.default_rng(5)
    w = cp.asarray(rng.normal(size=(48, 32)).astype(np.float32))
    x = cp.asarray(rng.normal(size=(16, 48)).astype(np.float32))
    dy = cp.asarray(rng.normal(size=(16, 32)).astype(np.float32))
    copies = P.WeightCopies({"w": w})
    with P.using("bf16"):
        cast = [gpu_blas.matmul(x, w), gpu_blas.matmul(dy, w.T), gpu_blas.matmul(x[:, :40], w[:40])]
        with P.copies_in_use(copies):
            assert P.copy_of(w.T) is not None
            read = [gpu_blas.matmul(x, w), gpu_blas.matmul(dy, w.T)]
            read.append(gpu_blas.matmul(x[:, :40], w[:40]))
    for a, b in zip(cast, read, strict=True):
        assert a.tobytes() == b.tobytes()
    for spec in ({"name": "sgd", "lr": 0.1, "momentum": 0.9}, {"name": "adamw", "lr": 0.01}):
        opt = make_optimizer(spec)
        opt.bf16_copies = copies.words
        opt.update(0, "w", w, cp.asarray(rng.normal(size=(48, 32)).astype(np.float32)))
        want = P.bf16_bits(cp.asnumpy(w)).reshape(w.shape)
        assert np.array_equal(cp.asnumpy(copies.words["w"]), want), spec


def test_tf32_products_agree_with_the_cpus_emulation_to_tf32s_rounding_only(cp):
    """The CPU emulates TF32 by rounding the operands to nearest (ties away). cuBLAS does not
    say how its TF32 mode converts them (rounded or cut) nor in what order it sums: a GPU
    product is held to the emulation within the operands' conversion, not bit for bit."""
    from raysinga.kernels import gpu_blas
    from raysinga.kernels import precision as P

    rng = np.random.default_rng(9)
    x = rng.normal(size=(64, 256)).astype(np.float32)
    w = rng.normal(size=(256, 48)).astype(np.float32)
    with P.using("tf32"):
        got = cp.asnumpy(gpu_blas.matmul(cp.asarray(x), cp.asarray(w))).astype(np.float64)
    emulated = P.round_tf32(x).astype(np.float64) @ P.round_tf32(w).astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    # each operand within 2^-10 of itself (cut) and of its rounding, plus float32 sums
    assert np.all(np.abs(got - emulated) <= scale * (4 * 2.0**-10 + 256 * 2.0**-23))
    exact = x.astype(np.float64) @ w.astype(np.float64)
    # TF32 it was: float32 operands would be off by some 2^-24 of the scale, not 2^-16
    assert np.max(np.abs(got - exact) / scale) > 2.0**-16
