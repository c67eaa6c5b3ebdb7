"""Whole nets against an independent reference (PyTorch on CPU), and the model spec itself."""

from __future__ import annotations

import numpy as np
import pytest

from raysinga import ModelSpec, Net, StepContext
from raysinga.nn import layers
from raysinga.nn.layers import DW_ROW_BLOCKS

torch = pytest.importorskip("torch")
F = torch.nn.functional

MLP = {
    "input_shape": [20],
    "layers": [
        {"kind": "dense", "name": "fc1", "units": 33, "activation": "relu"},
        {"kind": "dropout", "name": "drop1", "rate": 0.25},
        {"kind": "dense", "name": "fc2", "units": 17, "activation": "tanh"},
        {"kind": "batchnorm", "name": "bn"},
        {"kind": "dense", "name": "fc3", "units": 12, "activation": "sigmoid"},
        {"kind": "dense", "name": "out", "units": 10},
    ],
}
CNN = {
    "input_shape": [1, 12, 12],
    "layers": [
        {
            "kind": "conv2d",
            "name": "conv1",
            "filters": 6,
            "kernel": 3,
            "padding": 1,
            "activation": "relu",
        },
        {"kind": "batchnorm", "name": "bn1"},
        {"kind": "maxpool", "name": "pool1", "kernel": 2},
        {
            "kind": "conv2d",
            "name": "conv2",
            "filters": 5,
            "kernel": 3,
            "stride": 2,
            "activation": "tanh",
        },
        {"kind": "avgpool", "name": "pool2", "kernel": 2, "stride": 1},
        {"kind": "flatten", "name": "flat"},
        {"kind": "dropout", "name": "drop", "rate": 0.3},
        {"kind": "dense", "name": "out", "units": 7},
    ],
}

ACTS = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "linear": lambda t: t}


def torch_forward(net: Net, params: dict, x, ctx: StepContext, masks: dict):
    """The same net written directly in PyTorch, sharing only the parameters and dropout masks."""
    for ly in net.layers:
        o = ly.opts
        if ly.kind == "dense":
            x = ACTS[o["activation"]](x @ params[f"{ly.name}/W"] + params[f"{ly.name}/b"])
        elif ly.kind == "conv2d":
            z = F.conv2d(
                x,
                params[f"{ly.name}/W"],
                params[f"{ly.name}/b"],
                stride=o["stride"],
                padding=o["padding"],
            )
            x = ACTS[o["activation"]](z)
        elif ly.kind == "maxpool":
            x = F.max_pool2d(x, o["kernel"], o["stride"], o["padding"])
        elif ly.kind == "avgpool":
            x = F.avg_pool2d(x, o["kernel"], o["stride"], o["padding"])
        elif ly.kind == "flatten":
            x = x.reshape(x.shape[0], -1)
        elif ly.kind == "dropout":
            x = x * masks[ly.name]
        elif ly.kind == "batchnorm":
            x = F.batch_norm(
                x,
                None,
                None,
                params[f"{ly.name}/gamma"],
                params[f"{ly.name}/beta"],
                training=True,
                eps=o["eps"],
            )
        else:
            raise AssertionError(ly.kind)
    return x


@pytest.mark.parametrize("spec_dict,batch", [(MLP, 16), (MLP, 5), (CNN, 8), (CNN, 3)])
def test_gradients_match_pytorch_float32(spec_dict, batch):
    spec = ModelSpec.from_dict(spec_dict)
    net = Net(spec, dtype="float32")
    params, state = net.init_params(seed=1), net.init_state()
    rng = np.random.default_rng(batch)
    x = rng.normal(size=(batch, *spec.input_shape)).astype(np.float32)
    y = rng.integers(0, net.output_shape[0], size=batch)
    ctx = StepContext(train=True, seed=9, step=4)
    loss, grads, _ = net.loss_and_grads(params, state, x, y, ctx)

    masks = {ly.name: torch.from_numpy(ly._cache[0]) for ly in net.layers if ly.kind == "dropout"}
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    tloss = F.cross_entropy(
        torch_forward(net, tp, torch.from_numpy(x), ctx, masks), torch.from_numpy(y)
    )
    tloss.backward()
    np.testing.assert_allclose(loss, tloss.item(), rtol=1e-5)
    for k, t in tp.items():
        ref = t.grad.numpy()
        err = np.abs(grads[k] - ref).max() / max(np.abs(ref).max(), 1e-12)
        assert err <= 1e-5, f"{k}: relative error {err:.2e}"


