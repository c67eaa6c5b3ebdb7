"""Checkpoints of the distributed trainer and exact resume: same topology bit for bit, another
topology by resharding, every piece of state used, bad input refused, failed writes never
committed, a SIGKILLed driver resumed from the command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import checkpoint_tensors as tensors
from helpers import run_cli, sigkill_once, start_ray, tensorboard_scalars, trained_to

from raysinga import config
from raysinga.checkpoint import Checkpoint, CheckpointError, save, steps
from raysinga.distributed import DistributedTrainer
from raysinga.run import registry as run_registry

ROOT = Path(__file__).resolve().parents[2]
QUIET = {"log": lambda line: None}

# Batch norm (state), dropout (the RNG), Adam (slots and update counts), a cosine schedule.
JOB = """
name: resume
seed: 5
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 48, activation: relu}
    - {kind: batchnorm, name: bn1}
    - {kind: dropout, name: drop, rate: 0.2}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 32}
updater: {name: adam, lr: {kind: cosine, lr: 0.01, steps: 60, min_lr: 0.0001}}
train_steps: 40
disp_freq: 5
test_freq: 20
checkpoint_frequency: 10
topology: {preset: sandblaster, n_servers: 1, workers_per_group: 2}
"""


def job(tmp_path: Path, *more: str) -> config.JobConfig:
    f = tmp_path / "job.yaml"
    if not f.exists():
        f.write_text(JOB)
    return config.load(f, [f"run_dir={tmp_path}", *more])


def losses(history: list[dict], after: int) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in history if r["kind"] == "train" and r["step"] > after}


@pytest.fixture(scope="module")
def ray_module():
    """``ray_session`` for module fixtures (the same embedded Ray)."""
    return start_ray()


@pytest.fixture(scope="module")
def straight(tmp_path_factory, ray_module):
    """The uninterrupted 40-step run."""
    d = tmp_path_factory.mktemp("straight")
    result = DistributedTrainer(job(d), **QUIET).fit()
    return d, result


@pytest.fixture(scope="module")
def halfway(tmp_path_factory, ray_module):
    """The same run stopped after 20 steps (its final checkpoint is step 20)."""
    d = tmp_path_factory.mktemp("halfway")
    DistributedTrainer(job(d, "train_steps=20"), **QUIET).fit()
    return d


def resumed_from(tmp_path: Path, src_run: Path, *more: str) -> tuple[Path, object]:
    """Copy the halfway run's step-20 checkpoint into a new run directory and resume it."""
    import shutil

    (tmp_path / "checkpoints").mkdir(exist_ok=True)
    shutil.copytree(src_run / "checkpoints" / "step-20", tmp_path / "checkpoints" / "step-20")
    result = DistributedTrainer(job(tmp_path, *more), resume=True, **QUIET).fit()
    return tmp_path, result


def test_resume_is_bit_exact_with_the_same_loss_curve(straight, halfway, tmp_path):
    (sd, sres), (rd, rres) = straight, resumed_from(tmp_path, halfway)
    assert steps(rd / "checkpoints")[0] == 40
    assert tensors(rd / "checkpoints/step-40") == tensors(sd / "checkpoints/step-40")
    for k in sres.params:
        assert sres.params[k].tobytes() == rres.params[k].tobytes(), k
    assert losses(rres.history, 20) == losses(sres.history, 20) and losses(sres.history, 20)
    # the restored history is the halfway run's, then the resumed steps
    assert [r["step"] for r in rres.history if r["kind"] == "train"] == list(range(5, 45, 5))


def test_a_resumed_distributed_run_writes_its_history_and_checkpoints_to_tensorboard(
    halfway, tmp_path
):
    rd, res = resumed_from(tmp_path, halfway, "tensorboard=true")
    got = tensorboard_scalars(rd)
    train = [r for r in res.history if r["kind"] == "train"]
    assert [s for s, _ in got["train/loss"]] == [r["step"] for r in train] == list(range(5, 45, 5))
    assert [v for _, v in got["train/loss"]] == pytest.approx([r["loss"] for r in train], 1e-6)
    assert [s for s, _ in got["eval/test_accuracy"]] == [20, 40]
    # step 10's record came with the history, step 20's without its timings (the checkpoint
    # holds its own record before it is committed)
    assert [s for s, _ in got["checkpoint/seconds"]] == [10, 30, 40]
    saved = [r["step"] for r in res.history if r["kind"] == "checkpoint"]
    assert saved == [10, 20, 30, 40]


