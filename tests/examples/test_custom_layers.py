"""examples/custom_layers/: the language model with layers of the user's own (RMSNorm and
SwiGLU in the example's own module), named by import path and shipped with the job. It trains
on one process and on Ray from a working directory that is not the example's; a SIGKILLed
driver resumed, and a lost worker, each end bit-identical to a run never interrupted.
(tests/cluster/test_submit.py runs it on hosts that have neither raysinga nor the module.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import start_ray
from helpers import params_of, sigkill_once, signal_worker_at

from raysinga import config
from raysinga.checkpoint import Checkpoint, steps
from raysinga.distributed import DistributedTrainer

JOB = Path(__file__).resolve().parents[2] / "examples" / "custom_layers" / "charlm.yaml"
SMALL = [
    "train_steps=8",
    "checkpoint_frequency=4",
    "disp_freq=2",
    "test_freq=0",
    "data.source.max_chars=200000",
    "data.source.valid_every=10",
]


def command(run_dir: Path, *more: str) -> list[str]:
    cmd = [sys.executable, "-m", "raysinga.cli", "train", str(JOB), *more]
    return cmd + [x for s in [*SMALL, f"run_dir={run_dir}"] for x in ("--set", s)]


def train(run_dir: Path, *more: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ""}  # the example's module comes with the job alone
    return subprocess.run(
        command(run_dir, *more),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=run_dir.parent,
        env=env,
    )


def small(run_dir: Path, *more: str) -> config.JobConfig:
    return config.load(JOB, [*SMALL, f"run_dir={run_dir}", *more])


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The small job on Ray (2 workers, 2 servers), never interrupted: its run directory."""
    start_ray()  # the session's embedded Ray (``ray_session`` is per test)
    run = tmp_path_factory.mktemp("custom") / "straight"
    DistributedTrainer(small(run), log=None).fit()
    return run


def test_the_example_trains_on_one_process(tmp_path):
    r = train(tmp_path / "local", "--local")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bits per character" in r.stdout, r.stdout


