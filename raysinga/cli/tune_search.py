"""The search expressions of ``raysinga tune`` (:mod:`.tune`): ``KEY=SAMPLER(ARGS)``, a dotted
job key and one of Ray Tune's samplers, its arguments YAML values
(``updater.lr=loguniform(1e-4,1e-1)``, ``data.batch_size=choice(32,64)``), each checked, with the
job at each end of every range, before Ray starts."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from raysinga import config
from raysinga.config import ConfigError
from raysinga.tune.lineage import job_for

SAMPLERS = ("loguniform", "uniform", "choice", "randint", "grid")
# keys each trial sets itself (its name, run directory and checkpoints)
TRIAL_KEYS = ("name", "run_dir", "checkpoint", "checkpoint_frequency")
EXPRESSION = re.compile(r"\s*([A-Za-z_][\w.]*)\s*=\s*([a-z]+)\s*\((.*)\)\s*", re.DOTALL)


@dataclass(frozen=True)
class Search:
    """One searched job key: ``sampler`` over ``args`` (as in ``--search``)."""

    key: str
    sampler: str
    args: tuple[Any, ...]
    text: str

    @property
    def values(self) -> tuple[Any, ...]:
        """The values the job is checked with: both ends of a range, every listed value."""
        if self.sampler == "randint":
            return (self.args[0], self.args[1] - 1)  # Tune's upper bound is exclusive
        return self.args

    def domain(self, mutation: bool = False) -> Any:
        """The Ray Tune sampler (``mutation``: as PBT's ``hyperparam_mutations`` takes it, a
        grid there being a choice of its values)."""
        from ray import tune  # noqa: PLC0415

        if self.sampler == "grid":
            return tune.choice(list(self.args)) if mutation else tune.grid_search(list(self.args))
        if self.sampler == "choice":
            return tune.choice(list(self.args))
        return getattr(tune, self.sampler)(*self.args)


def parse_search(text: str) -> Search:
    """``KEY=SAMPLER(ARGS)`` as a :class:`Search`; a :class:`ConfigError` naming the
    expression where it is not one."""
    m = EXPRESSION.fullmatch(text)
    if not m:
        raise ConfigError(
            f"--search {text!r}: expected KEY=SAMPLER(ARGS), SAMPLER one of {', '.join(SAMPLERS)}"
            " (e.g. updater.lr=loguniform(1e-4,1e-1))"
        )
    key, sampler, inner = m.groups()
    if sampler not in SAMPLERS:
        raise ConfigError(
            f"--search {text!r}: unknown sampler {sampler!r}; one of {', '.join(SAMPLERS)}"
        )
    try:
        args = config.parse_yaml(f"[{inner}]")
    except Exception as e:  # noqa: BLE001 - any YAML error: the expression is what is wrong
        first = str(e).strip().splitlines()[0]
        raise ConfigError(
            f"--search {text!r}: its arguments are not YAML values ({first})"
        ) from None
    if key.split(".")[0] in TRIAL_KEYS:
        raise ConfigError(f"--search {text!r}: {key} is set by each trial, not searched")
    _check_args(text, sampler, args)
    return Search(key, sampler, tuple(args), text)


def _check_args(text: str, sampler: str, args: list[Any]) -> None:
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    if sampler in ("choice", "grid"):
        if not args:
            raise ConfigError(f"--search {text!r}: {sampler} takes one value or more")
        return
    if len(args) != 2 or not all(map(number, args)) or not args[0] < args[1]:
        raise ConfigError(f"--search {text!r}: {sampler} takes two numbers, low < high")
    if sampler == "loguniform" and args[0] <= 0:
        raise ConfigError(f"--search {text!r}: loguniform takes 0 < low < high")
    if sampler == "randint" and not all(isinstance(v, int) for v in args):
        raise ConfigError(f"--search {text!r}: randint takes two integers, low < high (exclusive)")


def check_searches(texts: list[str], job: config.JobConfig) -> list[Search]:
    """The ``--search`` expressions, each checked against ``job`` with every value it names."""
    if not texts:
        raise ConfigError("give at least one --search KEY=SAMPLER(ARGS)")
    searches = [parse_search(t) for t in texts]
    seen: set[str] = set()
    for s in searches:
        if s.key in seen:
            raise ConfigError(f"--search {s.text!r}: {s.key} is searched twice")
        seen.add(s.key)
        for v in s.values:
            try:
                job_for(job.raw, {s.key: v})
            except ConfigError as e:
                raise ConfigError(f"--search {s.text!r}: with {s.key}={v!r}: {e}") from None
    return searches
