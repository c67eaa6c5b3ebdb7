"""The data cursor: no batch is trained twice and none is left out, whatever the number of
groups does between checkpoints."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raysinga.data.cursor import DataCursor


def _advance(cursor: DataCursor, steps: list[int], to: list[int], out: list[int]) -> None:
    n = len(steps)
    for g in range(n):
        out += [cursor.batch(s, g, n) for s in range(steps[g], to[g])]
        steps[g] = to[g]


def test_groups_take_turns() -> None:
    c = DataCursor()
    assert [c.batch(s, g, 2) for s in range(3) for g in range(2)] == [0, 1, 2, 3, 4, 5]


def test_shrink_from_unaligned_groups_skips_what_the_faster_group_took() -> None:
    """The review's case: two groups at steps [10, 12] shrunk to one. Group 1 took batches 21
    and 23 beyond group 0's step 10; the one group left takes 20, 22, 24, 25, ..."""
    c = DataCursor()
    taken: list[int] = []
    _advance(c, [0, 0], [10, 12], taken)
    assert {21, 23} <= set(taken) and 20 not in taken and 22 not in taken
    steps, c1 = c.regroup([10, 12], 1)
    assert steps == [10]
    nxt = [c1.batch(s) for s in range(10, 15)]
    assert nxt == [20, 22, 24, 25, 26]
    assert not set(nxt) & set(taken)


def test_same_number_of_groups_goes_on_where_each_was() -> None:
    c = DataCursor(offset=3)
    steps, c1 = c.regroup([4, 6], 2)
    assert steps == [4, 6] and c1 is c


def test_cursor_round_trips_through_the_manifest() -> None:
    c = DataCursor(offset=-4, skip=(21, 23))
    assert DataCursor.from_dict(c.to_dict()) == c
    assert DataCursor.from_dict({"batch_offset": 7}) == DataCursor(7)  # written before skip
    with pytest.raises(ValueError, match="skip"):
        DataCursor.from_dict({"batch_offset": 0, "skip": ["x"]})


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(
        st.tuples(st.lists(st.integers(0, 7), min_size=4, max_size=4), st.integers(1, 4)),
        max_size=6,
    ),
)
def test_no_batch_twice_and_none_left_out(first_groups: int, phases: list) -> None:
    """Random runs: groups advance unevenly, then the number of groups changes; at the end every
    group catches up past every skipped batch. Each batch was taken once, and the batches taken
    are exactly 0..N-1."""
    cursor, steps, taken = DataCursor(), [0] * first_groups, []
    for advance, groups in phases:
        _advance(cursor, steps, [s + a for s, a in zip(steps, advance, strict=False)], taken)
        steps, cursor = cursor.regroup(steps, groups)
    end = max(steps) + (max(cursor.skip) if cursor.skip else 0) + 2
    _advance(cursor, steps, [end] * len(steps), taken)
    assert len(taken) == len(set(taken)), "a batch was trained twice"
    assert sorted(taken) == list(range(len(taken))), "a batch was left out"