@pytest.mark.slow
def test_the_example_trains_on_ray_with_its_module_shipped(tmp_path):
    r = train(tmp_path / "ray", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "started an embedded local Ray" in r.stdout and "bits per character" in r.stdout


@pytest.mark.slow
def test_the_example_resumes_bit_identically_after_a_sigkill(ray_session, straight, tmp_path):
    want = params_of(straight / "checkpoints" / "step-8")
    run = tmp_path / "killed"
    address = ray_session.get_runtime_context().gcs_address
    cmd = command(run, "--address", address)
    sigkill_once(cmd, run / "checkpoints" / "step-4", timeout_s=300)
    assert steps(run / "checkpoints")[0] < 8
    r = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert params_of(run / "checkpoints" / "step-8") == want


@pytest.mark.slow
def test_the_example_survives_a_lost_worker_bit_identically(ray_session, straight, tmp_path):
    t = DistributedTrainer(small(tmp_path / "lost"), log=None)
    fired = signal_worker_at(t, 4, signal.SIGKILL)  # a report (disp_freq 2), mid-run
    t.fit()
    assert fired, "the kill never fired"
    got = params_of(tmp_path / "lost" / "checkpoints" / "step-8")
    assert got == params_of(straight / "checkpoints" / "step-8")
    lines = (tmp_path / "lost" / "metrics.jsonl").read_text()
    assert '"kind": "failure"' in lines and '"role": "worker"' in lines


@pytest.mark.slow
def test_the_example_resumes_resharded_over_other_counts_of_workers_and_servers(
    ray_session, straight, tmp_path
):
    """Stopped at step 4 with 2 workers and 2 servers, then resumed with 4 workers and 1
    server: the user's layers' parameters and Adam's slots are merged from two servers'
    slices into one, and the run ends where the straight one does, to float rounding (a
    batch summed over 4 sub-batches, not 2)."""
    import shutil

    shutil.copytree(straight / "checkpoints" / "step-4", tmp_path / "checkpoints" / "step-4")
    more = "topology={preset: sandblaster, n_servers: 1, workers_per_group: 4}"
    got = DistributedTrainer(small(tmp_path, more), resume=True, log=None).fit().params
    want = Checkpoint.open(straight / "checkpoints" / "step-8").arrays("param")
    at4 = Checkpoint.open(straight / "checkpoints" / "step-4").arrays("param")
    assert any(k.startswith("b1.ffn/") for k in got) and sorted(got) == sorted(want)
    for k, a in want.items():
        # to rounding, against how far steps 5 to 8 moved it: Adam scales the rounding noise
        # of a gradient that is zero in exact arithmetic (attention's key bias) up to its
        # step, so a few elements differ by more than rounding; a wrong merge of slices or
        # slots would differ by the whole move (measured: at most 0.2% of it)
        assert np.linalg.norm(got[k] - a) <= 1e-2 * np.linalg.norm(a - at4[k]), k
    ck = Checkpoint.open(tmp_path / "checkpoints" / "step-8")
    assert {i.shard for i in ck.infos if i.name == "b1.ffn/Wg"} == {0}  # one server now


@pytest.mark.slow
def test_the_examples_checkpoint_is_handed_to_another_ray_task(ray_session, straight):
    """A checkpoint of the user's layers put into Ray's object store and read by another task,
    which rebuilds the net from the recorded spec (the module from the recorded path) and
    writes the same text as this process does from the disk copy."""
    import ray

    from raysinga.checkpoint import objstore
    from raysinga.run.generate import generate

    ck_dir = straight / "checkpoints" / "step-8"
    ref = objstore.put(str(ck_dir))

    # a runtime env of its own keeps the task's process, whose path the recorded module
    # joins, out of the pool of plain tasks (the next test's nodes must lack the module)
    @ray.remote(runtime_env={"env_vars": {"RAYSINGA_EXAMPLE_TASK": "generate"}})
    def write(refs):
        return generate(objstore.get(refs[0]), "The ", 40, temperature=0.0)

    got = ray.get(write.remote([ref]), timeout=300)
    assert got == generate(Checkpoint.open(ck_dir), "The ", 40, temperature=0.0)
    assert len(got) == len("The ") + 40


def test_a_node_that_cannot_import_the_jobs_module_is_one_line(ray_session, tmp_path):
    """Not shipped (``--no-ship``), in a Ray that other code started: the session's nodes
    have raysinga but not the example's module, and the run stops before any role with one
    line naming the node, the module and what to do."""
    from raysinga.cluster.shipping import NodeSetupError

    with pytest.raises(NodeSetupError) as e:
        DistributedTrainer(small(tmp_path / "unshipped"), log=None, ship=False).fit()
    line = str(e.value)
    assert "\n" not in line
    assert "cannot import mylayers" in line and "No module named 'mylayers'" in line, line
    assert "the job's `modules` names it" in line and "py_modules" in line, line
    assert not (tmp_path / "unshipped" / "checkpoints").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_on_a_gpu_the_examples_layers_agree_with_their_numpy_selves(dtype):
    """SwiGLU's gate runs the example's own CUDA kernels on CuPy arrays and their NumPy twins
    on NumPy arrays; RMSNorm runs on xp. Forward and backward agree to float rounding."""
    sys.path.insert(0, str(JOB.parent))
    try:
        import mylayers
    finally:
        sys.path.remove(str(JOB.parent))
    from raysinga import kernels as K

    cp = K.cupy_module()
    rng = np.random.default_rng(0)
    for layer in (mylayers.SwiGLU("ffn", hidden=24), mylayers.RMSNorm("n")):
        layer.build((5, 16))
        p = {k: layer.init_param(k, s, rng).astype(dtype) for k, s in layer.param_shapes().items()}
        x, dy = (rng.standard_normal((3, 5, 16)).astype(dtype) for _ in range(2))
        y = layer.forward(p, {}, x, None)
        dx, grads = layer.backward(dy)
        gy = layer.forward({k: cp.asarray(v) for k, v in p.items()}, {}, cp.asarray(x), None)
        gdx, ggrads = layer.backward(cp.asarray(dy))
        assert type(gy).__module__.startswith("cupy") and gy.dtype == dtype
        tol = 1e-5 if dtype == np.float32 else 1e-12
        for got, want in [(gy, y), (gdx, dx), *((ggrads[k], grads[k]) for k in grads)]:
            np.testing.assert_allclose(cp.asnumpy(got), want, rtol=tol, atol=tol)
