"""The distributed trainer against the single-process reference, and its failure modes."""

from __future__ import annotations

import glob
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from ray import cloudpickle

from raysinga import config
from raysinga.actors.common.errors import RoleError
from raysinga.actors.placement import ResourceError
from raysinga.actors.server import ParamServer
from raysinga.actors.worker import Worker
from raysinga.distributed import DistributedTrainer
from raysinga.run import Trainer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QUIET = {"log": lambda line: None}


def job(tmp_path, topology: str, *more: str):
    return config.load(
        EXAMPLES / "digits_mlp.yaml",
        [
            "train_steps=50",
            "disp_freq=25",
            "test_freq=0",
            f"run_dir={tmp_path}",
            f"topology={topology}",
            *more,
        ],
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cfg = job(tmp_path_factory.mktemp("ref"), "null")
    return Trainer(cfg, **QUIET).fit().params


def relative_error(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max()) for k in b)


@pytest.mark.parametrize(
    "servers, workers",
    [(1, 2), (3, 4)]  # the rest of the grid in the slow tier (the default tier's time)
    + [pytest.param(*c, marks=pytest.mark.slow) for c in ((1, 1), (1, 4), (3, 1), (3, 2))],
)
def test_sandblaster_matches_the_single_process_reference(
    ray_session, reference, tmp_path, workers, servers
):
    # slice_bytes small enough that the larger weights are cut over the servers.
    cfg = job(
        tmp_path, f"{{workers_per_group: {workers}, n_servers: {servers}, slice_bytes: 8192}}"
    )
    params = DistributedTrainer(cfg, **QUIET).fit().params
    assert relative_error(params, reference) <= 1e-5


def test_a_fork_goes_on_under_the_jobs_hyperparameters_as_in_the_single_process_run(
    ray_session, tmp_path
):
    """A fork (what a PBT exploit does) of a one-worker, one-server run: the checkpoint's whole
    state, the job's learning rate, bit-identical to the same fork in one process."""
    one = "{workers_per_group: 1, n_servers: 1}"
    first = Trainer(job(tmp_path / "first", one, "train_steps=50"), until=20, **QUIET).fit()
    lr = "updater.lr=0.02"
    runs = []
    for name, trainer in (("local", Trainer), ("dist", DistributedTrainer)):
        cfg = job(tmp_path / name, one, lr)
        runs.append(trainer(cfg, fork_from=first.checkpoint, **QUIET).fit())
    local, dist = runs
    for k in local.params:
        assert local.params[k].tobytes() == np.asarray(dist.params[k]).tobytes(), k
    train = [[r for r in res.history if r["kind"] == "train"] for res in runs]
    assert [r["lr"] for r in train[1] if r["step"] > 20] == [0.02, 0.02]
    assert [r["loss"] for r in train[0]] == [r["loss"] for r in train[1]]


def test_clipping_matches_the_reference_and_reports_the_norm(ray_session, tmp_path):
    clip = "updater.clip_norm=0.5"  # below the norms of the first steps: clipping happens
    ref = Trainer(job(tmp_path / "ref", "null", clip), **QUIET).fit()
    got = DistributedTrainer(job(tmp_path / "d", "{workers_per_group: 2}", clip), **QUIET).fit()
    assert relative_error(got.params, ref.params) <= 1e-5
    norms = [[r["grad_norm"] for r in res.history if r["kind"] == "train"] for res in (got, ref)]
    assert len(norms[0]) == 2 and norms[0] == pytest.approx(norms[1], rel=1e-5)
    assert norms[1][0] > 0.5


def test_allreduce_places_a_server_with_each_worker_and_matches(ray_session, reference, tmp_path):
    cfg = job(tmp_path, "{preset: allreduce, workers_per_group: 2, slice_bytes: 8192}")
    trainer = DistributedTrainer(cfg, **QUIET)
    assert trainer.topo.n_servers == 2
    assert relative_error(trainer.fit().params, reference) <= 1e-5