def test_compressed_checkpoints_resume_bit_exact(straight, ray_module, tmp_path):
    """Servers snapshot compressed shards into plain buffers (no shard image): same state."""
    sd, _ = straight
    (tmp_path / "half").mkdir()
    DistributedTrainer(
        job(tmp_path / "half", "train_steps=20", "checkpoint.compression=zstd"), **QUIET
    ).fit()
    ck = Checkpoint.open(tmp_path / "half/checkpoints/step-20")
    assert {f["compression"] for f in ck.manifest["files"] if f["file"] != "params.meta"} == {
        "zstd"
    }
    (tmp_path / "res").mkdir()
    rd, _ = resumed_from(tmp_path / "res", tmp_path / "half", "checkpoint.compression=zstd")
    assert tensors(rd / "checkpoints/step-40") == tensors(sd / "checkpoints/step-40")


@pytest.mark.slow  # the default tier's time (resharding: tests/checkpoint/test_finetune.py)
def test_resume_with_more_workers_and_servers_reshards(ray_module, tmp_path):
    """Batch norm normalises each worker's sub-batch, so a model with it trains differently on
    another number of workers; without it, 3 workers and 2 servers continue the 2-worker,
    1-server run to rounding."""
    text = JOB.replace("    - {kind: batchnorm, name: bn1}\n", "")
    for d in ("straight", "halfway", "resharded"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "job.yaml").write_text(text)
    want = DistributedTrainer(job(tmp_path / "straight"), **QUIET).fit().params
    DistributedTrainer(job(tmp_path / "halfway", "train_steps=20"), **QUIET).fit()
    topo = "topology={preset: sandblaster, n_servers: 2, workers_per_group: 3, slice_bytes: 1024}"
    _, res = resumed_from(tmp_path / "resharded", tmp_path / "halfway", topo)
    ck = Checkpoint.open(tmp_path / "resharded/checkpoints/step-40")
    assert {i.shard for i in ck.infos if i.name == "fc1/W"} == {0, 1}  # cut over both servers
    for k, a in want.items():
        assert np.abs(res.params[k] - a).max() <= 1e-5 * np.abs(a).max(), k


# --- every piece of state is used -------------------------------------------------------------


def _rewrite(src: Path, dst_root: Path, alter: str) -> None:
    """Re-save ``src`` (whole tensors, one shard) with one piece of its state altered."""
    ck = Checkpoint.open(src)
    params = {n: np.array(ck.array(n)) for n in ck.names("param")}
    slots = {n: np.array(ck.array(n)) for n in ck.names("slot")}
    state = {n: np.array(ck.array(n)) for n in ck.names("state")}
    meta = ck.meta
    run = meta["run"]
    if alter == "optimizer slots":
        slots = {n: np.zeros_like(a) for n, a in slots.items()}
    elif alter == "update counts":  # Adam's bias correction
        run["optimizer"]["counts"] = {p: 1 for p in run["optimizer"]["counts"]}
    elif alter == "schedule state":
        run["optimizer"]["schedule"]["lr"] = 0.02
    elif alter == "data cursor":
        run["cursor"]["batch_offset"] = 3
    elif alter == "rng":
        run["rng"]["seed"] = 6
    elif alter == "batch-norm state":
        for n in list(state):
            if n.endswith("running_mean"):
                state[n] = state[n] + 1.0
    else:
        assert alter == "nothing"
    save(dst_root, ck.step, params, slots, state, meta)


ALTERATIONS = [
    "optimizer slots",
    "update counts",
    "schedule state",
    "data cursor",
    "rng",
    "batch-norm state",
]


