"""A whole host lost mid-run, on hosts that share nothing but a network (tests/hosts.py): the
run notices it by itself (its heartbeat, and the host's silence), replaces the worker and the
server it held on another host, rebuilds the server from its copy, and ends bit-identical to a
run never interrupted; ``raysinga train --resume`` from a third host continues it bit-exactly.
Checkpoints on a directory every host mounts, and on an S3 server on a host of its own. The
host of the stub lost: every role restarts from the newest checkpoint, bit-identical still. Then
chaos: roles SIGKILLed at seeded random instants, each kill with an even chance of taking the
role's whole host (a new host joining in its place), and the run still ends bit-identical."""

from __future__ import annotations

import json

import hosts
import pyarrow.fs as pafs
import pytest
from helpers import S3_BUCKET, S3_KEYS

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOB = """
name: lost-host
seed: 4
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 64, activation: relu}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 64}
updater: {name: sgd, lr: {kind: cosine, lr: 0.05, steps: 1000, min_lr: 0.001}, momentum: 0.9}
train_steps: 400
disp_freq: 50
test_freq: 0
checkpoint_frequency: 100
topology: {preset: sandblaster, n_servers: 2, workers_per_group: 2, worker: {cpus: 2}}
"""


@pytest.fixture(scope="module")
def cluster(module_lab):
    """A head that holds no role (the drivers run there), three 2-CPU hosts (one worker
    each, the third free for what a lost host held), all seeing the shared directory, and an
    S3 server on a host of its own. Yields a dict the tests share."""
    made = hosts.ray_cluster(module_lab, [0, 2, 2, 2])
    endpoint = module_lab.s3(module_lab.host("s3"))
    fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1", **S3_KEYS)
    pafs.S3FileSystem(
        endpoint_override=endpoint,
        scheme="http",
        region="us-east-1",
        allow_bucket_creation=True,
        **S3_KEYS,
    ).create_dir(S3_BUCKET)
    made[0].path("/mnt/shared/job.yaml").write_text(JOB)
    yield {"lab": module_lab, "hosts": made, "endpoint": endpoint, "fs": fs}


def train(on, head, *sets: str, wait: bool = True, more: tuple[str, ...] = ()):
    args = ["raysinga", "train", "/mnt/shared/job.yaml", "--address", f"{head.address}:6379", *more]
    args += [x for s in sets for x in ("--set", s)]
    return on.run(args, timeout=900) if wait else on.popen(args)


def meta(read, where: str, step: int) -> list[str]:
    """The lines of a checkpoint's params.meta (every tensor's checksum), its comment left
    out."""
    text = read(f"{where}/step-{step}/params.meta")
    return [line for line in text.splitlines() if not line.startswith("#")]


@pytest.fixture(scope="module")
def reference(cluster):
    """A run never interrupted, to step 500 with a checkpoint every 100 steps."""
    head = cluster["hosts"][0]
    r = train(head, head, "run_dir=/mnt/shared/reference", "train_steps=500")
    assert r.returncode == 0, r.stdout
    where = "/mnt/shared/reference/checkpoints"
    return {s: meta(lambda p: head.path(p).read_text(), where, s) for s in (400, 500)}


def lose_at_step_150(run, head, nodes, chosen):
    """Follow ``run``'s output; at step 150, lose the first of ``nodes`` whose roles (their
    classes) are ``chosen``. Returns the output once the run has ended with exit 0, the host
    lost and the roles each host held then."""
    out, victim, held = [], None, {}
    for line in run.stdout:
        out.append(line)
        if victim is None and line.split()[:2] == ["step", "150/400"]:
            held = hosts.roles_by_host(head, nodes)
            victim = next(h for h in nodes if chosen(held[h.name]))
            victim.lose()
    run.wait(timeout=600)
    text = "".join(out)
    assert run.returncode == 0 and victim is not None, text
    return text, victim, held


def add_a_host(cluster) -> None:
    """A new 2-CPU machine in a lost one's place, for the tests that follow."""
    spare = cluster["lab"].host(f"h{len(cluster['hosts']) + 1}", shared=True)
    spare.ray_start(2, head=cluster["hosts"][0])
    cluster["hosts"].append(spare)


