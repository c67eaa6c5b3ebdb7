"""The CLI's progress: one bar redrawn in place on a terminal, plain lines anywhere else."""

from __future__ import annotations

import io

from raysinga.obs.console import render
from raysinga.obs.events import CheckpointCommitted, Evaluated, RunStarted, TrainStep
from raysinga.obs.progress import Progress, _duration


def train(step: int) -> TrainStep:
    return TrainStep(step, 100, 0, 0.5, 0.01, 1000.0)


def line(step: int) -> str:
    return f"step {step:>3}/100  epoch 0  loss 0.5000  lr 0.01  1,000 samples/s"


def test_events_render_as_the_lines_users_read():
    assert render(train(10)) == line(10)
    assert render(Evaluated(10, 100, {"test_loss": 0.4})) == "step  10/100  test_loss 0.4000"
    ck = CheckpointCommitted(50, "/x/step-50", 0.0123, 0.5, in_background=True)
    assert render(ck) == (
        "raysinga: checkpoint step 50 -> /x/step-50 (training waited 12 ms; written in 0.50 s)"
    )


def test_a_run_over_hosts_shows_its_busiest_hosts_bytes_per_step():
    net = {"10.0.0.1": {"in": 4_200_000, "out": 812}, "10.0.0.2": {"in": 0, "out": 3_100}}
    ev = TrainStep(10, 100, 0, 0.5, 0.01, 1000.0, net=net)
    assert render(ev) == line(10) + "  net 4.2 MB in, 812 B out per step (10.0.0.1)"
    assert ev.record()["net"] == net
    assert "net" not in train(10).record()  # one node: nothing crossed a network


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    p = Progress(out)  # StringIO is no TTY
    p(train(10))
    p(Evaluated(10, 100, {"test_loss": 0.4}))
    p.close()
    assert out.getvalue() == line(10) + "\nstep  10/100  test_loss 0.4000\n"


def test_a_terminal_gets_one_bar_and_other_lines_above_it():
    out = io.StringIO()
    p = Progress(out, tty=True)
    p(train(25))
    p(train(50))
    p(CheckpointCommitted(50, "/x/step-50", 0.0, 0.1, in_background=False))
    p(train(100))
    p.close()
    text = out.getvalue()
    assert "\n" not in text.split("raysinga: checkpoint")[0]  # bar updates stay on one line
    assert "[######..................] " + line(25) in text
    assert "[############............] " + line(50) in text
    assert " left" in text.split(line(50))[1].split("\r")[0]  # a time left estimate
    # the checkpoint line erased the bar, stayed on its own line, and the bar came back below
    assert "\r\x1b[Kraysinga: checkpoint step 50 -> /x/step-50 (" in text
    assert "written in 0.10 s)\n\r\x1b[K[####" in text
    assert text.endswith("[" + "#" * 24 + "] " + line(100) + "\n")


def test_a_restart_from_a_checkpoint_resets_the_estimate():
    out = io.StringIO()
    p = Progress(out, tty=True)
    p(train(60))
    p(RunStarted("r", "Ray", 100, 40))  # a recovery went back to step 40
    p(train(45))
    assert p._since is not None and p._since[1] == 45


def test_durations():
    assert _duration(59.6) == "1:00" and _duration(3725) == "1:02:05"
