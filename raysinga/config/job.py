"""The job's schema: every key of a job file, with its type, default, bounds and meaning, stated
once, here (the ``topology`` section's in :mod:`.topology`, ``fault``'s in :mod:`.fault`, a
data source's in :mod:`raysinga.data.kinds`, a layer's in :mod:`raysinga.nn`, an optimizer's
in :mod:`raysinga.optim`). ``docs/concepts.md``'s key tables are drawn from these models."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    PlainValidator,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from raysinga.data.check import DEFAULT_SCAN_BYTES
from raysinga.nn import usercode
from raysinga.nn.model import ModelSpec

from . import rules
from .compute import GpuConfig, PrecisionConfig
from .fault import FaultConfig
from .observe import MetricsConfig, MlflowConfig
from .section import ConfigError, Section, explain, key
from .topology import Topology

# Metrics an evaluation records (raysinga.run.evaluate), by split: higher is better only
# for accuracy.
METRICS = ("loss", "accuracy", "bits")
EVAL_SPLITS = ("valid", "test")
BEST = tuple(f"{s}_{m}" for s in EVAL_SPLITS for m in METRICS)


class HoldOut(Section):
    """``data.validation``: a fraction of the training split held out (``0.1``, or
    ``{fraction: 0.1, seed: 0}``)."""

    fraction: float = key(
        gt=0,
        lt=1,
        description="the share of the training split held out",
        expected="a fraction of the training split (0 < f < 1)",
    )
    seed: int = key(0, ge=0, description="the seed of the rows chosen")


class DataConfig(Section):
    source: dict[str, Any] = key(
        description="a data set, by `kind`; its held-out split is the test set "
        "(`docs/data.md` lists the kinds and their keys)"
    )
    batch_size: int = key(
        64,
        ge=1,
        description="the batch of one step; in a distributed run, the group's batch, split over "
        "its workers (at least one sample each)",
    )
    shuffle: bool = key(
        True, description="a new sample order every epoch; `false`: the stored order"
    )
    eval_batch_size: int = key(1024, ge=1, description="batch size of evaluation")
    validation: HoldOut | None = key(
        None,
        shown="none",
        description="hold out this fraction of the training split (`0.1`, or `{fraction: 0.1, "
        "seed: 0}`) as the validation split: never trained on, evaluated beside the test split "
        "as `valid_loss`, `valid_accuracy`",
    )
    scan_bytes: int = key(
        DEFAULT_SCAN_BYTES,
        ge=0,
        description="the data check scans every row of a split up to this many bytes (128 MiB; "
        "about a second from the page cache for Parquet, less for .npy and Arrow), an even sample "
        "of rows beyond, and logs that it sampled",
    )

    @field_validator("validation", mode="before")
    @classmethod
    def _fraction_alone(cls, v: Any) -> Any:
        return v if v is None or isinstance(v, dict) else {"fraction": v}

    @field_validator("source")
    @classmethod
    def _known_source(cls, spec: dict[str, Any]) -> dict[str, Any]:
        rules.check_source(spec)
        return spec

    def held_out(self) -> dict[str, Any] | None:
        """``validation`` as the data splits take it."""
        return None if self.validation is None else self.validation.model_dump()


class CheckpointConfig(Section):
    dir: str | None = key(
        None,
        min_length=1,
        shown="`<run_dir>/checkpoints`",
        description="a path or a pyarrow URI (`s3://`, `gs://`, `hdfs://`, `file://`)",
        expected="a path or URI",
    )
    keep_last: int = key(3, ge=1, description="keep the newest N checkpoints")
    keep_every: int | None = key(
        None,
        ge=1,
        shown="none",
        description="also keep every checkpoint whose step is a multiple of N",
    )
    keep_best: Literal[BEST] | None = key(
        None,
        shown="none",
        description="also keep the best checkpoint by an evaluation metric: `valid_loss`, "
        "`valid_accuracy`, `valid_bits` or the same of `test` (accuracy: highest; loss, bits: "
        "lowest; ties: the earliest step)",
        expected=f"an evaluation metric ({', '.join(BEST)})",
    )
    object_store: bool = key(
        False, description="also hold each kept checkpoint in Ray's object store"
    )
    compression: Literal["zstd", "lz4"] | None = key(
        None,
        description="`null`, `zstd` or `lz4` (Arrow IPC buffer compression)",
        expected="one of null, zstd, lz4",
    )
    final: bool = key(
        True, description="checkpoint at the end, and on SIGTERM or Ctrl-C before stopping"
    )

    @property
    def best_is_max(self) -> bool:
        """Whether a higher ``keep_best`` value is better (accuracy) or a lower (loss, bits)."""
        return bool(self.keep_best) and self.keep_best.endswith("_accuracy")

    @property
    def best_split(self) -> str | None:
        """The split ``keep_best`` is measured on: "valid" or "test"."""
        return self.keep_best.partition("_")[0] if self.keep_best else None


class InitConfig(Section):
    rename: dict[str, str] = key(
        {},
        description="checkpoint name -> this model's name, for `--init-from` (a name ending in "
        "`/` renames every name it starts)",
        expected="names (text) on both sides",
    )
    strip_prefix: str | None = key(
        None,
        min_length=1,
        description="removed from the front of each checkpoint name first, for `--init-from`",
        expected="a name prefix (text)",
    )

    @field_validator("rename")
    @classmethod
    def _names(cls, rename: dict[str, str]) -> dict[str, str]:
        for old, new in rename.items():
            if not new or not old:
                raise ValueError(f"expected names (text) on both sides, got {old!r}: {new!r}")
            if old.endswith("/") != new.endswith("/"):
                raise ValueError(
                    f"{old!r} -> {new!r}: a prefix (ending in '/') renames to a prefix"
                )
        return rename


class DivergenceConfig(Section):
    factor: float | None = key(
        2.0,
        gt=1,
        description="stop when the mean loss of the newest `window` samples is over this many "
        "times the early level; `null`: only NaN or infinite values stop the run",
        expected="a number > 1 or null",
    )
    early_steps: int = key(
        3,
        ge=1,
        description="the early level is the mean loss of the run's first N steps (every "
        "group's), and for a classifier at least the loss of a uniform guess, ln(classes)",
    )
    window: int = key(
        256,
        ge=1,
        description="samples whose mean loss is checked: the newest step losses (of any group) "
        "holding at least this many",
    )


def _model(v: Any) -> ModelSpec:
    if isinstance(v, ModelSpec):
        return v
    try:
        return ModelSpec.from_dict(v)
    except ValueError as e:  # ModelSpec names the key path
        raise ConfigError(str(e)) from None


def _updater(d: Any) -> dict[str, Any]:
    """The optimizer's spec, checked by building it: its hyperparameters are the optimizer's
    to state (:mod:`raysinga.optim`); ``clip_norm`` and ``async_lr`` apply around it."""
    from raysinga.optim.optimizers import make_optimizer  # noqa: PLC0415
    from raysinga.optim.schedules import make_schedule  # noqa: PLC0415

    if not isinstance(d, dict):
        raise ConfigError(f"updater: expected a mapping, got {type(d).__name__} {d!r}")
    d = dict(d)
    clip = d.pop("clip_norm", None)
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0
    ):
        raise ConfigError(f"updater.clip_norm: expected a positive number, got {clip!r}")
    rule = d.pop("async_lr", None)
    if rule is not None and rule not in ASYNC_LR:
        raise ConfigError(f"updater.async_lr: expected one of {', '.join(ASYNC_LR)}, got {rule!r}")
    if "lr" in d:
        try:
            make_schedule(d["lr"])
        except (ValueError, TypeError) as e:
            raise ConfigError(f"updater.lr: {e}") from None
    try:
        make_optimizer(d)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"updater: {e}") from None
    extra = {k: v for k, v in (("clip_norm", clip), ("async_lr", rule)) if v is not None}
    return {**d, **extra}


ASYNC_LR = ("groups", "none")  # updater.async_lr: how the rate follows asynchronous groups


class JobConfig(Section):
    """A whole job: what :func:`from_dict` and :func:`load` return."""

    name: str = key(
        "run",
        min_length=1,
        pattern=r"^[^/]*$",
        description="the run's name, in the default run directory and the object-store key; no `/`",
        expected="a non-empty string without '/'",
    )
    seed: int = key(
        0,
        ge=0,
        le=2**64 - 1,
        description="initialisation, data order and dropout masks are pure functions of it; a "
        "resume keeps the checkpoint's",
    )
    dtype: Literal["float32", "float64"] = key("float32", description="`float32` or `float64`")
    device: Literal["auto", "cpu", "gpu"] = key(
        "auto", description="`auto`, `cpu` or `gpu` (see `docs/devices.md`)"
    )
    gpu: GpuConfig = key(GpuConfig, shown="", description="how a GPU runs the steps (below)")
    precision: PrecisionConfig = key(
        PrecisionConfig, shown="", description="the precision of the matrix products (below)"
    )
    modules: list[str] = key(
        [],
        shown="none",
        description="Python files or package directories that the model's layers and losses of "
        "your own come from (`docs/layers.md`), relative to the job file: importable here and "
        "shipped to every node with the run",
        expected="a list of paths",
    )
    model: Annotated[ModelSpec, PlainValidator(_model)] = key(
        description="the net: its input shape, layers and loss (below)"
    )
    data: DataConfig = key(description="the data set and batch size (below)")
    updater: Annotated[dict[str, Any], PlainValidator(_updater)] = key(
        description="the optimizer and learning rate (below)"
    )
    train_steps: int = key(
        ge=1, description="steps to train; in a distributed run, steps per group"
    )
    test_freq: int = key(
        0,
        ge=0,
        description="evaluate the test and validation splits every N steps; `0`: only at the "
        "end (and at checkpoints, with `checkpoint.keep_best`)",
    )
    disp_freq: int = key(100, ge=1, description="log and record training metrics every N steps")
    run_dir: str | None = key(
        None,
        min_length=1,
        shown="`runs/<name>`",
        description="where `metrics.jsonl` goes; a local path",
        expected="a path",
    )
    tensorboard: bool = key(
        False,
        description="also write the metrics as TensorBoard event files in `<run_dir>/tensorboard`",
    )
    metrics: MetricsConfig = key(
        MetricsConfig, shown="", description="metrics where a Ray cluster's operators look (below)"
    )
    mlflow: MlflowConfig | None = key(
        None,
        shown="absent",
        description="track the run in MLflow (below; `docs/observe.md`); absent: not",
    )
    topology: Topology | None = key(
        None,
        shown="absent",
        description="servers, groups, workers and their resources (below); absent or `null`: "
        "one process, no Ray",
    )
    checkpoint_after: int = key(0, ge=0, description="no periodic checkpoint before this step")
    checkpoint_frequency: int = key(
        0, ge=0, description="checkpoint every N steps from `checkpoint_after` (`0`: none)"
    )
    checkpoint_every_seconds: float = key(
        0.0,
        ge=0,
        description="also checkpoint when this many seconds have passed (`0`: never)",
        expected="a number of seconds >= 0",
    )
    checkpoint: CheckpointConfig = key(
        CheckpointConfig, shown="", description="where and how checkpoints are kept (below)"
    )
    fault: FaultConfig = key(
        FaultConfig, shown="", description="recovery from lost roles and nodes (below)"
    )
    init: InitConfig = key(
        InitConfig, shown="", description="how `--init-from`'s checkpoint names map onto this model"
    )
    divergence: DivergenceConfig = key(
        DivergenceConfig, shown="", description="when a rising loss stops the run (below)"
    )

    @field_validator("modules", mode="before")
    @classmethod
    def _modules(cls, v: Any, info: ValidationInfo) -> list[str]:
        base = (info.context or {}).get("base") or Path.cwd()
        try:
            return usercode.resolve(v, Path(base))
        except ValueError as e:
            raise ConfigError(str(e)) from None

    # The job as given (YAML's values, before defaults), kept in checkpoints and the run record.
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _across_sections(self) -> JobConfig:
        rules.check_job(self)
        return self

    @property
    def raw(self) -> dict[str, Any]:
        return self._raw

    def with_raw(self, raw: dict[str, Any]) -> JobConfig:
        self._raw = copy.deepcopy(raw)
        return self

    @property
    def clip_norm(self) -> float | None:
        return self.updater.get("clip_norm")

    @property
    def optimizer(self) -> dict[str, Any]:
        """``updater`` less what applies around the optimizer (``clip_norm``, ``async_lr``)."""
        return {k: v for k, v in self.updater.items() if k not in ("clip_norm", "async_lr")}

    def lr_scale(self, topology: Any = None) -> float:
        """The factor on every update's learning rate under ``topology`` (default: the job's):
        1 / its groups for downpour and hogwild with ``updater.async_lr: groups`` (the
        default), whose every group's update lands on the servers; else 1."""
        t = self.topology if topology is None else topology
        if t is None or t.preset not in ("downpour", "hogwild"):
            return 1.0
        return 1.0 if self.updater.get("async_lr", "groups") == "none" else 1.0 / t.n_groups

    @property
    def run_path(self) -> str:
        return self.run_dir or f"runs/{self.name}"

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or f"{self.run_path}/checkpoints"

    def checkpoint_due(self, step: int) -> bool:
        """Whether ``step`` (steps done) is a periodic checkpoint step."""
        f, a = self.checkpoint_frequency, self.checkpoint_after
        return bool(f) and step > 0 and step >= a and (step - a) % f == 0

    def evaluation_due(self, step: int) -> bool:
        """Whether the held-out splits are evaluated once ``step`` steps are done: every
        ``test_freq`` steps, at the end, and (``checkpoint.keep_best``) at each periodic
        checkpoint, whose value the retention compares."""
        if step == self.train_steps or (self.test_freq and step % self.test_freq == 0):
            return True
        return bool(self.checkpoint.keep_best) and self.checkpoint_due(step)

    def next_checkpoint(self, step: int) -> int | None:
        """The first periodic checkpoint step after ``step``, or None."""
        f, a = self.checkpoint_frequency, self.checkpoint_after
        if not f:
            return None
        if step < a:
            return a if a > 0 else f
        return a + ((step - a) // f + 1) * f


# What the job's sections are, by key, for their docs and messages.
DATA_KEYS = {name: info.description for name, info in DataConfig.model_fields.items()}


def from_dict(d: Any, base: str | Path | None = None) -> JobConfig:
    """A job from a mapping of the job file's keys, validated; a refusal is a
    :class:`ConfigError` naming the key path. ``base``: what the paths of ``modules`` are
    relative to (the job file's directory; default: the working directory)."""
    if not isinstance(d, dict):
        raise ConfigError(f"(top level): expected a mapping, got {type(d).__name__} {d!r}")
    rules.storable("", d)
    try:
        cfg = JobConfig.model_validate(d, context={"base": base})
    except ValidationError as e:
        raise ConfigError(explain(e, JobConfig, d)) from None
    return cfg.with_raw(d)
