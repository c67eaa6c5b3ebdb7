"""Where the driver cuts a group's steps into chunks
(:class:`~raysinga.distributed.stepping.StepRunner`)."""

from types import SimpleNamespace

import pytest

from raysinga.distributed.stepping import StepRunner


def runner(max_chunk: int, checkpoint_at: int | None = None, staleness: int | None = None):
    cfg = SimpleNamespace(
        train_steps=1000,
        disp_freq=10,
        test_freq=0,
        next_checkpoint=lambda s: checkpoint_at if checkpoint_at and s < checkpoint_at else None,
    )
    topo = SimpleNamespace(staleness=staleness, n_groups=2 if staleness is not None else 1)
    r = StepRunner.__new__(StepRunner)  # only what cuts chunks
    r.cfg, r.topo, r.max_chunk = cfg, topo, max_chunk
    return r


def chunks(r: StepRunner, start: int, stop: int) -> list[int]:
    out, s = [], start
    while s < stop:
        e = r._chunk_end(s)
        assert s < e
        out.append(e - s)
        s = e
    return out


@pytest.mark.parametrize(
    ("max_chunk", "sizes"),
    [
        (8, [10, 10, 10]),  # a report 10 steps on: taken whole, not as 8 and a sliver of 2
        (7, [10, 10, 10]),
        (6, [6, 4, 6, 4, 6, 4]),  # past half as many again: a full chunk, then the rest
        (1, [1] * 30),
        (1 << 30, [10, 10, 10]),
    ],
)
def test_a_boundary_a_little_past_a_chunk_is_taken_whole(max_chunk, sizes):
    assert chunks(runner(max_chunk), 0, 30) == sizes


def test_a_chunk_never_runs_past_a_checkpoint_or_the_staleness_bound():
    assert chunks(runner(8, checkpoint_at=7), 0, 10) == [7, 3]
    assert chunks(runner(8, staleness=3), 0, 10) == [3, 3, 3, 1]
