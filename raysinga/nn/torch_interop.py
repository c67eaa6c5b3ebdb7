"""Weights to and from PyTorch: a ``state_dict`` with PyTorch's names and layouts, and the
``torch.nn`` model that computes what a raysinga net computes.

Every layer ``NAME`` becomes a module of the same name (a dotted name nests, as PyTorch does):

=============  ==========================================  ====================================
kind           torch.nn module                             state_dict entries (raysinga's)
=============  ==========================================  ====================================
dense          ``Linear(in, units)`` (+ activation)        weight = W.T, bias = b
conv2d         ``Conv2d(c, filters, kernel, stride, pad)``  weight = W, bias = b
batchnorm      ``BatchNorm1d/2d(c, eps, momentum)``        weight = gamma, bias = beta,
                                                           running_mean, running_var
embedding      ``Embedding(vocab, dim)``                   weight = W
positional     ``Embedding(T, dim)`` of ``arange(T)``, added  weight = W
layernorm      ``LayerNorm(features, eps)``                weight = gamma, bias = beta
rmsnorm        ``RMSNorm(features, eps)``                  weight = gamma
attention      ``MultiheadAttention(dim, heads,            in_proj_weight = Wqkv.T,
               batch_first=True)``, causal mask            in_proj_bias = bqkv,
                                                           out_proj.weight = Wo.T,
                                                           out_proj.bias = bo
gru, lstm      ``GRU/LSTM(features, units, batch_first)``  weight_ih_l0 = Wx.T,
                                                           weight_hh_l0 = Wh.T,
                                                           bias_ih_l0 = bx, bias_hh_l0 = bh
=============  ==========================================  ====================================

The other kinds (pooling, activations, flatten, dropout, gelu, add) hold no weights. PyTorch
is needed only to read or write its files and to build the module (:func:`torch_module`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from .model import ModelSpec, Net, recorded_spec
from .registry import is_own

# (raysinga local name, PyTorch name, transposed) per layer kind
NAMES: dict[str, tuple[tuple[str, str, bool], ...]] = {
    "dense": (("W", "weight", True), ("b", "bias", False)),
    "conv2d": (("W", "weight", False), ("b", "bias", False)),
    "batchnorm": (("gamma", "weight", False), ("beta", "bias", False)),
    "embedding": (("W", "weight", False),),
    "positional": (("W", "weight", False),),
    "layernorm": (("gamma", "weight", False), ("beta", "bias", False)),
    "rmsnorm": (("gamma", "weight", False),),
    "attention": (
        ("Wqkv", "in_proj_weight", True),
        ("bqkv", "in_proj_bias", False),
        ("Wo", "out_proj.weight", True),
        ("bo", "out_proj.bias", False),
    ),
    "gru": (
        ("Wx", "weight_ih_l0", True),
        ("Wh", "weight_hh_l0", True),
        ("bx", "bias_ih_l0", False),
        ("bh", "bias_hh_l0", False),
    ),
}
NAMES["lstm"] = NAMES["gru"]
STATE_NAMES = {"batchnorm": (("running_mean", "running_mean"), ("running_var", "running_var"))}


def _names(ly: Any) -> tuple[tuple[str, str, bool], ...]:
    """A layer's (local, PyTorch name, transposed): raysinga's table for its own kinds, the
    class's ``torch_names`` for a layer of the user's own (``docs/layers.md``). A layer of the
    user's own with parameters and no ``torch_names`` raises ValueError in one line."""
    if is_own(ly.kind):
        return NAMES.get(ly.kind, ())
    names = getattr(type(ly), "torch_names", None)
    if names is None:
        if not ly.param_shapes() and not ly.state_shapes():
            return ()
        raise ValueError(
            f"layer {ly.name!r} ({ly.kind}) does not say how its parameters map to PyTorch's: "
            "give its class torch_names, ((name, PyTorch name, transposed), ...) (docs/layers.md)"
        )
    return tuple((str(a), str(b), bool(t)) for a, b, t in names)


