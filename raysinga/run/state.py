"""What a training checkpoint holds, and how trainers write and read it.

A training checkpoint is an ordinary checkpoint (:mod:`raysinga.checkpoint`) whose shards are
written by the parameter servers, one each, in parallel: every slice of every parameter (kind
``param``) and of every optimizer slot (kind ``slot``, named ``<param>/<slot>``), stored under the
parameter's own name and flat element range. Any other slicing reads it back with
``flat_range`` (resharding). One more shard, written by the driver, holds the workers'
non-trainable state (kind ``state``): group 0 / worker 0's under the plain names (what evaluation
and export use) and every worker's under ``worker/g<G>w<I>/<name>``.

The manifest's ``meta["run"]`` holds everything else resume needs::

    format      RUN_FORMAT
    model       {"digest": ModelSpec.digest(), "spec": ...}
    topology    the topology that wrote it (informative: a different one reshards)
    steps       steps done per group
    data        what the cursor assumes of the data: batch size, order, sample count and
                shape, a digest of some rows (raysinga.data.identity); checked on resume
    cursor      {"batch_offset": B, "skip": [...]}: group g's batch at step s is slot
                s * n_groups + g + B of the run's data order, where slot k is the k-th batch
                index not in skip (batches consumed out of turn; see raysinga.data.cursor)
    rng         {"seed": S}: the seed of initialisation, data order and dropout masks; every
                random draw is a pure function of it and of step/sample counters, so the
                seed is the whole RNG state
    optimizer   {"name", "hparams", "schedule", "counts": {param: updates applied}}
    history     the metric records so far (metrics.jsonl up to this step), ending with this
                checkpoint's own record: its step (its timings are known only once committed)
    best        the best evaluation so far ({"step", "metric", "value"}) or None
    config      the job as given
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raysinga.checkpoint import Checkpoint, CheckpointError, storage
from raysinga.checkpoint.finetune import MatchReport
from raysinga.checkpoint.format import TensorInfo
from raysinga.data.cursor import DataCursor

RUN_FORMAT = 1
WORKER_PREFIX = "worker/"


def worker_key(group: int, index: int, name: str) -> str:
    return f"{WORKER_PREFIX}g{group}w{index}/{name}"


# --------------------------------------------------------------------------- writing


def slice_tensors(
    slices: list[Any],
    shapes: dict[str, tuple[int, ...]],
    values: dict[str, np.ndarray],
    slots: dict[str, dict[str, np.ndarray]],
    version: int,
) -> list[tuple[TensorInfo, np.ndarray]]:
    """A server's shard: its parameter slices, then their optimizer slots.

    ``values`` and ``slots`` are keyed by slice name (``Slice.name``); slots of a slice that
    has not been updated yet may be absent.
    """
    out = []
    for s in slices:
        shape, arr = tuple(shapes[s.param]), values[s.name]
        out.append(
            (TensorInfo(s.param, "param", shape, str(arr.dtype), s.start, s.stop, version), arr)
        )
    for s in slices:
        for slot, arr in sorted(slots.get(s.name, {}).items()):
            info = TensorInfo(
                f"{s.param}/{slot}",
                "slot",
                tuple(shapes[s.param]),
                str(arr.dtype),
                s.start,
                s.stop,
                version,
            )
            out.append((info, arr))
    return out


def state_tensors(
    states: dict[tuple[int, int], dict[str, np.ndarray]],
) -> list[tuple[TensorInfo, np.ndarray]]:
    """The driver's shard: non-trainable state of every worker (keyed by (group, index))."""
    out = []
    first = states.get((0, 0), {})
    named = [(n, a) for n, a in first.items()]
    named += [
        (worker_key(g, i, n), a) for (g, i), st in sorted(states.items()) for n, a in st.items()
    ]
    for name, a in named:
        a = np.ascontiguousarray(a)
        out.append((TensorInfo(name, "state", a.shape, str(a.dtype), 0, a.size), a))
    return out


