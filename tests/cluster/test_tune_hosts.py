"""A population-based training search whose trials run on two emulated hosts that share
nothing but a network and the Tune storage directory (tests/hosts.py): synchronous PBT over four
trials, two on each host (each host's keeper owns its trials' checkpoints in the object store),
where a trial's donor may be on the other host. The trial with the longest lineage is
replayed from the head, its segments read across the network, bit for bit."""

from __future__ import annotations

import json

import hosts
import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOB = """
name: hosttune
seed: 3
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 32, activation: relu}
    - {kind: dropout, name: drop, rate: 0.1}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 32}
updater: {name: sgd, lr: 0.01, momentum: 0.9}
train_steps: 40
disp_freq: 10
"""

KEEPERS = """
import json, ray
ray.init(address="{address}", log_to_driver=False)
ips = {{n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}}
names = ray.util.list_named_actors(all_namespaces=True)
print(json.dumps(sorted(ips.get(a["name"][len("{prefix}"):], "?") for a in names
                        if a["name"].startswith("{prefix}"))))
"""


def test_a_pbt_search_over_two_hosts_exploits_across_them_and_replays_bit_for_bit(module_lab):
    from raysinga.tune.handover import KEEPER_PREFIX  # noqa: PLC0415

    head, *nodes = hosts.ray_cluster(module_lab, [0, 2, 2])
    head.path("/mnt/shared/job.yaml").write_text(JOB)
    address = f"{head.address}:6379"
    tune = ["raysinga", "tune", "/mnt/shared/job.yaml", "--address", address]
    run = head.run(
        [*tune, "--search", "updater.lr=grid(0.0005,0.002,0.02,0.08)", "--trials", "1"]
        + ["--scheduler", "pbt", "--synch", "--report-every", "10", "--quiet"]
        + ["--storage", "/mnt/shared/tune", "--name", "hosts"],
        timeout=600,
    )
    assert run.returncode == 0, run.stdout
    lines = run.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("trial "))
    rows = [line.split() for line in lines[first + 1 : first + 5]]
    assert [r[3] for r in rows] == ["40"] * 4, run.stdout  # every trial ran to the end
    lineage = {r[0]: int(r[4]) for r in rows}
    assert max(lineage.values()) > 1, "PBT exploited no trial"

    keepers = head.python(KEEPERS.format(address=address, prefix=KEEPER_PREFIX))
    assert keepers.returncode == 0, keepers.stdout
    held = json.loads(keepers.stdout.strip().splitlines()[-1])
    assert held == sorted(h.address for h in nodes), held  # trials ran on both hosts

    trial = max(lineage, key=lineage.get)
    (trial_dir,) = head.path("/mnt/shared/tune/hosts").glob(f"*_{trial}_*")
    inside = "/mnt/shared/tune/hosts/" + trial_dir.name
    replay = head.run([*tune, "--replay", inside], timeout=600)
    assert replay.returncode == 0, replay.stdout
    said = f"replaying trial {trial} ({lineage[trial]} segment(s)) to step 40"
    assert said in replay.stdout, replay.stdout
    same = f"the parameters equal trial {trial}'s at step 40, bit for bit"
    assert same in replay.stdout, replay.stdout