@pytest.mark.parametrize(
    ("example", "compute"),
    [
        ("digits_mlp", "f32"),
        pytest.param("digits_cnn", "f32", marks=pytest.mark.slow),  # the default tier's time
        pytest.param("digits_cnn", "bf16", marks=pytest.mark.slow),
    ],
)
def test_the_single_process_run_is_the_exact_reference_of_one_worker_and_one_server(
    ray_session, tmp_path, example, compute
):
    """Review: the two drifted apart (3e-8 after one step of the MLP): the driver's BLAS ran on
    every core, the worker's on the one CPU it holds, and OpenBLAS sums a product's inner
    dimension in other blocks with more threads. Both now run on the workers' share. With
    ``precision.compute: bf16`` the worker's process takes the job's precision as the
    single process does."""
    more = [
        "train_steps=300",
        "disp_freq=50",
        "test_freq=150",
        "topology={workers_per_group: 1, n_servers: 1}",
        f"precision.compute={compute}",
    ]
    runs = []
    for name, trainer in (("local", Trainer), ("dist", DistributedTrainer)):
        cfg = config.load(EXAMPLES / f"{example}.yaml", [*more, f"run_dir={tmp_path / name}"])
        runs.append(trainer(cfg, **QUIET).fit())
    local, dist = runs
    for k in local.params:
        assert local.params[k].tobytes() == np.asarray(dist.params[k]).tobytes(), k
    for k in local.state:  # batch norm's running statistics
        assert local.state[k].tobytes() == np.asarray(dist.state[k]).tobytes(), k
    losses = [[(r["kind"], r["step"], r.get("loss")) for r in res.history] for res in runs]
    assert losses[0] == losses[1]


@pytest.mark.slow  # the quick tier has the shorter checks of this
def test_two_runs_of_one_topology_are_bit_identical(ray_session, tmp_path):
    topo = "{workers_per_group: 2, n_servers: 3, slice_bytes: 8192}"
    # Dropout makes the check stronger: its masks must not depend on the worker either.
    extra = (
        "model.layers=[{kind: dense, name: fc1, units: 64, activation: relu}, "
        "{kind: dropout, name: drop, rate: 0.3}, {kind: dense, name: out, units: 10}]"
    )
    a = DistributedTrainer(job(tmp_path / "a", topo, extra), **QUIET).fit().params
    b = DistributedTrainer(job(tmp_path / "b", topo, extra), **QUIET).fit().params
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.slow
def test_downpour_with_two_groups_reaches_95_percent(ray_session, tmp_path):
    cfg = config.load(
        EXAMPLES / "digits_mlp.yaml",
        [
            f"run_dir={tmp_path}",
            "train_steps=800",
            "disp_freq=200",
            "topology={preset: downpour, n_groups: 2, workers_per_group: 1, staleness: 4}",
        ],
    )
    result = DistributedTrainer(cfg, **QUIET).fit()
    assert result.final_eval["test_accuracy"] >= 0.95


@pytest.mark.parametrize("topology", ["{workers_per_group: 2}", "{preset: downpour, n_groups: 2}"])
def test_a_diverging_loss_stops_every_topology_before_it_is_checkpointed(
    ray_session, tmp_path, topology
):
    """Review: the single-process trainer stopped on a non-finite loss; the distributed one
    went on and checkpointed NaN parameters. (The divergence guard now stops such a run on its
    first flying loss, before it turns NaN.)"""
    from raysinga.checkpoint import Checkpoint, steps

    cfg = job(
        tmp_path, topology, "updater.lr=1e6", "updater.momentum=0.99", "checkpoint_frequency=5"
    )
    with pytest.raises(FloatingPointError, match=r"loss is \S+ .*at step \d+.*lower updater.lr"):
        DistributedTrainer(cfg, **QUIET).fit()
    for s in steps(tmp_path / "checkpoints"):
        ck = Checkpoint.open(tmp_path / "checkpoints" / f"step-{s}", verify="full")
        assert all(np.isfinite(ck.array(n)).all() for n in ck.names("param")), s


def test_a_topology_larger_than_the_cluster_fails_fast_naming_what_is_missing(
    ray_session, tmp_path
):
    t0 = time.monotonic()
    with pytest.raises(ResourceError, match=r"CPU: needs 12, cluster has 8"):
        DistributedTrainer(job(tmp_path, "{workers_per_group: 12}"), **QUIET).fit()
    with pytest.raises(ResourceError, match=r"GPU: needs 12, cluster has \d+"):  # 0 or a few
        DistributedTrainer(
            job(tmp_path, "{workers_per_group: 12, worker: {cpus: 0.5, gpus: 1}}"), **QUIET
        ).fit()
    assert time.monotonic() - t0 < 10


