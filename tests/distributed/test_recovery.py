"""Lost roles: a worker, a server or a stub SIGKILLed mid-run; the run restarts every role from
the newest checkpoint, redoes the steps since, and ends bit-identical to an uninterrupted run.
More failures than ``fault.max_failures`` stop it with a summary, leaving a checkpoint to resume."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import load_job, start_ray
from ray import cloudpickle

from raysinga import config
from raysinga.actors.memory.grads_in import SumViews
from raysinga.actors.placement import ResourceError
from raysinga.actors.server import ParamServer
from raysinga.checkpoint import Checkpoint, CheckpointError, steps
from raysinga.distributed import DistributedTrainer, FailuresExceeded
from raysinga.obs.events import CheckpointCommitted, Event, StateChanged, TrainStep

JOB = """
name: faults
seed: 11
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 32, activation: relu}
    - {kind: dropout, name: drop, rate: 0.1}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 32}
updater: {name: adam, lr: 0.01}
train_steps: 40
disp_freq: 5
checkpoint_frequency: 10
topology: {preset: sandblaster, n_servers: 1, workers_per_group: 2}
"""


def job(d: Path, *more: str) -> config.JobConfig:
    return load_job(d, JOB, *more)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    start_ray()
    d = tmp_path_factory.mktemp("straight")
    return DistributedTrainer(job(d), log=lambda line: None).fit()


def kill_at(trainer: DistributedTrainer, role: str, at_step: int):
    """An event hook that, once training reports step ``at_step``, SIGKILLs the role's process
    from another thread a moment later (while the next steps run)."""
    import ray

    fired = []

    def hook(ev: Event) -> None:
        if fired or not (isinstance(ev, TrainStep) and ev.step == at_step):
            return
        actor = {
            "worker": lambda: trainer.workers[0][1],
            "server": lambda: trainer.servers[0],
            "stub": lambda: trainer.stubs[0],
        }[role]()
        pid = ray.get(actor.pid.remote())
        fired.append(trainer.tag)  # the shared-memory files of the roles about to be lost

        def kill() -> None:
            time.sleep(0.005)
            os.kill(pid, signal.SIGKILL)

        threading.Thread(target=kill, daemon=True).start()

    return hook, fired


def events(run_dir: Path, kinds: tuple[str, ...] = ("failure",)) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] in kinds]


ROLES = ("worker", "stub", "server")


@pytest.mark.parametrize(
    "role, recovery, spares, replay",
    [
        ("worker", "replace", "true", 20),
        ("stub", "replace", "true", 20),
        ("server", "replace", "true", 20),  # a spare rebuilt from the copy and the stub's log
        ("server", "replace", "true", 0),  # no copies: every role restarts
        # the variants of the same paths, in the slow tier (the default tier's time)
        # a new worker, stub or server spawned in the lost one's bundle
        *(pytest.param(r, "replace", "false", 20, marks=pytest.mark.slow) for r in ROLES),
        # a copy every 2 steps: few steps replayed
        pytest.param("server", "replace", "true", 4, marks=pytest.mark.slow),
        pytest.param("worker", "restart", "true", 20, marks=pytest.mark.slow),
    ],
)
def test_a_killed_role_is_recovered_bit_exact(straight, tmp_path, role, recovery, spares, replay):
    """SIGKILL of one role at step 15. A worker or a stub is replaced alone (by a spare, or
    a new one) and its group redoes at most the interrupted step, nothing rolled back; a
    server is rebuilt from its copy and the stub's log of the steps since, nothing rolled
    back either. Without copies (``fault.replay_steps: 0``) or with ``fault.recovery:
    restart``, every role restarts from the checkpoint of step 10."""
    lines: list[str] = []
    more = (f"fault.recovery={recovery}", f"fault.spares={spares}", f"fault.replay_steps={replay}")
    t = DistributedTrainer(job(tmp_path, *more), log=lines.append)
    hook, fired = kill_at(t, role, 15)
    t.hub.subscribe(hook)
    res = t.fit()
    assert fired, "the kill never fired"
    for k, a in straight.params.items():
        assert res.params[k].tobytes() == a.tobytes(), k
    (ev,) = events(tmp_path)
    assert ev["role"] == role and ev["step"] >= 15
    if recovery == "replace" and replay:
        rebuilt = role == "server"
        assert ev["recovery"] == ("rebuilt and replayed" if rebuilt else "replaced"), ev
        assert ev["rolled_back"] == 0, ev
        assert ev["restored_from"] >= ev["step"] and ev["steps_redone"] <= 1, ev
        assert {"stop_s", "respawn_s", "rebuild_s", "rewire_s"} <= set(ev), ev
        assert t.tag == fired[0]  # the other roles kept their processes
        if rebuilt:  # the newest copy is at most a copy interval and a step behind
            assert 0 <= ev["steps_replayed"] <= replay // 2 + 2, ev
        else:
            assert ev["steps_replayed"] == 0, ev
    else:
        assert ev["recovery"] == "restarted" and ev["restored_from"] in (0, 10), ev
        assert "not_replaced" not in ev, ev  # chosen (the job's settings), not a failed try
        assert ev["steps_redone"] == ev["rolled_back"] == ev["step"] - ev["restored_from"]
    assert ev["restore_s"] > 0 and ev["source"]
    assert any("recovering (failure 1 of at most 3)" in line for line in lines), lines
    # the recovered run's own history keeps the event, and its checkpoints the whole history
    ck = Checkpoint.open(tmp_path / "checkpoints" / f"step-{steps(tmp_path / 'checkpoints')[0]}")
    assert [r for r in ck.meta["run"]["history"] if r["kind"] == "failure"] == [ev]
    # roles killed outright leave no shared-memory file behind, nor do those of the last start
    for tag in (fired[0], t.tag):
        assert not list(Path("/dev/shm").glob(f"raysinga-{tag}-*")), tag


BN_JOB = JOB.replace(
    "    - {kind: dropout, name: drop, rate: 0.1}",
    "    - {kind: batchnorm, name: bn}\n    - {kind: dropout, name: drop, rate: 0.1}",
)


@pytest.fixture(scope="module")
def straight_bn(tmp_path_factory):
    start_ray()
    d = tmp_path_factory.mktemp("straight-bn")
    return d, DistributedTrainer(load_job(d, BN_JOB), log=lambda line: None).fit()


def final_state(run_dir: Path) -> dict[str, bytes]:
    """Every worker's batch-norm statistics in the run's last checkpoint."""
    ck = Checkpoint.open(run_dir / "checkpoints" / f"step-{steps(run_dir / 'checkpoints')[-1]}")
    return {n: ck.array(n).tobytes() for n in ck.names("state")}


@pytest.mark.parametrize("role", ["worker", "stub"])
def test_a_role_of_a_group_with_batch_norm_is_replaced_alone_bit_exact(straight_bn, tmp_path, role):
    """Workers with state of their own (batch norm's running statistics, and dropout): a
    worker or the stub SIGKILLed at step 15 is replaced alone, nothing rolled back. The new
    worker starts from the lost one's copy of its statistics at the step the group redoes,
    the live worker takes its own copy of that step back, and the run ends with the
    parameters and every worker's statistics of an uninterrupted run."""
    ref_dir, ref = straight_bn
    t = DistributedTrainer(load_job(tmp_path, BN_JOB), log=None)
    hook, fired = kill_at(t, role, 15)
    t.hub.subscribe(hook)
    res = t.fit()
    assert fired, "the kill never fired"
    (ev,) = events(tmp_path)
    assert (ev["role"], ev["recovery"], ev["rolled_back"]) == (role, "replaced", 0), ev
    assert ev["steps_redone"] <= 1, ev
    for k, a in ref.params.items():
        assert res.params[k].tobytes() == a.tobytes(), k
    want = final_state(ref_dir)
    assert any("bn" in n for n in want) and final_state(tmp_path) == want


GPU_SHARES = ("topology.worker.gpus=0.25", "topology.server.gpus=0.25")


@pytest.fixture(scope="module")
def straight_gpu(tmp_path_factory):
    """The jobs above with both workers and the server sharing one GPU, uninterrupted."""
    start_ray()
    runs = {}
    for name, text in (("mlp", JOB), ("bn", BN_JOB)):
        d = tmp_path_factory.mktemp(f"straight-gpu-{name}")
        t = DistributedTrainer(load_job(d, text, *GPU_SHARES), log=lambda line: None)
        assert (t.worker_device, t.server_device) == ("gpu", "gpu")
        runs[name] = (d, t.fit())
    return runs


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, role, spares",
    [
        ("mlp", "worker", "true"),  # the spare, warmed up on the GPU, takes over
        ("mlp", "worker", "false"),  # a new worker in the lost one's bundle
        ("mlp", "stub", "true"),
        ("mlp", "server", "true"),  # rebuilt on the GPU from its copy and the stub's log
        ("bn", "worker", "true"),  # with batch norm's statistics, from the lost one's copy
    ],
)
def test_a_killed_gpu_role_is_replaced_alone_bit_exact(straight_gpu, tmp_path, name, role, spares):
    """GPU workers and a GPU server sharing one GPU: a worker, the stub or the server SIGKILLed
    at step 15 is replaced alone (a server rebuilt from its copy, whose optimizer slots came
    down from the device, and the log), nothing rolled back, and the run ends with the bits of
    an uninterrupted GPU run, batch norm's statistics included."""
    ref_dir, ref = straight_gpu[name]
    text = JOB if name == "mlp" else BN_JOB
    t = DistributedTrainer(
        load_job(tmp_path, text, *GPU_SHARES, f"fault.spares={spares}"), log=None
    )
    hook, fired = kill_at(t, role, 15)
    t.hub.subscribe(hook)
    res = t.fit()
    assert fired, "the kill never fired"
    (ev,) = events(tmp_path)
    path = "rebuilt and replayed" if role == "server" else "replaced"
    assert (ev["role"], ev["recovery"], ev["rolled_back"]) == (role, path, 0), ev
    assert ev["steps_redone"] <= 1 and t.tag == fired[0], ev
    for k, a in ref.params.items():
        assert res.params[k].tobytes() == a.tobytes(), k
    if name == "bn":
        want = final_state(ref_dir)
        assert any("bn" in n for n in want) and final_state(tmp_path) == want