@pytest.mark.slow  # the quick tier has the shorter checks of this
def test_every_piece_of_state_is_used(straight, halfway, tmp_path):
    """Resumed from a faithful copy the run ends bit-identical; with any one piece of state
    altered it does not (batch-norm statistics only show in evaluation and the saved state)."""
    want = tensors(straight[0] / "checkpoints/step-40")
    outcome = {}
    for alter in ["nothing", *ALTERATIONS]:
        d = tmp_path / alter.replace(" ", "-")
        _rewrite(halfway / "checkpoints/step-20", d / "checkpoints", alter)
        DistributedTrainer(job(d), resume=True, **QUIET).fit()
        got = tensors(d / "checkpoints/step-40")
        outcome[alter] = sorted(n for n in want if got[n] != want[n])
    assert outcome["nothing"] == []
    for alter in ALTERATIONS:
        assert outcome[alter], f"altering the {alter} changed nothing"
    assert any(n.startswith("fc1/") for n in outcome["rng"])  # dropout masks and data order


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(straight, halfway, tmp_path):
    """A byte flipped inside step 20's shard (sizes intact: only the servers' full hash sees
    it): the run moves step 20 aside, resumes from step 10 and still ends bit-identical."""
    import shutil

    shutil.copytree(halfway / "checkpoints", tmp_path / "checkpoints")
    f = tmp_path / "checkpoints/step-20/shard-0.arrow"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x01
    f.write_bytes(bytes(b))
    lines: list[str] = []
    DistributedTrainer(job(tmp_path), resume=True, log=lines.append).fit()
    assert any("failed verification" in line and "checksum mismatch" in line for line in lines)
    assert any("resuming 'resume' at step 10" in line for line in lines), lines
    assert len(list((tmp_path / "checkpoints").glob("step-20.invalid-*"))) == 1
    assert 20 in steps(tmp_path / "checkpoints")  # written again
    want = tensors(straight[0] / "checkpoints/step-40")
    assert tensors(tmp_path / "checkpoints/step-40") == want


def test_resume_from_the_object_store_after_the_disk_copy_is_gone(straight, tmp_path):
    """With ``checkpoint.object_store``, each committed checkpoint is also kept in Ray's object
    store; a resume whose directory lost its checkpoints takes the registry's copy."""
    import shutil

    import ray

    from raysinga.checkpoint import objstore

    on = ("name=resume-objstore", "checkpoint.object_store=true")
    DistributedTrainer(
        job(tmp_path, "train_steps=20", *on, "checkpoint.keep_last=1"), **QUIET
    ).fit()
    reg = objstore.registry()
    key = run_registry.key("resume-objstore", tmp_path / "checkpoints")
    kept = [e["step"] for e in ray.get(reg.list.remote(key))]
    assert kept == [20]  # pruned with the disk copies: the store does not fill up
    shutil.rmtree(tmp_path / "checkpoints")
    (tmp_path / "checkpoints").mkdir()
    lines: list[str] = []
    try:
        DistributedTrainer(job(tmp_path, *on), resume=True, log=lines.append).fit()
    finally:
        for e in ray.get(reg.list.remote(key)):
            ray.get(reg.delete.remote(key, e["step"]))
    assert any("from object store, run 'resume-objstore' step 20" in line for line in lines)
    assert tensors(tmp_path / "checkpoints/step-40") == tensors(straight[0] / "checkpoints/step-40")


@pytest.mark.slow  # the quick tier has the shorter checks of this
def test_a_short_job_that_starts_the_registry_leaves_its_checkpoints_in_it(ray_module, tmp_path):
    """A job's calls to the registry are not waited for while it trains; one that ends first
    (the registry just starting) would take them with it. The driver waits at the end."""
    import ray

    from raysinga.checkpoint import objstore

    old = run_registry.actor()
    if old is not None:  # this job must start it
        ray.kill(old)
        deadline = time.monotonic() + 30
        while run_registry.actor() is not None:
            assert time.monotonic() < deadline, "the old registry never went away"
            time.sleep(0.1)
    (tmp_path / "job.yaml").write_text(JOB)
    # only the final checkpoint: the registry starts as the job ends
    sets = ("train_steps=20", "checkpoint_frequency=0", "checkpoint.object_store=true")
    sets += (f"run_dir={tmp_path}",)
    address = ray_module.get_runtime_context().gcs_address
    overrides = [a for s in sets for a in ("--set", s)]
    r = run_cli("train", str(tmp_path / "job.yaml"), "--address", address, *overrides)
    assert r.returncode == 0, r.stderr
    reg = objstore.registry(create=False)
    key = run_registry.key("resume", tmp_path / "checkpoints")
    try:
        assert [e["step"] for e in ray.get(reg.list.remote(key))] == [20]
        assert run_registry.lookup(key)["step"] == 20  # its object is there, not lost
    finally:
        for e in ray.get(reg.list.remote(key)):
            ray.get(reg.delete.remote(key, e["step"]))


