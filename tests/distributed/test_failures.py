"""The book of a run's failures and resizes (raysinga/distributed/failures.py): what a resize
leaves in the run's history."""

from __future__ import annotations

from types import SimpleNamespace

from raysinga.distributed.failures import FailureBook
from raysinga.obs.events import EventHub, Notice, Resized


def topo(groups: int, workers: int = 1) -> SimpleNamespace:
    return SimpleNamespace(n_groups=groups, workers_per_group=workers)


def book() -> tuple[FailureBook, list]:
    seen: list = []
    fault = SimpleNamespace(max_failures=3, window_s=0)
    return FailureBook(fault, "/runs/x", EventHub([seen.append])), seen


def test_a_resize_into_room_that_is_there_is_recorded_with_the_sizes_before():
    b, seen = book()
    b.resizing(200, topo(1))
    b.relaunched("checkpoint", 200, topo(2))
    (rec,) = b.notes
    assert (rec["kind"], rec["step"], rec["groups"]) == ("resize", 200, 2)
    assert rec["resized_from"] == {"groups": 1, "workers": 1}
    assert [type(e) for e in seen] == [Resized]


def test_a_resize_whose_room_was_gone_when_placed_is_no_resize_and_says_so():
    """A node just lost may still be listed as alive for a moment: a grow started for it
    places the same size again. The history keeps no resize for it; a notice says what
    happened."""
    b, seen = book()
    b.resizing(150, topo(1))
    b.relaunched("checkpoint", 150, topo(1))
    assert b.notes == []
    (notice,) = seen
    assert isinstance(notice, Notice) and "room to grow at step 150 was gone" in notice.text
    assert b.resize is None and b.was is None  # nothing left pending for the next launch
