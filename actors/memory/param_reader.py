"""What a worker computes with: the servers' values, read from where they are on its node
(a server's own buffer beside it, a mirror of a server elsewhere, a snapshot) and joined into
whole parameters."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..common.buffers import SEQ, Attachments, Layout, ShmHandle, stable_copy
from ..common.protocol import MirrorAt, ServerAt, server_layouts
from ..common.slicing import Slice
from ..exchange.mirrors import wait_for
from ..exchange.wire import decode, rounded


class ParamReader:
    """Whole parameters from per-server sources (a shared-memory handle or a snapshot array).

    ``consistent``: values in shared memory are copied under the server's sequence lock first
    (asynchronous groups: another group's update may land while this one computes); otherwise
    they are read in place (one synchronous group: the servers update only between steps)."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        slices: Sequence[Slice],
        n_servers: int,
        dtype: str,
        consistent: bool = False,
        wire: str = "f32",
        check: Callable[[], None] = lambda: None,
    ) -> None:
        self.shapes, self.dtype, self.wire, self.check = shapes, dtype, wire, check
        self.layouts = server_layouts(slices, n_servers, dtype)
        self._private = (
            [np.empty(lay.nbytes, np.uint8) for lay in self.layouts] if consistent else []
        )
        self.pieces = {
            p: sorted((s for s in slices if s.param == p), key=lambda s: s.start) for p in shapes
        }
        self._att = Attachments()
        # Parameters cut over several servers are gathered here; whole ones are read in place.
        self._joined = {
            p: np.empty(shape, dtype) for p, shape in shapes.items() if len(self.pieces[p]) > 1
        }
        # each server's slices of the parameters joined here (by server)
        self._joins = [
            [s for p in self._joined for s in self.pieces[p] if s.server == k]
            for k in range(n_servers)
        ]

    def read(self, sources: tuple[ShmHandle | np.ndarray, ...]) -> dict[str, np.ndarray]:
        """The parameters, from each server's ``sources`` (in server order). Each server's
        slices of a parameter cut over several are joined as soon as that server's values are
        in, while the later servers' still cross (a worker ahead of its values waits for them
        server by server): the copying is done by the time the last values land, save the
        last server's."""
        views = []
        for k, (src, lay) in enumerate(zip(sources, self.layouts, strict=True)):
            views.append(self._view(k, src, lay))
            for s in self._joins[k]:
                self._joined[s.param].reshape(-1)[s.start : s.stop] = views[k][s.name]
        out = {}
        for p, shape in self.shapes.items():
            ps = self.pieces[p]
            out[p] = (
                self._joined[p] if len(ps) > 1 else views[ps[0].server][ps[0].name].reshape(shape)
            )
        return out

    def _view(self, k: int, src: ShmHandle | np.ndarray, lay: Layout) -> dict[str, np.ndarray]:
        """Server ``k``'s values as this worker computes with them: under ``wire: bf16``
        rounded alike whether they crossed a link (published as bfloat16) or not."""
        if isinstance(src, MirrorAt):  # as they crossed (rounded already), once they are in
            wait_for(self._att, src, self.check)
            return self._att.views(src.handle)
        if isinstance(src, ServerAt):  # a server beside it, once its update is done
            wait_for(self._att, src, self.check)
            src = src.handle
        if isinstance(src, list):  # published by slices (actors.exchange.wire): consistent copies
            return dict(zip((e.name for e in lay.entries), decode(src), strict=True))
        if not isinstance(src, ShmHandle):  # a snapshot: a consistent copy already
            return lay.views(src)
        if not self._private:
            return rounded(self._att.views(src), self.wire)
        flat = self._att.flat(src)[: lay.nbytes]
        stable_copy(flat, self._att.views(src)[SEQ], self._private[k])
        return rounded(lay.views(self._private[k]), self.wire)
