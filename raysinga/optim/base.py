"""The optimizers' common part: hyperparameters checked once, slots allocated on first use, the
update's paths (NumPy, threaded NumPy, fused CUDA kernels, a replayed CUDA graph's step values)
and the state a checkpoint keeps. The optimizers themselves are in :mod:`.optimizers`."""

from __future__ import annotations

import math
import numbers
from typing import Any, ClassVar

import numpy as np

from raysinga.kernels import get_array_module, precision, to_numpy

from .grads import chunks, on_threads
from .schedules import Schedule, make_schedule, schedule_from_state
from .server_updates import ServerUpdates, check_float


def hparam_number(opt: str, key: str, v: Any, upper: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"optimizer {opt!r}: {key} must be a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v) or v < 0 or (upper is not None and v >= upper):
        bound = f"in [0, {upper:g})" if upper is not None else ">= 0"
        raise ValueError(f"optimizer {opt!r}: {key} must be {bound}, got {v!r}")
    return v


def hparam_flag(opt: str, key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"optimizer {opt!r}: {key} must be true or false, got {v!r}")
    return v


def lerp_(a: Any, b: Any, w: float) -> None:
    # torch's lerp: two formulas, picked by |w| < 0.5 so the result stays exact at both ends.
    if abs(w) < 0.5:
        a += w * (b - a)
    else:
        a[...] = b - (b - a) * (1.0 - w)


class Optimizer(ServerUpdates):
    """Base class. Subclasses set ``name``, ``defaults`` and implement ``_check`` and ``_apply``.
    A parameter server's own updates are :class:`.server_updates.ServerUpdates`'s."""

    name: ClassVar[str] = ""
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, lr: float | dict | Schedule = 0.01, **hparams: Any) -> None:
        self.schedule = make_schedule(lr)
        self.hparams = self._hparams(hparams)
        self._slots: dict[str, dict[str, Any]] = {}  # param name -> slot name -> array
        self._ready: set[str] = set()  # names whose slots live on the param's device and dtype
        self.counts: dict[str, int] = {}  # param name -> updates applied
        # param name -> its bfloat16 copy, written with each update (precision.WeightCopies's
        # words: the bf16 compute precision); not part of the state
        self.bf16_copies: dict[str, Any] = {}

    def _hparams(self, given: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"unknown hyperparameter(s) {unknown} for optimizer {self.name!r}; "
                f"allowed: {sorted(['lr', *self.defaults])}"
            )
        h = {**self.defaults, **given}
        self._check(h)
        return h

    def _check(self, h: dict[str, Any]) -> None:
        """Validate and normalise ``h`` in place."""
        for k in ("eps", "weight_decay"):
            if k in h:
                h[k] = hparam_number(self.name, k, h[k])

    def slot_names(self) -> tuple[str, ...]:
        """The slots each parameter name gets, e.g. ("m", "v") for Adam."""
        return self._slot_names(self.hparams)

    @staticmethod
    def _slot_names(h: dict[str, Any]) -> tuple[str, ...]:
        raise NotImplementedError

    def _apply(self, xp: Any, param: Any, grad: Any, s: dict[str, Any], lr: float, t: int) -> None:
        raise NotImplementedError

    def _fused(
        self,
        param: Any,
        grad: Any,
        s: dict[str, Any],
        lr: float,
        t: int,
        step: Any = None,
        copy: Any = None,
    ) -> bool:
        """Apply the update to a contiguous CuPy ``param`` in one fused kernel; False where this
        optimizer has none (then ``_apply`` runs, as CuPy array operations). ``step``: the
        values of :meth:`_step_values` in device memory, read in place of ``lr`` and ``t``.
        ``copy``: the parameter's bfloat16 copy, written by the same kernel."""
        return False

    def _step_values(self, lr: float, t: int) -> tuple[float, ...]:
        """What a fused kernel reads from device memory in a replayed CUDA graph: the values
        that change from step to step (default: the rate)."""
        return (lr,)

    # The factor on the schedule's rate, set by who runs the optimizer (a server of an
    # asynchronous topology: 1 / its groups, JobConfig.lr_scale); not part of the state.
    lr_scale: float = 1.0

    def lr(self, step: int) -> float:
        lr = self.schedule(step)
        return lr if self.lr_scale == 1.0 else lr * self.lr_scale

    def update(
        self, step: int, name: str, param: Any, grad: Any, pool: Any = None, values: Any = None
    ) -> None:
        """Update ``param`` in place; ``step`` is the global step (it picks the learning rate).

        With a thread pool (``concurrent.futures.Executor``), a large NumPy parameter is updated
        in contiguous chunks on several threads. Every optimizer here is element-wise, so the
        result is bit-identical to one pass; NumPy releases the GIL inside its loops.

        ``values`` (a step recorded as a CUDA graph: ``kernels.gpu_graph.StepValues``): the rate
        and what else changes from step to step are read from device memory, so that each
        replay applies its own step's.
        """
        xp = get_array_module(param)
        check_float(name, param)
        # The stub sends NumPy gradients; a GPU server's parameters are CuPy (no copy otherwise).
        grad = xp.asarray(grad, dtype=param.dtype)
        if grad.shape != param.shape:
            raise ValueError(f"gradient for {name!r} has shape {grad.shape}, param {param.shape}")
        self._prepare_once(xp, name, param)
        t = self.counts.get(name, 0) + 1
        slots, lr = self._slots.get(name, {}), self.lr(step)
        pieces = chunks(param.size, pool) if xp is np and param.flags.c_contiguous else []
        on_device = None
        if values is not None:
            on_device = values.floats(
                f"optimizer/{name}",
                len(self._step_values(lr, t)),
                lambda s, _: self._step_values(self.lr(s), self.counts.get(name, 0) + 1),
            )
        copy = self.bf16_copies.get(name)
        if (
            xp is not np
            and param.flags.c_contiguous
            and self._fused(param, grad, slots, lr, t, on_device, copy)
        ):
            copy = None  # one fused kernel on the GPU, bit-identical to _apply, wrote it
        elif (
            on_device is not None
            and not param.flags.c_contiguous
            and self._fused_strided(param, grad, slots, lr, t, on_device, copy)
        ):
            copy = None
        elif on_device is not None:  # CuPy array operations with the rate as a device value
            if type(self)._step_values is not Optimizer._step_values:
                raise RuntimeError(
                    f"optimizer {self.name!r}: {name!r} (not contiguous) has no fused update "
                    "that a CUDA graph can replay with each step's values"
                )
            self._apply(xp, param, grad, slots, on_device[:1].astype(param.dtype), t)
        elif len(pieces) > 1:
            p, g = param.reshape(-1), np.ascontiguousarray(grad).reshape(-1)
            flat = {k: v.reshape(-1) for k, v in slots.items()}

            def run(ab: tuple[int, int]) -> None:
                a, b = ab
                self._apply(xp, p[a:b], g[a:b], {k: v[a:b] for k, v in flat.items()}, lr, t)

            on_threads(pool, run, pieces)
        else:
            self._apply(xp, param, grad, slots, lr, t)
        if copy is not None:  # no fused kernel wrote it: a pass of its own
            precision.write_copy(param, copy)
        self.counts[name] = t

    def _prepare_once(self, xp: Any, name: str, param: Any) -> None:
        if name not in self._ready:
            self._prepare(xp, name, param)

    def _fused_strided(
        self, param: Any, grad: Any, slots: dict, lr: float, t: int, on_device: Any, copy: Any
    ) -> bool:
        """The fused kernel of a step that a CUDA graph replays, for a parameter that is not
        contiguous (a view): run on contiguous copies of it, its slots and its bfloat16 copy,
        which are then written back (copies a graph replays too). False where this optimizer
        has no fused kernel."""
        xp = get_array_module(param)
        p = xp.ascontiguousarray(param)
        s = {k: xp.ascontiguousarray(v) for k, v in slots.items()}
        c = None if copy is None else xp.ascontiguousarray(copy)
        if not self._fused(p, xp.ascontiguousarray(grad), s, lr, t, on_device, c):
            return False
        for dst, src in [(param, p), (copy, c), *((slots[k], v) for k, v in s.items())]:
            if dst is not None and src is not dst:
                dst[...] = src
        return True

    def update_all(
        self, step: int, params: dict, grads: dict, pool: Any = None, values: Any = None
    ) -> None:
        """Update every parameter that has a gradient, in name order (deterministic)."""
        extra = sorted(set(grads) - set(params))
        if extra:
            raise KeyError(f"gradients for unknown parameter(s) {extra}")
        for name in sorted(grads):
            self.update(step, name, params[name], grads[name], pool, values)

    def advance(self, names: Any) -> None:
        """Count one update of each of ``names`` without computing it: a replayed CUDA graph
        applied it (the host's step counts, which Adam's bias corrections and checkpoints
        read, stay those of the updates done)."""
        for name in names:
            self.counts[name] = self.counts.get(name, 0) + 1

    def _initial_slot(self, xp: Any, slot: str, param: Any) -> Any:
        return xp.zeros_like(param)

    def _prepare(self, xp: Any, name: str, param: Any) -> None:
        loaded = self._slots.get(name, {})
        slots = {}
        for slot in self.slot_names():
            if slot not in loaded:
                slots[slot] = self._initial_slot(xp, slot, param)
                continue
            a = loaded[slot]
            if tuple(a.shape) != param.shape:
                raise ValueError(
                    f"slot {name}/{slot} has shape {tuple(a.shape)}, parameter {param.shape}"
                )
            # A copy: loaded arrays may be read-only zero-copy views of a checkpoint.
            # NumPy cannot read a CuPy array implicitly; CuPy reads both (and other devices).
            src = to_numpy(a) if xp is np else a
            slots[slot] = xp.array(src, dtype=param.dtype, copy=True)
        if slots:
            self._slots[name] = slots
        self._ready.add(name)

    def state_dict(self) -> dict:
        """Plain data plus arrays: live references, not copies (serialise before updating)."""
        slots = {
            f"{name}/{slot}": arr
            for name in sorted(self._slots)
            for slot, arr in sorted(self._slots[name].items())
        }
        hp = {k: list(v) if isinstance(v, tuple) else v for k, v in self.hparams.items()}
        return {
            "name": self.name,
            "hparams": hp,
            "schedule": self.schedule.state_dict(),
            "slots": slots,
            "counts": dict(sorted(self.counts.items())),
        }

    def load_state_dict(self, d: dict) -> None:
        """Load a state_dict; its hyperparameters and schedule replace ours (the checkpoint is
        authoritative), a different optimizer name is refused. Arrays are copied to each
        parameter's device and dtype on its next update."""
        keys = {"name", "hparams", "schedule", "slots", "counts"}
        if not isinstance(d, dict) or set(d) != keys:
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"optimizer state must have keys {sorted(keys)}, got {got}")
        if d["name"] != self.name:
            raise ValueError(f"cannot load {d['name']!r} optimizer state into {self.name!r}")
        # Validate everything before touching self, so a bad state leaves us unchanged.
        hparams = self._hparams(dict(d["hparams"]))
        schedule = schedule_from_state(d["schedule"])
        expected = self._slot_names(hparams)
        slots: dict[str, dict[str, Any]] = {}
        for key, arr in d["slots"].items():
            name, _, slot = key.rpartition("/")
            if not name or slot not in expected:
                raise ValueError(f"unexpected slot {key!r} for {self.name!r}; slots: {expected}")
            slots.setdefault(name, {})[slot] = arr
        counts = {}
        for name, c in d["counts"].items():
            if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0:
                raise ValueError(f"update count for {name!r} must be an integer >= 0, got {c!r}")
            counts[name] = int(c)
        for name, c in counts.items():
            missing = [s for s in expected if s not in slots.get(name, {})]
            if c > 0 and missing:
                raise ValueError(f"optimizer state for {name!r} lacks slot(s) {missing}")
        self.hparams, self.schedule = hparams, schedule
        self._slots, self.counts, self._ready = slots, counts, set()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lr={self.schedule!r}, {self.hparams})"
