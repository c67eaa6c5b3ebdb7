"""A worker's copies of its own state in its shared buffer (actors.common.protocol): laid out after
the gradient, two slots tagged with their step, a copy being written never taken, the gradient part
of the layout what the stub and the servers sum."""

from __future__ import annotations

import numpy as np

from raysinga.actors.common.buffers import Layout
from raysinga.actors.common.protocol import (
    STATE_TAGS,
    gradient_layout,
    read_state_copy,
    worker_buffer_layout,
    write_state_copy,
)

SHAPES = {"fc/W": (4, 3), "fc/b": (3,)}
STATE = {"bn/running_mean": (3,), "bn/running_var": (3,)}


def _views():
    layout = worker_buffer_layout(SHAPES, "float32", STATE)
    views = layout.views(bytearray(layout.nbytes))
    views[STATE_TAGS][...] = -1
    return layout, views


def test_the_gradient_comes_first_laid_out_as_the_parameters():
    layout, _ = _views()
    params = Layout.of({p: (s, "float32") for p, s in SHAPES.items()})
    assert gradient_layout(layout) == params
    assert [e.offset for e in layout.entries[: len(SHAPES)]] == [e.offset for e in params.entries]
    assert worker_buffer_layout(SHAPES, "float32", {}) == params  # no state, no copies


def test_the_copy_of_a_step_is_found_until_it_is_two_steps_old():
    _, views = _views()
    assert read_state_copy(views, list(STATE), 0) is None  # nothing written yet
    for step in range(5):
        write_state_copy(views, {n: np.full(s, step, np.float32) for n, s in STATE.items()}, step)
    assert read_state_copy(views, list(STATE), 4)["bn/running_var"].tolist() == [4, 4, 4]
    assert read_state_copy(views, list(STATE), 3)["bn/running_mean"].tolist() == [3, 3, 3]
    assert read_state_copy(views, list(STATE), 2) is None


def test_a_copy_cut_short_is_not_taken():
    _, views = _views()
    write_state_copy(views, {n: np.ones(s, np.float32) for n, s in STATE.items()}, 6)
    views[STATE_TAGS][6 % 2] = -1  # as a writer killed mid-copy leaves it
    assert read_state_copy(views, list(STATE), 6) is None
