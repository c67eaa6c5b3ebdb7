"""What the console of ``raysinga train`` shows of a loss the run recovers from: one line for the
loss and one for the recovery, naming one story's steps."""

from __future__ import annotations

from raysinga.obs.console import render
from raysinga.obs.events import Recovered, RoleLost


def test_the_lines_of_one_loss_tell_one_story():
    """The console lines of a loss noticed while its group ran a chunk of steps (the driver
    had last heard of step 6000), and of its recovery at step 6464 where the servers stood."""
    lost = RoleLost(6000, "worker", 1, 0, "worker 1 of group 0 was lost: died", 1, 3, (6000, 6500))
    assert render(lost) == (
        "raysinga: worker 1 of group 0 was lost: died in steps 6000 to 6500 (its group's chunk "
        "under way); recovering (failure 1 of at most 3)"
    )
    info = {"restore_s": 0.11, "restored_from": 6464, "steps_redone": 1, "recovery": "replaced"}
    assert render(Recovered(info)) == (
        "raysinga: recovered in 0.11 s from step 6464, where the group's servers stood "
        "(1 step(s) to redo)"
    )
    # a loss outside a chunk (while checkpointing, launching): the step the driver knows
    between = RoleLost(6000, "server", 0, None, "server 0 was lost: died", 2, 3)
    assert " at step 6000; recovering (failure 2 of at most 3)" in render(between)
    info = {"restore_s": 2.0, "restored_from": 5000, "steps_redone": 1000, "recovery": "restarted"}
    assert "from step 5000, every role restarted (1000 step(s) to redo)" in render(Recovered(info))
