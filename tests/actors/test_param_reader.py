"""A worker's reading of the servers' values (actors/memory/param_reader.py): whole parameters,
each server's slices joined as soon as that server's values are in."""

from __future__ import annotations

import uuid

import numpy as np

from actors.common.buffers import SEQ, SharedBuffer, UpdateGuard, with_seq
from actors.common.protocol import ServerAt, server_layouts
from actors.common.slicing import plan_slices
from actors.memory.param_reader import ParamReader

SHAPES = {"W": (8, 16), "b": (16,), "V": (16, 2)}


def test_a_servers_slices_are_joined_while_a_later_servers_values_are_still_awaited():
    slices = plan_slices(SHAPES, 4, 2, 64)  # W is cut over both servers; b and V are whole
    assert {s.server for s in slices if s.param == "W"} == {0, 1}
    layouts = server_layouts(slices, 2, "float32")
    tag = uuid.uuid4().hex[:8]
    bufs = [SharedBuffer(f"test-reader-{tag}-{k}", with_seq(lay)) for k, lay in enumerate(layouts)]
    rng = np.random.default_rng(0)
    whole = {p: rng.standard_normal(s).astype(np.float32) for p, s in SHAPES.items()}
    guards = [UpdateGuard(b.arrays[SEQ]) for b in bufs]
    try:

        def fill(k: int) -> None:
            for s in slices:
                if s.server == k:
                    bufs[k].arrays[s.name][...] = whole[s.param].reshape(-1)[s.start : s.stop]

        fill(0)
        guards[0].set_version(1)
        guards[1].set_version(1)
        guards[1].__enter__()  # server 1's second update under way: its values are not in
        seen: list[bool] = []
        reader: ParamReader

        def check() -> None:  # runs while the read waits for server 1
            if not seen:
                mine = [s for s in slices if s.param == "W" and s.server == 0]
                joined = reader._joined["W"].reshape(-1)
                seen.append(
                    all(
                        joined[s.start : s.stop].tobytes()
                        == whole["W"].reshape(-1)[s.start : s.stop].tobytes()
                        for s in mine
                    )
                )
                fill(1)
                guards[1].__exit__()

        reader = ParamReader(SHAPES, slices, 2, "float32", check=check)
        out = reader.read((ServerAt(bufs[0].handle(), 1, 0), ServerAt(bufs[1].handle(), 2, 1)))
        assert seen == [True]  # server 0's slices of W were in before server 1's values
        for p in SHAPES:
            assert out[p].shape == SHAPES[p] and out[p].tobytes() == whole[p].tobytes(), p
    finally:
        for b in bufs:
            b.close()
