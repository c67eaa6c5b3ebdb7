"""What a data set that cannot be trained on raises: :class:`DataError`, whose message names
the split, the file, the key or column and the row (:func:`where`). Every data module raises
it; it imports nothing of the package."""

from __future__ import annotations

import functools


def where(file: str | None = None, key: str | None = None, split: str | None = None) -> str:
    """``"train split, data/x.npy (x array)"``: the prefix of every data error message."""
    head = ", ".join(p for p in (f"{split} split" if split else None, file) if p)
    return f"{head} ({key})" if head and key else head or key or "data"


class DataError(ValueError):
    """A data set that cannot be trained on. The message names the split, the file (as the job
    gives it), the key or column, and for a bad value the row; the same parts are attributes,
    so callers and tests need not parse the text."""

    def __init__(
        self,
        problem: str,
        *,
        file: str | None = None,
        key: str | None = None,
        split: str | None = None,
        row: int | None = None,
    ) -> None:
        self.problem, self.file, self.key, self.split = problem, file, key, split
        self.row = None if row is None else int(row)
        at = "" if row is None else f"row {row}: "
        super().__init__(f"{where(file, key, split)}: {at}{problem}")

    def __reduce__(self) -> tuple:
        # Rebuilt from its parts, not from the message: a worker's error crosses Ray pickled.
        parts = {"file": self.file, "key": self.key, "split": self.split, "row": self.row}
        return functools.partial(DataError, **parts), (self.problem,)

    def at(self, *, split: str | None = None, row_offset: int = 0) -> DataError:
        """The same error with the split named, or its row shifted from a chunk's start."""
        return DataError(
            self.problem,
            file=self.file,
            key=self.key,
            split=split or self.split,
            row=None if self.row is None else self.row + row_offset,
        )