class KilledInRecoveryServer(ParamServer):
    """Counts its incarnations in a file; the second (the relaunch after the first loss)
    SIGKILLs itself when first asked whether it is up, while the driver recovers."""

    counter = ""

    def describe(self):
        path = Path(self.counter)
        n = int(path.read_text()) + 1 if path.exists() else 1
        path.write_text(str(n))
        if n == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().describe()


def test_a_server_lost_while_a_loss_is_recovered_restarts_the_recovery(straight, tmp_path):
    """A worker SIGKILLed at step 15 (the restart path), then a server dying while every role
    is relaunched: two failures, the second recovered by the same path, bit-identical."""

    class Server(KilledInRecoveryServer):
        counter = str(tmp_path / "incarnations")

    t = DistributedTrainer(
        job(tmp_path, "fault.recovery=restart"), classes={"server": Server}, log=None
    )
    hook, fired = kill_at(t, "worker", 15)
    t.hub.subscribe(hook)
    states: list[str] = []
    t.hub.subscribe(lambda ev: isinstance(ev, StateChanged) and states.append(ev.state))
    res = t.fit()
    assert fired and (tmp_path / "incarnations").read_text() == "3"
    for k, a in straight.params.items():
        assert res.params[k].tobytes() == a.tobytes(), k
    evs = events(tmp_path)
    assert [e["role"] for e in evs] == ["worker", "server"], evs
    assert all(e["recovery"] == "restarted" for e in evs), evs
    i = states.index("recovering")
    assert states[i : i + 5] == ["recovering", "placing", "launching", "recovering", "placing"]