# --- bad input ----------------------------------------------------------------------------------


def test_resume_without_a_checkpoint(ray_session, tmp_path):
    with pytest.raises(CheckpointError, match="--resume: no valid checkpoint of run 'resume'"):
        DistributedTrainer(job(tmp_path), resume=True, **QUIET).fit()
    res = DistributedTrainer(job(tmp_path, "train_steps=10"), resume="auto", **QUIET).fit()
    assert res.history[-1]["step"] == 10 and steps(tmp_path / "checkpoints") == [10]


def test_a_fresh_start_over_checkpoints_is_refused_unless_fresh(halfway, tmp_path):
    import shutil

    shutil.copytree(halfway / "checkpoints", tmp_path / "checkpoints")
    with pytest.raises(CheckpointError, match=r"already holds checkpoints .* \(newest: step 20\)"):
        DistributedTrainer(job(tmp_path), **QUIET).fit()
    assert steps(tmp_path / "checkpoints") == [20, 10]
    DistributedTrainer(job(tmp_path, "train_steps=10"), fresh=True, **QUIET).fit()
    assert steps(tmp_path / "checkpoints") == [10]


def test_a_checkpoint_of_another_model_is_refused_with_the_names(halfway, tmp_path):
    import shutil

    shutil.copytree(halfway / "checkpoints", tmp_path / "checkpoints")
    text = JOB.replace("units: 48", "units: 24").replace("name: out", "name: head")
    (tmp_path / "job.yaml").write_text(text)
    with pytest.raises(CheckpointError) as e:
        DistributedTrainer(job(tmp_path), resume=True, **QUIET).fit()
    msg = str(e.value)
    assert "use --init-from" in msg
    assert "shape mismatch: fc1/W: checkpoint [64, 48], model [64, 24]" in msg
    assert "missing (initialised fresh): head/W" in msg and "unexpected (ignored): out/W" in msg


@pytest.mark.parametrize(
    "change, named",
    [
        ("data.batch_size=16", "data.batch_size is 16 in the job but 32"),
        ("dtype=float64", "trains in float64 but the checkpoint holds"),
    ],
)
def test_resume_refuses_another_batch_size_or_dtype(halfway, tmp_path, change, named):
    """Review defects: the data cursor counts batches (another batch size trains on other
    samples), and the servers used to cast a checkpoint of another dtype silently."""
    import shutil

    shutil.copytree(halfway / "checkpoints", tmp_path / "checkpoints")
    with pytest.raises(CheckpointError, match=named):
        DistributedTrainer(job(tmp_path, change), resume=True, **QUIET).fit()
    assert steps(tmp_path / "checkpoints") == [20, 10]


def test_init_from_loads_what_matches(halfway, tmp_path):
    text = JOB.replace("name: out", "name: head")  # a new head; fc1 and bn1 are reused
    (tmp_path / "job.yaml").write_text(text)
    lines: list[str] = []
    src = halfway / "checkpoints/step-20"
    t = DistributedTrainer(
        job(tmp_path, "train_steps=1", "updater.lr=0.0"), init_from=str(src), log=lines.append
    )
    res = t.fit()
    report = next(line for line in lines if "--init-from" in line)
    assert "matched 4, missing 2, unexpected 2" in report
    ck = Checkpoint.open(src)
    np.testing.assert_array_equal(res.params["fc1/W"], ck.array("fc1/W"))  # lr 0: unchanged
    assert not np.array_equal(res.params["head/b"], ck.array("out/b"))
    # the job file's init section renames the old head onto the new one
    (tmp_path / "job.yaml").write_text(text + "init: {rename: {out/: head/}}\n")
    lines.clear()
    more = [f"run_dir={tmp_path / 'renamed'}", "train_steps=1", "updater.lr=0.0"]
    cfg = config.load(tmp_path / "job.yaml", more)
    res = DistributedTrainer(cfg, init_from=str(src), log=lines.append).fit()
    report = next(line for line in lines if "--init-from" in line)
    assert "matched 6, missing 0, unexpected 0" in report, report
    for name in ("W", "b"):
        np.testing.assert_array_equal(res.params[f"head/{name}"], ck.array(f"out/{name}"))


