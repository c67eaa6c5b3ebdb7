"""Spreading parameters over servers, balanced by bytes (SINGA's ``slice2server``).

A parameter larger than ``slice_bytes`` is cut into ``n_servers`` contiguous flat slices of equal
size (as SINGA does), so that no single server carries a huge layer alone; the pieces are then
assigned, largest first, to the least-loaded server that holds no other piece of the same
parameter. The plan is a pure function of its inputs: every process computes the same one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Slice:
    param: str  # the parameter's name, e.g. "fc1/W"
    start: int  # flat element range [start, stop) of the parameter
    stop: int
    server: int

    @property
    def name(self) -> str:
        return f"{self.param}[{self.start}:{self.stop}]"

    @property
    def size(self) -> int:
        return self.stop - self.start


def plan_slices(
    shapes: dict[str, tuple[int, ...]], itemsize: int, n_servers: int, slice_bytes: int
) -> list[Slice]:
    """Slices of every parameter, in parameter order then by offset."""
    if n_servers < 1 or slice_bytes < 1 or itemsize < 1:
        raise ValueError("n_servers, slice_bytes and itemsize must be positive")
    pieces: list[tuple[str, int, int]] = []
    for name, shape in shapes.items():
        size = math.prod(shape)
        k = min(n_servers, max(size, 1)) if size * itemsize > slice_bytes else 1
        bounds = [size * i // k for i in range(k + 1)]
        pieces += [(name, bounds[i], bounds[i + 1]) for i in range(k)]

    load = [0] * n_servers
    holders: dict[str, set[int]] = {}
    placed: dict[tuple[str, int], int] = {}
    order = sorted(range(len(pieces)), key=lambda i: (-(pieces[i][2] - pieces[i][1]), i))
    for i in order:
        name, start, stop = pieces[i]
        taken = holders.setdefault(name, set())
        server = min((s for s in range(n_servers) if s not in taken), key=lambda s: (load[s], s))
        taken.add(server)
        load[server] += (stop - start) * itemsize
        placed[(name, start)] = server
    return [Slice(n, a, b, placed[(n, a)]) for n, a, b in pieces]


def server_loads(slices: list[Slice], itemsize: int, n_servers: int) -> list[int]:
    """Bytes per server."""
    load = [0] * n_servers
    for s in slices:
        load[s.server] += s.size * itemsize
    return load