def test_a_lost_server_beside_a_live_one_is_rebuilt_to_its_step_bit_exact(straight, tmp_path):
    """Two servers; the second SIGKILLed at step 15: it is rebuilt from its copy and the
    stub's log to the live server's step, and the run ends bit-identical (the slicing over
    servers does not change the bits)."""
    import ray

    t = DistributedTrainer(job(tmp_path, "topology.n_servers=2"), log=None)
    fired: list[int] = []

    def hook(ev: Event) -> None:
        if not fired and isinstance(ev, TrainStep) and ev.step == 15:
            fired.append(ray.get(t.servers[1].pid.remote()))
            os.kill(fired[0], signal.SIGKILL)

    t.hub.subscribe(hook)
    res = t.fit()
    assert fired
    for k, a in straight.params.items():
        assert res.params[k].tobytes() == a.tobytes(), k
    (ev,) = events(tmp_path)
    assert (ev["role"], ev["index"], ev["recovery"]) == ("server", 1, "rebuilt and replayed"), ev
    assert ev["rolled_back"] == 0 and ev["restored_from"] >= 15, ev


def test_losses_one_after_another_are_each_replaced_bit_exact(straight, tmp_path):
    """A worker killed at step 15, then the stub at step 25 (the spares spent on the first
    loss have been spawned again by then): two replacements, nothing rolled back."""
    t = DistributedTrainer(job(tmp_path), log=None)
    first, fired_worker = kill_at(t, "worker", 15)
    second, fired_stub = kill_at(t, "stub", 25)
    t.hub.subscribe(first)
    t.hub.subscribe(second)
    res = t.fit()
    assert fired_worker and fired_stub
    for k, a in straight.params.items():
        assert res.params[k].tobytes() == a.tobytes(), k
    evs = events(tmp_path)
    assert [(e["role"], e["recovery"], e["rolled_back"]) for e in evs] == [
        ("worker", "replaced", 0),
        ("stub", "replaced", 0),
    ], evs


