"""Gradient sums in a fixed order, the global norm and clipping."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from raysinga.optim.grads import clip_grad_norm, global_grad_norm, sum_into


def test_sum_into_adds_in_the_given_order() -> None:
    # 1 + 1e-8 rounds away in float32, so (1e8 + 1) - 1e8 differs with the order of the terms
    parts = [np.full(3, v, np.float32) for v in (1e8, 1.0, -1e8)]
    out = np.empty(3, np.float32)
    sum_into(out, parts)
    np.testing.assert_array_equal(out, (parts[0] + parts[1]) + parts[2])
    sum_into(out, [parts[0], parts[2], parts[1]])
    np.testing.assert_array_equal(out, np.ones(3, np.float32))
    sum_into(out, parts[1:2])
    np.testing.assert_array_equal(out, parts[1])
    assert not np.shares_memory(out, parts[1])


@pytest.mark.parametrize(("dtype", "rtol"), [(np.float64, 1e-12), (np.float32, 1e-6)])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_matches_torch(dtype, rtol: float, max_norm: float) -> None:
    rng = np.random.default_rng(2)
    grads = {k: rng.standard_normal(s).astype(dtype) for k, s in [("b", (7,)), ("a", (3, 4))]}
    before = copy.deepcopy(grads)
    ts = [torch.zeros(g.shape, dtype=torch.from_numpy(g).dtype) for g in grads.values()]
    for t, g in zip(ts, grads.values(), strict=True):
        t.grad = torch.tensor(g)
    expected = torch.nn.utils.clip_grad_norm_(ts, max_norm).item()
    norm = clip_grad_norm(grads, max_norm)
    assert norm == pytest.approx(expected, rel=rtol)
    for t, (k, g) in zip(ts, grads.items(), strict=True):
        assert g.dtype == dtype
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=rtol, err_msg=k)
    if max_norm > norm:
        for k in grads:
            np.testing.assert_array_equal(grads[k], before[k])


def test_global_grad_norm_is_float64_and_order_independent() -> None:
    rng = np.random.default_rng(3)
    grads = {f"g{i}": rng.standard_normal(100).astype(np.float32) for i in range(5)}
    reverse = dict(reversed(list(grads.items())))
    exact = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads.values()))
    assert global_grad_norm(grads) == global_grad_norm(reverse)
    assert global_grad_norm(grads) == pytest.approx(exact, rel=1e-14)
    assert global_grad_norm({}) == 0.0
    with pytest.raises(ValueError, match="max_norm must be a number > 0"):
        clip_grad_norm(grads, 0.0)