def _one_batch(spec_dict, dw_row_blocks=1):
    """A net of ``spec_dict``, its parameters and state, and one training batch with its
    context: what the gradient tests take a backward pass of."""
    net = Net(ModelSpec.from_dict(spec_dict), dw_row_blocks=dw_row_blocks)
    params, state = net.init_params(3), net.init_state()
    x = np.random.default_rng(4).standard_normal((9, *spec_dict["input_shape"]), np.float32)
    y = np.arange(9) % 7
    ctx = StepContext(train=True, seed=1, step=2)
    return net, params, state, x, y, ctx


@pytest.mark.parametrize("spec_dict", [MLP, CNN])
def test_gradients_written_into_given_arrays_are_the_same_bits(spec_dict):
    """A worker hands the net its shared gradient buffer: dense layers write their weight
    gradients there (no copy), the others' come back as new arrays, every one bit-identical to
    a backward pass without it."""
    net, params, state, x, y, ctx = _one_batch(spec_dict)
    loss, plain, _ = net.loss_and_grads(params, state, x, y, ctx)
    into = {k: np.full_like(v, np.nan) for k, v in params.items()}
    loss_into, given, _ = net.loss_and_grads(params, net.init_state(), x, y, ctx, into=into)
    assert loss_into == loss and given.keys() == plain.keys()
    kinds = {ly.name: ly.kind for ly in net.layers}
    for k, g in given.items():
        np.testing.assert_array_equal(g, plain[k], err_msg=k)
        layer, _, local = k.rpartition("/")
        assert (g is into[k]) == (kinds[layer] == "dense" and local == "W"), k
    assert all(not ly.grads_into for ly in net.layers)  # held for one call only


@pytest.mark.parametrize("spec_dict", [MLP, CNN])
def test_each_layers_gradients_are_handed_over_once_its_backward_pass_is_done(spec_dict):
    """What a worker sends on while the backward pass goes on: every gradient once, the last
    layer's first, whole when handed over (the bits the pass ends with), and only once the
    layer is done with its dx as well: the layer under it has not started."""
    net, params, state, x, y, ctx = _one_batch(spec_dict)
    _, plain, _ = net.loss_and_grads(params, state, x, y, ctx)
    told: list[tuple[str, np.ndarray]] = []
    started: list[str] = []  # the layers whose backward pass had begun
    ended: list[str] = []  # and those whose backward pass (dx included) had returned
    for ly in net.layers:
        real = ly.backward

        def spy(dy, ly=ly, real=real):
            started.append(ly.name)
            out = real(dy)
            ended.append(ly.name)
            return out

        ly.backward = spy

    def on_grads(g):
        layer = next(iter(g)).rpartition("/")[0]
        assert ended[-1] == layer, (layer, ended)  # done, its dx too
        assert started[-1] == layer, (layer, started)  # nothing under it begun yet
        told.extend((k, v.copy()) for k, v in g.items())

    into = {k: np.zeros_like(v) for k, v in params.items()}
    _, grads, _ = net.loss_and_grads(
        params, net.init_state(), x, y, ctx, into=into, on_grads=on_grads
    )
    names = [k for k, _ in told]
    assert sorted(names) == sorted(plain) and len(names) == len(set(names))
    order = [ly.name for ly in net.layers if ly.param_shapes()][::-1]
    layers = [n.rpartition("/")[0] for n in names]
    assert layers == sorted(layers, key=order.index)
    for k, v in told:  # whole when told: the bits the pass ends with
        np.testing.assert_array_equal(v, plain[k], err_msg=k)
        np.testing.assert_array_equal(grads[k], plain[k], err_msg=k)


