"""The job file's ``checkpoint`` section: where checkpoints go, which are kept (the newest,
every N-th, and the best by a metric of the evaluation at their step), and how they are written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checks import ConfigError, choice, flag, integer, section

CHECKPOINT_KEYS = {
    "dir": "where checkpoints go: a path or a pyarrow URI (default: <run_dir>/checkpoints)",
    "keep_last": "keep the newest N checkpoints (default 3)",
    "keep_every": "also keep every checkpoint whose step is a multiple of N (default: none)",
    "keep_best": "also keep the checkpoint with the best value of this evaluation metric "
    "(valid_loss, valid_accuracy, test_loss, ...; the run evaluates at each periodic checkpoint; "
    "accuracy is best highest, loss and bits lowest; default: none)",
    "object_store": "also put each checkpoint into Ray's object store (default false)",
    "compression": "null | zstd | lz4 (default null)",
    "final": "checkpoint at the end and on SIGTERM/Ctrl-C (default true)",
}
# Metrics an evaluation records (raysinga.run.trainer.evaluate), by split: higher is better only
# for accuracy.
METRICS = ("loss", "accuracy", "bits")
EVAL_SPLITS = ("valid", "test")


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    keep_last: int = 3
    keep_every: int | None = None
    keep_best: str | None = None  # an evaluation metric, e.g. "valid_accuracy"
    object_store: bool = False
    compression: str | None = None
    final: bool = True

    @property
    def best_is_max(self) -> bool:
        """Whether a higher ``keep_best`` value is better (accuracy) or a lower (loss, bits)."""
        return bool(self.keep_best) and self.keep_best.endswith("_accuracy")

    @property
    def best_split(self) -> str | None:
        """The split ``keep_best`` is measured on: "valid" or "test"."""
        return self.keep_best.partition("_")[0] if self.keep_best else None


def checkpoint_section(d: Any) -> CheckpointConfig:
    d = section("checkpoint", d, CHECKPOINT_KEYS)
    where = d.get("dir")
    if where is not None and (not isinstance(where, str) or not where):
        raise ConfigError(f"checkpoint.dir: expected a path or URI, got {where!r}")
    keep_every = d.get("keep_every")
    return CheckpointConfig(
        dir=where,
        keep_last=integer("checkpoint.keep_last", d.get("keep_last", 3), 1),
        keep_every=None if keep_every is None else integer("checkpoint.keep_every", keep_every, 1),
        keep_best=_metric(d.get("keep_best")),
        object_store=flag("checkpoint.object_store", d.get("object_store", False)),
        compression=choice("checkpoint.compression", d.get("compression"), (None, "zstd", "lz4")),
        final=flag("checkpoint.final", d.get("final", True)),
    )


def _metric(v: Any) -> str | None:
    if v is None:
        return None
    allowed = [f"{s}_{m}" for s in EVAL_SPLITS for m in METRICS]
    if v not in allowed:
        raise ConfigError(
            f"checkpoint.keep_best: expected an evaluation metric ({', '.join(allowed)}), got {v!r}"
        )
    return v
