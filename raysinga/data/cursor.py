"""The data cursor: which batch of the run's data order a group trains on at a step.

Groups take turns through one sequence of batches: group ``g`` of ``G`` at step ``s`` takes
*slot* ``s * G + g + offset``, so no two groups train on one batch. While the number of groups
stays the same, each group goes on at its own step. When it changes (an elastic shrink or
growth, ``--resume`` with another ``n_groups``, a ``--local`` resume of a Downpour run) the groups
may stand at different steps: the faster ones have consumed batches beyond the slowest one's. The
new groups all start at the slowest step, and the batches consumed out of turn are *skipped*:
slot ``k`` is the ``k``-th batch index that is not in ``skip``. So no batch is trained twice and
none is left out.

Pure arithmetic on integers: no Ray, no data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DataCursor:
    """``offset`` moves slot numbers; ``skip`` (sorted) holds batches already consumed out of
    turn, all of them beyond every batch the slots below the groups' steps map to."""

    offset: int = 0
    skip: tuple[int, ...] = ()

    def batch(self, step: int, group: int = 0, n_groups: int = 1) -> int:
        """The batch index group ``group`` of ``n_groups`` trains on at ``step``."""
        b = step * n_groups + group + self.offset
        if b < 0:
            raise ValueError(f"step {step} of group {group} lies before the data cursor")
        # The k-th index not in skip: each skipped index at or below the candidate pushes it on.
        i = 0
        while i < len(self.skip) and self.skip[i] <= b:
            b += 1
            i += 1
        return b

    def regroup(self, steps: list[int], n_groups: int) -> tuple[list[int], DataCursor]:
        """Steps and cursor for ``n_groups`` groups, going on from groups at ``steps``.

        The same number of groups goes on where each group was. Otherwise every new group
        starts at the slowest step; the batches the faster groups took beyond it join ``skip``.
        """
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1, got {n_groups}")
        old = len(steps)
        if old == n_groups:
            return list(steps), self
        base = min(steps)
        # Everything before this batch is consumed: the slots below base*old + offset, and
        # the skipped indices among them.
        first_open = self.batch(base, 0, old)
        taken = set(self.skip)
        taken.update(self.batch(s, g, old) for g in range(old) for s in range(base, steps[g]))
        while first_open in taken:
            first_open += 1
        skip = tuple(sorted(b for b in taken if b > first_open))
        return [base] * n_groups, DataCursor(first_open - base * n_groups, skip)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``run.cursor``."""
        out: dict[str, Any] = {"batch_offset": self.offset}
        if self.skip:
            out["skip"] = list(self.skip)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataCursor:
        skip = d.get("skip", [])
        if not isinstance(skip, list) or not all(isinstance(b, int) and b >= 0 for b in skip):
            raise ValueError(f"cursor.skip must be a list of batch indices, got {skip!r}")
        return cls(int(d["batch_offset"]), tuple(sorted(set(skip))))


__all__ = ["DataCursor"]