@pytest.mark.parametrize("spec_dict", [MLP, CNN])
def test_a_dense_layers_gradients_are_handed_over_final_before_its_dx(spec_dict):
    """What a worker may send before a layer's dx: a dense layer's weight and bias gradients,
    once each, final (the bits the pass ends with), while that layer's backward pass is under
    way (its dx, which reads its weights, still to come); every layer's gradients are still
    handed over whole once it is done."""
    net, params, state, x, y, ctx = _one_batch(spec_dict)
    _, plain, _ = net.loss_and_grads(params, state, x, y, ctx)
    ready: list[tuple[str, np.ndarray]] = []
    told: list[str] = []
    inside: list[str] = []  # the layer whose backward pass is under way
    for ly in net.layers:
        real = ly.backward

        def spy(dy, ly=ly, real=real):
            inside.append(ly.name)
            try:
                return real(dy)
            finally:
                inside.pop()

        ly.backward = spy

    def on_ready(g):
        layer = next(iter(g)).rpartition("/")[0]
        assert inside == [layer], (layer, inside)  # under way, not done
        ready.extend((k, v.copy()) for k, v in g.items())

    into = {k: np.zeros_like(v) for k, v in params.items()}
    net.loss_and_grads(
        params,
        net.init_state(),
        x,
        y,
        ctx,
        into=into,
        on_grads=lambda g: told.extend(g),
        on_ready=on_ready,
    )
    dense = {ly.key(k) for ly in net.layers if ly.kind == "dense" for k in ly.param_shapes()}
    names = [k for k, _ in ready]
    assert sorted(names) == sorted(dense) and len(names) == len(set(names))
    assert sorted(told) == sorted(plain)
    for k, v in ready:
        np.testing.assert_array_equal(v, plain[k], err_msg=k)
    assert all(ly.grads_ready is None for ly in net.layers)  # held for one call only


@pytest.mark.parametrize("start", [0, 2])
def test_a_dense_weights_gradient_is_told_final_by_blocks_of_rows_from_the_block_asked(
    start, monkeypatch
):
    """A dense layer's weight gradient is computed by blocks of rows, written into the buffer:
    each block told final (the bits the pass ends with, the rest not written yet), from the
    block the hook asks for first, round; the same bits as with no hook, or no buffer."""
    monkeypatch.setattr(layers, "DW_BLOCKED_ELEMENTS", 1)  # this MLP's weights are small
    net, params, state, x, y, ctx = _one_batch(MLP, layers.dw_row_blocks("hosts"))
    _, plain, _ = net.loss_and_grads(params, state, x, y, ctx)
    into = {k: np.full_like(v, np.nan) for k, v in params.items()}
    told: list[tuple[str, int, int]] = []

    class Hook:
        bounds: dict[str, list[int]] = {}

        def first_block(self, key, bounds):
            assert bounds[0] == 0 and bounds[-1] == into[key].size
            assert len(bounds) == min(DW_ROW_BLOCKS, into[key].shape[0]) + 1
            self.bounds[key] = list(bounds)
            return start % (len(bounds) - 1)

        def rows_final(self, key, a, b):
            flat = into[key].reshape(-1)
            np.testing.assert_array_equal(flat[a:b], plain[key].reshape(-1)[a:b], err_msg=key)
            done = sum(bb - aa for k, aa, bb in told if k == key)
            assert np.isnan(flat).sum() == flat.size - done - (b - a)  # the others still to come
            told.append((key, a, b))

    hook = Hook()
    _, grads, _ = net.loss_and_grads(params, state, x, y, ctx, into=into, on_rows=hook)
    weights = [ly.key("W") for ly in net.layers if ly.kind == "dense"]
    assert sorted({k for k, _, _ in told}) == sorted(weights)
    for key in weights:
        ranges = [(a, b) for k, a, b in told if k == key]
        bounds = hook.bounds[key]
        blocks = list(zip(bounds, bounds[1:], strict=False))
        assert sorted(ranges) == blocks  # every block once
        first = start % len(blocks)
        assert ranges == blocks[first:] + blocks[:first]  # from the block asked for, round
        np.testing.assert_array_equal(into[key], plain[key], err_msg=key)
    for k in plain:
        np.testing.assert_array_equal(grads[k], plain[k], err_msg=k)
    assert all(ly.rows_hook is None for ly in net.layers)  # held for one call only


