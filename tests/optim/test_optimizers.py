"""Optimizers against torch.optim, exact resume, slice updates, summed updates."""

from __future__ import annotations

import copy

import msgpack
import numpy as np
import pytest
import torch

from raysinga.optim.grads import global_grad_norm
from raysinga.optim.optimizers import make_optimizer

STEPS = 20
SHAPES = {"fc1/W": (4, 5), "fc1/b": (5,)}
# A schedule that changes the rate at every step, so per-step lr handling is tested everywhere.
LR = {"kind": "exponential", "lr": 0.05, "gamma": 0.9}
TORCH = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rmsprop": torch.optim.RMSprop,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
CASES = [
    ("sgd", {}),
    ("sgd", {"momentum": 0.9}),
    ("sgd", {"momentum": 0.9, "nesterov": True}),
    ("sgd", {"weight_decay": 0.1}),
    ("sgd", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    ("adagrad", {}),
    ("adagrad", {"eps": 1e-6, "initial_accumulator_value": 0.1, "weight_decay": 0.1}),
    ("rmsprop", {}),
    ("rmsprop", {"centered": True}),
    ("rmsprop", {"momentum": 0.5, "weight_decay": 0.1}),
    ("rmsprop", {"alpha": 0.3, "centered": True, "momentum": 0.5, "eps": 1e-4}),
    ("adam", {}),
    ("adam", {"weight_decay": 0.1, "eps": 1e-6}),
    ("adam", {"betas": (0.3, 0.5)}),  # 1 - beta1 >= 0.5: the other branch of torch's lerp
    ("adamw", {}),
    ("adamw", {"weight_decay": 0.3, "betas": (0.8, 0.9)}),
]
# Fast averages make the centered variance square_avg - grad_avg**2 a difference of near-equal
# numbers (it drops to ~1% of square_avg here): float32 keeps ~2 fewer digits, and torch's fused
# multiply-adds round differently from NumPy's separate ops. Both stay within 1e-5 of float64.
F32_RTOL = {("rmsprop", 0.3): 1e-5}
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in h.items()) or 'default'}" for n, h in CASES]


def problem(dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}
    grads = [
        {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()} for _ in range(STEPS)
    ]
    return params, grads


def run_torch(name: str, hparams: dict, params: dict, grads: list, lrs: list) -> list[dict]:
    names = sorted(params)
    ts = [torch.tensor(params[k], requires_grad=True) for k in names]
    opt = TORCH[name](ts, lr=lrs[0], foreach=False, **hparams)
    out = []
    for lr, g in zip(lrs, grads, strict=True):
        opt.param_groups[0]["lr"] = lr
        for t, k in zip(ts, names, strict=True):
            t.grad = torch.tensor(g[k])
        opt.step()
        out.append({k: t.detach().numpy().copy() for k, t in zip(names, ts, strict=True)})
    return out


@pytest.mark.parametrize(("dtype", "rtol"), [(np.float64, 1e-12), (np.float32, 1e-6)])
@pytest.mark.parametrize(("name", "hparams"), CASES, ids=IDS)
def test_matches_torch(name: str, hparams: dict, dtype, rtol: float) -> None:
    params, grads = problem(dtype)
    if dtype == np.float32:
        rtol = F32_RTOL.get((name, hparams.get("alpha")), rtol)
    opt = make_optimizer({"name": name, "lr": LR, **hparams})
    lrs = [opt.lr(i) for i in range(STEPS)]
    expected = run_torch(name, hparams, params, grads, lrs)
    for i, g in enumerate(grads):
        opt.update_all(i, params, g)
        for k in params:
            assert params[k].dtype == dtype
            np.testing.assert_allclose(params[k], expected[i][k], rtol=rtol, atol=rtol, err_msg=k)
    assert opt.counts == {k: STEPS for k in SHAPES}


def snapshot(state: dict) -> dict:
    # Like a checkpoint: the arrays come back read-only and the plain part through msgpack.
    plain = msgpack.unpackb(msgpack.packb({k: v for k, v in state.items() if k != "slots"}))
    slots = {}
    for k, v in state["slots"].items():
        a = v.copy()
        a.flags.writeable = False
        slots[k] = a
    return {**plain, "slots": slots}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(("name", "hparams"), CASES, ids=IDS)
