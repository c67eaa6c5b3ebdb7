"""The bytes a run reports moving between hosts (``metrics.jsonl``'s ``net``, counted by the
roles from what they hand one another: :mod:`actors.exchange.traffic`) against what the hosts'
interfaces counted, on hosts that share nothing but a network (tests/hosts.py).

A driver on the head reads every host's interface counters at two progress reports of one run
(at a report the group stands between two steps: nothing of a step is in flight), so the
difference is what the steps between them moved. Per step, each host's counted bytes in and
out must then be what its interface carried, less the headers of the packets that carried
them (Ethernet, IP and TCP: about 4.6% of a full 1500-byte frame), their acknowledgements, Ray's
calls, and Ray's own traffic, which goes on by the second (so the longer a step, the more of it).
"""

from __future__ import annotations

import json

import hosts
import pytest
from helpers import checkpoint_tensors, start_ray

from raysinga import config
from raysinga.distributed import DistributedTrainer

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOB = """
name: traffic
seed: 3
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 256, activation: relu}
    - {kind: dense, name: fc2, units: 256, activation: relu}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 64}
updater: {name: sgd, lr: 0.05, momentum: 0.9}
disp_freq: 20
test_freq: 0
checkpoint_frequency: 0
"""
FROM, TO = 40, 200  # the progress reports the counters are read at
HEADERS = 0.10  # packet headers and acknowledgements, of the counted bytes
CALLS = 20_000  # Ray's calls of a step, on any host
CHATTER = 100_000  # Ray's own traffic per second on any host (at most about 50 kB/s was seen)


@pytest.fixture(scope="module")
def cluster(module_lab):
    """A head that holds no role (the driver runs there) and three 2-CPU hosts: one worker
    on each of two of them, the stub and the servers where placement puts them."""
    made = hosts.ray_cluster(module_lab, [0, 2, 2, 2])
    made[0].path("/mnt/shared/job.yaml").write_text(JOB)
    return made


@pytest.fixture(scope="module")
def counted(cluster):
    """Each topology's counted run of the job on the hosts (:func:`counted_run`), made once
    for the module, its bytes and its bits read off the same run: topology -> its run
    directory and the driver's output."""
    head, done = cluster[0], {}

    def run(topology: str) -> tuple[str, str]:
        if topology not in done:
            run_dir = f"/mnt/shared/counted-{[STUB, HOSTS, ZSTD, DELTA].index(topology)}"
            r = hosts.drive(cluster, counted_run, f"{head.address}:6379", run_dir, topology)
            assert r.returncode == 0, r.stdout
            done[topology] = (run_dir, r.stdout)
        return done[topology]

    return run


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """The job summed by hosts run on this machine alone (every read local) to step ``TO``,
    once for the module: its final checkpoint's tensors."""
    made: dict[str, dict] = {}

    def tensors() -> dict:
        if not made:
            start_ray()
            d = tmp_path_factory.mktemp("alone")
            (d / "job.yaml").write_text(JOB)
            sets = [f"run_dir={d / 'here'}", f"train_steps={TO}", f"topology={HOSTS}"]
            DistributedTrainer(config.load(d / "job.yaml", sets), log=None).fit()
            made["tensors"] = checkpoint_tensors(d / f"here/checkpoints/step-{TO}")
        return made["tensors"]

    return tensors


def counted_run(address: str, run_dir: str, topology: str) -> None:
    """A driver on the head (:func:`hosts.drive`): trains the job, reading every host's
    counters at the reports of steps ``FROM`` and ``TO``; prints them with the run's ``net``."""
    import time  # noqa: PLC0415

    import ray  # noqa: PLC0415

    from raysinga import config  # noqa: PLC0415
    from raysinga.distributed import DistributedTrainer  # noqa: PLC0415
    from raysinga.obs.events import TrainStep  # noqa: PLC0415

    ray.init(address=address, log_to_driver=False)
    lab = hosts.RemoteCluster()
    sets = [f"run_dir={run_dir}", f"train_steps={TO}", f"topology={topology}"]
    t = DistributedTrainer(config.load("/mnt/shared/job.yaml", sets), log=print)
    seen: dict[int, dict] = {}

    def hook(ev) -> None:
        if isinstance(ev, TrainStep) and FROM <= ev.step <= TO:
            counters = lab.counters() if ev.step in (FROM, TO) else None
            seen[ev.step] = {"counters": counters, "net": ev.net, "t": time.monotonic()}

    t.hub.subscribe(hook)
    t.fit()
    print(json.dumps(seen))


STUB = "{preset: sandblaster, n_servers: 2, workers_per_group: 2, worker: {cpus: 2}}"
# one worker and one server on each of the three hosts, summed by hosts (actors.exchange.wire)
HOSTS = "{preset: allreduce, reduce: hosts, workers_per_group: 3, worker: {cpus: 2}}"
# the same, compressed without loss on the wire
ZSTD = HOSTS.replace("workers_per_group: 3,", "workers_per_group: 3, wire: f32+zstd,")
# only the values' differences compressed, the sums as they are
DELTA = HOSTS.replace("workers_per_group: 3,", "workers_per_group: 3, wire: f32+delta,")
PARAMS = 4 * (64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10)  # the model's bytes