@pytest.mark.parametrize("storage", ["shared", "s3"])
def test_a_lost_host_is_replaced_and_the_run_ends_bit_identical(cluster, reference, storage):
    head, *nodes = [h for h in cluster["hosts"] if not h.lost]
    if storage == "shared":
        where = f"/mnt/shared/{storage}-run/checkpoints"
        sets = [f"run_dir=/mnt/shared/{storage}-run"]

        def read(p: str) -> str:
            return head.path(p).read_text()

    else:
        query = f"endpoint_override={cluster['endpoint']}&scheme=http&region=us-east-1"
        keys = f"{S3_KEYS['access_key']}:{S3_KEYS['secret_key']}"
        where = f"{S3_BUCKET}/lost-host"
        sets = ["run_dir=/mnt/s3-run", f"checkpoint.dir=s3://{keys}@{where}?{query}"]

        def read(p: str) -> str:
            with cluster["fs"].open_input_stream(p) as f:
                return f.read().decode()

    run = train(head, head, *sets, wait=False)
    text, victim, held = lose_at_step_150(
        run, head, nodes, lambda roles: "ParamServer" in roles and "Stub" not in roles
    )
    assert "Worker" in held[victim.name], held
    assert f"node(s) {victim.address} unreachable" in text, text
    assert "recovered in" in text and "restarting" not in text, text
    assert meta(read, where, 400) == reference[400]

    third = next(h for h in nodes if h is not victim)
    resumed = train(third, head, *sets, "train_steps=500", more=("--resume",))
    assert resumed.returncode == 0, resumed.stdout
    assert "resuming 'lost-host' at step 400" in resumed.stdout, resumed.stdout
    assert meta(read, where, 500) == reference[500]

    add_a_host(cluster)


def test_a_lost_host_that_held_the_stub_restarts_from_the_newest_checkpoint(cluster, reference):
    """The stub held the servers' copies and the replay log: with its host they are gone, so
    every role restarts from the newest checkpoint, and the run still ends bit-identical."""
    head, *nodes = [h for h in cluster["hosts"] if not h.lost]
    run_dir = "/mnt/shared/stub-run"
    run = train(head, head, f"run_dir={run_dir}", wait=False)
    lose_at_step_150(run, head, nodes, lambda roles: "Stub" in roles)
    lines = head.path(f"{run_dir}/metrics.jsonl").read_text().splitlines()
    (ev,) = [r for r in map(json.loads, lines) if r["kind"] == "failure"]
    # the newest checkpoint before the loss: step 100, or 200 where the host went down only
    # after the run had passed 200 (a machine under load: CI saw the failure at step 250)
    assert ev["recovery"] == "restarted" and ev["restored_from"] in (100, 200), ev
    assert 0 <= ev["step"] - ev["restored_from"] <= 100, ev
    assert "with the stub" in ev["not_replaced"], ev  # why, said
    assert ev["steps_redone"] == ev["step"] - ev["restored_from"], ev
    assert meta(lambda p: head.path(p).read_text(), f"{run_dir}/checkpoints", 400) == reference[400]
    add_a_host(cluster)


def chaos_taking_hosts(address: str, run_dir: str, seed: int) -> None:
    """A driver on the head (``hosts.drive``): the job under raysinga's chaos, four kills, each
    with an even chance of losing the chosen role's host (a 2-CPU host joining after each).
    Prints the chaos's lines, then the roles killed (``node`` for a host)."""
    import ray  # noqa: PLC0415

    from raysinga import config  # noqa: PLC0415
    from raysinga.distributed import DistributedTrainer  # noqa: PLC0415
    from raysinga.distributed.chaos import Chaos  # noqa: PLC0415

    ray.init(address=address, log_to_driver=False)
    sets = [f"run_dir={run_dir}", "train_steps=500", "checkpoint_frequency=50"]
    t = DistributedTrainer(config.load("/mnt/shared/job.yaml", [*sets, "fault.max_failures=20"]))
    lines: list[str] = []
    cluster = hosts.RemoteCluster()
    with Chaos(t, seed, 4, (0.3, 1.0), 1, lines.append, cluster, node_share=0.5) as chaos:
        t.fit()
    print("\n".join(lines))
    print(json.dumps([k.role for k in chaos.done]))


def test_chaos_that_takes_whole_hosts_is_survived_bit_exact(cluster, reference):
    head = cluster["hosts"][0]
    run_dir = "/mnt/shared/chaos"
    r = hosts.drive(cluster["hosts"], chaos_taking_hosts, f"{head.address}:6379", run_dir, 4)
    assert r.returncode == 0, r.stdout
    roles = hosts.last_json(r.stdout)
    assert len(roles) == 4 and "node" in roles, r.stdout
    assert meta(lambda p: head.path(p).read_text(), f"{run_dir}/checkpoints", 500) == reference[500]
