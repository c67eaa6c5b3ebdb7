"""The parts of a split layer exchanging through shared memory on one host
(actors/exchange/parts.py): sums and concatenations in part order, the same bits on every
part, exchange after exchange through the same slots, between threads and between processes;
a part that never comes is given up on; an array too large for the slots is refused."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from raysinga.actors.exchange.parts import PartsExchange, PartsTimeout, create
from raysinga.nn.layers import Dense, StepContext
from raysinga.nn.partition import LocalExchange, part_of, split


class Aborted(Exception):
    pass


@pytest.fixture
def shared():
    made = []

    def make(parts: int, capacity: int = 4096):
        buf = create(f"test-parts-{len(made)}", parts, capacity)
        made.append(buf)
        return buf.handle()

    yield make
    for buf in made:
        buf.close()


def arrays(seed: int, n: int = 5) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("k", [2, 3])
def test_exchanges_add_and_concatenate_in_part_order_exchange_after_exchange(shared, k):
    handle = shared(k)
    mine = [arrays(p) for p in range(k)]

    def work(part: int) -> list[np.ndarray]:
        ex = PartsExchange(handle, k, part, timeout_s=30)
        try:
            out = []
            for i in range(5):  # the same slots, again and again
                out.append(ex.sum(mine[part][i]))
                out.append(ex.gather(mine[part][i], axis=1))
            return out
        finally:
            ex.close()

    with ThreadPoolExecutor(k) as pool:
        got = list(pool.map(work, range(k)))
    for i in range(5):
        want_sum = mine[0][i].copy()
        for p in range(1, k):
            want_sum += mine[p][i]
        want_cat = np.concatenate([mine[p][i] for p in range(k)], axis=1)
        for p in range(k):
            assert got[p][2 * i].tobytes() == want_sum.tobytes()
            assert got[p][2 * i + 1].tobytes() == want_cat.tobytes()


def test_a_split_dense_pair_through_shared_memory_gives_the_bits_of_the_parts_in_memory(shared):
    rng = np.random.default_rng(4)
    ctx = StepContext(train=True)
    first, second = Dense("fc1", units=8, activation="relu"), Dense("fc2", units=3)
    first.build((6,)), second.build((8,))
    p1 = {"W": rng.standard_normal((6, 8)).astype(np.float32), "b": np.zeros(8, np.float32)}
    p2 = {"W": rng.standard_normal((8, 3)).astype(np.float32), "b": np.ones(3, np.float32)}
    cols, rows = split(first, "columns", p1, 2), split(second, "rows", p2, 2)
    x = rng.standard_normal((5, 6)).astype(np.float32)
    dy = rng.standard_normal((5, 3)).astype(np.float32)

    def step(ex) -> tuple[np.ndarray, np.ndarray]:
        a, b = part_of(first, "columns", ex), part_of(second, "rows", ex)
        y = b.forward(rows[ex.part], {}, a.forward(cols[ex.part], {}, x, ctx), ctx)
        dx, _ = a.backward(b.backward(dy)[0])
        return y, dx

    handle = shared(2)
    with ThreadPoolExecutor(2) as pool:
        in_memory = list(pool.map(step, LocalExchange.group(2)))
        through_shm = list(pool.map(step, [PartsExchange(handle, 2, p) for p in range(2)]))
    for (y, dx), (y2, dx2) in zip(in_memory, through_shm, strict=True):
        assert y.tobytes() == y2.tobytes() and dx.tobytes() == dx2.tobytes()


def _child(handle, part: int, queue) -> None:
    ex = PartsExchange(handle, 2, part, timeout_s=30)
    queue.put([ex.sum(a).tobytes() for a in arrays(part)])
    ex.close()


def test_parts_in_two_processes_exchange_through_the_file(shared):
    handle = shared(2)
    ctx = multiprocessing.get_context("spawn")  # not fork: pytest-xdist runs threads
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(handle, p, queue)) for p in range(2)]
    for pr in procs:
        pr.start()
    got = [queue.get(timeout=60) for _ in procs]
    for pr in procs:
        pr.join(30)
        assert pr.exitcode == 0
    want = [(a + b).tobytes() for a, b in zip(arrays(0), arrays(1), strict=True)]
    assert got[0] == got[1] == want


def test_a_part_that_never_comes_is_given_up_on(shared):
    handle = shared(2)
    told = {"stop": False}

    def check() -> None:
        if told["stop"]:
            raise Aborted

    ex = PartsExchange(handle, 2, 0, check=check, timeout_s=0.3)
    with pytest.raises(PartsTimeout, match="part 0: part 1 has not written exchange 1 within"):
        ex.sum(np.ones(3, np.float32))
    told["stop"] = True
    again = PartsExchange(handle, 2, 0, check=check, timeout_s=30)
    with pytest.raises(Aborted):  # the run stopping: the wait gives up at its next look
        again.sum(np.ones(3, np.float32))
    ex.close(), again.close()


def test_an_array_larger_than_the_slots_is_refused(shared):
    ex = PartsExchange(shared(2, capacity=64), 2, 1)
    with pytest.raises(ValueError, match="an array of 80 bytes does not fit .* slots of 64 bytes"):
        ex.sum(np.zeros(20, np.float32))
    with pytest.raises(ValueError, match="part 2 of 2 does not exist"):
        PartsExchange(shared(2), 2, 2)
    ex.close()