def test_resume_is_bit_identical(name: str, hparams: dict, dtype) -> None:
    params, grads = problem(dtype)
    a = make_optimizer({"name": name, "lr": LR, **hparams})
    for i in range(STEPS // 2):
        a.update_all(i, params, grads[i])
    saved_state, saved_params = snapshot(a.state_dict()), copy.deepcopy(params)
    assert set(saved_state["slots"]) == {f"{k}/{s}" for k in SHAPES for s in a.slot_names()}
    for i in range(STEPS // 2, STEPS):
        a.update_all(i, params, grads[i])

    # Built with other settings: the checkpoint's hyperparameters and schedule win.
    b = make_optimizer({"name": name, "lr": 123.0})
    b.load_state_dict(saved_state)
    assert b.hparams == a.hparams and b.schedule == a.schedule
    for i in range(STEPS // 2, STEPS):
        b.update_all(i, saved_params, grads[i])
    for k in params:
        np.testing.assert_array_equal(saved_params[k], params[k])
    for k, v in a.state_dict()["slots"].items():
        np.testing.assert_array_equal(b.state_dict()["slots"][k], v)
    assert b.counts == a.counts


@pytest.mark.parametrize(("name", "hparams"), CASES, ids=IDS)
def test_slices_update_like_the_whole_tensor(name: str, hparams: dict) -> None:
    rng = np.random.default_rng(1)
    whole = rng.standard_normal((6, 8)).astype(np.float32)
    sliced = whole.copy()
    bounds = [(0, 16), (16, 30), (30, 48)]  # uneven, as a server's balanced cut may be
    w_opt = make_optimizer({"name": name, "lr": LR, **hparams})
    s_opt = make_optimizer({"name": name, "lr": LR, **hparams})
    for step in range(STEPS):
        g = rng.standard_normal(whole.shape).astype(np.float32)
        w_opt.update(step, "fc1/W", whole, g)
        for a, b in bounds:
            s_opt.update(step, f"fc1/W[{a}:{b}]", sliced.reshape(-1)[a:b], g.reshape(-1)[a:b])
    np.testing.assert_array_equal(sliced, whole)
    w_slots, s_slots = w_opt.state_dict()["slots"], s_opt.state_dict()["slots"]
    for slot in w_opt.slot_names():
        joined = np.concatenate([s_slots[f"fc1/W[{a}:{b}]/{slot}"] for a, b in bounds])
        np.testing.assert_array_equal(joined, w_slots[f"fc1/W/{slot}"].reshape(-1))


def test_update_leaves_the_gradient_alone_and_casts_it_to_the_param_dtype() -> None:
    p = np.ones(3, np.float32)
    g = np.full(3, 0.5)  # float64
    opt = make_optimizer({"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.1})
    opt.update(0, "p", p, g)
    np.testing.assert_array_equal(g, np.full(3, 0.5))
    assert p.dtype == np.float32 and opt.state_dict()["slots"]["p/momentum"].dtype == np.float32
    np.testing.assert_allclose(p, 1 - 0.1 * (0.5 + 0.1), rtol=1e-7)


def test_loaded_slots_take_the_param_dtype() -> None:
    opt = make_optimizer({"name": "adam", "lr": 0.1})
    opt.update(0, "p", np.ones(3), np.ones(3))
    state = opt.state_dict()
    p = np.ones(3, np.float32)
    other = make_optimizer({"name": "adam"})
    other.load_state_dict(state)
    assert other.state_dict()["slots"]["p/m"].dtype == np.float64  # as loaded, until used
    other.update(1, "p", p, np.ones(3, np.float32))
    assert other.state_dict()["slots"]["p/m"].dtype == np.float32
    assert other.counts == {"p": 2}


def test_slot_names() -> None:
    assert make_optimizer({"name": "sgd"}).slot_names() == ()
    assert make_optimizer({"name": "sgd", "momentum": 0.9}).slot_names() == ("momentum",)
    assert make_optimizer({"name": "adagrad"}).slot_names() == ("sum",)
    rms = make_optimizer({"name": "rmsprop", "centered": True, "momentum": 0.1})
    assert rms.slot_names() == ("square_avg", "grad_avg", "momentum")
    assert make_optimizer({"name": "adamw"}).slot_names() == ("m", "v")


def test_state_dict_layout() -> None:
    opt = make_optimizer({"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True})
    opt.update_all(0, {"b": np.ones(2), "a/W": np.ones(2)}, {"b": np.ones(2), "a/W": np.ones(2)})
    d = opt.state_dict()
    assert d["name"] == "sgd"
    assert d["hparams"] == {"momentum": 0.9, "nesterov": True, "weight_decay": 0.0}
    assert d["schedule"] == {"kind": "fixed", "lr": 0.1}
    assert list(d["slots"]) == ["a/W/momentum", "b/momentum"]
    assert d["counts"] == {"a/W": 1, "b": 1}


def test_load_refusals() -> None:
    adam = make_optimizer({"name": "adam"})
    adam.update(0, "p", np.ones(2), np.ones(2))
    good = adam.state_dict()
    sgd = make_optimizer({"name": "sgd"})
    with pytest.raises(ValueError, match="cannot load 'adam' optimizer state into 'sgd'"):
        sgd.load_state_dict(good)
    with pytest.raises(ValueError, match=r"unexpected slot 'p/momentum'"):
        adam.load_state_dict({**good, "slots": {**good["slots"], "p/momentum": np.ones(2)}})
    with pytest.raises(ValueError, match=r"lacks slot\(s\) \['v'\]"):
        adam.load_state_dict({**good, "slots": {"p/m": np.ones(2)}})
    with pytest.raises(ValueError, match="update count"):
        adam.load_state_dict({**good, "counts": {"p": -1}})
    with pytest.raises(ValueError, match="must have keys"):
        adam.load_state_dict({"name": "adam"})
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        adam.load_state_dict({**good, "hparams": {"momentum": 0.9}})
    fresh = make_optimizer({"name": "adam"})
    fresh.load_state_dict({**good, "slots": {"p/m": np.ones(3), "p/v": np.ones(3)}})
    with pytest.raises(ValueError, match=r"slot p/m has shape \(3,\), parameter \(2,\)"):
        fresh.update(1, "p", np.ones(2), np.ones(2))


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ({"name": "lbfgs"}, ValueError, r"unknown optimizer 'lbfgs'; allowed: sgd, adagrad"),
        ({"lr": 0.1}, ValueError, "unknown optimizer None"),
        ({"name": "sgd", "momentun": 0.9}, ValueError, r"unknown hyperparameter\(s\) \['momentun'"),
        ({"name": "sgd", "dampening": 0.1}, ValueError, "allowed: .*'momentum'"),
        ({"name": "sgd", "lr": -0.1}, ValueError, "lr must be >= 0"),
        ({"name": "sgd", "lr": {"kind": "step", "lr": 0.1}}, ValueError, "missing required"),
        ({"name": "sgd", "momentum": -0.9}, ValueError, "momentum must be >= 0"),
        ({"name": "sgd", "nesterov": True}, ValueError, "nesterov needs momentum"),
        ({"name": "sgd", "nesterov": "yes", "momentum": 0.9}, TypeError, "nesterov must be"),
        ({"name": "sgd", "weight_decay": -1e-4}, ValueError, "weight_decay must be >= 0"),
        ({"name": "adagrad", "eps": -1.0}, ValueError, "eps must be >= 0"),
        ({"name": "adagrad", "initial_accumulator_value": -1}, ValueError, "initial_accum"),
        ({"name": "rmsprop", "alpha": 1.5}, ValueError, "alpha must be <= 1"),
        ({"name": "adam", "betas": (0.9, 1.0)}, ValueError, r"betas\[1\] must be in \[0, 1\)"),
        ({"name": "adam", "betas": 0.9}, ValueError, "betas must be a pair"),
        ({"name": "adamw", "weight_decay": "0.1"}, TypeError, "weight_decay must be a number"),
    ],
)
def test_bad_specs(spec: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        make_optimizer(spec)


def test_bad_updates() -> None:
    opt = make_optimizer({"name": "sgd"})
    with pytest.raises(ValueError, match=r"gradient for 'p' has shape \(3,\), param \(2,\)"):
        opt.update(0, "p", np.ones(2), np.ones(3))
    with pytest.raises(TypeError, match="must be floating point"):
        opt.update(0, "p", np.ones(2, np.int64), np.ones(2))
    with pytest.raises(KeyError, match="unknown parameter"):
        opt.update_all(0, {"a": np.ones(2)}, {"b": np.ones(2)})


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "hparams"), CASES, ids=IDS)
def test_cupy_matches_numpy(name: str, hparams: dict) -> None:
    import cupy  # noqa: PLC0415 - only where a GPU is

    params, grads = problem(np.float64)
    gpu_params = {k: cupy.asarray(v) for k, v in params.items()}
    cpu_opt = make_optimizer({"name": name, "lr": LR, **hparams})
    gpu_opt = make_optimizer({"name": name, "lr": LR, **hparams})
    for i, g in enumerate(grads):
        cpu_opt.update_all(i, params, g)
        gpu_opt.update_all(i, gpu_params, g)  # NumPy gradients, as the stub sends them
        if i == STEPS // 2:  # GPU state restored into a CPU optimizer and back
            cpu_opt.load_state_dict(gpu_opt.state_dict())
            gpu_opt.load_state_dict(copy.deepcopy(cpu_opt.state_dict()))
    for k in params:
        assert isinstance(gpu_params[k], cupy.ndarray)  # updated in place, on the GPU
        np.testing.assert_allclose(cupy.asnumpy(gpu_params[k]), params[k], rtol=1e-12)
    gpu_norm = global_grad_norm({k: cupy.asarray(v) for k, v in grads[0].items()})
    assert gpu_norm == pytest.approx(global_grad_norm(grads[0]), rel=1e-14)


@pytest.mark.parametrize(
    "spec",
    [
        {"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
        {"name": "adam", "lr": 0.01, "weight_decay": 1e-2},
        {"name": "rmsprop", "lr": 0.01, "centered": True, "momentum": 0.5},
    ],
)
def test_threaded_chunked_update_is_bit_identical(spec):
    """Servers update large slices in chunks on a thread pool; nothing may change a bit."""
    from concurrent.futures import ThreadPoolExecutor

    from raysinga.optim.grads import PARALLEL_CHUNK
    from raysinga.optim.optimizers import make_optimizer

    rng = np.random.default_rng(0)
    p0 = rng.normal(size=3 * PARALLEL_CHUNK + 17).astype(np.float32)
    a, b = make_optimizer(spec), make_optimizer(spec)
    pa, pb = p0.copy(), p0.copy()
    with ThreadPoolExecutor(3) as pool:
        for step in range(4):
            g = rng.normal(size=p0.size).astype(np.float32)
            a.update(step, "w", pa, g)
            b.update(step, "w", pb, g, pool)
    np.testing.assert_array_equal(pa, pb)
    for k, v in a.state_dict()["slots"].items():
        np.testing.assert_array_equal(v, b.state_dict()["slots"][k])


FUSED = [(i, c) for i, c in zip(IDS, CASES, strict=True) if c[0] in ("sgd", "adam", "adamw")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("name", "hparams"), [c for _, c in FUSED], ids=[i for i, _ in FUSED])
def test_fused_gpu_updates_are_bit_identical_to_numpy(name, hparams, dtype, monkeypatch) -> None:
    """SGD, Adam and AdamW on CuPy parameters run as one fused kernel per update, and round
    exactly as the NumPy path does: the same bits after every step, in both dtypes."""
    import cupy  # noqa: PLC0415 - only where a GPU is

    from raysinga.kernels import gpu_optim  # noqa: PLC0415

    launched = []

    def counted(real):
        def run(*args, **kwargs):
            launched.append(real.__name__)
            return real(*args, **kwargs)

        return run

    for fn in ("sgd_update", "adam_update"):
        monkeypatch.setattr(gpu_optim, fn, counted(getattr(gpu_optim, fn)))
    params, grads = problem(dtype)
    gpu_params = {k: cupy.asarray(v) for k, v in params.items()}
    cpu_opt = make_optimizer({"name": name, "lr": LR, **hparams})
    gpu_opt = make_optimizer({"name": name, "lr": LR, **hparams})
    for i, g in enumerate(grads):
        cpu_opt.update_all(i, params, g)
        gpu_opt.update_all(i, gpu_params, g)
        for k in params:
            assert cupy.asnumpy(gpu_params[k]).tobytes() == params[k].tobytes(), (i, k)
    assert len(launched) == len(grads) * len(params)


@pytest.mark.parametrize("n_parts", [1, 2, 3])
@pytest.mark.parametrize(("name", "hparams"), CASES, ids=IDS)
def test_summed_updates_are_bit_identical_to_summing_first(name, hparams, n_parts) -> None:
    """A server sums its workers' gradients inside its update, block by block, the work of
    all its slices split over a thread pool: the parameters, the slots and the written sums
    have the bits of summing each gradient, then updating it alone."""
    from concurrent.futures import ThreadPoolExecutor

    from raysinga.optim.grads import BLOCK, PARALLEL_CHUNK, sum_into

    rng = np.random.default_rng(4)
    sizes = {"w": 2 * PARALLEL_CHUNK + 3 * BLOCK + 5, "b": 7, "v": PARALLEL_CHUNK + 1}
    p0 = {k: rng.normal(size=n).astype(np.float32) for k, n in sizes.items()}
    a = make_optimizer({"name": name, "lr": LR, **hparams})
    b = make_optimizer({"name": name, "lr": LR, **hparams})
    pa = {k: v.copy() for k, v in p0.items()}
    pb = {k: v.copy() for k, v in p0.items()}
    written = {k: np.full(n, np.nan, np.float32) for k, n in sizes.items()}
    with ThreadPoolExecutor(3) as pool:
        for step in range(3):
            parts = {
                k: [rng.normal(size=n).astype(np.float32) for _ in range(n_parts)]
                for k, n in sizes.items()
            }
            for k in sizes:
                summed = np.empty(sizes[k], np.float32)
                sum_into(summed, parts[k])
                a.update(step, k, pa[k], summed)
            b.update_summed(step, pb, written, parts, pool)
            for k in sizes:
                expected = np.empty(sizes[k], np.float32)
                sum_into(expected, parts[k])
                np.testing.assert_array_equal(written[k], expected)
    for k in sizes:
        np.testing.assert_array_equal(pa[k], pb[k])
    assert a.counts == b.counts
    for k, v in a.state_dict()["slots"].items():
        np.testing.assert_array_equal(v, b.state_dict()["slots"][k])
    with pytest.raises(ValueError, match="gradient parts for 'b' do not match"):
        b.update_summed(3, pb, written, {"b": [np.ones(3, np.float32)]})
    with pytest.raises(ValueError, match="'w': a summed update needs contiguous arrays"):
        b.update_summed(3, {"w": pb["w"][::2]}, {"w": written["w"][::2]}, {"w": [pb["w"][::2]]})
    assert a.counts == b.counts  # refused before anything changed


@pytest.mark.parametrize(("name", "hparams"), CASES, ids=IDS)
def test_updates_by_ranges_are_bit_identical_and_can_be_taken_back(name, hparams) -> None:
    """A server of a group summed by hosts updates its slices a part at a time, each part
    some ranges of them: counted once all are done, the bits are those of one update; a step
    taken back part way leaves the parameters, the slots and the counts as they were."""
    from concurrent.futures import ThreadPoolExecutor

    from raysinga.optim.grads import PARALLEL_CHUNK

    rng = np.random.default_rng(5)
    sizes = {"w": 2 * PARALLEL_CHUNK + 11, "b": 7}
    p0 = {k: rng.normal(size=n).astype(np.float32) for k, n in sizes.items()}
    a = make_optimizer({"name": name, "lr": LR, **hparams})
    b = make_optimizer({"name": name, "lr": LR, **hparams})
    pa = {k: v.copy() for k, v in p0.items()}
    pb = {k: v.copy() for k, v in p0.items()}
    n = sizes["w"]
    parts = [[("w", 0, 5)], [("w", 5, n // 2)], [("w", n // 2, n), ("b", 0, 7)]]
    with ThreadPoolExecutor(3) as pool:
        for step in range(3):
            g = {k: rng.normal(size=m).astype(np.float32) for k, m in sizes.items()}
            a.update_all(step, pa, g)
            for part in parts:
                b.update_spans(step, pb, g, part, pool)
            b.advance(list(sizes))
        before = ({k: v.copy() for k, v in pb.items()}, copy.deepcopy(b.state_dict()))
        kept: list = []
        g = {k: rng.normal(size=m).astype(np.float32) for k, m in sizes.items()}
        for part in parts[:2]:
            b.update_spans(3, pb, g, part, pool, kept)
        assert pb["w"].tobytes() != before[0]["w"].tobytes()
        b.restore_spans(kept)
    for k in sizes:
        assert pa[k].tobytes() == pb[k].tobytes(), k
        assert pb[k].tobytes() == before[0][k].tobytes(), k
    assert a.counts == b.counts == before[1]["counts"]
    for k, v in a.state_dict()["slots"].items():
        assert (
            v.tobytes() == b.state_dict()["slots"][k].tobytes() == before[1]["slots"][k].tobytes()
        )
    with pytest.raises(ValueError, match="'w': an update of ranges needs a contiguous"):
        b.update_spans(4, {"w": pb["w"][::2]}, {"w": g["w"][::2]}, [("w", 0, 3)])
