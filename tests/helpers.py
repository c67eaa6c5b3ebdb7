"""What the tests share that is not a fixture: starting the session's Ray, jobs written to
disk, the CLI run as a user runs it, clusters of ``ray start`` processes, an S3 server's requests,
and the tiny jobs several test modules train. Fixtures are in ``conftest.py``; test modules
import these by name (``from helpers import cli_error``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

__all__ = [
    "S3_BUCKET",
    "S3_KEYS",
    "TINY_JOB",
    "TINY_LM",
    "cli_error",
    "descendants",
    "free_port",
    "group_of",
    "load_job",
    "node_env",
    "ray_start_cluster",
    "run_cli",
    "s3_requests",
    "signal_worker_at",
    "start_ray",
    "stop_group",
    "tensorboard_scalars",
    "trained_to",
]


def start_ray():
    """The session's embedded Ray (module-scoped fixtures call this directly)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    return ray


def load_job(d: Path, text: str, *more: str):
    """A job from YAML ``text``, written as ``d/job.yaml`` with its run in ``d``, and
    ``more`` overrides."""
    from raysinga import config  # noqa: PLC0415

    d.mkdir(parents=True, exist_ok=True)
    (d / "job.yaml").write_text(text)
    return config.load(d / "job.yaml", [f"run_dir={d}", *more])


S3_BUCKET = "raysinga-test"


S3_KEYS = {"access_key": "testing", "secret_key": "testing"}


