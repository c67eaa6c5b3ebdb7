"""Job configuration: a YAML file in the spirit of SINGA's job.conf, validated when it is read.

Every error names the key path (``updater.momentum``) and what was expected, so a typo fails at
once rather than a hundred steps into a run. ``--set key.path=value`` overrides go through the same
checks.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raysinga.data.check import DEFAULT_SCAN_BYTES
from raysinga.nn.model import ModelSpec

from .checkpoint import CheckpointConfig, checkpoint_section
from .checks import ConfigError, check_elastic, check_sizes, check_source, storable
from .checks import choice as _choice
from .checks import flag as _flag
from .checks import integer as _int
from .checks import mapping as _mapping
from .checks import section as _section
from .divergence import DivergenceConfig, divergence_section
from .init import InitConfig, init_section
from .topology import Topology, TopologyError


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` as a string; learning rates are written that way, so accept it.
    A key given twice in one mapping is refused: plain YAML lets the second silently win."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                key_node, yaml.ScalarNode
            ):
                continue  # `<<: *defaults` may be overridden, as YAML intends
            key = self.construct_object(key_node)
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first at {first[key].line + 1}:"
                    f"{first[key].column + 1})",
                    key_node.start_mark,
                )
            first[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


ASYNC_LR = ("groups", "none")  # updater.async_lr: how the rate follows asynchronous groups


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _yaml_problem(e: yaml.YAMLError) -> str:
    """What the parser found, on one line."""
    what = [str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x]
    return "; ".join(what) or str(e).splitlines()[0]


TOP_KEYS = {
    "name": "a name for the run (used for the run directory)",
    "seed": "integer seed of initialisation, data order and dropout",
    "dtype": "float32 | float64",
    "device": "auto | cpu | gpu",
    "model": "the net: input_shape, layers, loss",
    "data": "source (a data set; its held-out split is the test set) and batch_size",
    "updater": "optimizer name, lr (number or schedule), its options, clip_norm, async_lr",
    "train_steps": "number of training steps",
    "test_freq": "evaluate on the test (and validation) split every N steps (0: only at the end)",
    "disp_freq": "print training metrics every N steps",
    "run_dir": "where metrics.jsonl is written (default: runs/<name>)",
    "tensorboard": "also write the metrics as TensorBoard event files in <run_dir>/tensorboard "
    "(default false)",
    "topology": "servers, groups, workers per group, resources (absent: one process, no Ray)",
    "checkpoint_after": "no periodic checkpoint before this step (SINGA's checkpoint_after)",
    "checkpoint_frequency": "checkpoint every N steps from checkpoint_after (0: none)",
    "checkpoint_every_seconds": "also checkpoint when this many seconds have passed (0: never)",
    "checkpoint": "dir (a path or URI), keep_last, keep_every, keep_best, object_store, "
    "compression, final",
    "init": "rename, strip_prefix: how --init-from's checkpoint names map onto this model",
    "divergence": "factor, early_steps, window: when a rising loss stops the run",
    "fault": "max_failures, window_s, min_workers, min_groups, grow_check_s, recovery, spares, "
    "replay_steps, replay_mb: how a distributed run recovers from lost roles and nodes",
}
FAULT_KEYS = {
    "max_failures": "recover from at most N lost roles or nodes, then stop with a summary "
    "(default 3; 0: the first loss ends the run)",
    "window_s": "count only the failures of the last this many seconds (default 0: the whole run)",
    "min_workers": "after a loss, go on with as few as this many workers per group where no more "
    "fit (default: topology.workers_per_group, i.e. never fewer)",
    "min_groups": "after a loss, go on with as few as this many groups where no more fit "
    "(default: topology.n_groups)",
    "grow_check_s": "while running smaller than configured, look this often for room to grow "
    "back (default 30)",
    "recovery": "replace (default): a lost worker or stub is replaced alone and its group redoes "
    "the interrupted step; restart: every loss restarts every role from the newest checkpoint",
    "spares": "with recovery: replace, keep an idle spare worker, stub and server on each "
    "group's node, which take over a lost one's place at once (default true)",
    "replay_steps": "with recovery: replace, log this many steps' summed gradients and keep a copy "
    "of each server every half of them, to rebuild a lost server (default 20; 0: restart)",
    "replay_mb": "at most this many MiB of logged gradients per group (default 256)",
}
DATA_KEYS = {
    "source": "a data set, by kind; its held-out split is the test set",
    "batch_size": "the batch of one step (default 64)",
    "shuffle": "a new sample order every epoch (default true)",
    "eval_batch_size": "batch size of evaluation (default 1024)",
    "validation": "hold out this fraction of the training split (0 < f < 1; rows chosen by a "
    "fixed seed, or {fraction: f, seed: n}) as the validation split, evaluated as valid_*",
    "scan_bytes": "the data check scans every row of a split up to this many bytes, an even "
    "sample of rows beyond (default 134217728: 128 MiB)",
}


@dataclass(frozen=True)
class DataConfig:
    source: dict[
        str, Any
    ]  # a data set spec (raysinga.data.load_dataset); "test" is its held-out split
    batch_size: int = 64
    shuffle: bool = True
    eval_batch_size: int = 1024
    scan_bytes: int = DEFAULT_SCAN_BYTES
    validation: dict[str, Any] | None = None  # {"fraction": f, "seed": n}: held out of "train"


@dataclass(frozen=True)
class FaultConfig:
    max_failures: int = 3
    window_s: float = 0.0
    min_workers: int | None = None  # None: topology.workers_per_group
    min_groups: int | None = None  # None: topology.n_groups
    grow_check_s: float = 30.0
    recovery: str = "replace"  # "restart": every loss restarts every role (for comparison)
    spares: bool = True  # replace: idle spare roles wait on each group's node
    replay_steps: int = 20  # replace: the steps logged to rebuild a lost server (0: restart)
    replay_mb: int = 256  # replace: the bound of that log, per group


@dataclass(frozen=True)
class JobConfig:
    model: ModelSpec
    data: DataConfig
    updater: dict[str, Any]
    train_steps: int
    name: str = "run"
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"
    test_freq: int = 0
    disp_freq: int = 100
    run_dir: str | None = None
    tensorboard: bool = False
    topology: Topology | None = None
    checkpoint_after: int = 0
    checkpoint_frequency: int = 0
    checkpoint_every_seconds: float = 0.0
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    init: InitConfig = field(default_factory=InitConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

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


def _optional_int(path: str, v: Any, minimum: int) -> int | None:
    return None if v is None else _int(path, v, minimum)


def _data(d: Any) -> DataConfig:
    d = _mapping("data", d)
    unknown = set(d) - set(DATA_KEYS)
    if unknown:
        raise ConfigError(f"data: unknown key(s) {sorted(unknown)}; allowed: {sorted(DATA_KEYS)}")
    if "source" not in d:
        raise ConfigError("data.source: missing (a data set, e.g. {kind: digits})")
    shuffle = _flag("data.shuffle", d.get("shuffle", True))
    return DataConfig(
        source=check_source(_mapping("data.source", d["source"])),
        batch_size=_int("data.batch_size", d.get("batch_size", 64), 1),
        shuffle=shuffle,
        eval_batch_size=_int("data.eval_batch_size", d.get("eval_batch_size", 1024), 1),
        scan_bytes=_int("data.scan_bytes", d.get("scan_bytes", DEFAULT_SCAN_BYTES), 0),
        validation=_validation(d.get("validation")),
    )


def _validation(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    d = v if isinstance(v, dict) else {"fraction": v}
    d = _section("data.validation", d, {"fraction": "", "seed": ""})
    f = d.get("fraction")
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1:
        raise ConfigError(
            f"data.validation: expected a fraction of the training split (0 < f < 1), got {f!r}"
        )
    return {"fraction": float(f), "seed": _int("data.validation.seed", d.get("seed", 0), 0)}


def _fault(d: Any) -> FaultConfig:
    d = _section("fault", d, FAULT_KEYS)
    return FaultConfig(
        max_failures=_int("fault.max_failures", d.get("max_failures", 3), 0),
        window_s=_seconds("fault.window_s", d.get("window_s", 0)),
        min_workers=_optional_int("fault.min_workers", d.get("min_workers"), 1),
        min_groups=_optional_int("fault.min_groups", d.get("min_groups"), 1),
        grow_check_s=_seconds("fault.grow_check_s", d.get("grow_check_s", 30)),
        recovery=_choice("fault.recovery", d.get("recovery", "replace"), ("replace", "restart")),
        spares=_flag("fault.spares", d.get("spares", True)),
        replay_steps=_int("fault.replay_steps", d.get("replay_steps", 20), 0),
        replay_mb=_int("fault.replay_mb", d.get("replay_mb", 256), 1),
    )


def _seconds(path: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
        raise ConfigError(f"{path}: expected a number of seconds >= 0, got {v!r}")
    return float(v)


def _updater(d: Any) -> dict[str, Any]:
    from raysinga.optim.optimizers import make_optimizer  # noqa: PLC0415 - keeps config importable on its own

    d = dict(_mapping("updater", d))
    clip = d.pop("clip_norm", None)
    if clip is not None and (not isinstance(clip, (int, float)) or clip <= 0):
        raise ConfigError(f"updater.clip_norm: expected a positive number, got {clip!r}")
    rule = d.pop("async_lr", None)
    rule = rule if rule is None else _choice("updater.async_lr", rule, ASYNC_LR)
    if "lr" in d:
        from raysinga.optim.schedules import make_schedule  # noqa: PLC0415

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


def from_dict(d: Any) -> JobConfig:
    d = _mapping("(top level)", d)
    storable("", d)
    unknown = set(d) - set(TOP_KEYS)
    if unknown:
        raise ConfigError(f"{sorted(unknown)[0]}: unknown key; allowed: {', '.join(TOP_KEYS)}")
    for key in ("model", "data", "updater", "train_steps"):
        if key not in d:
            raise ConfigError(f"{key}: missing ({TOP_KEYS[key]})")
    try:
        model = ModelSpec.from_dict(d["model"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    name = d.get("name", "run")
    if not isinstance(name, str) or not name or "/" in name:
        raise ConfigError(f"name: expected a non-empty string without '/', got {name!r}")
    topology = None
    if d.get("topology") is not None:
        try:
            topology = Topology.from_dict(_mapping("topology", d["topology"]))
        except (TopologyError, TypeError) as e:
            raise ConfigError(
                str(e) if str(e).startswith("topology") else f"topology: {e}"
            ) from None
    data = _data(d["data"])
    if topology is not None and data.batch_size < topology.workers_per_group:
        raise ConfigError(
            f"data.batch_size: {data.batch_size} is smaller than "
            f"topology.workers_per_group ({topology.workers_per_group}): every "
            "worker needs at least one sample"
        )
    checkpoint = checkpoint_section(d.get("checkpoint"))
    if checkpoint.best_split == "valid" and data.validation is None:
        raise ConfigError(
            f"checkpoint.keep_best: {checkpoint.keep_best} needs a validation split "
            "(data.validation: a fraction of the training split, e.g. 0.1)"
        )
    device = _choice("device", d.get("device", "auto"), ("auto", "cpu", "gpu"))
    if device == "gpu" and topology is not None and not topology.worker.gpus:
        raise ConfigError(
            "device: gpu in a distributed run needs GPUs for the workers "
            "(topology.worker.gpus, e.g. 1 or 0.5)"
        )
    tensorboard = _flag("tensorboard", d.get("tensorboard", False))
    fault = _fault(d.get("fault"))
    check_elastic(fault, topology)
    dtype = _choice("dtype", d.get("dtype", "float32"), ("float32", "float64"))
    check_sizes(model, data, dtype, topology)
    run_dir = d.get("run_dir")
    if run_dir is not None and (not isinstance(run_dir, str) or not run_dir):
        raise ConfigError(f"run_dir: expected a path, got {run_dir!r}")
    return JobConfig(
        model=model,
        data=data,
        updater=_updater(d["updater"]),
        train_steps=_int("train_steps", d["train_steps"], 1),
        name=name,
        seed=_int("seed", d.get("seed", 0), 0, 2**64 - 1),
        dtype=dtype,
        device=device,
        test_freq=_int("test_freq", d.get("test_freq", 0), 0),
        disp_freq=_int("disp_freq", d.get("disp_freq", 100), 1),
        run_dir=run_dir,
        tensorboard=tensorboard,
        topology=topology,
        checkpoint_after=_int("checkpoint_after", d.get("checkpoint_after", 0), 0),
        checkpoint_frequency=_int("checkpoint_frequency", d.get("checkpoint_frequency", 0), 0),
        checkpoint_every_seconds=_seconds(
            "checkpoint_every_seconds", d.get("checkpoint_every_seconds", 0)
        ),
        checkpoint=checkpoint,
        fault=fault,
        init=init_section(d.get("init")),
        divergence=divergence_section(d.get("divergence")),
        raw=copy.deepcopy(d),
    )


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``["updater.lr=0.05", "train_steps=10"]`` applied to a copy of ``d``; values are YAML."""
    d = copy.deepcopy(d)
    for item in overrides:
        path, sep, text = item.partition("=")
        if not sep or not path:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        keys = path.split(".")
        node = d
        for i, k in enumerate(keys[:-1]):
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(keys[: i + 1])}: is not a mapping, cannot set {path}")
        try:
            node[keys[-1]] = parse_yaml(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: not a YAML value: {_yaml_problem(e)}") from None
    return d


def load(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Read and validate a YAML job file."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{path}: a directory, not a job file")
    if not p.is_file():
        raise ConfigError(f"{path}: no such job file")
    try:
        d = parse_yaml(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the job file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:  # one line: where, and what the parser found
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML: {_yaml_problem(e)}") from None
    return from_dict(apply_overrides(d or {}, overrides or []))