@pytest.mark.gpu
def test_gpu_workers_match_the_reference_and_repeat_bit_identically(
    ray_session, reference, tmp_path
):
    """Two workers sharing one GPU keep parameters and activations on it; the run matches the
    single-process reference, and a second run gives the same bits."""
    topo = "{workers_per_group: 2, worker: {cpus: 1, gpus: 0.5}}"
    runs = [
        DistributedTrainer(job(tmp_path / str(i), topo), **QUIET).fit().params for i in range(2)
    ]
    assert relative_error(runs[0], reference) <= 1e-5
    for k, a in runs[0].items():
        assert a.tobytes() == runs[1][k].tobytes(), k


@pytest.mark.gpu
@pytest.mark.parametrize("compute", ["f32", "bf16"])
def test_gpu_workers_with_graphs_match_their_uncaptured_steps_bit_for_bit(
    ray_session, tmp_path, monkeypatch, compute
):
    """gpu.graphs in a distributed run: each GPU worker records its step and replays it; the
    run ends with the bits of the same code run step by step (RAYSINGA_GPU_GRAPHS=uncaptured,
    read by the driver and handed to the workers in their spec). Under bf16 the recorded step
    casts the uploaded values into the weights' copies itself."""
    topo = "{workers_per_group: 2, worker: {cpus: 1, gpus: 0.25}, server: {cpus: 0, gpus: 0.25}}"
    runs = {}
    for mode in ("strict", "uncaptured"):
        monkeypatch.setenv("RAYSINGA_GPU_GRAPHS", mode)
        cfg = job(tmp_path / mode, topo, f"precision.compute={compute}")
        runs[mode] = DistributedTrainer(cfg, **QUIET).fit().params
    for k, a in runs["strict"].items():
        assert a.tobytes() == runs["uncaptured"][k].tobytes(), k


@pytest.mark.gpu
def test_a_gpu_server_matches_the_reference_and_resumes_bit_exact(ray_session, reference, tmp_path):
    """The server's optimizer on the GPU (fused kernels); a checkpoint copies its slots down
    asynchronously, and a run resumed from it ends with the same bits as an unbroken one."""
    topo = "{workers_per_group: 2, worker: {cpus: 1, gpus: 0.25}, server: {cpus: 0, gpus: 0.25}}"
    trainer = DistributedTrainer(job(tmp_path / "a", topo), **QUIET)
    assert (trainer.worker_device, trainer.server_device) == ("gpu", "gpu")
    straight = trainer.fit().params
    assert relative_error(straight, reference) <= 1e-5
    first = job(tmp_path / "b", topo, "train_steps=20", "checkpoint_frequency=10")
    DistributedTrainer(first, **QUIET).fit()
    rest = job(tmp_path / "b", topo, "checkpoint_frequency=10")
    resumed = DistributedTrainer(rest, resume=True, **QUIET).fit().params
    for k, a in straight.items():
        assert resumed[k].tobytes() == a.tobytes(), k


def test_device_gpu_needs_gpus_for_the_workers(tmp_path):
    with pytest.raises(config.ConfigError, match="device: gpu in a distributed run needs GPUs"):
        job(tmp_path, "{workers_per_group: 2}", "device=gpu")
    cfg = job(tmp_path, "{workers_per_group: 2, worker: {cpus: 1, gpus: 0.5}}", "device=cpu")
    assert DistributedTrainer(cfg, **QUIET).worker_device == "cpu"