# The actors' processes cannot import this test module: ship its classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class DiesMidSumServer(ParamServer):
    """Server 1, summing the workers' gradients itself, leaves garbage in its share of step
    15's logged sum (as a server killed halfway through writing it would) and SIGKILLs itself,
    once (``marker``: a file, made by the kill)."""

    marker = ""

    def _update(self, step, grads, group=0):
        if self.index == 1 and step == 15 and not os.path.exists(self.marker):
            assert isinstance(grads, SumViews), "the servers should sum the gradients here"
            with grads.writing(step):  # its share of the row marked as being written
                for row in grads.rows[step % len(grads.rows)].values():
                    row[...] = np.nan
                Path(self.marker).touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return super()._update(step, grads, group)


def test_a_server_lost_halfway_through_summing_a_step_is_rebuilt_through_it(straight, tmp_path):
    """Two servers sum the workers' gradients into the stub's log as they update; the second
    dies having written only garbage of step 15's sum, while the first applies the step. The
    stub sums the step's row again from the workers' buffers, so the lost server is rebuilt
    to the live one's step through it: nothing rolled back, the run bit-identical."""

    class Server(DiesMidSumServer):
        marker = str(tmp_path / "killed")

    t = DistributedTrainer(
        job(tmp_path, "topology.n_servers=2"), classes={"server": Server}, log=None
    )
    res = t.fit()
    assert (tmp_path / "killed").exists()
    for k, a in straight.params.items():
        assert res.params[k].tobytes() == a.tobytes(), k
    (ev,) = events(tmp_path)
    assert (ev["role"], ev["index"], ev["recovery"]) == ("server", 1, "rebuilt and replayed"), ev
    assert ev["rolled_back"] == 0 and ev["restored_from"] >= 15, ev


