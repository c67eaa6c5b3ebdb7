"""The updates a parameter server makes of its slices, beside :meth:`.base.Optimizer.update`:
its workers' gradients summed inside the update (:meth:`ServerUpdates.update_summed`), and
ranges of its slices updated a part at a time, with what they were kept to be put back
(:meth:`ServerUpdates.update_spans`, a group summed by hosts). Element-wise, as every optimizer
here is: the bits are those of one :meth:`~.base.Optimizer.update` of the whole parameter."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .grads import BLOCK, chunks, on_threads, sum_into


def check_float(name: str, param: Any) -> None:
    if param.dtype.kind != "f":
        raise TypeError(f"parameter {name!r} must be floating point, got {param.dtype}")


def _within(sizes: list[int], span: tuple[int, int]) -> Iterator[tuple[int, int, int]]:
    """``(i, lo, hi)``: the range ``[lo, hi)`` of array ``i`` (of arrays of ``sizes`` laid
    end to end) that ``span`` covers, for each array it covers."""
    off = 0
    for i, n in enumerate(sizes):
        lo, hi = max(span[0] - off, 0), min(span[1] - off, n)
        if lo < hi:
            yield i, lo, hi
        off += n


class ServerUpdates:
    """A mixin of :class:`.base.Optimizer` (whose slots, counts, rate and ``_apply`` these
    use)."""

    _slots: dict[str, dict[str, Any]]
    counts: dict[str, int]

    def update_summed(
        self, step: int, params: dict, grads: dict, parts: dict, pool: Any = None
    ) -> None:
        """Update the NumPy parameters named in ``parts``, each with the sum of its gradient's
        ``parts[name]`` (added in the given order), written into ``grads[name]`` on the way,
        one cache-sized block at a time: the sum costs no pass over memory of its own. All are
        contiguous and shaped alike. The work of all of them is split evenly over the pool's
        threads and the caller's (one hand-over per call). The bits are those of summing each
        gradient, then :meth:`update`."""
        work = []
        for name in parts:
            param, grad = params[name], grads[name]
            check_float(name, param)
            p, g, ps = param.reshape(-1), grad.reshape(-1), [x.reshape(-1) for x in parts[name]]
            if g.shape != p.shape or not ps or any(x.shape != p.shape for x in ps):
                raise ValueError(f"gradient parts for {name!r} do not match param {param.shape}")
            if not (param.flags.c_contiguous and grad.flags.c_contiguous):
                raise ValueError(f"{name!r}: a summed update needs contiguous arrays")
            self._prepare_once(np, name, param)
            flat = {k: v.reshape(-1) for k, v in self._slots.get(name, {}).items()}
            work.append((p, g, ps, flat, self.counts.get(name, 0) + 1))
        sizes = [w[0].size for w in work]
        lr, spans = self.lr(step), chunks(sum(sizes), pool)

        def run(span: tuple[int, int]) -> None:
            for i, lo, hi in _within(sizes, span):
                p, g, ps, flat, t = work[i]
                for a in range(lo, hi, BLOCK):
                    b = min(hi, a + BLOCK)
                    sum_into(g[a:b], [x[a:b] for x in ps])
                    self._apply(np, p[a:b], g[a:b], {k: v[a:b] for k, v in flat.items()}, lr, t)

        on_threads(pool, run, spans)
        for name, w in zip(parts, work, strict=True):
            self.counts[name] = w[4]

    def update_spans(
        self,
        step: int,
        params: dict,
        grads: dict,
        spans: list[tuple[str, int, int]],
        pool: Any = None,
        kept: list | None = None,
    ) -> None:
        """Update the flat ranges ``spans`` (each ``(name, start, stop)``) of the contiguous
        NumPy ``params`` with the same ranges of ``grads``, as :meth:`update` updates them,
        without counting the update: :meth:`advance` counts it once every range of the
        parameters is done. The work is split evenly over the pool's threads and the
        caller's. ``kept``: each range's values and slots as they were are appended to it
        first, for :meth:`restore_spans`."""
        work = []
        for name, a, b in spans:
            param = params[name]
            check_float(name, param)
            if not param.flags.c_contiguous:
                raise ValueError(f"{name!r}: an update of ranges needs a contiguous parameter")
            self._prepare_once(np, name, param)
            p = param.reshape(-1)[a:b]
            flat = {k: v.reshape(-1)[a:b] for k, v in self._slots.get(name, {}).items()}
            if kept is not None:
                kept.append((p, p.copy(), {k: (v, v.copy()) for k, v in flat.items()}))
            g = grads[name].reshape(-1)[a:b]
            work.append((p, g, flat, self.counts.get(name, 0) + 1))
        sizes = [w[0].size for w in work]
        lr, total = self.lr(step), sum(sizes)
        if not total:
            return

        def run(span: tuple[int, int]) -> None:
            for i, lo, hi in _within(sizes, span):
                p, g, flat, t = work[i]
                sl = slice(lo, hi)
                self._apply(np, p[sl], g[sl], {k: v[sl] for k, v in flat.items()}, lr, t)

        on_threads(pool, run, chunks(total, pool))

    @staticmethod
    def restore_spans(kept: list) -> None:
        """Put back what :meth:`update_spans` kept, last first."""
        for p, was, slots in reversed(kept):
            p[...] = was
            for now, before in slots.values():
                now[...] = before
