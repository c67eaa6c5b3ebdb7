"""The single-process trainer: the exact reference that the distributed trainer reproduces.

One step is: take batch ``step`` of the plan (a pure function of seed and step), compute loss and
gradients, clip, and let the optimizer update every parameter in name order. Nothing here depends
on wall-clock time or on arrival order, so two runs with one config give the same bits.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import kernels as K
from .config import JobConfig
from .data import BatchPlan, Dataset, has_split, load_dataset
from .data_check import check_splits
from .layers import StepContext
from .model import Net
from .optim import clip_grad_norm, make_optimizer
from .tb_events import EventWriter


@dataclass
class TrainResult:
    params: dict[str, np.ndarray]
    state: dict[str, np.ndarray]
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final_eval(self) -> dict[str, Any] | None:
        evals = [r for r in self.history if r["kind"] == "eval"]
        return evals[-1] if evals else None


class MetricsLog:
    """Records go to the result's history and, one JSON object a line, to
    ``<run_dir>/metrics.jsonl``, flushed at once so a crash loses nothing already reported;
    with ``tensorboard``, also to an event file in ``<run_dir>/tensorboard``."""

    def __init__(self, run_dir: Path, result: TrainResult, tensorboard: bool = False) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.result, self.file = result, (run_dir / "metrics.jsonl").open("w")
        self.events = EventWriter(run_dir) if tensorboard else None
        for rec in result.history:  # a resumed run's records so far
            self._write(rec)

    def _write(self, rec: dict[str, Any]) -> None:
        # NaN and infinity are not JSON: a reader of metrics.jsonl gets null instead.
        self.file.write(json.dumps(_finite_or_null(rec), allow_nan=False) + "\n")
        self.file.flush()
        if self.events is not None:
            self.events.record(rec)

    def record(self, rec: dict[str, Any]) -> None:
        self.result.history.append(rec)
        self._write(rec)

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()
        if self.events is not None:
            self.events.close()


def evaluate(
    net: Net, params: dict, state: dict, data: Dataset, batch_size: int, xp: Any, dtype: Any
) -> dict[str, float]:
    """Mean loss and accuracy over a whole data set, in inference mode."""
    total_loss, correct, n = 0.0, 0.0, len(data)
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(start + batch_size, n))
        x, y = data.get(idx)
        loss, acc = net.evaluate(params, state, xp.asarray(x, dtype), xp.asarray(y))
        total_loss += loss * len(idx)
        correct += (acc or 0.0) * len(idx)
    out = {"test_loss": total_loss / n}
    if net.spec.loss == "softmax_cross_entropy":
        out["test_accuracy"] = correct / n
    return out


class Trainer:
    """Runs a :class:`JobConfig` in this process (no Ray)."""

    def __init__(
        self,
        cfg: JobConfig,
        log: Callable[[str], None] = print,
        resume: bool | str = False,
        init_from: Any = None,
        fresh: bool = False,
    ) -> None:
        """``resume`` (True, or "auto": only if there is a checkpoint), ``init_from`` (a
        checkpoint path, URI, :class:`~raysinga.checkpoint.Checkpoint` or object-store ref whose
        parameters start a new run) and ``fresh`` (delete the run's checkpoints first) work as
        in :class:`~raysinga.distributed.DistributedTrainer`; checkpoints are written in this
        process, in the same layout (one server)."""
        if resume not in (False, True, "auto"):
            raise ValueError(f"resume must be True, False or 'auto', got {resume!r}")
        if sum(map(bool, (resume, init_from is not None, fresh))) > 1:
            raise ValueError("resume, init_from and fresh exclude one another")
        self.cfg, self.log = cfg, log
        self.resume, self.init_from, self.fresh = resume, init_from, fresh
        self.device = _resolve_device(cfg.device)
        self.xp = K.xp_for(self.device)
        self.net = Net(cfg.model, dtype=cfg.dtype)
        self.train_data, self.test_data = open_data(cfg, self.net, log)
        self.plan = BatchPlan(len(self.train_data), cfg.data.batch_size, cfg.seed, cfg.data.shuffle)
        self.optimizer = make_optimizer({k: v for k, v in cfg.updater.items() if k != "clip_norm"})
        self.run_dir = Path(cfg.run_path)

    def fit(self) -> TrainResult:
        from .run_state import LocalCheckpoints  # noqa: PLC0415

        with LocalCheckpoints(self) as ckpts:
            return self._fit(ckpts)

    def _fit(self, ckpts: Any) -> TrainResult:
        cfg, xp, dtype = self.cfg, self.xp, self.net.dtype
        seed = ckpts.seed
        params = {k: xp.asarray(v) for k, v in ckpts.params.items()}
        state = {k: xp.asarray(v) for k, v in ckpts.state.items()}
        result = TrainResult({}, {}, list(ckpts.history))
        self.log(
            f"raysinga: training {cfg.name!r} on {self.device} for {cfg.train_steps} steps, "
            f"batch {cfg.data.batch_size}, {len(self.train_data)} training samples, "
            f"{sum(int(np.prod(s)) for s in self.net.param_shapes().values()):,} parameters"
        )

        window_loss, window_steps, t0 = 0.0, 0, time.perf_counter()
        with MetricsLog(self.run_dir, result, cfg.tensorboard) as metrics:
            ckpts.metrics, record = metrics, metrics.record
            for step in range(ckpts.start, cfg.train_steps):
                if ckpts.stop_signal is not None:
                    ckpts.save(step, params, state, result.history, final=True)
                    ckpts.preempted(step)
                b = ckpts.cursor.batch(step)
                epoch, _ = self.plan.cursor(b)
                x, y = self.train_data.get(self.plan.indices(b))
                ctx = StepContext(train=True, seed=seed, step=b)
                loss, grads, _ = self.net.loss_and_grads(
                    params, state, xp.asarray(x, dtype), xp.asarray(y), ctx
                )
                if not np.isfinite(loss):
                    raise NonFiniteLoss(loss, step, first_step=ckpts.start)
                grad_norm = clip_grad_norm(grads, cfg.clip_norm) if cfg.clip_norm else None
                if grad_norm is not None and not math.isfinite(grad_norm):
                    raise NonFiniteLoss(
                        grad_norm, step, what="gradient norm", first_step=ckpts.start
                    )
                lr = self.optimizer.lr(step)
                self.optimizer.update_all(step, params, grads)
                window_loss, window_steps = window_loss + loss, window_steps + 1

                done = step + 1
                if done % cfg.disp_freq == 0 or done == cfg.train_steps:
                    dt = time.perf_counter() - t0
                    rec = {
                        "kind": "train",
                        "step": done,
                        "epoch": epoch,
                        "loss": window_loss / window_steps,
                        "lr": lr,
                        "samples_per_s": window_steps * cfg.data.batch_size / max(dt, 1e-9),
                    }
                    if grad_norm is not None:
                        rec["grad_norm"] = grad_norm
                    record(rec)
                    self.log(_format(rec, cfg.train_steps))
                    window_loss, window_steps, t0 = 0.0, 0, time.perf_counter()
                at_test = (cfg.test_freq and done % cfg.test_freq == 0) or done == cfg.train_steps
                if at_test and self.test_data is not None:
                    rec = {
                        "kind": "eval",
                        "step": done,
                        **evaluate(
                            self.net,
                            params,
                            state,
                            self.test_data,
                            cfg.data.eval_batch_size,
                            xp,
                            dtype,
                        ),
                    }
                    record(rec)
                    self.log(_format(rec, cfg.train_steps))
                    t0 = time.perf_counter()  # evaluation time is not training throughput
                if ckpts.due(done):
                    ckpts.save(done, params, state, result.history)
                    t0 = time.perf_counter()
            ckpts.save(cfg.train_steps, params, state, result.history, final=True)
        result.params = {k: K.to_numpy(v) for k, v in params.items()}
        result.state = {k: K.to_numpy(v) for k, v in state.items()}
        return result


class NonFiniteLoss(FloatingPointError):
    """The loss (or the gradients' norm) became NaN or infinite: the run stops before a
    checkpoint can take the state it leads to, naming the likely cause."""

    def __init__(
        self,
        loss: float,
        step: int,
        group: int | None = None,
        what: str = "loss",
        first_step: int = 0,
    ) -> None:
        where = f"step {step}" if group is None else f"step {step} of group {group}"
        if step <= first_step:  # nothing trained yet: the inputs, not the optimizer
            cause = "likely the data: check it for NaN or infinite values"
        else:
            cause = "likely the learning rate: lower updater.lr or set updater.clip_norm"
        super().__init__(
            f"{what} is {loss} at {where}; the run stops, its last checkpoint is from before "
            f"({cause})"
        )
        self.step, self.group = step, group


class NonFiniteState(FloatingPointError):
    """A checkpoint was about to take NaN or infinite values: it is never committed."""


def first_nonfinite(named: Any, chunk: int = 1 << 20) -> str | None:
    """The name of the first array of ``named`` ((name, array) pairs) holding a NaN or an
    infinity, or None; checked in pieces, so the check allocates little whatever the size."""
    for name, a in named:
        flat = np.asarray(a).reshape(-1)
        if flat.dtype.kind != "f":
            continue
        for i in range(0, flat.size, chunk):
            if not np.isfinite(flat[i : i + chunk]).all():
                return name
    return None


def check_finite_state(named: Any, step: int) -> None:
    """Refuse to checkpoint a state that holds NaN or infinite values."""
    bad = first_nonfinite(named)
    if bad is not None:
        raise NonFiniteState(
            f"{bad} holds NaN or infinite values at step {step}: not checkpointed, the run "
            "stops (likely the learning rate: lower updater.lr or set updater.clip_norm)"
        )


def _finite_or_null(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite_or_null(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite_or_null(x) for x in v]
    return v


def _resolve_device(want: str) -> str:
    if want == "auto":
        return K.device()
    if want == "gpu" and not K.gpu_available():
        raise RuntimeError(
            f"device: gpu requested but no GPU is usable: {K.gpu_unavailable_reason()}"
        )
    return want


def open_data(cfg: JobConfig, net: Net, log: Callable[[str], None]) -> tuple[Dataset, Any]:
    """The training and test splits, checked against the model and each other before step 0:
    a mistake in the data is refused now, not after minutes of training (or at the final
    evaluation). Splits too large to scan whole are sampled, and the log says so."""
    source = cfg.data.source
    train = load_dataset(source, split="train")
    test = load_dataset(source, split="test") if has_split(source, "test") else None
    notes = check_splits(
        train,
        test,
        input_shape=net.spec.input_shape,
        output_shape=net.output_shape,
        loss=net.spec.loss,
        batch_size=cfg.data.batch_size,
        scan_bytes=cfg.data.scan_bytes,
        source=source,
    )
    for note in notes:
        log(f"raysinga: {note}")
    _check_fits(net, train)
    return train, test


def _check_fits(net: Net, data: Dataset) -> None:
    if tuple(data.sample_shape) != tuple(net.spec.input_shape):
        raise ValueError(
            f"model.input_shape {list(net.spec.input_shape)} does not match the data's sample "
            f"shape {list(data.sample_shape)}; set data.source.sample_shape or the model's input"
        )
    classes = getattr(data, "num_classes", None)
    if net.spec.loss == "softmax_cross_entropy" and classes and net.output_shape != (classes,):
        raise ValueError(
            f"model.layers[{len(net.spec.layers) - 1}]: the net's output shape "
            f"{list(net.output_shape)} does not match the {classes} classes of data.source"
        )


def _format(rec: dict[str, Any], total: int) -> str:
    width = len(str(total))
    head = f"step {rec['step']:>{width}}/{total}"
    if rec["kind"] == "eval":
        acc = f"  test_accuracy {rec['test_accuracy']:.4f}" if "test_accuracy" in rec else ""
        return f"{head}  test_loss {rec['test_loss']:.4f}{acc}"
    return (
        f"{head}  epoch {rec['epoch']}  loss {rec['loss']:.4f}  lr {rec['lr']:.4g}  "
        f"{rec['samples_per_s']:,.0f} samples/s"
    )
