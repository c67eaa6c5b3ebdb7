"""The divergence guard: a loss far above its early level (or NaN) stops the run with one line
naming the step, the loss, the learning rate and the topology; the checkpoints from after the
divergence began are set aside, and the newest from before it is what ``--resume`` takes."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from raysinga import config
from raysinga.checkpoint import latest, prune, save, steps
from raysinga.config import ConfigError, DivergenceConfig
from raysinga.run import Trainer
from raysinga.run.divergence import (
    Diverged,
    EarlyLevel,
    Guard,
    chance_loss,
    describe_topology,
)

QUIET = {"log": lambda line: None}
ONE = (lambda s: (0.05, "one process"), 64)  # where, batch


def guard(cfg=None, history=(), first=(0,), chance=None, where=ONE, **kw) -> Guard:
    return Guard(cfg or DivergenceConfig(), list(history), list(first), chance, *where, **kw)


def test_a_spike_over_twice_the_early_level_stops_the_run_and_names_it():
    g = guard(where=(lambda s: (0.05 * (s + 1), "sandblaster: 1 group(s) x 2 worker(s)"), 64))
    early = [g.observe(s, v) for s, v in enumerate([3.0, 3.2, 2.8])]
    assert early[:2] == [None, None] and early[2] == EarlyLevel(3, pytest.approx(3.0))
    assert early[2].record() == {"kind": "guard", "step": 3, "early_loss": pytest.approx(3.0)}
    for s, v in enumerate([2.5, 1.0, 2.9, 3.5, 6.0, 7.0], start=3):
        g.observe(s, v)  # a window of 4 steps (256 samples): 3.5 6 7 are still under 6
    assert g.safe == 5  # the newest step at or below the early level
    with pytest.raises(Diverged) as e:
        g.observe(9, 12.0)  # the mean of 6 7 3.5 12 is 7.125 > 2 x 3.0
    msg = str(e.value)
    assert msg.startswith("loss is 7.125 (the mean over the last 256 samples), over 2x its early")
    assert "level 3 at step 9: the run diverged (learning rate 0.5, sandblaster: 1 group(s)" in msg
    assert msg.endswith(
        "(likely the learning rate: lower updater.lr and start over, or set updater.clip_norm "
        "and resume (a resume keeps the checkpoint's optimizer, but applies that))"
    )
    assert (e.value.step, e.value.safe) == (9, 5)


def test_a_classifier_is_checked_against_at_least_its_chance_level():
    """A run that starts low (a fine-tuned model) is not stopped by a rise that stays under
    twice the loss of a uniform guess; above that, it is."""
    g = guard(chance=math.log(10))
    for s, v in enumerate([0.2, 0.25, 0.15, 0.9, 1.8, 3.0, 4.0]):
        g.observe(s, v)  # 10x the early level, under 2 x ln 10 = 4.6 in the mean of 4
    with pytest.raises(Diverged, match=r"over 2x the chance level 2.303 at step 7"):
        g.observe(7, 12.0)
    assert chance_loss("softmax_cross_entropy", (10,)) == pytest.approx(math.log(10))
    assert chance_loss("sequence_cross_entropy", (32, 65)) == pytest.approx(math.log(65))
    assert chance_loss("mean_squared_error", (1,)) is None


def test_non_finite_values_stop_the_run_even_without_a_loss_factor():
    g = guard(DivergenceConfig(factor=None))
    with pytest.raises(Diverged, match=r"^loss is nan at step 0: .* \(likely the data: check"):
        g.observe(0, float("nan"))
    g = guard(DivergenceConfig(factor=None))
    for s in range(6):
        g.observe(s, 1e6 * (s + 1))  # no factor: a rising loss goes on
    with pytest.raises(Diverged, match=r"^gradient norm is inf at step 6: .*likely the learning"):
        g.observe(6, 1.0, grad_norm=float("inf"))


def test_groups_count_their_own_steps_and_the_advice_names_the_async_rule():
    g = guard(first=(10, 10, 10), where=(lambda s: (0.05, "downpour"), 64), async_rule=True)
    for s in range(10, 13):
        for grp in range(3):
            g.observe(s, 2.0, group=grp)
    assert g.early == pytest.approx(2.0) and g.safe == 12
    g.observe(13, 1.0, group=0)
    assert g.safe_steps == [13, 12, 12] and g.safe == 12
    with pytest.raises(Diverged) as e:
        for _ in range(4):
            g.observe(13, 30.0, group=1)
    assert "at step 13 of group 1: the run diverged (learning rate 0.05, downpour)" in str(e.value)
    assert "or set updater.async_lr: groups and resume" in str(e.value)


def test_a_resumed_run_keeps_the_early_level_of_its_first_start():
    history = [
        {"kind": "train", "step": 5, "loss": 0.1},
        {"kind": "guard", "step": 3, "early_loss": 2.0},
    ]
    g = guard(history=history, first=(40,))
    assert g.level == 2.0 and g.observe(40, 0.5) is None  # nothing more to fix
    # the window holds what this start has seen: 0.5 and 9 (128 samples) are over 2 x 2
    with pytest.raises(
        Diverged,
        match=r"is 4.75 \(the mean over the last 128 samples\), over 2x its early level 2 at "
        r"step 41",
    ):
        for s in range(41, 44):
            g.observe(s, 9.0)


def test_the_divergence_section_is_checked():
    base = config.parse_yaml(
        "model: {input_shape: [4], layers: [{kind: dense, name: out, units: 2}]}\n"
        "data: {source: {kind: digits}}\nupdater: {name: sgd, lr: 0.1}\ntrain_steps: 5\n"
    )
    assert config.from_dict(base).divergence == DivergenceConfig(
        factor=2.0, early_steps=3, window=256
    )
    got = config.from_dict({**base, "divergence": {"factor": None, "window": 64}}).divergence
    assert got == DivergenceConfig(factor=None, early_steps=3, window=64)
    for bad, says in [
        ({"factor": 1}, "divergence.factor: expected a number > 1 or null, got 1"),
        ({"factor": "big"}, "divergence.factor: expected a number > 1 or null"),
        ({"early_steps": 0}, "divergence.early_steps: expected an integer >= 1, got 0"),
        ({"windw": 3}, "divergence: unknown key"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            config.from_dict({**base, "divergence": bad})
    assert describe_topology(None) == "one process"


def test_pruning_keeps_the_newest_checkpoint_from_before_the_guards_floor(tmp_path):
    for s in (2, 4, 6, 8):
        save(tmp_path, s, {"w": np.full(3, s, np.float32)})
    assert sorted(prune(tmp_path, keep_last=1, floor=5)) == [2, 6]
    assert steps(tmp_path) == [8, 4]
    assert prune(tmp_path, keep_last=1, floor=8) == [4]


MLP = """
name: diverging
seed: 0
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 64, activation: relu}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 64}
updater: {name: sgd, lr: 0.05, momentum: 0.9}
train_steps: 200
disp_freq: 10
checkpoint_frequency: 2
checkpoint: {keep_last: 1}
"""


def test_a_single_process_run_that_diverges_resumes_from_before_it(tmp_path):
    """The learning rate jumps to 4 at step 20 (a multistep schedule): the loss flies up, the
    run stops, the checkpoints after the divergence are set aside (keep_last: 1 still kept the
    newest from before it), and a resume at a sane rate goes on from there to the end."""
    (tmp_path / "job.yaml").write_text(MLP)
    jump = "updater.lr={kind: multistep, lr: 0.05, gamma: 80, milestones: [20]}"
    cfg = config.load(tmp_path / "job.yaml", [f"run_dir={tmp_path}", jump])
    with pytest.raises(Diverged) as e:
        Trainer(cfg, **QUIET).fit()
    msg, root = str(e.value), tmp_path / "checkpoints"
    found = re.match(
        r"loss is (\S+) \(the mean over the last 256 samples\), over 2x its early level "
        r"(\S+) at step (\d+): the run diverged \(learning rate 4, one process\)",
        msg,
    )
    assert found, msg
    assert float(found[2]) > math.log(10)  # the mean of steps 0-2, above chance at the start
    assert float(found[1]) > 2 * float(found[2]) and 20 < int(found[3]) < 40
    left, aside = steps(root), sorted(p.name for p in root.glob("step-*.diverged-*"))
    assert left == [e.value.safe - e.value.safe % 2] and left[0] <= 20, (left, e.value.safe)
    assert f"its latest checkpoint is step-{left[0]}, from before the divergence" in msg
    assert aside, "the checkpoints of the diverged steps were left in place"
    assert all(int(a.split(".")[0][5:]) > e.value.safe for a in aside)
    assert latest(root).checkpoint.step == left[0]
    records = [r for r in map(eval_json, (tmp_path / "metrics.jsonl").read_text().splitlines())]
    assert [r["kind"] for r in records if r["kind"] == "guard"] == ["guard"]

    # a resume takes the newest checkpoint from before the divergence, with the checkpoint's
    # optimizer and the early level of the first start: the same steps, which diverge again
    # (seen sooner: the guard's window starts empty)
    lines: list[str] = []
    with pytest.raises(Diverged) as again:
        Trainer(cfg, resume=True, log=lines.append).fit()
    assert any(f"step-{left[0]}" in line and "resum" in line for line in lines), lines
    assert f"over 2x its early level {found[2]} at step" in str(again.value)
    assert left[0] < again.value.step <= int(found[3]) and steps(root) == left

    # forked from it at the rate before the jump, a new run goes on to the end
    sane = config.load(tmp_path / "job.yaml", [f"run_dir={tmp_path / 'sane'}", "train_steps=60"])
    res = Trainer(sane, fork_from=root / f"step-{left[0]}", **QUIET).fit()
    assert res.checkpoint_step == 60 and res.final_eval["test_accuracy"] > 0.9
    assert sum(r["kind"] == "guard" for r in res.history) == 1  # the level of the first start


def eval_json(line: str) -> dict:
    import json  # noqa: PLC0415

    return json.loads(line)
