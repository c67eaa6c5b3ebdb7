"""Checkpoints of the single-process trainer, in the layout of a one-server run (so either trainer
resumes the other's), read and written in this process at step boundaries."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from raysinga.checkpoint import storage, writer
from raysinga.kernels import to_numpy

from .finite import check_finite_state
from .session import RunSession, Start
from .state import run_meta, slice_tensors, slot_names, state_tensors, worker_state


@dataclass(frozen=True)
class _WholeSlice:
    """A parameter held whole by the one server of this layout."""

    param: str
    size: int
    start: int = 0
    server: int = 0

    @property
    def stop(self) -> int:
        return self.size

    @property
    def name(self) -> str:
        return f"{self.param}[0:{self.size}]"


def load_start(start: Start, net: Any, optimizer: Any) -> tuple[dict, dict]:
    """Parameters and non-trainable state to start from (as writable NumPy arrays), with the
    optimizer's state loaded on a resume. ``start`` is verified already."""
    ck = start.checkpoint
    state = net.init_state()
    if ck is None:
        return net.init_params(start.seed), state
    shapes = net.param_shapes()
    if start.resumed:  # every parameter from the checkpoint: none initialised to be overwritten
        assert start.info is not None
        params = {p: np.array(ck.array(p)) for p in shapes}
        opt = start.info["optimizer"]
        # a fork goes on under this job's hyperparameters; a resume under the checkpoint's
        own = optimizer.state_dict() if start.kind == "fork" else opt
        optimizer.load_state_dict(
            {
                "name": opt["name"],
                "hparams": own["hparams"],
                "schedule": own["schedule"],
                "slots": {
                    f"{p}/{s}": ck.array(f"{p}/{s}") for p in shapes for s in slot_names(ck, p)
                },
                "counts": {p: int(opt["counts"].get(p, 0)) for p in shapes},
            }
        )
    else:  # --init-from: the parameters that fit, cast to this run's dtype
        params = net.init_params(start.seed)
        for p, stored in start.names.items():
            params[p] = np.array(ck.array(stored), dtype=net.dtype)
    # group 0 / worker 0's saved non-trainable state, as writable copies
    saved = worker_state(ck, 0, 0, list(state))
    state.update({k: np.array(v) for k, v in saved.items()})
    return params, state


def save(
    session: RunSession,
    step: int,
    net: Any,
    optimizer: Any,
    params: dict,
    state: dict,
    cursor: Any,
    history: list,
) -> None:
    """Write and commit the checkpoint of ``step`` (training waits for all of it), unless this
    exact state is committed already."""
    replace = session.replaces(step, (step,))
    if replace is None or step == 0:
        return
    cfg = session.cfg
    t0 = time.perf_counter()
    shapes = net.param_shapes()
    slices = [_WholeSlice(p, int(np.prod(s))) for p, s in shapes.items()]
    st = optimizer.state_dict()
    slice_of = {s.param: s.name for s in slices}
    slots: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in st["slots"].items():
        p, _, slot = key.rpartition("/")
        slots.setdefault(slice_of[p], {})[slot] = to_numpy(arr).reshape(-1)
    values = {s.name: to_numpy(params[s.param]).reshape(-1) for s in slices}
    check_finite_state(
        [
            *((s.param, values[s.name]) for s in slices),
            *((k, to_numpy(v)) for k, v in st["slots"].items()),
        ],
        step,
    )
    # A Downpour checkpoint resumed here may hold other groups' steps under this number.
    tmp = session.staging(step, replace)
    try:
        compression = cfg.checkpoint.compression
        shard = writer.write_shard(
            tmp, 0, slice_tensors(slices, shapes, values, slots, step), compression
        )
        host_state = {k: to_numpy(v) for k, v in state.items()}
        st_shard = writer.write_shard(tmp, 1, state_tensors({(0, 0): host_state}), compression)
        opt = {
            "name": st["name"],
            "hparams": st["hparams"],
            "schedule": st["schedule"],
            "counts": {p: int(st["counts"].get(p, 0)) for p in shapes},
        }
        seed, data = session.start.seed, session.data
        meta = run_meta(cfg, [step], cursor, opt, history, step, seed=seed, data=data)
        session.check_lock()
        path = writer.commit(tmp, step, [shard, st_shard], meta, replace=replace)
    except BaseException:
        storage.remove_dir(tmp)
        raise
    seconds = time.perf_counter() - t0
    session.committed(step, (step,), str(path), seconds, seconds, in_background=False)