def test_init_from_something_that_is_not_a_checkpoint(ray_session, tmp_path):
    (tmp_path / "junk").mkdir()
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        DistributedTrainer(job(tmp_path), init_from=str(tmp_path / "junk"), **QUIET).fit()


def test_resume_and_fresh_exclude_each_other(tmp_path):
    with pytest.raises(ValueError, match="exclude"):
        DistributedTrainer(job(tmp_path), resume=True, fresh=True)


# --- a failed background write ------------------------------------------------------------------


def test_a_failed_background_write_reaches_the_driver_and_commits_nothing(
    ray_session, tmp_path, small_fs
):
    # 64x4096 float32 weights with Adam's two slots: 3 MiB, more than the 2 MiB disk holds
    text = JOB.replace("units: 48", "units: 4096")
    (tmp_path / "job.yaml").write_text(text)
    cfg = job(tmp_path, "train_steps=20", f"checkpoint.dir={small_fs / 'ck'}")
    with pytest.raises(
        CheckpointError, match="checkpoint of step 10 failed, nothing was committed"
    ):
        DistributedTrainer(cfg, **QUIET).fit()
    assert steps(small_fs / "ck") == []
    assert [d for d in os.listdir(small_fs / "ck") if d != ".writer.lock"] == []


# --- the driver SIGKILLed, resumed from the command line ----------------------------------------


def _long_job(checkpoint_frequency: int) -> str:
    """The job at 200 steps, checkpointed every ``checkpoint_frequency`` (0: at its end)."""
    text = JOB.replace("train_steps: 40", "train_steps: 200").replace("steps: 60", "steps: 200")
    text = text.replace("checkpoint_frequency: 10", f"checkpoint_frequency: {checkpoint_frequency}")
    return text.replace("disp_freq: 5", "disp_freq: 10").replace("test_freq: 20", "test_freq: 0")


@pytest.fixture(scope="module")
def long_ref(tmp_path_factory, ray_module):
    """The job at 200 steps trained uninterrupted, checkpointed every 20 steps (where a run
    checkpoints changes none of its bits): its directory and result."""
    d = tmp_path_factory.mktemp("long-ref")
    (d / "job.yaml").write_text(_long_job(20))
    return d, DistributedTrainer(job(d), **QUIET).fit()


