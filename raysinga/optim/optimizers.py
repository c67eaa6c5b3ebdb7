"""Optimizers (SGD, AdaGrad, RMSProp, Adam, AdamW) on NumPy or CuPy arrays (their common part:
:mod:`.base`).

The math follows torch.optim's single-tensor code operation by operation (same formulas, same order
of operations), so results agree with PyTorch to rounding. Every update is element-wise and in
place, so a server that owns a slice of a parameter and updates it under its own name (e.g.
"fc1/W[0:512]") gets bit-for-bit the values the whole-tensor update would give.

Slots (momentum, Adam's m and v, ...) are keyed by the name passed to ``update`` and allocated on
the first update of that name, on the parameter's device and in its dtype. The learning rate comes
from a Schedule evaluated at the global step; Adam's bias correction uses the number of updates
applied to that name, kept per name so that it survives a checkpoint.
"""

from __future__ import annotations

from typing import Any, ClassVar

from raysinga.kernels.common import adam_step_values

from .base import Optimizer, hparam_flag, hparam_number, lerp_

__all__ = [
    "OPTIMIZERS",
    "SGD",
    "AdaGrad",
    "Adam",
    "AdamW",
    "Optimizer",
    "RMSProp",
    "make_optimizer",
]


class SGD(Optimizer):
    name = "sgd"
    defaults = {"momentum": 0.0, "nesterov": False, "weight_decay": 0.0}

    def _check(self, h: dict[str, Any]) -> None:
        super()._check(h)
        h["momentum"] = hparam_number(self.name, "momentum", h["momentum"])
        h["nesterov"] = hparam_flag(self.name, "nesterov", h["nesterov"])
        if h["nesterov"] and h["momentum"] == 0:
            raise ValueError("optimizer 'sgd': nesterov needs momentum > 0")

    @staticmethod
    def _slot_names(h: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum",) if h["momentum"] else ()

    def _apply(self, xp, param, grad, s, lr, t) -> None:
        h = self.hparams
        g = grad
        if h["weight_decay"]:
            g = grad + h["weight_decay"] * param  # a new array: the caller's grad stays as given
        if h["momentum"]:
            buf = s["momentum"]
            buf *= h["momentum"]
            buf += g  # zero-initialised, so the first step gives buf = g as torch's clone does
            g = g + h["momentum"] * buf if h["nesterov"] else buf
        param -= lr * g

    def _fused(self, param, grad, s, lr, t, step=None, copy=None) -> bool:
        from raysinga.kernels import gpu_optim  # noqa: PLC0415 - CuPy, only for CuPy parameters

        h = self.hparams
        buf = s["momentum"] if h["momentum"] else None
        gpu_optim.sgd_update(
            param, grad, buf, lr, h["momentum"], h["weight_decay"], h["nesterov"], step, copy
        )
        return True


class AdaGrad(Optimizer):
    name = "adagrad"
    defaults = {"eps": 1e-10, "initial_accumulator_value": 0.0, "weight_decay": 0.0}

    def _check(self, h: dict[str, Any]) -> None:
        super()._check(h)
        key = "initial_accumulator_value"
        h[key] = hparam_number(self.name, key, h[key])

    @staticmethod
    def _slot_names(h: dict[str, Any]) -> tuple[str, ...]:
        return ("sum",)

    def _initial_slot(self, xp, slot, param):
        return xp.full_like(param, self.hparams["initial_accumulator_value"])

    def _apply(self, xp, param, grad, s, lr, t) -> None:
        h = self.hparams
        g = grad + h["weight_decay"] * param if h["weight_decay"] else grad
        s["sum"] += g * g
        std = xp.sqrt(s["sum"])
        std += h["eps"]
        param += -lr * g / std


class RMSProp(Optimizer):
    name = "rmsprop"
    defaults = {"alpha": 0.99, "eps": 1e-8, "momentum": 0.0, "centered": False, "weight_decay": 0}

    def _check(self, h: dict[str, Any]) -> None:
        super()._check(h)
        h["alpha"] = hparam_number(self.name, "alpha", h["alpha"])
        if h["alpha"] > 1:
            raise ValueError(f"optimizer 'rmsprop': alpha must be <= 1, got {h['alpha']!r}")
        h["momentum"] = hparam_number(self.name, "momentum", h["momentum"])
        h["centered"] = hparam_flag(self.name, "centered", h["centered"])

    @staticmethod
    def _slot_names(h: dict[str, Any]) -> tuple[str, ...]:
        return (
            ("square_avg",)
            + (("grad_avg",) if h["centered"] else ())
            + (("momentum",) if h["momentum"] else ())
        )

    def _apply(self, xp, param, grad, s, lr, t) -> None:
        h = self.hparams
        g = grad + h["weight_decay"] * param if h["weight_decay"] else grad
        sq = s["square_avg"]
        sq *= h["alpha"]
        sq += (1 - h["alpha"]) * g * g
        if h["centered"]:
            ga = s["grad_avg"]
            lerp_(ga, g, 1 - h["alpha"])
            avg = sq - ga * ga
            xp.sqrt(avg, out=avg)
        else:
            avg = xp.sqrt(sq)
        avg += h["eps"]
        if h["momentum"]:
            buf = s["momentum"]
            buf *= h["momentum"]
            buf += g / avg
            param -= lr * buf
        else:
            param += -lr * g / avg


class Adam(Optimizer):
    name = "adam"
    defaults = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    decoupled: ClassVar[bool] = False  # AdamW: decay the parameter, not the gradient

    def _check(self, h: dict[str, Any]) -> None:
        super()._check(h)
        b = h["betas"]
        if not isinstance(b, (list, tuple)) or len(b) != 2:
            raise ValueError(f"optimizer {self.name!r}: betas must be a pair, got {b!r}")
        h["betas"] = (
            hparam_number(self.name, "betas[0]", b[0], upper=1.0),
            hparam_number(self.name, "betas[1]", b[1], upper=1.0),
        )

    @staticmethod
    def _slot_names(h: dict[str, Any]) -> tuple[str, ...]:
        return ("m", "v")

    def _apply(self, xp, param, grad, s, lr, t) -> None:
        h = self.hparams
        beta1, beta2 = h["betas"]
        wd = h["weight_decay"]
        g = grad
        if wd and self.decoupled:
            param *= 1 - lr * wd
        elif wd:
            g = grad + wd * param
        m, v = s["m"], s["v"]
        lerp_(m, g, 1 - beta1)
        v *= beta2
        v += (1 - beta2) * g * g
        step_size = lr / (1 - beta1**t)
        denom = xp.sqrt(v)
        denom /= (1 - beta2**t) ** 0.5
        denom += h["eps"]
        param += -step_size * m / denom

    def _fused(self, param, grad, s, lr, t, step=None, copy=None) -> bool:
        from raysinga.kernels import gpu_optim  # noqa: PLC0415 - CuPy, only for CuPy parameters

        h = self.hparams
        gpu_optim.adam_update(
            param,
            grad,
            s["m"],
            s["v"],
            lr,
            t,
            h["betas"],
            h["eps"],
            h["weight_decay"],
            self.decoupled,
            step,
            copy,
        )
        return True

    def _step_values(self, lr: float, t: int) -> tuple[float, ...]:
        h = self.hparams
        return adam_step_values(lr, t, h["betas"], h["weight_decay"])


class AdamW(Adam):
    name = "adamw"
    defaults = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}  # torch's defaults
    decoupled = True


OPTIMIZERS: dict[str, type[Optimizer]] = {c.name: c for c in (SGD, AdaGrad, RMSProp, Adam, AdamW)}


def make_optimizer(spec: dict) -> Optimizer:
    """An optimizer from ``{"name": "sgd", "lr": 0.1 or a schedule dict, **hyperparameters}``."""
    if not isinstance(spec, dict):
        raise TypeError(f"optimizer spec must be a dict, got {type(spec).__name__}")
    args = dict(spec)
    name = args.pop("name", None)
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](**args)