def test_raysinga_device_decides_for_the_roles_where_the_job_says_auto(tmp_path, monkeypatch):
    """The roles do not inherit the driver's environment: the driver applies it for them."""
    monkeypatch.setenv("RAYSINGA_DEVICE", "gpu")
    with pytest.raises(ValueError, match="RAYSINGA_DEVICE=gpu in a distributed run needs GPUs"):
        DistributedTrainer(job(tmp_path, "{workers_per_group: 2}"), **QUIET)
    topo = "{workers_per_group: 2, worker: {cpus: 1, gpus: 0.5}, server: {gpus: 0.5}}"
    trainer = DistributedTrainer(job(tmp_path, topo), **QUIET)
    assert (trainer.worker_device, trainer.server_device) == ("gpu", "gpu")
    monkeypatch.setenv("RAYSINGA_DEVICE", "cpu")
    trainer = DistributedTrainer(job(tmp_path, topo), **QUIET)
    assert (trainer.worker_device, trainer.server_device) == ("cpu", "cpu")
    monkeypatch.setenv("RAYSINGA_DEVICE", "gpu")  # the job file's word comes first
    assert DistributedTrainer(job(tmp_path, topo, "device=cpu"), **QUIET).worker_device == "cpu"


# The actors' processes cannot import this test module: ship its classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class BrokenWorker(Worker):
    """Fails at step 3 in worker 1, whichever path (Ray calls or doorbells) drives it."""

    def _compute(self, step, part, parts, sources, early=None):
        if step == 3 and self.index == 1:
            return self._explode(step)
        return super()._compute(step, part, parts, sources, early)

    def _explode(self, step):
        raise ValueError(f"bad sample at step {step}")


class BrokenServer(ParamServer):
    def _update(self, step, grads):
        if step == 2 and self.index == 2:
            raise OSError("disk on fire")
        return super()._update(step, grads)


def test_an_exception_in_a_worker_reaches_the_driver_with_role_index_and_traceback(
    ray_session, tmp_path
):
    trainer = DistributedTrainer(
        job(tmp_path, "{workers_per_group: 2}"), classes={"worker": BrokenWorker}, **QUIET
    )
    with pytest.raises(RoleError) as info:
        trainer.fit()
    e = info.value
    assert (e.role, e.index, e.group) == ("worker", 1, 0)
    assert "ValueError: bad sample at step 3" in str(e)
    assert "_explode" in e.tb  # the remote traceback, down to the raising function
    assert trainer.stubs == [] and trainer.servers == []  # everything was torn down


def test_an_exception_in_a_server_names_the_server(ray_session, tmp_path):
    trainer = DistributedTrainer(
        job(tmp_path, "{n_servers: 3, slice_bytes: 8192}"),
        classes={"server": BrokenServer},
        **QUIET,
    )
    with pytest.raises(RoleError, match=r"^server 2 failed: OSError: disk on fire"):
        trainer.fit()


def test_shared_memory_is_released_after_a_run(ray_session, tmp_path):
    cfg = job(tmp_path, "{workers_per_group: 2}", "name=shmcheck")
    DistributedTrainer(cfg, **QUIET).fit()
    assert glob.glob("/dev/shm/raysinga-shmcheck-*") == []


def test_validation_and_the_best_checkpoint_as_in_the_single_process_run(ray_session, tmp_path):
    """The workers hold out the same validation rows as the single process, evaluate it at
    each checkpoint, and the driver keeps the same best checkpoint beside the newest."""
    more = [
        "train_steps=60",
        "test_freq=0",
        "updater.lr=1.5",  # a loss that rises again: the best is not the newest
        "divergence.factor=null",  # (it rises far enough that the guard would stop it)
        "checkpoint_frequency=10",
        "data.validation=0.2",
        "checkpoint={keep_last: 1, keep_best: valid_loss}",
        "topology={workers_per_group: 1, n_servers: 1}",
    ]
    runs = []
    for name, trainer in (("local", Trainer), ("dist", DistributedTrainer)):
        cfg = config.load(EXAMPLES / "digits_mlp.yaml", [*more, f"run_dir={tmp_path / name}"])
        runs.append(trainer(cfg, **QUIET).fit())
    evals = [[r for r in res.history if r["kind"] == "eval"] for res in runs]
    assert [r["step"] for r in evals[1]] == list(range(10, 61, 10))
    assert evals[0] == evals[1]  # bit-exact reference: the same numbers
    assert runs[0].best["step"] == runs[1].best["step"] != 60
    kept = [
        sorted(p.name for p in (tmp_path / n / "checkpoints").glob("step-*"))
        for n in ("local", "dist")
    ]
    assert kept[0] == kept[1] == sorted([f"step-{runs[0].best['step']}", "step-60"])