def to_state_dict(net: Net, params: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """The net's parameters and state under PyTorch's names, in PyTorch's layouts."""
    out: dict[str, Any] = {}
    for ly in net.layers:
        kind = ly.kind
        for local, theirs, transposed in _names(ly):
            a = np.asarray(params[ly.key(local)])
            out[f"{ly.name}.{theirs}"] = np.ascontiguousarray(a.T if transposed else a)
        for local, theirs in STATE_NAMES.get(kind, ()):
            out[f"{ly.name}.{theirs}"] = np.asarray(state[ly.key(local)])
        if kind == "batchnorm":
            out[f"{ly.name}.num_batches_tracked"] = np.array(0, np.int64)
    return out


def from_state_dict(net: Net, sd: dict[str, Any]) -> dict[str, np.ndarray]:
    """raysinga's parameters and state from a PyTorch ``state_dict`` of the same model; a
    ValueError names a missing or misshapen entry."""
    out: dict[str, np.ndarray] = {}
    shapes = {**net.param_shapes(), **net.state_shapes()}
    for ly in net.layers:
        pairs = list(_names(ly))
        pairs += [(loc, th, False) for loc, th in STATE_NAMES.get(ly.kind, ())]
        for local, theirs, transposed in pairs:
            key = f"{ly.name}.{theirs}"
            if key not in sd:
                raise ValueError(f"the state_dict has no {key!r} (for {ly.key(local)})")
            a = np.asarray(sd[key])
            a = a.T if transposed else a
            if a.shape != tuple(shapes[ly.key(local)]):
                raise ValueError(
                    f"{key!r} has shape {list(np.asarray(sd[key]).shape)}; this model's "
                    f"{ly.key(local)} needs {list(shapes[ly.key(local)])}"
                    + (" (transposed in PyTorch)" if transposed else "")
                )
            out[ly.key(local)] = np.ascontiguousarray(a, dtype=net.dtype)
    return out


def save(sd: dict[str, Any], path: str) -> None:
    """``torch.save`` of the state_dict's tensors (PyTorch is needed to write its format)."""
    torch = _torch()
    torch.save({k: torch.from_numpy(np.array(v, copy=True)) for k, v in sd.items()}, path)


def load(path: str) -> dict[str, np.ndarray]:
    """A ``state_dict`` file's tensors as NumPy arrays (``torch.load(weights_only=True)``)."""
    torch = _torch()
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a file it cannot read
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"{path}: not a PyTorch state_dict file PyTorch can read: {first}"
        ) from None
    if not isinstance(sd, dict):
        raise ValueError(f"{path}: not a state_dict (a mapping of names to tensors)")
    if isinstance(sd.get("state_dict"), dict):  # a training script's checkpoint around it
        sd = sd["state_dict"]
    return {k: v.detach().cpu().numpy() for k, v in sd.items() if hasattr(v, "detach")}


def export(ck: Any, out: str) -> list[str]:
    """Write a checkpoint's model as a PyTorch ``state_dict`` file ``out``, whole or not at
    all; returns its entries' names."""
    spec = recorded_spec(ck.meta["run"], f"checkpoint {ck.location}")
    params, state = ck.arrays("param"), ck.arrays("state")
    net = Net(spec, dtype=str(next(iter(params.values())).dtype))
    sd = to_state_dict(net, params, state)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        save(sd, tmp)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return list(sd)


def as_checkpoint(path: str, cfg: Any, where: Path) -> Path:
    """A PyTorch ``state_dict`` file of this job's model, converted to a checkpoint in
    ``where`` (step 0) that ``--init-from`` reads like any other."""
    net = Net(cfg.model, dtype=cfg.dtype)
    try:
        arrays = from_state_dict(net, load(path))
    except ValueError as e:
        raise ValueError(f"--init-from {path}: {e}") from None
    state = {k: v for k, v in arrays.items() if k in net.state_shapes()}
    params = {k: v for k, v in arrays.items() if k not in state}
    from raysinga.checkpoint import save as save_checkpoint  # noqa: PLC0415

    if (where / "step-0").exists():
        shutil.rmtree(where / "step-0")  # an earlier conversion: this file may differ
    save_checkpoint(where, 0, params, state=state, meta={"converted_from": str(path)})
    return where / "step-0"


def _torch() -> Any:
    try:
        import torch  # noqa: PLC0415 - optional: only to read and write PyTorch's files
    except ImportError:
        raise ValueError("PyTorch files need PyTorch: pip install torch") from None
    return torch


def torch_module(spec: ModelSpec, dtype: str = "float32") -> Any:
    """A ``torch.nn.Module`` computing what ``Net(spec)`` computes, its submodules named as
    the layers (load :func:`to_state_dict`'s output into it)."""
    torch = _torch()
    return _build(torch, spec, getattr(torch, dtype))