def _long_run(ray_session, tmp_path: Path, checkpoint_frequency: int) -> tuple:
    """The job at 200 steps in ``run``: returns ``run`` and the command line that trains it
    on the session's Ray."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.yaml").write_text(_long_job(checkpoint_frequency))
    address = ray_session.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "raysinga.cli", "train", str(run / "job.yaml")]
    return run, [*cmd, "--address", address, "--set", f"run_dir={run}"]


@pytest.mark.slow
def test_sigkilled_driver_resumes_bit_exact(ray_session, long_ref, tmp_path):
    (ref, want), (run, cmd) = long_ref, _long_run(ray_session, tmp_path, checkpoint_frequency=20)
    sigkill_once(cmd, run / "checkpoints/step-120")
    killed_at = steps(run / "checkpoints")[0]
    assert 120 <= killed_at < 200
    r = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resuming 'resume' at step {killed_at}" in r.stdout
    assert tensors(run / "checkpoints/step-200") == tensors(ref / "checkpoints/step-200")
    got = Checkpoint.open(run / "checkpoints/step-200").meta["run"]["history"]
    assert losses(got, killed_at) == losses(want.history, killed_at)


@pytest.mark.slow
def test_sigterm_checkpoints_the_step_reached_and_resumes_bit_exact(
    ray_session, long_ref, tmp_path
):
    """SIGTERM (preemption, ``ray job stop``) to a distributed run: it finishes the steps under
    way, checkpoints that step, exits 128 + 15, and ``--resume`` ends bit-identical to a run
    never stopped."""
    (ref, _), (run, cmd) = long_ref, _long_run(ray_session, tmp_path, checkpoint_frequency=0)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not trained_to(run, 50):
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read()
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=120)[0]
        assert p.returncode == 128 + signal.SIGTERM, out
    finally:
        p.kill()
    (stopped,) = steps(run / "checkpoints")
    assert 50 <= stopped < 200, out
    assert f"stopped by SIGTERM at step {stopped}; checkpoint" in out
    Checkpoint.open(run / f"checkpoints/step-{stopped}", verify="full")
    r = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert tensors(run / "checkpoints/step-200") == tensors(ref / "checkpoints/step-200")


def test_sigterm_before_the_steps_stops_in_one_line_and_leaves_the_lock_alone(
    ray_session, tmp_path
):
    """SIGTERM while the run waits for another writer's lease to run out (outside the steps,
    where Ray's own handler holds): one line, exit 128 + 15, no traceback, nothing written,
    and the other writer's lock as it was."""
    import json

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "job.yaml").write_text(JOB)
    held = {"host": "another-machine", "pid": 7, "token": "t", "until": time.time() + 3600}
    lock = run / "checkpoints" / ".writer.lock"
    lock.write_text(json.dumps(held))
    address = ray_session.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "raysinga.cli", "train", str(run / "job.yaml")]
    cmd += ["--address", address, "--set", f"run_dir={run}"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        while not any("waiting up to" in line for line in seen):
            line = p.stdout.readline()
            assert line, "".join(seen)
            seen.append(line)
        p.send_signal(signal.SIGTERM)
        out = "".join(seen) + p.communicate(timeout=60)[0]
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGTERM, out
    errors = [x for x in out.splitlines() if x.startswith("raysinga: ") and "SIGTERM" in x]
    assert len(errors) == 1 and "outside the training steps" in errors[0], out
    assert "Traceback" not in out, out
    assert json.loads(lock.read_text()) == held
    assert sorted(os.listdir(run / "checkpoints")) == [".writer.lock"]


# --- the driver's memory during a checkpoint of a large model -----------------------------------


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


@pytest.mark.slow
def test_driver_memory_stays_flat_while_a_1_gib_model_is_checkpointed(ray_session, tmp_path):
    """Parameters never pass through the driver: its peak RSS while the servers write two
    checkpoints of 1 GiB of parameters stays within 200 MiB of what it was before."""
    width = 8192
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((16, width), dtype=np.float32))
    np.save(tmp_path / "y.npy", rng.integers(0, 10, 16).astype(np.int64))
    layers = [{"kind": "dense", "name": f"fc{i}", "units": width} for i in range(4)]
    cfg = config.from_dict(
        {
            "name": "big",
            "model": {
                "input_shape": [width],
                "layers": [*layers, {"kind": "dense", "name": "out", "units": 10}],
            },
            "data": {
                "source": {
                    "kind": "npy",
                    "x": str(tmp_path / "x.npy"),
                    "y": str(tmp_path / "y.npy"),
                },
                "batch_size": 2,
            },
            "updater": {"name": "sgd", "lr": 1e-6},
            "train_steps": 2,
            "disp_freq": 1,
            "run_dir": str(tmp_path / "run"),
            "checkpoint_frequency": 1,
            "topology": {"preset": "sandblaster", "n_servers": 1, "workers_per_group": 1},
        }
    )
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current RSS
    except OSError as e:
        pytest.skip(f"cannot reset the peak RSS: {e}")
    before = _rss_kib("VmRSS")
    t = DistributedTrainer(cfg, gather=False, **QUIET)
    t.fit()
    peak = _rss_kib("VmHWM")  # before this test maps the checkpoint itself, below
    assert (peak - before) / 1024 < 200, f"driver RSS rose {(peak - before) / 1024:.0f} MiB"
    assert [s["step"] for s in t.saved] == [1, 2]
    ck = Checkpoint.open(tmp_path / "run/checkpoints/step-2", verify="fast")
    assert sum(i.nbytes for i in ck.infos if i.kind == "param") >= 1 << 30