@contextlib.contextmanager
def s3_requests():
    """The requests the moto server answers meanwhile, as ``(method, path)``: read off the
    request lines its HTTP server logs, so a request is counted where it arrives."""
    import logging  # noqa: PLC0415
    import re  # noqa: PLC0415

    seen: list[tuple[str, str]] = []
    line = re.compile(r'"(?:\x1b\[[0-9;]*m)*([A-Z]+) (\S+) HTTP')

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            m = line.search(record.getMessage())
            if m:
                seen.append((m.group(1), m.group(2)))

    log = logging.getLogger("werkzeug")
    handler, level, propagate = Collect(), log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield seen
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """The scalars of a run's TensorBoard event files by tag, as TensorBoard itself reads them."""
    from tensorboard.backend.event_processing.event_accumulator import (  # noqa: PLC0415
        EventAccumulator,
    )

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def run_cli(*args: str, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``raysinga ARGS`` as a user runs it: its own process, output captured."""

    return subprocess.run(
        [sys.executable, "-m", "raysinga.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli_error(*args: str, named: str | list[str] = (), status: int | None = None) -> str:
    """``raysinga ARGS`` run in this process (fast: no interpreter start; distributed runs join
    the session's Ray) for an input mistake: asserts a non-zero exit with exactly one
    ``raysinga: error:`` line naming each of ``named``, and no traceback. Returns that line."""
    import contextlib  # noqa: PLC0415
    import io  # noqa: PLC0415

    from raysinga import cli  # noqa: PLC0415

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
    text = err.getvalue()
    assert "Traceback" not in text + out.getvalue(), text
    assert code not in (0, None), f"exit {code}; stderr: {text}; stdout: {out.getvalue()}"
    if status is not None:
        assert code == status, (code, text)
    errors = [line for line in text.splitlines() if line.startswith("raysinga: error:")]
    if code != 2 or errors:  # argparse prints "usage: ..." and its own error line
        assert len(errors) == 1, text
    line = errors[0] if errors else text
    for n in [named] if isinstance(named, str) else named:
        assert n in line, f"{n!r} not named in: {line}"
    return line


# A single-process digits run with a checkpoint every 10 of its 30 steps (Adam: slots and counts),
# for tests of where and how checkpoints are written; "{name}" is the run's name.
TINY_JOB = """
name: {name}
seed: 3
model:
  input_shape: [64]
  layers:
    - {{kind: dense, name: fc1, units: 16, activation: relu}}
    - {{kind: dense, name: out, units: 10}}
data: {{source: {{kind: digits}}, batch_size: 32}}
updater: {{name: adam, lr: 0.01}}
train_steps: 30
disp_freq: 10
test_freq: 0
checkpoint_frequency: 10
"""


def trained_to(run_dir, step: int) -> bool:
    """Whether a run in another process has reported training at ``step`` or beyond, read from
    its records (``metrics.jsonl``), not from its console text."""
    import json
    from pathlib import Path

    f = Path(run_dir) / "metrics.jsonl"
    if not f.exists():
        return False
    for line in f.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line being written
            rec = json.loads(line)
            if rec.get("kind") == "train" and rec["step"] >= step:
                return True
    return False


def free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_of(pid: int) -> list[int]:
    """The live processes of process group ``pid``."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pid:
            out.append(int(d.name))
    return out


def descendants(pid: int) -> list[tuple[int, str]]:
    """The live processes descended from ``pid`` (children, theirs, ...), each with the first
    word of its command line (Ray's roles: their titles, ``ray::Worker.serve``)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            title = (d / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append((int(d.name), title))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def stop_group(*pgids: int, grace: float = 2.0) -> None:
    """End the processes ``ray start`` left in each of these process groups (the daemons and the
    workers they started), all groups at once: SIGTERM, then SIGKILL for what is left after
    ``grace`` seconds, and wait until they are gone. They are the suite's own: a graceful stop
    saves nothing worth the wait (here Ray's GCS server outlived 20 s of SIGTERM, and a raylet
    took 10 s to follow it)."""
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    live = list(pgids)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 15.0)):
        for pgid in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
        deadline = time.monotonic() + wait
        while (live := [g for g in live if group_of(g)]) and time.monotonic() < deadline:
            time.sleep(0.1)


@contextlib.contextmanager
def ray_start_cluster(nodes: list[tuple[str, int]], env: dict[str, str], head_cpus: int = 0):
    """A cluster of ``ray start`` processes as a user starts one: a head with ``head_cpus``
    (this environment's Ray), then one node per ``(python, cpus)``, each with ports of its own
    and in a process group of its own, so that exactly these are stopped afterwards (a user's
    Ray beside the suite holds the default ports and lives on). Yields the head's address, its
    dashboard's port and the process group of each node after the head (to remove one, kill
    its group)."""
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    # Not a client of the session's RAY_ADDRESS; a node joins the head with `ray start`'s token
    env = {**{k: v for k, v in env.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "token"}
    port, dash = free_port(), free_port()
    # Its own temp dir keeps its address file out of /tmp/ray, where a later ray.init() would
    # find the stopped head (`ray stop` removes that file; stopping the group does not).
    temp = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # short: Ray's socket paths must fit
    own = ("--disable-usage-stats", f"--dashboard-agent-listen-port={free_port()}")
    head = [
        sys.executable,
        "-c",
        "from ray.scripts.scripts import main; main()",
        "start",
        "--head",
        f"--port={port}",
        f"--dashboard-port={dash}",
        f"--ray-client-server-port={free_port()}",
        f"--num-cpus={head_cpus}",
        f"--temp-dir={temp}",
        *own,
    ]
    started = []
    try:
        for i, cmd in enumerate(
            [head]
            + [
                [
                    py,
                    "-c",
                    "from ray.scripts.scripts import main; main()",
                    "start",
                    f"--address=127.0.0.1:{port}",
                    f"--num-cpus={cpus}",
                    "--disable-usage-stats",
                    f"--dashboard-agent-listen-port={free_port()}",
                ]
                for py, cpus in nodes
            ]
        ):
            p = subprocess.Popen(
                cmd,
                cwd=temp,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            started.append(p.pid)
            out, _ = p.communicate(timeout=180)
            assert p.returncode == 0, f"ray start ({'head' if i == 0 else f'node {i}'}): {out}"
        yield f"127.0.0.1:{port}", dash, started[1:]
    finally:
        stop_group(*started)
        shutil.rmtree(temp, ignore_errors=True)
    assert not any(group_of(pid) for pid in started), "a node's processes outlived the stop"


def node_env(
    where: Path, without: tuple[str, ...] = (), only: tuple[str, ...] | None = None
) -> str:
    """A virtual environment in ``where`` whose Python imports what this one's site-packages
    hold, but not raysinga (its install's hook is a path file, which a directory reached
    through another path file does not run) nor the top-level modules ``without``; ``only``:
    instead, nothing but the distributions named (``"ray[default]"`` with an extra) and what
    they require, as ``pip install`` of them would bring. Returns its Python."""
    import sysconfig  # noqa: PLC0415

    subprocess.run([sys.executable, "-m", "venv", str(where / "venv")], check=True)
    py = str(where / "venv" / "bin" / "python")
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = Path(sysconfig.get_paths()["purelib"])
    if without or only is not None:  # a directory of links to the entries kept, in the
        linked = where / "venv" / "deps"  # environment (which an emulated host sees:
        linked.mkdir()  # tests/hosts.py)
        kept = _entries_of(only) if only is not None else None
        for entry in deps.iterdir():
            top = entry.name.split("-")[0].split(".")[0].lower()
            if top in without or (kept is not None and entry.name not in kept):
                continue
            (linked / entry.name).symlink_to(entry)
        deps = linked
    Path(site, "deps.pth").write_text(f"{deps}\n")
    lacks = ["raysinga", *without]
    for module in ["ray", "numpy", "pyarrow", "msgpack", *lacks]:
        found = subprocess.run([py, "-c", f"import {module}"], cwd=where, capture_output=True)
        assert (found.returncode == 0) == (module not in lacks), (module, found.stderr)
    return py


def _entries_of(dists: tuple[str, ...]) -> set[str]:
    """The names in site-packages (packages, modules, ``.libs`` and ``.dist-info``
    directories) of the installed distributions ``dists`` and of every distribution they
    require, extras followed, as pip resolves them; ``.pth`` files left out."""
    import importlib.metadata as md  # noqa: PLC0415

    from packaging.requirements import Requirement  # noqa: PLC0415

    seen: set[tuple[str, frozenset[str]]] = set()
    entries: set[str] = set()
    todo = [Requirement(d) for d in dists]
    while todo:
        req = todo.pop()
        key = (req.name.lower().replace("_", "-"), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue  # a requirement for another platform or Python
        for f in dist.files or ():
            top = f.parts[0]
            if top != ".." and not top.endswith(".pth") and top != "__pycache__":
                entries.add(top)
        for r in dist.requires or ():
            sub = Requirement(r)
            extras = req.extras or {""}
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return entries


# A character-level language model small enough to train in a second, for the tests of text
# generation and of PyTorch interop.
TINY_LM = """
name: tiny-lm
seed: 1
model:
  input_shape: [16]
  loss: sequence_cross_entropy
  layers:
    - {kind: embedding, name: tok, vocab: 98, dim: 16}
    - {kind: positional, name: pos}
    - {kind: layernorm, name: ln}
    - {kind: attention, name: attn, heads: 2}
    - {kind: add, name: res, from: [pos, attn]}
    - {kind: dense, name: head, units: 98}
data:
  source: {kind: text, context: 16, valid_every: 5, max_chars: 200000}
  batch_size: 8
updater: {name: adam, lr: 0.01}
train_steps: 12
disp_freq: 6
test_freq: 0
"""


def tune_job(name: str) -> dict:
    """The small digits job the Tune tests search over (a dict, as trials on any node take
    it), named ``name`` (Tune's experiment and the trials' run names follow it)."""
    return {
        "name": name,
        "seed": 3,
        "model": {
            "input_shape": [64],
            "layers": [
                {"kind": "dense", "name": "fc1", "units": 32, "activation": "relu"},
                {"kind": "dropout", "name": "drop", "rate": 0.1},
                {"kind": "dense", "name": "out", "units": 10},
            ],
        },
        "data": {"source": {"kind": "digits"}, "batch_size": 32},
        "updater": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "train_steps": 60,
        "disp_freq": 10,
    }


def signal_worker_at(trainer, step: int, sig: int) -> list[int]:
    """Subscribe to ``trainer`` a hook that, once training reports ``step``, sends ``sig`` to
    the process of group 0's worker 1 from another thread (while the next steps run). Returns
    the pids signalled, filled as it fires."""
    import threading  # noqa: PLC0415

    import ray  # noqa: PLC0415

    from raysinga.obs.events import TrainStep  # noqa: PLC0415

    fired: list[int] = []

    def hook(ev) -> None:
        if fired or not (isinstance(ev, TrainStep) and ev.step == step):
            return
        pid = ray.get(trainer.workers[0][1].pid.remote())
        fired.append(pid)
        threading.Thread(target=os.kill, args=(pid, sig), daemon=True).start()

    trainer.hub.subscribe(hook)
    return fired


def sigkill_once(cmd: list[str], made: Path, timeout_s: float = 240) -> None:
    """Start ``cmd`` (a training run) and SIGKILL it as soon as ``made`` exists (its
    checkpoint directory of some step); fails, with the run's output, where it ends first or
    ``made`` is not there within ``timeout_s``."""
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    try:
        while not made.exists():
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, f"the run never made {made}"
            time.sleep(0.02)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        p.kill()


def checkpoint_tensors(path: Path | str) -> dict[str, bytes]:
    """Every tensor of a checkpoint (parameters, optimizer slots, state) by name, as bytes,
    read after a full check of its files."""
    from raysinga.checkpoint import Checkpoint  # noqa: PLC0415

    ck = Checkpoint.open(path, verify="full")
    return {n: ck.array(n).tobytes() for k in ("param", "slot", "state") for n in ck.names(k)}


def params_of(ck_dir: Path) -> dict:
    """The parameters of the checkpoint at ``ck_dir``, verified in full, as bytes by name: what
    a bit-exact comparison of two runs compares."""
    from raysinga.checkpoint import Checkpoint  # noqa: PLC0415

    ck = Checkpoint.open(ck_dir, verify="full")
    return {k: v.tobytes() for k, v in ck.arrays("param").items()}


def train_digits_embedded(where: Path, steps: int) -> subprocess.Popen:
    """``raysinga train examples/digits_mlp.yaml`` in a process of its own on an embedded Ray
    (``RAY_ADDRESS=local``), its run directory ``where/run``, no evaluation; stdout and stderr
    together, as text."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "raysinga.cli", "train", str(root / "examples/digits_mlp.yaml")]
    cmd += ["--set", f"train_steps={steps}", "--set", "test_freq=0"]
    cmd += ["--set", f"run_dir={where / 'run'}"]
    env = {**os.environ, "RAY_ADDRESS": "local"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=where, env=env
    )