def _build(torch: Any, spec: ModelSpec, dtype: Any) -> Any:
    nn = torch.nn
    net = Net(spec)
    acts = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}

    def module(ly: Any) -> Any:
        o, shape = ly.opts, ly.in_shape
        kind = ly.kind
        if not is_own(kind):  # a layer of the user's own says how, or has no module
            make = getattr(ly, "torch_module", None)
            if make is None:
                raise ValueError(
                    f"layer {ly.name!r} ({kind}) has no PyTorch module: give its class "
                    "torch_module(self, torch, dtype) (docs/layers.md)"
                )
            return make(torch, dtype)
        if kind == "dense":
            cls = _with_activation(nn.Linear, acts.get(o["activation"]))
            return cls(shape[-1], o["units"], dtype=dtype)
        if kind == "conv2d":
            cls = _with_activation(nn.Conv2d, acts.get(o["activation"]))
            return cls(shape[0], o["filters"], o["kernel"], o["stride"], o["padding"], dtype=dtype)
        if kind == "batchnorm":
            cls = nn.BatchNorm1d if len(shape) == 1 else nn.BatchNorm2d
            return cls(shape[0], eps=o["eps"], momentum=o["momentum"], dtype=dtype)
        if kind in ("maxpool", "avgpool"):
            cls = nn.MaxPool2d if kind == "maxpool" else nn.AvgPool2d
            kw = {} if kind == "maxpool" else {"count_include_pad": True}
            return cls(o["kernel"], o["stride"], o["padding"], **kw)
        if kind in acts:
            return acts[kind]()
        if kind == "flatten":
            return nn.Flatten()
        if kind == "dropout":
            return nn.Dropout(o["rate"])
        if kind == "embedding":
            return nn.Embedding(o["vocab"], o["dim"], dtype=dtype)
        if kind == "positional":
            return _Positional(nn, torch, shape, dtype)
        if kind == "layernorm":
            return nn.LayerNorm(shape[-1], eps=o["eps"], dtype=dtype)
        if kind == "rmsnorm":
            return nn.RMSNorm(shape[-1], eps=o["eps"], dtype=dtype)
        if kind == "gelu":
            return nn.GELU(approximate="tanh")
        if kind == "attention":
            return _Attention(nn, torch, shape, o["heads"], dtype)
        if kind in ("gru", "lstm"):
            cls = nn.GRU if kind == "gru" else nn.LSTM
            return _Recurrent(nn, cls(shape[-1], o["units"], batch_first=True, dtype=dtype))
        if kind == "add":
            return nn.Identity()
        raise ValueError(f"layer {ly.name!r}: no PyTorch module for kind {kind!r}")

    class TorchNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.order = [(ly.name, srcs) for ly, srcs in zip(net.layers, net.sources, strict=True)]
            self.kept = net.kept
            root = nn.Module()
            for ly in net.layers:  # a dotted name nests: b1.attn is attn inside b1
                parent = root
                *path, leaf = ly.name.split(".")
                for part in path:
                    if not hasattr(parent, part):
                        parent.add_module(part, nn.Module())
                    parent = getattr(parent, part)
                parent.add_module(leaf, module(ly))
            for name, child in root.named_children():
                self.add_module(name, child)

        def forward(self, x: Any) -> Any:
            kept: dict[str, Any] = {}
            for name, sources in self.order:
                if sources is not None:
                    x = sum(kept[s] for s in sources)
                x = self.get_submodule(name)(x)
                if name in self.kept:
                    kept[name] = x
            return x

    return TorchNet()


def _with_activation(base: Any, act: Any) -> Any:
    """``base`` (Linear, Conv2d) followed by ``act`` (None: none), its weights named as
    ``base``'s."""
    if act is None:
        return base

    class WithActivation(base):
        def forward(self, x: Any) -> Any:
            return act()(super().forward(x))

    return WithActivation


def _Positional(nn: Any, torch: Any, shape: tuple, dtype: Any) -> Any:  # noqa: N802
    class Positional(nn.Embedding):
        def forward(self, x: Any) -> Any:
            return x + self.weight

    return Positional(shape[0], shape[1], dtype=dtype)


def _Attention(nn: Any, torch: Any, shape: tuple, heads: int, dtype: Any) -> Any:  # noqa: N802
    t = shape[0]

    class Attention(nn.MultiheadAttention):
        def forward(self, x: Any) -> Any:  # type: ignore[override]
            mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
            return super().forward(x, x, x, attn_mask=mask, need_weights=False)[0]

    return Attention(shape[1], heads, batch_first=True, dtype=dtype)


def _Recurrent(nn: Any, rnn: Any) -> Any:  # noqa: N802
    class Recurrent(type(rnn)):
        def forward(self, x: Any) -> Any:  # type: ignore[override]
            return super().forward(x)[0]

    rnn.__class__ = Recurrent
    return rnn
