"""``raysinga tune``: search expressions are checked (each bad one named, before Ray starts), and a
real population-based search through the command, in this process on the session's Ray, prints
its table of trials and the best, replays a trial bit for bit and releases its checkpoints."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from helpers import cli_error

from raysinga import cli, config
from raysinga.cli import tune as tune_cli
from raysinga.cli.tune_search import parse_search
from raysinga.config import ConfigError

tune = pytest.importorskip("ray.tune")

JOB = """
name: clitune
seed: 3
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 32, activation: relu}
    - {kind: dropout, name: drop, rate: 0.1}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 32}
updater: {name: sgd, lr: 0.01, momentum: 0.9}
train_steps: 40
disp_freq: 10
"""


@pytest.fixture
def job(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text(JOB)
    return p


def test_search_expressions_become_tune_samplers():
    s = parse_search("updater.lr=loguniform(1e-4, 1e-1)")
    assert (s.key, s.sampler, s.args) == ("updater.lr", "loguniform", (1e-4, 0.1))
    d = s.domain()
    assert isinstance(d, tune.search.sample.Float) and (d.lower, d.upper) == (1e-4, 0.1)
    assert isinstance(d.get_sampler(), tune.search.sample.LogUniform)
    assert parse_search("updater.momentum=choice(0.8,0.9)").domain().categories == [0.8, 0.9]
    assert parse_search("data.batch_size=randint(16,65)").values == (16, 64)  # high exclusive
    assert parse_search("updater.name=choice(sgd, adam)").args == ("sgd", "adam")
    grid = parse_search("updater.lr=grid(0.01,0.1)")
    assert grid.domain() == {"grid_search": [0.01, 0.1]}
    assert grid.domain(mutation=True).categories == [0.01, 0.1]  # PBT mutates within the grid
    u = parse_search("updater.lr = uniform(0, 0.5)").domain()
    assert isinstance(u.get_sampler(), tune.search.sample.Uniform)


@pytest.mark.parametrize(
    "expr, says",
    [
        ("updater.lr", "expected KEY=SAMPLER(ARGS)"),
        ("updater.lr=0.1", "expected KEY=SAMPLER(ARGS)"),
        ("updater.lr=logunif(1e-4,1e-1)", "unknown sampler 'logunif'"),
        ("updater.lr=loguniform(1e-4)", "loguniform takes two numbers"),
        ("updater.lr=loguniform(0,1e-1)", "loguniform takes 0 < low < high"),
        ("updater.lr=uniform(0.5,0.1)", "low < high"),
        ("data.batch_size=randint(16,64.5)", "randint takes two integers"),
        ("updater.lr=choice()", "choice takes one value or more"),
        ("updater.lr=choice([1,2)", "not YAML values"),
        ("updater.lrr=choice(0.1)", "unknown hyperparameter(s) ['lrr']"),
        ("updater.lr=uniform(-1,0.1)", "with updater.lr=-1: updater.lr: schedule"),
        ("run_dir=choice(a,b)", "run_dir is set by each trial"),
    ],
)
def test_a_bad_search_is_one_line_naming_it_before_ray_starts(job, monkeypatch, expr, says):
    monkeypatch.setattr(tune_cli, "_connect", lambda address: pytest.fail("Ray was started"))
    line = cli_error("tune", str(job), "--search", expr, status=2)
    assert f"--search {expr!r}: " in line and says in line, line


def test_scheduler_and_metric_mistakes_are_refused_before_ray_starts(job, monkeypatch):
    monkeypatch.setattr(tune_cli, "_connect", lambda address: pytest.fail("Ray was started"))
    lr = ("--search", "updater.lr=choice(0.1,0.2)")
    cli_error("tune", str(job), *lr, "--scheduler", "pb2", named="pb2 searches ranges only")
    cli_error("tune", str(job), "--scheduler", "pbt", named="at least one --search")
    twice = ("--search", "updater.lr=uniform(0.1,0.2)")
    cli_error("tune", str(job), *lr, *twice, named="updater.lr is searched twice")
    cli_error("tune", str(job), *lr, "--metric", "valid_loss", named="no data.validation")
    cli_error("tune", str(job), *lr, "--until", "20", named="--until goes with --replay")
    cli_error("tune", str(job), *lr, "--synch", named="--synch goes with --scheduler pbt or pb2")
    every = ("--set", "test_freq=20", "--report-every", "10")
    cli_error("tune", str(job), *lr, *every, named="evaluates every test_freq=20 steps")


def test_keep_checkpoint_dir_and_handover_reach_the_trainable(job, tmp_path, monkeypatch):
    from raysinga import tune as rtune

    monkeypatch.setattr(tune_cli, "_connect", lambda address: pytest.fail("Ray was started"))
    cli_error(
        "tune",
        str(job),
        "--search",
        "updater.lr=choice(0.1)",
        "--keep",
        "0",
        named="--keep must be 1 checkpoint or more, got 0",
    )
    seen = {}

    def trainable(*args, **kw):
        seen.update(kw)
        raise ConfigError("stop here")

    monkeypatch.setattr(rtune, "trainable", trainable)
    where = str(tmp_path / "copies")
    cli_error(
        *("tune", str(job), "--search", "updater.lr=choice(0.1)", "--keep", "3"),
        *("--checkpoint-dir", where, "--handover", "tune_storage"),
        named="stop here",
    )
    assert seen == {
        "report_every": 4,
        "keep": 3,
        "checkpoint_dir": where,
        "handover": "tune_storage",
    }


def test_synch_wants_every_trial_running_at_once(ray_session, job):
    """Synchronous PBT with more trials than the cluster runs at once was seen to wait forever
    (4 trials on 2 CPUs): refused, naming the counts (the session's Ray has 8 CPUs)."""
    grid = ("--search", "updater.lr=grid(0.001,0.01,0.1)", "--scheduler", "pbt", "--synch")
    cli_error(
        "tune",
        str(job),
        *grid,
        "--trials",
        "3",
        named="--synch: all 9 trials must run at once, and the cluster has 8 CPU(s)",
    )


def test_the_default_metric_is_the_held_out_loss():
    base = config.parse_yaml(JOB)
    plain = config.from_dict(base)
    held = config.from_dict({**base, "data": {**base["data"], "validation": 0.2}})
    assert tune_cli.choose_metric(plain, None, None) == ("test_loss", "min")
    assert tune_cli.choose_metric(held, None, None) == ("valid_loss", "min")
    assert tune_cli.choose_metric(held, "test_accuracy", None) == ("test_accuracy", "max")
    assert tune_cli.choose_metric(plain, "test_accuracy", "min") == ("test_accuracy", "min")
    with pytest.raises(ConfigError, match="give --mode"):
        tune_cli.choose_metric(plain, "step", None)


def _raysinga(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(list(args))
    return code, out.getvalue()


@pytest.mark.slow
def test_a_pbt_search_prints_its_trials_and_a_trial_replays_bit_for_bit(ray_session, job, tmp_path):
    storage = tmp_path / "tune"
    code, out = _raysinga(
        *("tune", str(job), "--search", "updater.lr=grid(0.0005,0.002,0.02,0.08)"),
        *("--trials", "1", "--scheduler", "pbt", "--synch", "--report-every", "10"),
        *("--storage", str(storage), "--name", "cli", "--quiet"),
    )
    assert code == 0, out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("trial "))
    assert lines[head].split() == ["trial", "updater.lr", "test_loss", "step", "lineage"]
    rows = [line.split() for line in lines[head + 1 : head + 5]]
    assert [r[3] for r in rows] == ["40"] * 4  # every trial ran to the end
    assert all(re.fullmatch(r"\d\.\d{4}", r[2]) for r in rows), rows
    lineage = {r[0]: int(r[4]) for r in rows}
    # synchronous PBT: at each of the 3 perturbation points before the end the worst of the 4
    # exploits the best, whatever the order in which the trials reported
    assert max(lineage.values()) > 1, "PBT exploited no trial"
    best = re.search(
        r"best trial (\S+) by test_loss \((\S+), min\): step 40, Tune checkpoint (\S+)", out
    )
    assert best, out
    assert float(best[2]) == min(float(r[2]) for r in rows)
    assert (storage / "cli").is_dir() and best[3].startswith(str(storage / "cli"))
    assert "checkpoints stay in Ray's object store" in out  # the session's Ray goes on

    # the trial with the longest lineage, from its directory: its final checkpoint, replayed
    trial = max(lineage, key=lineage.get)
    (trial_dir,) = (storage / "cli").glob(f"*_{trial}_*")
    code, out = _raysinga("tune", str(job), "--replay", str(trial_dir))
    assert code == 0, out
    assert f"replaying trial {trial} ({lineage[trial]} segment(s)) to step 40" in out
    assert f"the parameters equal trial {trial}'s at step 40, bit for bit (4 tensors)" in out

    code, out = _raysinga("tune", str(job), "--name", "cli", "--release")
    dropped = re.search(r"dropped (\d+) object-store checkpoint\(s\) of search cli", out)
    assert code == 0 and dropped and int(dropped[1]) >= 4, out  # keep=2 a trial: 4 to 8

    # released: the best trial's final checkpoint replays, compared with the copy of it that
    # Tune keeps in its storage (an in-place trial's final result holds the checkpoint's files)
    assert (Path(best[3]) / "shard-0.arrow").is_file()
    code, out = _raysinga("tune", str(job), "--replay", best[3])
    assert code == 0, out
    assert "bit for bit (4 tensors)" in out, out


@pytest.mark.slow
def test_a_pb2_search_exploits_through_the_object_store_and_replays_bit_for_bit(
    ray_session, job, tmp_path
):
    """PB2 (Ray Tune's population-based bandits: PBT whose explore step fits a Gaussian
    process to the trials' gains) over a range, through the command."""
    pytest.importorskip("GPy", reason="--scheduler pb2 needs GPy (the test extra has it)")
    storage = tmp_path / "tune"
    code, out = _raysinga(
        *("tune", str(job), "--search", "updater.lr=uniform(0.0005,0.08)"),
        *("--trials", "4", "--scheduler", "pb2", "--synch", "--report-every", "10"),
        *("--storage", str(storage), "--name", "pb2", "--quiet"),
    )
    assert code == 0, out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("trial "))
    rows = [line.split() for line in lines[head + 1 : head + 5]]
    assert [r[3] for r in rows] == ["40"] * 4, out  # every trial ran to the end
    assert all(0.0005 <= float(r[1]) <= 0.08 for r in rows), rows  # PB2 keeps to the range
    lineage = {r[0]: int(r[4]) for r in rows}
    assert max(lineage.values()) > 1, "PB2 exploited no trial"
    # reports hand Tune pointers: the only checkpoint files in its storage are the copies of
    # the trials' final results, one each
    finals = {p.parent for p in (storage / "pb2").rglob("*.arrow")}
    assert len(finals) == 4 and all(p.name.startswith("checkpoint_") for p in finals), finals

    trial = max(lineage, key=lineage.get)
    (trial_dir,) = (storage / "pb2").glob(f"*_{trial}_*")
    code, out = _raysinga("tune", str(job), "--replay", str(trial_dir))
    assert code == 0, out
    assert f"the parameters equal trial {trial}'s at step 40, bit for bit (4 tensors)" in out
    _raysinga("tune", str(job), "--name", "pb2", "--release")


def test_replay_mistakes_are_one_line(job, tmp_path):
    cli_error("tune", str(job), "--replay", str(tmp_path / "nowhere"), named="no such trial")
    trial = tmp_path / "search" / "trial_1"
    pointer = {"format": 1, "key": "k", "step": 40, "trial": "t", "uri": None, "lineage": []}
    (trial / "checkpoint_000003").mkdir(parents=True)
    (trial / "checkpoint_000003" / "raysinga-checkpoint.json").write_text(json.dumps(pointer))
    cli_error("tune", str(job), "--replay", str(trial.parent), named="give one of its trial dir")
    cli_error("tune", str(job), "--replay", str(trial), "--until", "41", named="train_steps=40")