def merge_optimizer(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The servers' optimizer descriptions as one: update counts by parameter."""
    counts: dict[str, int] = {}
    for p in parts:
        for param, c in p["counts"].items():
            if counts.setdefault(param, c) != c:
                raise CheckpointError(
                    f"optimizer: slices of {param!r} disagree on the update count "
                    f"({counts[param]} vs {c})"
                )
    first = parts[0]
    return {
        "name": first["name"],
        "hparams": first["hparams"],
        "schedule": first["schedule"],
        "counts": dict(sorted(counts.items())),
    }


def run_meta(
    cfg: Any,
    steps: list[int],
    cursor: DataCursor,
    optimizer: dict[str, Any],
    history: list[dict[str, Any]],
    step: int,
    seed: int | None = None,
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest meta of the training checkpoint of ``step`` (see the module's docstring)."""
    topo = cfg.topology.to_dict() if cfg.topology is not None else None
    history = [*history, {"kind": "checkpoint", "step": step}]
    return {
        "run": {
            "format": RUN_FORMAT,
            "name": cfg.name,
            "model": {"digest": cfg.model.digest(), "spec": cfg.model.to_dict()},
            "topology": topo,
            "steps": list(steps),
            "cursor": cursor.to_dict(),
            "rng": {"seed": cfg.seed if seed is None else seed},
            # the matrix products' precision (the tensors are float32 master state whatever it is)
            "precision": {"compute": cfg.precision.compute},
            "optimizer": optimizer,
            "data": data,
            "history": history,
            "best": best_eval(history, cfg.checkpoint.keep_best),
            "config": storage.redact_all(cfg.raw),  # the job, without credentials
        }
    }


def best_eval(history: list[dict[str, Any]], metric: str | None = None) -> dict[str, Any] | None:
    """The best evaluation by ``metric`` (``checkpoint.keep_best``), or without one: the highest
    test accuracy where every evaluation has one, else the lowest test loss (the validation
    split's where there is no test split). Ties go to the earliest step."""
    evals = [r for r in history if r.get("kind") == "eval"]
    if metric is None:
        for name in ("test_accuracy", "test_loss", "valid_accuracy", "valid_loss"):
            if evals and all(name in r for r in evals):
                metric = name
                break
        else:
            return None
    scored = [r for r in evals if metric in r]
    if not scored:
        return None
    sign = -1.0 if metric.endswith("_accuracy") else 1.0
    r = min(scored, key=lambda r: (sign * r[metric], r["step"]))
    return {"step": r["step"], "metric": metric, "value": r[metric]}


# --------------------------------------------------------------------------- reading


def run_info(ck: Checkpoint) -> dict[str, Any]:
    """``meta["run"]`` of a training checkpoint, checked for the keys resume relies on."""
    run = ck.meta.get("run") if isinstance(ck.meta, dict) else None
    keys = ("format", "model", "steps", "cursor", "rng", "optimizer", "history")
    if not isinstance(run, dict) or any(k not in run for k in keys):
        raise CheckpointError(
            f"{ck.location}: a checkpoint, but not of a training run (no run state in its "
            "manifest); use --init-from to load its parameters into a new run"
        )
    if not isinstance(run["format"], int) or run["format"] > RUN_FORMAT:
        raise CheckpointError(
            f"{ck.location}: run state format {run['format']!r} is newer than this raysinga "
            f"({RUN_FORMAT}); upgrade to resume it"
        )
    return run


def check_fits(
    ck: Checkpoint, shapes: dict[str, tuple[int, ...]], dtype: Any = None
) -> MatchReport:
    """Resume needs every parameter by name and shape, and (given ``dtype``) its values and
    optimizer slots in that dtype: anything else is refused with the list."""
    if dtype is not None:
        want = np.dtype(dtype).name
        wrong = [
            f"{n} ({ck.info(n).dtype})"
            for n in ck.names("param") + ck.names("slot")
            if ck.info(n).dtype != want
        ]
        if wrong:
            raise CheckpointError(
                f"{ck.location}: the run trains in {want} but the checkpoint holds "
                f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}; resume with the "
                "checkpoint's dtype, or start a new run from it with --init-from (which casts)"
            )
    stored = {n: ck.info(n).shape for n in ck.names("param")}
    report = MatchReport()
    for n, shape in stored.items():
        if n not in shapes:
            report.unexpected.append(n)
        elif tuple(shape) != tuple(shapes[n]):
            report.mismatched.append((n, tuple(shape), tuple(shapes[n])))
        else:
            report.matched.append(n)
    report.missing = [n for n in shapes if n not in stored]
    if report.mismatched and not (report.missing or report.unexpected):
        # the same names, other shapes (as a layer of the user's own whose code changed):
        # one line, the first of them named
        name, was, now = report.mismatched[0]
        more = len(report.mismatched) - 1
        raise CheckpointError(
            f"{ck.location}: parameter {name!r} is {list(was)} in the checkpoint and "
            f"{list(now)} in this model{f' (and {more} more)' if more else ''}: the checkpoint "
            "does not fit this model (to start a new run from what matches, use --init-from "
            "instead of --resume)"
        )
    if not report.perfect:
        raise CheckpointError(
            f"{ck.location}: the checkpoint does not fit this model (to start a new run from "
            f"what matches, use --init-from instead of --resume):\n{report}"
        )
    return report


def slot_names(ck: Checkpoint, param: str) -> list[str]:
    pre = param + "/"
    return sorted(
        n[len(pre) :] for n in ck.names("slot") if n.startswith(pre) and "/" not in n[len(pre) :]
    )


def worker_state(ck: Checkpoint, group: int, index: int, names: list[str]) -> dict[str, np.ndarray]:
    """A worker's saved non-trainable state: its own if this checkpoint has it (same topology),
    else group 0 / worker 0's (a different topology)."""
    have = set(ck.names("state"))
    out = {}
    for n in names:
        own = worker_key(group, index, n)
        if own in have:
            out[n] = ck.array(own)
        elif n in have:
            out[n] = ck.array(n)
    return out


def cursor_for(info: dict[str, Any], n_groups: int) -> tuple[list[int], DataCursor]:
    """Steps per group and the data cursor for ``n_groups`` groups, from a checkpoint's run
    state: the same groups continue where they were; a different number of groups starts at
    the slowest one's step, skipping the batches the faster ones took (:mod:`.cursor`)."""
    saved = [int(s) for s in info["steps"]]
    try:
        cursor = DataCursor.from_dict(info["cursor"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"run state: malformed data cursor {info['cursor']!r}: {e}") from e
    return cursor.regroup(saved, n_groups)