class StartKilledServer(ParamServer):
    """The first server to be asked whether it is up SIGKILLs its own process instead of
    answering: a real death at a known instant, while the driver launches the roles."""

    marker = ""  # a file: once it exists, the kill has happened

    def describe(self):
        if not os.path.exists(self.marker):
            Path(self.marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().describe()


def test_a_server_killed_while_the_run_starts_is_recovered_bit_exact(straight, tmp_path):
    """A server dies before the first step (the driver is launching the roles): one failure,
    recovered like a loss during steps, and the run ends bit-identical."""

    class Server(StartKilledServer):
        marker = str(tmp_path / "killed")

    t = DistributedTrainer(job(tmp_path), classes={"server": Server}, log=None)
    states: list[str] = []
    t.hub.subscribe(lambda ev: isinstance(ev, StateChanged) and states.append(ev.state))
    res = t.fit()
    assert (tmp_path / "killed").exists()
    (ev,) = events(tmp_path)
    assert ev["role"] == "server" and ev["step"] == 0 and ev["steps_redone"] == 0, ev
    assert states[:5] == ["placing", "launching", "recovering", "placing", "launching"], states
    for k, a in straight.params.items():
        assert res.params[k].tobytes() == a.tobytes(), k


class SlowCommitServer(ParamServer):
    """Writes its shard of step 20, then holds the checkpoint uncommitted for a while."""

    def _write_snapshot(self, live, tmp, *rest):
        out = super()._write_snapshot(live, tmp, *rest)
        if "step-20." in str(tmp):
            time.sleep(3)
        return out


class CopyFailsServer(ParamServer):
    """Its snapshot fails before the copy of its values is taken."""

    def _write_snapshot(self, live, tmp, *rest):
        raise OSError("no memory for the image")


def test_a_snapshot_failing_before_its_copy_stops_the_run_without_hanging(ray_session, tmp_path):
    t = DistributedTrainer(job(tmp_path), classes={"server": CopyFailsServer}, log=lambda x: None)
    with pytest.raises(CheckpointError, match=r"checkpoint of step 10 failed(.|\n)*no memory"):
        t.fit()
    assert not list((tmp_path / "checkpoints").glob("step-*"))


@pytest.mark.parametrize("replay", [20, pytest.param(0, marks=pytest.mark.slow)])
def test_a_server_lost_while_writing_a_checkpoint_leaves_nothing_used(straight, tmp_path, replay):
    """SIGKILL of the server between writing its shard and the commit: the half-written
    directory is removed and the run ends bit-exact. The server is rebuilt from its copy (the
    checkpoint in flight is dropped), or without copies every role restarts from the
    checkpoint before."""
    import ray

    root = tmp_path / "checkpoints"
    lines: list[str] = []
    more = (f"fault.replay_steps={replay}",)
    t = DistributedTrainer(
        job(tmp_path, *more), classes={"server": SlowCommitServer}, log=lines.append
    )
    killed: list[str] = []

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            half = list(root.glob("step-20.tmp-*/shard-0.arrow"))
            if half:
                pid = ray.get(t.servers[0].pid.remote())
                os.kill(pid, signal.SIGKILL)
                killed.append(str(half[0].parent))
                return
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()
    res = t.fit()
    assert killed, "the write was never caught in flight"
    assert not Path(killed[0]).exists()
    (ev,) = events(tmp_path)
    assert ev["role"] == "server" and ev["step"] >= 20, ev
    if replay:
        assert ev["recovery"] == "rebuilt and replayed" and ev["restored_from"] >= ev["step"]
        assert any("checkpoint of step 20 was dropped" in line for line in lines), lines
    else:
        assert ev["recovery"] == "restarted" and ev["restored_from"] == 10, ev
    for k, a in straight.params.items():
        assert res.params[k].tobytes() == a.tobytes(), k
    assert steps(root)[0] == 40 and not list(root.glob("*.tmp-*"))


def test_a_worker_lost_while_a_checkpoint_is_written_is_replaced_and_it_commits(straight, tmp_path):
    """SIGKILL of a worker while the server holds step 20's written shard uncommitted: the
    worker is replaced alone, the write goes on and step 20 is committed; bit-exact."""
    import ray

    root = tmp_path / "checkpoints"
    t = DistributedTrainer(job(tmp_path), classes={"server": SlowCommitServer}, log=None)
    killed: list[int] = []

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if list(root.glob("step-20.tmp-*/shard-0.arrow")):
                killed.append(ray.get(t.workers[0][0].pid.remote()))
                os.kill(killed[0], signal.SIGKILL)
                return
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()
    res = t.fit()
    assert killed, "the write was never caught in flight"
    (ev,) = events(tmp_path)
    assert (ev["role"], ev["recovery"], ev["rolled_back"]) == ("worker", "replaced", 0), ev
    assert 20 in steps(root)  # kept: the newest three are 40, 30 and 20
    commits = [r["step"] for r in events(tmp_path, ("checkpoint",))]
    assert 20 in commits, commits
    for k, a in straight.params.items():
        assert res.params[k].tobytes() == a.tobytes(), k


def test_a_lost_registry_is_replaced_and_the_object_store_copies_go_on(straight, tmp_path):
    """The object-store registry (a detached actor) SIGKILLed after the first checkpoint; later
    checkpoints go to a new one, and a worker lost afterwards is restored from it, bit-exact."""
    import ray
    from ray._private import state

    from raysinga.checkpoint import objstore

    # the restart path: a worker alone would be replaced, with no checkpoint read
    more = ("checkpoint.object_store=true", "fault.recovery=restart")
    t = DistributedTrainer(job(tmp_path, *more), log=None)
    kill_worker, fired = kill_at(t, "worker", 30)
    registry: list[int] = []
    committed: list[int] = []

    def hook(ev: Event) -> None:
        if isinstance(ev, CheckpointCommitted):
            committed.append(ev.step)
        # the first step reported after step 10's commit handed it to the registry
        if not registry and 10 in committed and isinstance(ev, TrainStep):
            ray.get(objstore.registry(create=False).list.remote())  # up (it starts in the back)
            (pid,) = [
                a["Pid"]
                for a in state.actors().values()
                if a["Name"] == objstore.REGISTRY_NAME and a["State"] == "ALIVE"
            ]
            os.kill(pid, signal.SIGKILL)
            registry.append(pid)
            # until Ray knows it dead, its name still leads to it, and a commit handed to it
            # is lost (the directory's copy stands; wait_adopted reports it at the end)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    objstore.registry(create=False)
                except ValueError:
                    break
                time.sleep(0.05)
        if isinstance(ev, TrainStep) and ev.step == 30:
            # the new registry starts in the back: a loss before it holds step 20 reads the
            # directory's copy (right, but not what this test is about)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:  # its name appears once Ray has created it
                    reg = objstore.registry(create=False)
                except ValueError:
                    reg = None
                if reg is not None and 20 in [e["step"] for e in ray.get(reg.list.remote())]:
                    break
                time.sleep(0.05)
        kill_worker(ev)

    t.hub.subscribe(hook)
    res = t.fit()
    assert registry and fired
    for k, a in straight.params.items():
        assert res.params[k].tobytes() == a.tobytes(), k
    (ev,) = events(tmp_path)
    assert ev["restored_from"] in (20, 30) and ev["source"].startswith("object store"), ev


@pytest.mark.slow
def test_more_failures_than_allowed_stop_the_run_with_a_summary(ray_session, tmp_path):
    t = DistributedTrainer(job(tmp_path, "fault.max_failures=0"), log=None)
    # after step 20's checkpoint began, step 10's is committed (a write in flight may not be)
    hook, fired = kill_at(t, "worker", 25)
    t.hub.subscribe(hook)
    with pytest.raises(FailuresExceeded) as e:
        t.fit()
    msg = str(e.value)
    assert "1 failure(s), more than fault.max_failures (0)" in msg
    assert "worker 1 of group 0 was lost" in msg and "with --resume" in msg
    assert steps(tmp_path / "checkpoints")[0] >= 10  # left for --resume
    res = DistributedTrainer(job(tmp_path), resume=True, log=lambda line: None).fit()
    assert res.history[-1]["step"] == 40


def test_fault_settings_are_checked(tmp_path):
    with pytest.raises(config.ConfigError, match="fault.max_failures"):
        job(tmp_path, "fault.max_failures=-1")
    with pytest.raises(config.ConfigError, match=r"fault.min_workers: 3 is more than topology"):
        job(tmp_path, "fault.min_workers=3")
    with pytest.raises(config.ConfigError, match=r"fault.min_groups: 2 is more than topology"):
        job(tmp_path, "fault.min_groups=2")
    with pytest.raises(config.ConfigError, match="fault.min_workers: expected an integer >= 1"):
        job(tmp_path, "fault.min_workers=0")
    with pytest.raises(config.ConfigError, match="fault.grow_check_s"):
        job(tmp_path, "fault.grow_check_s=-1")
    with pytest.raises(config.ConfigError, match="allreduce preset .* cannot shrink"):
        job(tmp_path, "topology.preset=allreduce", "topology.n_servers=2", "fault.min_workers=1")
    with pytest.raises(config.ConfigError, match="only a distributed run"):
        job(tmp_path, "topology=null", "fault.min_workers=1")
    assert job(tmp_path, "fault.min_workers=1").fault.min_workers == 1
    with pytest.raises(config.ConfigError, match="fault: unknown key"):
        job(tmp_path, "fault.retries=2")
    with pytest.raises(config.ConfigError, match="fault.replay_steps: expected an integer >= 0"):
        job(tmp_path, "fault.replay_steps=-1")
    with pytest.raises(config.ConfigError, match="fault.replay_mb: expected an integer >= 1"):
        job(tmp_path, "fault.replay_mb=0")
    assert job(tmp_path, "fault.replay_steps=0").fault.replay_steps == 0


FEWER_WORKERS = ("topology.workers_per_group=2", "fault.min_workers=1")
FEWER_GROUPS = (
    "topology.preset=downpour",
    "topology.n_groups=2",
    "topology.workers_per_group=1",
    "fault.min_groups=1",
)


@pytest.mark.parametrize(
    "shape, fits",
    [
        (FEWER_WORKERS, "room for 1 group(s) x 1 worker(s) of the configured 1 x 2"),
        (FEWER_GROUPS, "room for 1 group(s) x 1 worker(s) of the configured 2 x 1"),
    ],
    ids=["fewer-workers", "fewer-groups"],
)
def test_an_elastic_run_starts_in_what_fits(ray_session, tmp_path, shape, fits):
    """Workers of 5 CPUs on the session's 8-CPU Ray: one fits, and the run goes with one."""
    lines: list[str] = []
    cfg = job(tmp_path, *shape, "topology.worker.cpus=5", "fault.grow_check_s=3600")
    res = DistributedTrainer(cfg, log=lines.append).fit()
    assert [r["step"] for r in res.history if r["kind"] == "eval"] == [40]
    assert any(fits in x for x in lines), lines
    rigid = job(tmp_path / "rigid", *shape[:-1], "topology.worker.cpus=5")  # no minimum
    with pytest.raises(ResourceError, match="does not fit the cluster"):
        DistributedTrainer(rigid, log=lambda line: None).fit()
