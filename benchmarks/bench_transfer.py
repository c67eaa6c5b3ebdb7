"""Ray's object transfers against raysinga's own TCP connections (``actors/exchange/tcp.py``) for
the exchange a group summed by hosts makes twice a step, on emulated hosts that share nothing but a
network of finite bandwidth (``tests/hosts.py``: Linux namespaces; needs root and iproute2).

``--hosts N`` hosts, one actor on each, every link shaped to ``--link`` Mbit/s each way. In one
exchange every actor hands every other actor ``--mb`` MB (a block's sum of one server's slices,
or a server's values for one host):

- Ray: each actor ``ray.put``s its array; each then ``ray.get``s the others' at once (what a
  server did with the leaders' sums, and a node with a server's values, through the object
  store);
- TCP: each actor sends its array to every actor's inbox (its own too, as a leader does to the
  server beside it), one receiver at a time in a rotation (:meth:`actors.exchange.tcp.Outbox.send`),
  and takes the others' in.

An exchange's time is from the driver's calls to the last actor's answer. Each round is the
median of ``--exchanges`` exchanges of each side, the sides taking turns; the figures are the
medians of the rounds and the ratio Ray / TCP. The link alone needs (N-1)·MB per host each way.
Measured for reference: no goal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from report import Figure, Report, add_json_option

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the emulated hosts are the suite's
RESULT = "@result "


def exchanges(address: str, n: int, nbytes: int, rounds: int, per_round: int) -> None:
    """A driver on the head (:func:`hosts.drive`): prints each round's median exchange time
    of each side, in seconds."""
    import numpy as np  # noqa: PLC0415
    import ray  # noqa: PLC0415
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    ray.init(address=address, log_to_driver=False)
    nodes = sorted(
        (x for x in ray.nodes() if x["Alive"] and x["Resources"].get("CPU", 0) > 0),
        key=lambda x: x["NodeManagerAddress"],
    )

    @ray.remote(num_cpus=0)
    class Peer:
        def __init__(self, i: int) -> None:
            from raysinga.actors.common.protocol import node_ip  # noqa: PLC0415
            from raysinga.actors.exchange.tcp import Inbox, Outbox  # noqa: PLC0415

            self.i = i
            self.data = np.random.default_rng(i).standard_normal(nbytes // 4).astype(np.float32)
            self.inbox, self.outbox = Inbox(node_ip()), Outbox()

        def contact(self):
            return self.inbox.contact

        def put(self):
            return [ray.put(self.data)]  # inside a list: the caller passes the ref on

        def get(self, refs) -> None:
            ray.get([r[0] for r in refs])

        def tcp(self, contacts, step: int) -> None:
            k = len(contacts)
            turn = [(self.i + 1 + j) % k for j in range(k)]
            to = [contacts[t] for t in turn]
            self.outbox.send(to, 0, step, self.i, [[self.data]] * k, lambda: None)
            self.inbox.take(0, step, k, lambda: None)

    peers = [
        Peer.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[i]["NodeID"], soft=False)
        ).remote(i)
        for i in range(n)
    ]
    contacts = ray.get([p.contact.remote() for p in peers])
    out: dict[str, list[float]] = {"ray": [], "tcp": []}
    step = 0
    for _ in range(rounds):
        times: dict[str, list[float]] = {"ray": [], "tcp": []}
        for _ in range(per_round):
            refs = ray.get([p.put.remote() for p in peers])
            t = time.perf_counter()
            ray.get(
                [
                    p.get.remote([r for j, r in enumerate(refs) if j != i])
                    for i, p in enumerate(peers)
                ]
            )
            times["ray"].append(time.perf_counter() - t)
            step += 1
            t = time.perf_counter()
            ray.get([p.tcp.remote(contacts, step) for p in peers])
            times["tcp"].append(time.perf_counter() - t)
        for side, ts in times.items():
            out[side].append(statistics.median(ts))
    print(RESULT + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--link", type=float, default=1000.0, help="Mbit/s each way")
    ap.add_argument("--mb", type=float, default=1.86, help="MB each actor hands each other")
    ap.add_argument("--exchanges", type=int, default=8, help="per side and round")
    ap.add_argument("--rounds", type=int, default=3)
    add_json_option(ap)
    a = ap.parse_args()
    import bench_transfer as this  # noqa: PLC0415 - the driver's function, importable by name
    import hosts  # noqa: PLC0415

    why = hosts.unavailable()
    if why:
        raise SystemExit(f"bench_transfer.py: {why}")
    if a.hosts < 2:
        raise SystemExit("--hosts: at least 2")
    nbytes = int(a.mb * 1e6) // 4 * 4
    root = Path(tempfile.mkdtemp(prefix="bench-transfer-"))
    try:
        with hosts.lab(root) as lab:
            made = hosts.ray_cluster(lab, [0] + [1] * a.hosts)
            for h in made:
                h.shape(a.link)
            args = (f"{made[0].address}:6379", a.hosts, nbytes, a.rounds, a.exchanges)
            r = hosts.drive(made, this.exchanges, *args, timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    lines = [x for x in r.stdout.splitlines() if x.startswith(RESULT)]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"bench_transfer.py: the driver failed (exit {r.returncode}):\n{r.stdout}")
    got = json.loads(lines[-1][len(RESULT) :])
    link_ms = (a.hosts - 1) * nbytes / (a.link * 1e6 / 8) * 1e3
    report = Report("bench_transfer", {**vars(a), "link_ms": link_ms})
    print(f"the link alone: {link_ms:.1f} ms per exchange")
    report.add(Figure("Ray's object store: ms per exchange", [t * 1e3 for t in got["ray"]]), ".1f")
    report.add(Figure("raysinga's TCP: ms per exchange", [t * 1e3 for t in got["tcp"]]), ".1f")
    ratio = [x / y for x, y in zip(got["ray"], got["tcp"], strict=True)]
    report.add(Figure("Ray / TCP, time per exchange", ratio), ".2f")
    report.write(a.json)


if __name__ == "__main__":
    main()
