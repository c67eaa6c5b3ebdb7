"""Model partitioning (raysinga/nn/partition.py): each split layer kind, computed by 2 and 3
parts that exchange through :class:`LocalExchange` (one thread a part), gives the unsplit
layer's outputs and gradients to float rounding, forward and backward; the parts' parameters
are the whole one's ranges and join back to it bit for bit; what cannot be split is refused,
naming the layer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from raysinga.nn.layers import Dense, Dropout, ReLU, StepContext
from raysinga.nn.model import ModelSpec, Net
from raysinga.nn.partition import (
    LocalExchange,
    check_plan,
    join,
    join_params,
    part_net,
    part_of,
    split,
    split_params,
)
from raysinga.nn.sequence import Attention, Embedding

CTX = StepContext(train=True, seed=3, step=7)
TOL = {"rtol": 2e-5, "atol": 2e-6}  # float32: the products' terms added in another order


def built(layer, in_shape):
    layer.build(in_shape)
    return layer


def params_of(layer, rng):
    return {
        k: rng.standard_normal(s).astype(np.float32) * 0.3 for k, s in layer.param_shapes().items()
    }


def on_parts(k: int, work):
    """``work(ex)`` on each of ``k`` parts at once, each in its own thread: what each gave."""
    exchanges = LocalExchange.group(k, timeout_s=30)
    with ThreadPoolExecutor(k) as pool:
        return list(pool.map(work, exchanges))


def close(a, b):
    np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.parametrize("k", [2, 3])
def test_a_dense_pair_split_by_columns_then_rows_gives_the_unsplit_pairs_values(k):
    rng = np.random.default_rng(k)
    first = built(Dense("fc1", units=12, activation="relu"), (10,))
    second = built(Dense("fc2", units=5, activation="tanh"), (12,))
    p1, p2 = params_of(first, rng), params_of(second, rng)
    x = rng.standard_normal((4, 10)).astype(np.float32)
    dy = rng.standard_normal((4, 5)).astype(np.float32)
    # unsplit
    y = second.forward(p2, {}, first.forward(p1, {}, x, CTX), CTX)
    dh, g2 = second.backward(dy)
    dx, g1 = first.backward(dh)
    cols, rows = split(first, "columns", p1, k), split(second, "rows", p2, k)

    def work(ex):
        a, b = part_of(first, "columns", ex), part_of(second, "rows", ex)
        out = b.forward(rows[ex.part], {}, a.forward(cols[ex.part], {}, x, CTX), CTX)
        dh_part, gb = b.backward(dy)
        dx_part, ga = a.backward(dh_part)
        return out, dx_part, ga, gb

    got = on_parts(k, work)
    for out, dx_part, _, _ in got:
        close(out, y)
        close(dx_part, dx)
    g1_joined = join(first, "columns", [ga for _, _, ga, _ in got])
    g2_joined = join(second, "rows", [gb for _, _, _, gb in got])
    for name in ("W", "b"):
        close(g1_joined[name], g1[name])
        close(g2_joined[name], g2[name])
    # every part computes the same sums: the same bits on every part
    assert all(out.tobytes() == got[0][0].tobytes() for out, *_ in got)


@pytest.mark.parametrize("k", [2, 3])
def test_attention_split_by_heads_gives_the_unsplit_layers_values(k):
    rng = np.random.default_rng(10 + k)
    layer = built(Attention("attn", heads=6), (5, 12))
    p = params_of(layer, rng)
    x = rng.standard_normal((2, 5, 12)).astype(np.float32)
    dy = rng.standard_normal((2, 5, 12)).astype(np.float32)
    y = layer.forward(p, {}, x, CTX)
    dx, g = layer.backward(dy)
    shares = split(layer, "heads", p, k)

    def work(ex):
        part = part_of(layer, "heads", ex)
        out = part.forward(shares[ex.part], {}, x, CTX)
        return (out, *part.backward(dy))

    got = on_parts(k, work)
    for out, dx_part, _ in got:
        close(out, y)
        close(dx_part, dx)
    joined = join(layer, "heads", [gp for _, _, gp in got])
    for name in g:
        close(joined[name], g[name])


@pytest.mark.parametrize("by", ["vocab", "dim"])
@pytest.mark.parametrize("k", [2, 3])
def test_an_embedding_split_by_vocabulary_or_dimension_gives_the_unsplit_layers_values(k, by):
    rng = np.random.default_rng(20 + k)
    layer = built(Embedding("emb", vocab=12, dim=6), (7,))
    p = params_of(layer, rng)
    x = rng.integers(0, 12, size=(3, 7))
    dy = rng.standard_normal((3, 7, 6)).astype(np.float32)
    y = layer.forward(p, {}, x, CTX)
    _, g = layer.backward(dy)
    shares = split(layer, by, p, k)

    def work(ex):
        part = part_of(layer, by, ex)
        out = part.forward(shares[ex.part], {}, x, CTX)
        return out, part.backward(dy)[1]

    got = on_parts(k, work)
    for out, _ in got:
        close(out, y)
    close(join(layer, by, [gp for _, gp in got])["W"], g["W"])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_parts_parameters_join_back_to_the_whole_bit_for_bit(k):
    rng = np.random.default_rng(30)
    cases = [
        (built(Dense("c", units=6), (9,)), "columns"),
        (built(Dense("r", units=4), (6,)), "rows"),
        (built(Attention("a", heads=6), (4, 12)), "heads"),
        (built(Embedding("e", vocab=12, dim=6), (4,)), "vocab"),
        (built(Embedding("e", vocab=12, dim=6), (4,)), "dim"),
    ]
    for layer, by in cases:
        p = params_of(layer, rng)
        parts = split(layer, by, p, k)
        assert len(parts) == k
        whole = join(layer, by, parts)
        assert sorted(whole) == sorted(p)
        for name, a in p.items():
            assert whole[name].tobytes() == a.tobytes(), (layer.name, by, name)


def test_what_cannot_be_split_is_refused_naming_the_layer():
    fc1 = built(Dense("fc1", units=10, activation="relu"), (8,))
    act = built(ReLU("act"), (10,))
    drop = built(Dropout("drop", rate=0.1), (10,))
    fc2 = built(Dense("fc2", units=4), (10,))
    attn = built(Attention("attn", heads=4), (3, 8))
    with pytest.raises(ValueError, match=r"'fc1': its units \(10\) do not split into 3"):
        check_plan([fc1, act, fc2], {"fc1": "columns", "fc2": "rows"}, 3)
    with pytest.raises(ValueError, match=r"'attn': its heads \(4\) do not split into 3"):
        check_plan([attn], {"attn": "heads"}, 3)
    with pytest.raises(ValueError, match=r"'fc1' \(dense split by columns\): no dense split by"):
        check_plan([fc1, act], {"fc1": "columns"}, 2)
    with pytest.raises(ValueError, match=r"'fc1' .*must be a dense split by rows.*got 'fc2'"):
        check_plan([fc1, act, fc2], {"fc1": "columns"}, 2)
    with pytest.raises(ValueError, match=r"'fc2' \(dense split by rows\): needs a dense split"):
        check_plan([fc1, act, fc2], {"fc2": "rows"}, 2)
    with pytest.raises(ValueError, match=r"'fc1' .*must be a dense split by rows.*'drop'"):
        check_plan([fc1, drop, fc2], {"fc1": "columns", "fc2": "rows"}, 2)
    with pytest.raises(ValueError, match=r"'drop' \(dropout\): cannot be split by 'columns' \(th"):
        check_plan([drop], {"drop": "columns"}, 2)
    with pytest.raises(ValueError, match=r"'attn' \(attention\): cannot be split by 'rows' \(it"):
        check_plan([attn], {"attn": "rows"}, 2)
    with pytest.raises(ValueError, match="names no layer of the net: nope"):
        check_plan([fc1], {"nope": "columns"}, 2)
    check_plan([fc1, act, fc2, attn], {"fc1": "columns", "fc2": "rows", "attn": "heads"}, 2)


def train(net, params, batches, lr, splits=None, k=1):
    """SGD on ``batches``: each step's loss, and the parameters after (with ``splits``, as
    ``k`` parts, each a thread, joined at the end)."""

    def sgd(model, mine: dict) -> tuple[list[float], dict]:
        losses = []
        for i, (x, y) in enumerate(batches):
            loss, grads, _ = model.loss_and_grads(mine, {}, x, y, StepContext(True, 1, i))
            for name, g in grads.items():
                mine[name] = mine[name] - lr * g
            losses.append(loss)
        return losses, mine

    if splits is None:
        return sgd(net, params)
    shares = split_params(net, splits, params, k)
    got = on_parts(k, lambda ex: sgd(part_net(net, splits, ex), dict(shares[ex.part])))
    assert all(losses == got[0][0] for losses, _ in got)  # the same loss on every part
    return got[0][0], join_params(net, splits, [mine for _, mine in got])


def digits_batches(steps: int, batch: int = 32):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    rng = np.random.default_rng(0)
    order = [rng.permutation(len(x))[:batch] for _ in range(steps)]
    return [(x[o], y[o].astype(np.int64)) for o in order]


@pytest.mark.parametrize("k", [2, 4])
def test_an_mlp_with_its_dense_pair_split_trains_as_the_unsplit_one_for_200_steps(k):
    """The digits: 64 -> 32 (relu) -> 10, the pair split ``k`` ways: the same losses to float
    rounding, step by step, and the same parameters at the end."""
    spec = ModelSpec.from_dict(
        {
            "input_shape": [64],
            "layers": [
                {"kind": "dense", "name": "fc1", "units": 32, "activation": "relu"},
                {"kind": "dense", "name": "fc2", "units": 10},
            ],
        }
    )
    net, batches = Net(spec), digits_batches(200)
    start = {k: v.astype(np.float32) for k, v in net.init_params(seed=3).items()}
    want, whole = train(net, dict(start), batches, 0.1)
    got, joined = train(net, dict(start), batches, 0.1, {"fc1": "columns", "fc2": "rows"}, k)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert want[-1] < 0.5 * want[0]  # it trains
    for name, a in whole.items():
        np.testing.assert_allclose(joined[name], a, rtol=1e-3, atol=1e-5)


def test_a_small_language_model_split_by_vocabulary_heads_and_a_dense_pair_trains_alike():
    """Tokens -> embedding (by vocabulary) -> attention (by heads) -> dense pair -> logits at
    every position, 2 parts: the same losses as unsplit to float rounding over 50 steps."""
    spec = ModelSpec.from_dict(
        {
            "input_shape": [8],
            "layers": [
                {"kind": "embedding", "name": "emb", "vocab": 16, "dim": 12},
                {"kind": "attention", "name": "attn", "heads": 4},
                {"kind": "dense", "name": "up", "units": 24, "activation": "relu"},
                {"kind": "dense", "name": "down", "units": 16},
            ],
            "loss": "sequence_cross_entropy",
        }
    )
    net = Net(spec)
    rng = np.random.default_rng(5)
    text = rng.integers(0, 16, size=4000)
    starts = [rng.integers(0, len(text) - 9, size=8) for _ in range(50)]
    batches = [
        (np.stack([text[s : s + 8] for s in b]), np.stack([text[s + 1 : s + 9] for s in b]))
        for b in starts
    ]
    start = {k: v.astype(np.float32) for k, v in net.init_params(seed=4).items()}
    splits = {"emb": "vocab", "attn": "heads", "up": "columns", "down": "rows"}
    want, whole = train(net, dict(start), batches, 0.05)
    got, joined = train(net, dict(start), batches, 0.05, splits, 2)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    for name, a in whole.items():
        np.testing.assert_allclose(joined[name], a, rtol=1e-3, atol=1e-5)
