"""A population-based training search whose trials run on two emulated hosts that share
nothing but a network and the Tune storage directory (tests/hosts.py): synchronous PBT over four
trials, two on each host (each host's keeper owns its trials' checkpoints in the object store),
where a trial's donor may be on the other host. The trial with the longest lineage is
replayed from the head, its segments read across the network, bit for bit. A host lost with its
trials' keeper: the checkpoint of a trial with a disk copy on the shared directory is read from
there; the other's is refused, naming the loss."""

from __future__ import annotations

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

# The hosts of the live keepers (the last line); before it, every keeper actor Ray knows of,
# alive or not, with why one died (what a failure shows).
KEEPERS = """
import json, ray
from ray.util.state import list_actors
ray.init(address="{address}", log_to_driver=False)
ips = {{n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}}
every = [a for a in list_actors(limit=1000, detail=True) if (a.name or "").startswith("{prefix}")]
print(json.dumps([[ips.get(a.node_id, "?"), a.state, str(a.death_cause)[:400]] for a in every]))
names = ray.util.list_named_actors(all_namespaces=True)
print(json.dumps(sorted(ips.get(a["name"][len("{prefix}"):], "?") for a in names
                        if a["name"].startswith("{prefix}"))))
"""


@pytest.fixture(scope="module")
def cluster(module_lab):
    """A head that holds no trial (the drivers run there) and two 2-CPU hosts."""
    return hosts.ray_cluster(module_lab, [0, 2, 2])


def test_a_pbt_search_over_two_hosts_exploits_across_them_and_replays_bit_for_bit(cluster):
    from raysinga.tune.handover import KEEPER_PREFIX  # noqa: PLC0415

    head, *nodes = cluster
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
    held = hosts.last_json(keepers.stdout)
    # trials ran on both hosts, each host's keeper alive
    assert held == sorted(h.address for h in nodes), (held, keepers.stdout[-4000:], run.stdout)

    trial = max(lineage, key=lineage.get)
    (trial_dir,) = head.path("/mnt/shared/tune/hosts").glob(f"*_{trial}_*")
    inside = "/mnt/shared/tune/hosts/" + trial_dir.name
    replay = head.run([*tune, "--replay", inside], timeout=600)
    assert replay.returncode == 0, replay.stdout
    said = f"replaying trial {trial} ({lineage[trial]} segment(s)) to step 40"
    assert said in replay.stdout, replay.stdout
    same = f"the parameters equal trial {trial}'s at step 40, bit for bit"
    assert same in replay.stdout, replay.stdout


def keeper_lost_with_its_host(address: str) -> None:
    """A driver on the head (``hosts.drive``): two searches of one trial each, run on a new
    host (its resource ``doomed``) that is then lost with its keeper and the objects the
    keeper owned, one trial with a disk copy on the shared directory, one without."""
    import time  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415
    import ray  # noqa: PLC0415
    from helpers import tune_job  # noqa: PLC0415
    from ray import tune  # noqa: PLC0415
    from ray.exceptions import GetTimeoutError, RayActorError  # noqa: PLC0415

    from raysinga.checkpoint import Checkpoint, CheckpointError, objstore  # noqa: PLC0415
    from raysinga.tune import trials as rtune  # noqa: PLC0415
    from raysinga.tune.handover import KEEPER_PREFIX  # noqa: PLC0415

    ray.init(address=address, log_to_driver=False)
    cluster = hosts.RemoteCluster()
    doomed = cluster.add_node(num_cpus=1, resources={"doomed": 1})
    job = tune_job("keeper")
    kept = rtune.trainable(job, report_every=20, checkpoint_dir="/mnt/shared/keeper/disk")
    bare = rtune.trainable(job, report_every=20)
    pointers = []
    for trainable, name in ((kept, "lost-kept"), (bare, "lost-bare")):
        tuner = tune.Tuner(
            tune.with_resources(trainable, {"cpu": 1, "doomed": 1}),  # on the doomed host
            tune_config=tune.TuneConfig(metric="loss", mode="min"),
            run_config=tune.RunConfig(
                name=name, storage_path="/mnt/shared/keeper/tune", stop={"step": 40}, verbose=0
            ),
        )
        (result,) = tuner.fit()
        assert result.error is None, result.error
        pointers.append(rtune.read_pointer(result.checkpoint.path))
    assert pointers[0]["uri"] and pointers[1]["uri"] is None, pointers
    # not read here before the loss: a copy pulled to this node would outlive the owner
    want = Checkpoint.open(pointers[0]["uri"], verify="full")
    want = {n: np.array(want.array(n)) for n in want.names("param")}
    keeper = ray.get_actor(KEEPER_PREFIX + doomed.node_id, namespace=objstore.REGISTRY_NAMESPACE)
    cluster.remove_node(doomed)
    deadline = time.monotonic() + 180
    while True:  # until Ray knows it is gone: a silent host's calls only wait meanwhile
        try:
            ray.get(keeper.list.remote(), timeout=10)
        except GetTimeoutError:
            pass
        except RayActorError:
            break
        assert time.monotonic() < deadline, "Ray did not take the lost host's keeper for dead"
        time.sleep(1)

    lines: list[str] = []
    got = rtune.fetch(pointers[0], log=lines.append)
    (line,) = lines
    key = pointers[0]["key"]
    assert line.startswith(f"raysinga: the object-store copy of {key} step 40 is lost ("), line
    assert line.endswith(f"; reading {pointers[0]['uri']}"), line
    for name, a in want.items():
        assert got.array(name).tobytes() == a.tobytes(), name
    try:
        rtune.fetch(pointers[1], log=print)
        raise AssertionError("a checkpoint lost with its keeper and no disk copy was read")
    except CheckpointError as e:
        said = str(e)
    assert f"{pointers[1]['key']} step 40: the object-store copy is lost (" in said, said
    assert "and there is no disk copy (set checkpoint_dir=" in said, said
    print("the disk copy stood in; the bare checkpoint was refused")


def test_a_lost_host_takes_its_trials_checkpoints_and_the_disk_copy_stands_in(cluster):
    """(A node that had read an object keeps its copy, which Ray still serves after the
    owner's death: that is not the case tried here.)"""
    r = hosts.drive(cluster, keeper_lost_with_its_host, f"{cluster[0].address}:6379")
    assert r.returncode == 0, r.stdout
    # the driver's last line (Ray's own log lines may follow it in the output)
    done = "the disk copy stood in; the bare checkpoint was refused"
    assert done in r.stdout.strip().splitlines(), r.stdout
