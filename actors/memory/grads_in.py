"""Where a server's gradient of a step comes from: the stub's buffer of the whole sum (same
node), its own slices sent from another node, or the workers' gradients, which it sums itself
into the stub's log (:class:`SumViews`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..common.buffers import Attachments, Layout, ShmHandle
from ..common.protocol import SummedGrads, gradient_layout


def step_gradient(
    grads: ShmHandle | np.ndarray | SumViews | dict[str, np.ndarray],
    step: int,
    slices: list[Any],
    layout: Layout,
    attached: Attachments,
) -> tuple[dict[str, np.ndarray], dict[str, list[np.ndarray]]]:
    """A server's slices of step ``step``'s gradient as :meth:`ParamServer._update` is given
    it (or as it summed the blocks' sums), by slice name; and where the server sums it
    itself, the parts it sums (it writes the sum into the first dict)."""
    if isinstance(grads, SumViews):
        return grads.rows[step % len(grads.rows)], grads.parts
    if isinstance(grads, ShmHandle):
        return own_slices(attached.views(grads), slices), {}
    if isinstance(grads, dict):  # by slice name already (the blocks' sum, reduce: hosts)
        return grads, {}
    return layout.views(grads), {}


class SumViews:
    """A server's views of the gradients it sums (a :class:`SummedGrads`): each of its slices
    in every worker's gradient (``parts``) and in every row of the stub's log (``rows``). The
    files stay mapped from one ``serve`` call to the next: a fresh mapping would fault in
    every page of the log again."""

    def __init__(self) -> None:
        self._maps, self._rows = Attachments(), Attachments(writable=True)
        self.parts: dict[str, list[np.ndarray]] = {}
        self.rows: list[dict[str, np.ndarray]] = []

    def use(self, src: SummedGrads, slices: list[Any], index: int) -> SumViews:
        """Views of ``src`` for server ``index`` (the mappings of files it no longer names are
        let go)."""
        self._maps.keep_only({h.path for h in src.parts})
        self._rows.keep_only({src.rows.path})
        layout = gradient_layout(src.parts[0].layout)  # as every part and row is laid out
        workers = [own_slices(self._maps.views(h), slices) for h in src.parts]
        self.parts = {s.name: [w[s.name] for w in workers] for s in slices}
        log = self._rows.views(src.rows)
        rows, self.marks = log["rows"], log["marks"][index]
        self.rows = [
            own_slices(layout.views(rows[r].view(np.uint8)), slices) for r in range(src.n_rows)
        ]
        return self

    @contextlib.contextmanager
    def writing(self, step: int) -> Iterator[None]:
        """Mark this server's slices of ``step``'s row as being written, then (unless the
        update raised) as written: the stub sums a row left half-written again itself."""
        row = step % len(self.marks)
        self.marks[row] = -2 - step
        yield
        self.marks[row] = step


def own_slices(views: dict[str, np.ndarray], slices: list[Any]) -> dict[str, np.ndarray]:
    """A server's slices (by slice name) of full-parameter arrays ``views``."""
    return {s.name: views[s.param].reshape(-1)[s.start : s.stop] for s in slices}
