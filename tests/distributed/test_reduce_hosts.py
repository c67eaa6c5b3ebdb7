"""A synchronous group summed by hosts (``topology.reduce: hosts``, :mod:`actors.exchange.wire`):
the workers of each block summed by the block's leader, the blocks' sums by the servers, in an
order the job fixes; and ``wire: bf16``. On one node here (the traffic it saves on hosts that
share nothing is ``tests/cluster/test_traffic_hosts.py``'s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import checkpoint_tensors, load_job, sigkill_once, start_ray

from raysinga import config
from raysinga.checkpoint import Checkpoint, steps
from raysinga.config.topology import TopologyError
from raysinga.distributed import DistributedTrainer
from raysinga.run import Trainer

JOB = """
name: blocks
seed: 5
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 48, activation: relu}
    - {kind: dropout, name: drop, rate: 0.1}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 64}
updater: {name: adam, lr: 0.01}
train_steps: 30
disp_freq: 10
test_freq: 0
checkpoint_frequency: 10
topology: {preset: allreduce, reduce: hosts, workers_per_group: 4, workers_per_host: 2,
           slice_bytes: 4096}
"""
QUIET = {"log": lambda line: None}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def fit(d: Path, *more: str):
    return DistributedTrainer(load_job(d, JOB, *more), **QUIET).fit()


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    start_ray()
    return fit(tmp_path_factory.mktemp("blocks"))


@pytest.mark.slow  # the default tier's time: its check against --local is there
def test_the_blocks_fix_the_order_of_the_sum_wherever_the_servers_sit(blocks, tmp_path):
    """Two blocks of two workers: with the servers in the blocks (allreduce) or spread as
    sandblaster puts them, the same bits; one worker per block sums as the stub does."""
    topo = (
        "topology={preset: sandblaster, n_servers: 2, reduce: hosts, workers_per_group: 4, "
        "workers_per_host: 2, slice_bytes: 4096}"
    )
    assert same_bits(fit(tmp_path / "spread", topo).params, blocks.params)
    per_worker = fit(tmp_path / "one", "topology.workers_per_host=1", "topology.n_servers=4")
    stub = fit(tmp_path / "stub", "topology={preset: allreduce, workers_per_group: 4}")
    assert same_bits(per_worker.params, stub.params)


def test_one_worker_and_one_server_summed_by_hosts_is_the_single_process_run(blocks, tmp_path):
    """Bit for bit; and four workers in two blocks agree with it to float rounding."""
    topo = "topology={preset: allreduce, reduce: hosts, workers_per_group: 1}"
    dist = fit(tmp_path / "dist", topo)
    local = Trainer(load_job(tmp_path / "local", JOB, "topology=null"), **QUIET).fit()
    assert same_bits(dist.params, local.params)
    for k, want in local.params.items():
        err = float(np.abs(blocks.params[k] - want).max() / np.abs(want).max())
        assert err <= 1e-5, (k, err)


ALONE = ("topology.workers_per_host=1", "topology.n_servers=4")  # blocks of one worker


@pytest.mark.slow
@pytest.mark.parametrize(
    "role, more",
    [("worker", ()), ("server", ()), ("worker", ALONE)],
    ids=["worker", "server", "worker-sending-as-it-computes"],
)
def test_a_killed_role_of_a_block_is_recovered_bit_exact(blocks, tmp_path, role, more):
    """A block's worker SIGKILLed is replaced alone (its group redoes the step); a server
    (no role logs the whole sum to rebuild it from) restarts the roles from the checkpoint.
    A block of one worker sends its gradient as it computes it: one killed then has sent a
    server some parts of a step and not the rest."""
    import ray

    want = blocks.params if not more else fit(tmp_path / "want", *more).params
    t = DistributedTrainer(load_job(tmp_path / "run", JOB, "disp_freq=5", *more), **QUIET)
    fired = []

    def hook(ev) -> None:
        if fired or getattr(ev, "step", None) != 15 or type(ev).__name__ != "TrainStep":
            return
        actor = t.workers[0][1] if role == "worker" else t.servers[1]
        fired.append(ray.get(actor.pid.remote()))
        threading.Timer(0.005, os.kill, (fired[0], signal.SIGKILL)).start()  # as steps run

    t.hub.subscribe(hook)
    res = t.fit()
    assert fired
    kinds = [r for r in res.history if r["kind"] == "failure"]
    seen = [f"{r['role']} {r['index']} ({r['recovery']}): {r['error']}" for r in kinds]
    assert same_bits(res.params, want), seen
    assert len(kinds) == 1 and kinds[0]["role"] == role, seen
    how = "replaced" if role == "worker" else "restarted"
    assert kinds[0]["recovery"].startswith(how), seen


@pytest.mark.parametrize(
    "topology, names",
    [
        ("{preset: downpour, n_groups: 2, reduce: hosts}", "topology.reduce"),
        ("{workers_per_group: 3, reduce: hosts, workers_per_host: 2}", "workers_per_host"),
        ("{workers_per_group: 2, workers_per_host: 2}", "workers_per_host"),
        ("{workers_per_group: 2, wire: bf16}", "topology.wire"),
        (
            "{preset: allreduce, workers_per_group: 4, reduce: hosts, workers_per_host: 2, "
            "n_servers: 4}",
            "topology.n_servers",
        ),
    ],
)
def test_bad_reduce_settings_are_refused_naming_the_key(tmp_path, topology, names):
    with pytest.raises((config.ConfigError, TopologyError), match=names.replace(".", r"\.")):
        load_job(tmp_path, JOB, f"topology={topology}")


def test_clipping_is_refused_where_no_role_sees_the_whole_gradient(tmp_path):
    with pytest.raises(config.ConfigError, match=r"updater\.clip_norm: with topology\.reduce"):
        load_job(tmp_path, JOB, "updater.clip_norm=1.0")


@pytest.mark.slow
@pytest.mark.parametrize("wire", ["f32+zstd", "f32+delta"])
def test_a_compressed_wire_changes_no_bit(blocks, tmp_path, wire):
    """``wire: f32+zstd`` sends the blocks' sums and the values' differences compressed
    without loss, ``f32+delta`` the differences alone: the bits of ``f32``, and the checkpoint
    records the setting."""
    got = fit(tmp_path / "run", f"topology.wire={wire}")
    assert same_bits(got.params, blocks.params)
    ck = Checkpoint.open(tmp_path / "run" / "checkpoints" / "step-30")
    assert ck.meta["run"]["topology"]["wire"] == wire


# ------------------------------------------------------------------ wire: bf16


@pytest.mark.slow
def test_bf16_on_the_wire_trains_the_digits_as_well_as_float32(blocks, tmp_path):
    """The digits job (1500 steps), 2 workers in 2 blocks: test accuracy within 0.5 points."""
    topo = "topology={preset: allreduce, reduce: hosts, workers_per_group: 2}"
    acc = {}
    for wire in ("f32", "bf16"):
        sets = [f"run_dir={tmp_path / wire}", topo, f"topology.wire={wire}", "test_freq=0"]
        cfg = config.load(EXAMPLES / "digits_mlp.yaml", sets)
        acc[wire] = DistributedTrainer(cfg, **QUIET).fit().final_eval["test_accuracy"]
    assert acc["f32"] >= 0.95, acc
    assert abs(acc["bf16"] - acc["f32"]) <= 0.005, acc


@pytest.mark.slow
def test_bf16_on_the_wire_resumes_bit_exact_after_the_driver_is_sigkilled(blocks, tmp_path):
    """Killed after its step-40 checkpoint, resumed with ``--resume``: the same bits at step
    80 as a run never killed. The checkpoint records the setting."""
    ray = start_ray()
    text = JOB.replace("train_steps: 30", "train_steps: 80")
    text = text.replace("slice_bytes: 4096}", "slice_bytes: 4096, wire: bf16}")
    ref, run = tmp_path / "ref", tmp_path / "run"
    want = DistributedTrainer(load_job(ref, text), **QUIET).fit()
    load_job(run, text)
    address = ray.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "raysinga.cli", "train", str(run / "job.yaml")]
    cmd += ["--address", address, "--set", f"run_dir={run}"]
    sigkill_once(cmd, run / "checkpoints/step-40")
    killed_at = steps(run / "checkpoints")[0]
    assert 40 <= killed_at < 80
    ck = Checkpoint.open(run / f"checkpoints/step-{killed_at}")
    assert ck.meta["run"]["topology"]["wire"] == "bf16"
    r = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resuming 'blocks' at step {killed_at}" in r.stdout
    got, ref_ck = (checkpoint_tensors(d / "checkpoints/step-80") for d in (run, ref))
    assert got == ref_ck
    assert want.history  # (the reference ran)