@pytest.mark.parametrize("reduce", ["stub", "hosts"])
def test_a_dense_weight_is_one_gemm_outside_a_job_summed_by_hosts(reduce, monkeypatch):
    """Only a job summed by hosts computes a large dense weight's gradient by blocks of rows
    (its workers send them as they come); any other keeps one GEMM, and a net of the blocks
    gives the same gradient to float rounding."""
    monkeypatch.setattr(layers, "DW_BLOCKED_ELEMENTS", 1)
    net, params, state, x, y, ctx = _one_batch(MLP, layers.dw_row_blocks(reduce))
    seen, real = [], layers.K.dense_backward

    def counted(*a, row_blocks, **k):
        seen.append(row_blocks)
        return real(*a, row_blocks=row_blocks, **k)

    monkeypatch.setattr(layers.K, "dense_backward", counted)
    _, grads, _ = net.loss_and_grads(params, state, x, y, ctx)
    assert seen and set(seen) == {DW_ROW_BLOCKS if reduce == "hosts" else 1}
    whole, *_ = _one_batch(MLP)
    _, ref, _ = whole.loss_and_grads(params, state, x, y, ctx)
    for k in ref:
        np.testing.assert_allclose(grads[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_a_dense_weight_under_a_parts_worth_is_one_gemm_and_told_of_no_rows():
    net, params, state, x, y, ctx = _one_batch(MLP, layers.dw_row_blocks("hosts"))
    assert all(v.size < layers.DW_BLOCKED_ELEMENTS for v in params.values())
    into = {k: np.zeros_like(v) for k, v in params.items()}

    class Hook:
        def first_block(self, key, bounds):
            raise AssertionError(key)

        rows_final = first_block

    net.loss_and_grads(params, state, x, y, ctx, into=into, on_rows=Hook())


def test_batchnorm_running_statistics_match_pytorch():
    spec = ModelSpec.from_dict(
        {"input_shape": [3, 4, 4], "layers": [{"kind": "batchnorm", "name": "bn", "momentum": 0.2}]}
    )
    net = Net(spec, dtype="float64")
    params, state = net.init_params(0), net.init_state()
    bn = torch.nn.BatchNorm2d(3, momentum=0.2).double()
    rng = np.random.default_rng(0)
    for step in range(3):
        x = rng.normal(size=(5, 3, 4, 4)) * (step + 1)
        net.forward(params, state, x, StepContext(train=True, step=step))
        bn(torch.from_numpy(x))
    np.testing.assert_allclose(state["bn/running_mean"], bn.running_mean.numpy(), rtol=1e-12)
    np.testing.assert_allclose(state["bn/running_var"], bn.running_var.numpy(), rtol=1e-12)
    x = rng.normal(size=(2, 3, 4, 4))
    bn.eval()
    np.testing.assert_allclose(
        net.forward(params, state, x, StepContext(train=False)),
        bn(torch.from_numpy(x)).detach().numpy(),
        rtol=1e-10,
        atol=1e-12,
    )


def test_parameter_names_and_initialisation_are_stable():
    net = Net(ModelSpec.from_dict(CNN))
    assert list(net.param_shapes()) == [
        "conv1/W",
        "conv1/b",
        "bn1/gamma",
        "bn1/beta",
        "conv2/W",
        "conv2/b",
        "out/W",
        "out/b",
    ]
    assert net.param_shapes()["out/W"] == (5 * 1 * 1, 7)  # 12 -> 12 -> 6 -> 2 -> 1
    assert list(net.state_shapes()) == ["bn1/running_mean", "bn1/running_var"]
    a, b = net.init_params(3), Net(ModelSpec.from_dict(CNN)).init_params(3)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["conv1/W"], net.init_params(4)["conv1/W"])
    # A parameter's initial value does not depend on the layers around it.
    alone = Net(ModelSpec.from_dict({"input_shape": [1, 12, 12], "layers": [CNN["layers"][0]]}))
    np.testing.assert_array_equal(alone.init_params(3)["conv1/W"], a["conv1/W"])


def test_spec_round_trip_and_digest():
    spec = ModelSpec.from_dict(MLP)
    again = ModelSpec.from_dict(spec.to_dict())
    assert again == spec and again.digest() == spec.digest()
    changed = dict(MLP, layers=[*MLP["layers"][:-1], {"kind": "dense", "name": "out", "units": 9}])
    assert ModelSpec.from_dict(changed).digest() != spec.digest()


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"layers": []}, r"model.input_shape: missing"),
        ({"input_shape": [0], "layers": [{"kind": "relu", "name": "r"}]}, r"input_shape"),
        (
            {"input_shape": [4], "layers": [{"kind": "softmax", "name": "s"}]},
            r"model.layers\[0\].kind: unknown layer kind 'softmax'",
        ),
        (
            {
                "input_shape": [4],
                "layers": [{"kind": "relu", "name": "a"}, {"kind": "relu", "name": "a"}],
            },
            r"model.layers\[1\].name",
        ),
        (
            {"input_shape": [4], "layers": [{"kind": "relu", "name": "a/b"}]},
            r"model.layers\[0\].name",
        ),
        (
            {"input_shape": [4], "layers": [{"kind": "relu", "name": "a"}], "optimizer": {}},
            r"unknown key",
        ),
        (
            {"input_shape": [4], "layers": [{"kind": "relu", "name": "a"}], "loss": "hinge"},
            r"unknown loss 'hinge'",
        ),
    ],
)
def test_bad_specs_are_refused_with_the_key_path(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec.from_dict(bad)