@pytest.mark.parametrize(
    "topology", [STUB, HOSTS, ZSTD, DELTA], ids=["stub", "hosts", "zstd", "delta"]
)
def test_the_bytes_counted_per_host_are_what_the_interfaces_carried(counted, topology):
    """Summed by hosts, each host also carries at most 1.1x what ring allreduce moves,
    2 (W-1)/W of the parameters' bytes each way ([N2])."""
    _, stdout = counted(topology)
    seen = hosts.last_json(stdout)
    a, b = seen[str(FROM)]["counters"], seen[str(TO)]["counters"]
    # each report's: the mean of the steps since the report before
    nets = [v["net"] for k, v in seen.items() if int(k) > FROM]
    if topology in (STUB, HOSTS):  # a placement's steps all move the same
        assert all(n == seen[str(FROM)]["net"] for n in nets), stdout
    # compressed, each step moves its own count: the mean of the reports from FROM to TO
    net = {h: {k: sum(n[h][k] for n in nets) / len(nets) for k in ("in", "out")} for h in nets[-1]}
    steps = TO - FROM
    step_s = (seen[str(TO)]["t"] - seen[str(FROM)]["t"]) / steps
    per_step = {h: {k: (b[h][k] - a[h][k]) / steps for k in a[h]} for h in a}
    lines = [f"{h}: counted {net.get(h)}, interface {per_step[h]}" for h in per_step]
    report = "\n".join(lines) + "\n" + stdout
    print("\n".join(lines))
    # the progress lines show the busiest host's bytes
    assert any("  net " in x and " per step (" in x for x in stdout.splitlines()), report
    assert set(net) <= set(per_step), report
    into, out = (sum(v[k] for v in net.values()) for k in ("in", "out"))
    assert into == pytest.approx(out, rel=1e-6), report  # (each report's mean is rounded)
    assert max(v["in"] + v["out"] for v in net.values()) > 500_000, report  # the link matters
    for h, measured in per_step.items():
        counted = net.get(h, {"in": 0, "out": 0})
        for mine, theirs in (("out", "tx_bytes"), ("in", "rx_bytes")):
            low = counted[mine]
            high = counted[mine] * (1 + HEADERS) + CALLS + CHATTER * step_s
            assert low <= measured[theirs] <= high, f"{h} {mine}: not in [{low}, {high}]\n{report}"
    if topology != STUB:
        ring = 2 * (3 - 1) / 3 * PARAMS
        bound = 1.1 if topology == HOSTS else 0.95  # compressed: fewer bytes than the ring's
        assert len(net) == 3, report
        for h, v in net.items():
            assert max(v["in"], v["out"]) <= bound * ring, f"{h}: {v} against {ring}\n{report}"


@pytest.mark.parametrize("topology", [HOSTS, ZSTD, DELTA], ids=["f32", "f32+zstd", "f32+delta"])
def test_summed_by_hosts_over_the_network_ends_as_on_one_machine(cluster, counted, alone, topology):
    """Three hosts, the sums sent to the servers' inboxes and the values pushed to mirrors
    on each host (actors/exchange/tcp.py, actors/exchange/mirrors.py): every tensor of the final
    checkpoint the bits of the same job run on this machine alone, where every read is local; so too
    with the wire compressed (``f32+zstd``, ``f32+delta``: lossless). (The runs whose bytes
    are counted.)"""
    run, _ = counted(topology)
    theirs = checkpoint_tensors(cluster[0].path(f"{run}/checkpoints/step-{TO}"))
    ours = alone()
    assert theirs.keys() == ours.keys()
    assert [n for n in ours if ours[n] != theirs[n]] == []


def test_a_worker_killed_on_its_host_under_a_compressed_wire_is_recovered_bit_exact(cluster, alone):
    """``wire: f32+zstd``: a server sends a node's mirror only the difference from the values
    it pushed it last. A worker SIGKILLed on its host takes its node's mirror with it; the
    replacement's mirror is pushed whole, and the run ends with the bits of the same job run
    uninterrupted on this machine alone."""
    head, *nodes = cluster
    run_dir = "/mnt/shared/killed-zstd"
    args = ["raysinga", "train", "/mnt/shared/job.yaml", "--address", f"{head.address}:6379"]
    sets = [f"run_dir={run_dir}", f"train_steps={TO}", f"topology={ZSTD}"]
    run = head.popen([*args, *(x for s in sets for x in ("--set", s))])
    out, killed = [], None
    for line in run.stdout:
        out.append(line)
        if killed is None and line.split()[:2] == ["step", f"{FROM}/{TO}"]:
            workers = [r for r in hosts.placed_roles(head, nodes) if r["cls"] == "Worker"]
            killed = workers[-1]
            hosts.sigkill_role(nodes, killed)
    run.wait(timeout=600)
    text = "".join(out)
    assert run.returncode == 0 and killed is not None, text
    lines = head.path(f"{run_dir}/metrics.jsonl").read_text().splitlines()
    failures = [r for r in map(json.loads, lines) if r["kind"] == "failure"]
    seen = [f"{r['role']} {r['index']}: {r['error']}" for r in failures]
    assert [r["role"] for r in failures] == ["worker"], seen  # the others' calls go on
    theirs = checkpoint_tensors(head.path(f"{run_dir}/checkpoints/step-{TO}"))
    ours = alone()
    assert [n for n in ours if ours[n] != theirs[n]] == []
