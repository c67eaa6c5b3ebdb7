"""A host partitioned mid-run, its processes alive, and reconnected 30 s later, on hosts that
share nothing but a network (tests/hosts.py). The run notices the silence itself, replaces the
stub the host held on another host and goes on; once the link is back, what the old stub sends
is refused by the run's epoch (counted and reported by the servers), its processes end, and
the run ends bit-identical to one never interrupted, every checkpoint included."""

from __future__ import annotations

import re
import time

import hosts
import pytest
from returning import DRIVER

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

STEPS = 1500
JOB = f"""
name: partition
seed: 5
model:
  input_shape: [64]
  layers:
    - {{kind: dense, name: fc1, units: 64, activation: relu}}
    - {{kind: dense, name: out, units: 10}}
data: {{source: {{kind: digits}}, batch_size: 64}}
updater: {{name: sgd, lr: {{kind: cosine, lr: 0.05, steps: 1500, min_lr: 0.001}}, momentum: 0.9}}
train_steps: {STEPS}
disp_freq: 50
test_freq: 0
checkpoint_frequency: 100
checkpoint: {{keep_last: 20}}
topology:
  preset: sandblaster
  n_servers: 2
  workers_per_group: 2
  worker: {{cpus: 2}}
  stub: {{cpus: 2}}
"""
PARTITION_S = 30.0
ROLE_TITLES = ("ray::Worker", "ray::ParamServer", "ray::Stub", "ray::ReturningStub")


@pytest.fixture(scope="module")
def cluster(module_lab):
    """A head that holds no role (the driver runs there) and four 2-CPU hosts: a worker (and
    a server) on each of two, the stub alone on a third, the fourth free for what a lost
    host held."""
    made = hosts.ray_cluster(module_lab, [0, 2, 2, 2, 2])
    made[0].path("/mnt/shared/job.yaml").write_text(JOB)
    return made


def checkpoints(head, run: str) -> dict[int, list[str]]:
    """Every committed checkpoint of a run: its step -> the lines of its params.meta."""
    root = head.path(f"/mnt/shared/{run}/checkpoints")
    out = {}
    for d in root.iterdir():
        if re.fullmatch(r"step-\d+", d.name) and (d / "params.meta").exists():
            lines = (d / "params.meta").read_text().splitlines()
            out[int(d.name[5:])] = [x for x in lines if not x.startswith("#")]
    return out


def test_a_partitioned_host_is_replaced_and_its_returning_stub_is_refused(cluster):
    head, *nodes = cluster
    address = f"{head.address}:6379"
    ref = head.run(
        ["raysinga", "train", "/mnt/shared/job.yaml", "--address", address]
        + ["--set", "run_dir=/mnt/shared/reference"],
        timeout=900,
    )
    assert ref.returncode == 0, ref.stdout

    code = DRIVER.format(
        tests=str(hosts.CHECKOUT / "tests" / "cluster"),
        job="/mnt/shared/job.yaml",
        sets=["run_dir=/mnt/shared/partitioned"],
        address=address,
    )
    run = head.popen([str(hosts.VENV / "bin" / "python"), "-u", "-c", code])
    out, victim, cut, healed = [], None, 0.0, 0.0
    for line in run.stdout:
        out.append(line)
        # the stub's host is found a chunk before the cut (that takes seconds), so that the
        # cut falls mid-way between two checkpoints, as it is reported
        if victim is None and line.split()[:2] == ["step", f"100/{STEPS}"]:
            held = hosts.roles_by_host(head, nodes)
            victim = next((h for h in nodes if any("Stub" in c for c in held[h.name])), None)
            assert victim is not None, (held, "".join(out))
            assert "ParamServer" not in held[victim.name], held  # the stub, and spares
        if not cut and line.split()[:2] == ["step", f"150/{STEPS}"]:
            victim.link(False)
            cut = time.monotonic()
        if cut and not healed and time.monotonic() - cut >= PARTITION_S:
            victim.link(True)
            healed = time.monotonic()
    run.wait(timeout=600)
    text = "".join(out)
    assert run.returncode == 0 and "final: done" in text, text
    assert healed, f"the run ended within the partition: {text}"
    assert f"node(s) {victim.address} unreachable" in text, text
    assert "stub 0 was lost: silent" in text and "recovered in" in text, text
    assert "restarting" not in text, text  # nothing rolled back
    refused = [int(n) for n in re.findall(r"server \d+ refused (\d+) message", text)]
    assert sum(refused) >= 1, text

    # nothing of the returning stub's is in any checkpoint: each is the uninterrupted run's
    theirs, ours = checkpoints(head, "reference"), checkpoints(head, "partitioned")
    assert STEPS in ours and set(ours) <= set(theirs), (sorted(ours), sorted(theirs))
    for step, lines in ours.items():
        assert lines == theirs[step], step

    # and the returning roles end (Ray reaches them once the link is back)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        titles = []
        for pid in victim.processes():
            try:
                titles.append(open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode())
            except OSError:
                continue
        left = [t for t in titles if t.startswith(ROLE_TITLES)]
        if not left:
            break
        time.sleep(1)
    assert not left, left
