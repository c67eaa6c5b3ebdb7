"""The lineage of a Ray Tune trial of a raysinga job, the pointer a trial reports to Tune as its
checkpoint, and the replay of a lineage (:mod:`raysinga.tune`).

A lineage is the list of segments a trial's state went through: each a stretch of steps run
under one set of hyperparameters, by one trial, starting from the step of the trial it forked
from (population-based training's exploit). Running the segments again, each from the previous
one's checkpoint (:class:`~raysinga.run.trainer.Trainer`'s ``fork_from`` and ``until``), ends
bit-identical to the trial.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from raysinga import config
from raysinga.checkpoint import CheckpointError

POINTER = "raysinga-checkpoint.json"
FORMAT = 1


def flat_overrides(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Tune's ``config`` (flat dotted keys or nested dicts) as dotted job keys -> values."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and not _is_value(key, v):
            out.update(flat_overrides(v, f"{key}."))
        else:
            out[key] = v
    return out


def _is_value(key: str, v: Mapping[str, Any]) -> bool:
    """A mapping that is a job value itself (a schedule ``{kind: cosine, ...}``)."""
    return "kind" in v


def job_for(job: dict[str, Any], params: Mapping[str, Any], **run: Any) -> config.JobConfig:
    """A trial's job: the search's ``job`` (a dict) with the trial's hyperparameters and
    ``run`` keys, as dotted keys."""
    items = {**flat_overrides(params), **run}
    return config.from_dict(
        config.apply_overrides(job, [f"{k}={json.dumps(v)}" for k, v in items.items()])
    )


# ------------------------------------------------------------------------ lineage


def segment(trial: str, params: Mapping[str, Any], start: int, parent: dict | None) -> dict:
    """One stretch of steps run under one set of hyperparameters."""
    return {"trial": trial, "params": flat_overrides(params), "start": start, "from": parent}


def continue_lineage(
    pointer: dict[str, Any] | None, trial: str, params: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The lineage of a trial starting now: a fresh one, or the lineage of the checkpoint it
    starts from with a new segment (its hyperparameters, from that trial and step), unless it is
    its own checkpoint under the same hyperparameters (a restart of the same segment)."""
    if pointer is None:
        return [segment(trial, params, 0, None)]
    step = int(pointer["step"])
    lineage = [dict(s) for s in pointer["lineage"] if s["start"] <= step]
    last = lineage[-1]
    if pointer["trial"] == trial and last["params"] == flat_overrides(params):
        return lineage
    return [*lineage, segment(trial, params, step, {"trial": pointer["trial"], "step": step})]


def read_pointer(where: str | os.PathLike) -> dict[str, Any]:
    """The pointer in a Tune checkpoint directory (or the file itself)."""
    p = Path(where)
    p = p / POINTER if p.is_dir() else p
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p}: not a raysinga Tune checkpoint ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CheckpointError(f"{p}: not a raysinga Tune checkpoint of format {FORMAT}")
    return d


def last_metrics(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The newest training loss and learning rate and evaluation of a run's history."""
    out: dict[str, Any] = {}
    for r in history:
        if r.get("kind") == "train":
            out.update(loss=r["loss"], lr=r["lr"], samples_per_s=r["samples_per_s"])
        elif r.get("kind") == "eval":
            out.update({k: v for k, v in r.items() if k not in ("kind", "step")})
    return out


def replay(
    lineage: Sequence[Mapping[str, Any]] | str | os.PathLike,
    job: str | os.PathLike | Mapping[str, Any],
    work_dir: str | os.PathLike,
    until: int,
    overrides: Sequence[str] = (),
) -> Any:
    """Run a trial's ``lineage`` (a list of segments, or a Tune checkpoint / pointer file, whose
    lineage ends at its step) of ``job`` again in this process, each segment from the previous
    one's checkpoint under its own hyperparameters, to step ``until``. Returns the last
    segment's :class:`~raysinga.run.trainer.TrainResult`: bit-identical to the trial at that step.
    The checkpoints of the segments are written under ``work_dir``."""
    from raysinga.run.trainer import Trainer  # noqa: PLC0415

    if not isinstance(lineage, Sequence) or isinstance(lineage, str):
        lineage = read_pointer(lineage)["lineage"]
    base = load_job(job, overrides)
    source, result = None, None
    for i, seg in enumerate(lineage):
        end = min(lineage[i + 1]["start"] if i + 1 < len(lineage) else until, until)
        if end <= seg["start"]:
            continue  # no steps of its own, or all after `until`
        d = Path(work_dir, f"segment-{i}")
        cfg = job_for(base.raw, seg["params"], name=f"{base.name}-replay-{i}", run_dir=str(d))
        stop = None if end >= cfg.train_steps else end
        result = Trainer(cfg, log=None, fork_from=source, until=stop).fit()
        source = result.checkpoint
    if result is None:
        raise ValueError("the lineage holds no steps to run")
    return result


def load_job(
    job: str | os.PathLike | Mapping[str, Any], overrides: Sequence[str] = ()
) -> config.JobConfig:
    """A job file or dict, with ``overrides`` as ``--set`` takes them."""
    if isinstance(job, Mapping):
        return config.from_dict(config.apply_overrides(dict(job), list(overrides)))
    return config.load(job, list(overrides))
