"""A checkpoint handed across hosts through the object store (raysinga/run/registry.py), on
emulated hosts that share nothing but a network (tests/hosts.py): a run on two hosts puts its
checkpoints into the object store; a Ray task on a third host, which does not see the run's
checkpoint directory at all, reads the newest one from the registry, bit for bit. The registry
itself lives on that third host, as it may when the first job to ask started it there: it
cannot read the run's directory, so the run's node packs the checkpoints for it."""

from __future__ import annotations

import hashlib

import hosts
import pytest

from raysinga.checkpoint import Checkpoint

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

READ = """
import hashlib, json, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address="{address}", log_to_driver=False)
here = ray.get_runtime_context().get_node_id()

@ray.remote(num_cpus=0)
def read(key):
    import os, socket
    from raysinga.checkpoint import objstore
    ck = objstore.fetch(key)
    return {{
        "host": socket.gethostname(),
        "sees_dir": os.path.exists("{ckdir}"),
        "step": ck.step,
        "arrays": {{n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in ck.arrays().items()}},
    }}

from raysinga.run import registry
key = registry.key("registry-hosts", "{ckdir}")
pin = NodeAffinitySchedulingStrategy(here, soft=False)
print(json.dumps(ray.get(read.options(scheduling_strategy=pin).remote(key))))
"""

REGISTRY_HERE = """
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raysinga.checkpoint import objstore as O
ray.init(address="{address}", log_to_driver=False)
here = ray.get_runtime_context().get_node_id()
reg = ray.remote(O.CheckpointRegistry).options(
    name=O.REGISTRY_NAME, namespace=O.REGISTRY_NAMESPACE, lifetime="detached", num_cpus=0,
    scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
).remote()
ray.get(reg.list.remote())
print("registry on", here)
"""

JOB = """
name: registry-hosts
seed: 6
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 32, activation: relu}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 64}
updater: {name: adam, lr: 0.01}
train_steps: 200
disp_freq: 100
test_freq: 0
checkpoint_frequency: 100
checkpoint: {object_store: true}
topology: {preset: sandblaster, n_servers: 1, workers_per_group: 2}
"""


def test_a_task_on_another_host_reads_the_newest_checkpoint_from_the_registry(module_lab):
    head, *_ = hosts.ray_cluster(module_lab, [0, 2, 2])
    reader = module_lab.host("reader")  # no shared directory: the disk copy is out of reach
    reader.ray_start(0, head=head)  # it hosts no role, only the task
    hosts.wait_nodes(head, 4)
    address = f"{head.address}:6379"
    made = reader.python(REGISTRY_HERE.format(address=address), timeout=300)
    assert made.returncode == 0, made.stdout
    head.path("/mnt/shared/job.yaml").write_text(JOB)
    ckdir = "/mnt/shared/run/checkpoints"
    train = head.run(
        ["raysinga", "train", "/mnt/shared/job.yaml", "--address", address]
        + ["--set", "run_dir=/mnt/shared/run"],
        timeout=600,
    )
    assert train.returncode == 0, train.stdout
    code = READ.format(address=address, ckdir=ckdir)
    got = reader.python(code, timeout=300)
    assert got.returncode == 0, got.stdout
    seen = hosts.last_json(got.stdout)
    assert seen["host"] == "reader" and not seen["sees_dir"] and seen["step"] == 200
    on_disk = Checkpoint.open(head.path(f"{ckdir}/step-200"), verify="full")
    want = {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in on_disk.arrays().items()}
    assert seen["arrays"] == want
