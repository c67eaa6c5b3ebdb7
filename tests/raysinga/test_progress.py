"""The CLI's progress: one bar redrawn in place on a terminal, plain lines anywhere else."""

from __future__ import annotations

import io

from raysinga.progress import Progress, _duration

TRAIN = "step {:>3}/100  epoch 0  loss 0.5000  lr 0.01  1,000 samples/s"


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    p = Progress(out)  # StringIO is no TTY
    p(TRAIN.format(10))
    p("step  10/100  test_loss 0.4000")
    p.close()
    assert out.getvalue() == TRAIN.format(10) + "\nstep  10/100  test_loss 0.4000\n"


def test_a_terminal_gets_one_bar_and_other_lines_above_it():
    out = io.StringIO()
    p = Progress(out, tty=True)
    p(TRAIN.format(25))
    p(TRAIN.format(50))
    p("raysinga: checkpoint step 50 -> /x/step-50")
    p(TRAIN.format(100))
    p.close()
    text = out.getvalue()
    assert "\n" not in text.split("raysinga: checkpoint")[0]  # bar updates stay on one line
    assert "[######..................] " + TRAIN.format(25) in text
    assert "[############............] " + TRAIN.format(50) in text
    assert " left" in text.split(TRAIN.format(50))[1].split("\r")[0]  # a time left estimate
    # the checkpoint line erased the bar, stayed on its own line, and the bar came back below
    assert "\r\x1b[Kraysinga: checkpoint step 50 -> /x/step-50\n\r\x1b[K[####" in text
    assert text.endswith("[" + "#" * 24 + "] " + TRAIN.format(100) + "\n")


def test_a_restart_from_a_checkpoint_resets_the_estimate():
    out = io.StringIO()
    p = Progress(out, tty=True)
    p(TRAIN.format(60))
    p(TRAIN.format(40))  # a recovery went back to step 40
    assert p._since[1] == 40


def test_durations():
    assert _duration(59.6) == "1:00" and _duration(3725) == "1:02:05"
