"""Session-wide test setup: the suite's own Ray, skipping `gpu` tests where no GPU is usable,
the order of tests that replace the session's Ray, and the fixtures tests share. Helpers that
are not fixtures live in ``helpers.py``."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import hosts
import pytest
from helpers import (
    S3_BUCKET,
    S3_KEYS,
    free_port,
    group_of,
    node_env,
    start_ray,
    stop_group,
)

from raysinga.cluster.local import address_file as local_cluster_address_file
from raysinga.kernels import gpu_available, gpu_unavailable_reason


def pytest_configure(config):
    # The suite runs on Ray instances of its own: a `raysinga train` it starts, or its own
    # ray.init(), must not join a cluster the user runs on this machine (found through
    # RAY_ADDRESS or the address file of `ray start`). Tests that join a cluster name it.
    os.environ["RAY_ADDRESS"] = "local"
    # Ray's metrics, which no test reads, off in every Ray the suite starts: after a node of a
    # ray.cluster_utils cluster was removed, the driver's ray.shutdown() took 11 s, waiting in
    # OpenTelemetry's flush of them (0.3 s with them off), once per multi-node test
    os.environ.setdefault("RAY_enable_metrics_collection", "0")


def pytest_collection_modifyitems(config, items):
    _ray_stop_last(items)
    if gpu_available():
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {gpu_unavailable_reason()}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _ray_stop_last(items):
    """Multi-node tests replace the session's embedded Ray with a ``Cluster``, and ``ray_stop``
    tests shut it down for a ``ray start`` head of their own: run them after everything else, in
    that order, so the embedded Ray starts once. A ``users_ray`` test, which looks at the
    user's Ray after the whole suite, runs at the very end."""

    def order(item) -> int:
        for rank, marker in ((3, "users_ray"), (2, "ray_stop"), (1, "cluster")):
            if marker in item.keywords:
                return rank
        return 0

    items.sort(key=order)


@pytest.fixture(scope="session", autouse=True)
def users_ray(request):
    """Where the session runs a ``users_ray`` test: the Ray a user runs on this machine, there
    before the first test (:func:`users_ray_up`), or None where no such test runs. Under
    pytest-xdist the controller brings it up before it hands out any test and takes it down
    after the last (:func:`pytest_xdist_node_collection_finished`); a worker reads it from the
    file the controller named."""
    shared = getattr(request.config, "workerinput", {}).get(USERS_RAY_KEY)
    if shared is not None:
        yield json.loads(Path(shared).read_text()) if Path(shared).exists() else None
        return
    if not any("users_ray" in item.keywords for item in request.session.items):
        yield None
        return
    with users_ray_up() as found:
        yield found


USERS_RAY_KEY = "raysinga_users_ray"  # the file an xdist controller writes the user's Ray to
USERS_RAY_TESTS = "test_users_ray.py::"  # in the node ids of the users_ray tests


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist's controller, before a worker starts: the file it will write the user's
    Ray to, should the tests collected include a ``users_ray`` one."""
    config = node.config
    if not hasattr(config, "_users_ray"):
        config._users_ray = contextlib.ExitStack()
        config._users_ray_file = Path(tempfile.mkdtemp(prefix="raysinga-users-ray-")) / "ray.json"
        config._users_ray.callback(shutil.rmtree, config._users_ray_file.parent, True)
    node.workerinput[USERS_RAY_KEY] = str(config._users_ray_file)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """pytest-xdist's controller, once a worker has collected and before any test is handed
    out: the user's Ray is brought up where a ``users_ray`` test will run."""
    config = node.config
    if config._users_ray_file.exists() or not any(USERS_RAY_TESTS in i for i in ids):
        return
    found = config._users_ray.enter_context(users_ray_up())
    config._users_ray_file.write_text(json.dumps(found))


def pytest_unconfigure(config):
    if hasattr(config, "_users_ray"):
        config._users_ray.close()


@contextlib.contextmanager
def users_ray_up():
    """The Ray a user runs on this machine. A ``ray start --head`` found through Ray's address
    file is used as it is; else one is started as a user starts it (Ray's default temporary
    directory, so its address file is written; the default port where free), and stopped
    on leaving. Yields its address and the pids of its GCS and raylet where started here."""
    address = _users_address()
    if address is not None:
        yield {"address": address, "daemons": []}
        return
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    port = 6379 if _port_free(6379) else free_port()
    cmd = ["start", "--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false"]
    p = subprocess.Popen(
        [sys.executable, "-c", "from ray.scripts.scripts import main; main()", *cmd],
        env={**env, "RAY_USAGE_STATS_ENABLED": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    out, _ = p.communicate(timeout=180)
    try:
        assert p.returncode == 0, f"ray start --head: {out}"
        daemons = [
            pid
            for pid in group_of(p.pid)
            if Path(f"/proc/{pid}/comm").read_text().strip() in ("gcs_server", "raylet")
        ]
        yield {"address": _users_address(), "daemons": daemons}
    finally:
        stop_group(p.pid)
        address_file = local_cluster_address_file()
        with contextlib.suppress(OSError):
            if Path(address_file).read_text().strip().endswith(f":{port}"):
                os.remove(address_file)  # what `ray stop` would have removed


def _users_address() -> str | None:
    """The address in Ray's address file, where something answers there."""
    with contextlib.suppress(OSError):
        text = Path(local_cluster_address_file()).read_text().strip()
        host, _, port = text.rpartition(":")
        if port.isdigit() and not _port_free(int(port), host or "127.0.0.1"):
            return text
    return None


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    import socket  # noqa: PLC0415

    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) != 0


@pytest.fixture
def ray_session():
    """The embedded Ray shared by the session (``ray.init`` costs seconds), started on first
    use. Eight logical CPUs, so topologies of up to four workers fit a two-core machine.

    After the test, every CPU must come back to the session (Ray frees a killed role's CPUs a
    moment after it is killed) before the next test asks for them. A test whose placement
    groups, actors or tasks keep holding CPUs fails, naming them. Where nothing holds them,
    Ray's own accounting lost them (Ray's raylet was seen to keep a CPU of a Tune trial ended
    while its process started, on a loaded machine; ray-project/ray#47531 reports the same):
    the test passes with a warning that says so. Either way the next test gets a Ray of its
    own."""
    ray = start_ray()
    yield ray
    if not ray.is_initialized():
        return
    held = cpus_held(ray, wait_s=CPU_RELEASE_S)
    if held is None:
        return
    ray.shutdown()  # the next test starts a whole one
    amount, holders = held
    if holders:
        pytest.fail(f"the test left Ray CPUs held: {amount}; {'; '.join(holders)}", pytrace=False)
    warnings.warn(
        f"Ray lost track of CPUs after this test: {amount}, and no placement group, actor or "
        "task of the session holds them (Ray's accounting); the session's Ray is restarted",
        stacklevel=1,
    )


CPU_RELEASE_S = 60.0  # how long a finished test's CPUs may take to come back


def cpus_held(ray, wait_s: float) -> tuple[str, list[str]] | None:
    """None once every CPU of the session's Ray is back (waiting up to ``wait_s`` seconds);
    else how many are in use, and what holds them: the placement groups not removed, the
    actors not dead (detached ones, which hold no CPU here, left out) and the Ray's worker
    processes that run a task or an actor other than those."""
    import time  # noqa: PLC0415

    deadline = time.monotonic() + wait_s
    while True:
        total = ray.cluster_resources().get("CPU", 0.0)
        free = ray.available_resources().get("CPU", 0.0)
        if free >= total:
            return None
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    from ray.util import placement_group_table  # noqa: PLC0415

    holders = [
        f"placement group {g.get('name') or g.get('placement_group_id')} ({g.get('state')})"
        for g in placement_group_table().values()
        if g.get("state") != "REMOVED"
    ]
    detached: set[int] = set()
    with contextlib.suppress(Exception):  # Ray's actor table (no public getter without a dashboard)
        from ray._private import state  # noqa: PLC0415

        for a in state.actors().values():
            if a.get("State") == "DEAD":
                continue
            if a.get("IsDetached"):
                detached.add(int(a.get("Pid") or 0))
            else:
                name, pid, st = a.get("ActorClassName"), a.get("Pid"), a.get("State")
                holders.append(f"actor {name} (pid {pid}, {st})")
    holders += [f"worker {w}" for pid, w in _session_workers(ray) if pid not in detached]
    return f"{total - free:g} of {total:g} in use {wait_s:g} s after it ended", holders


RAY_OWN = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")  # no task's


def _session_workers(ray) -> list[tuple[int, str]]:
    """The session's Ray worker processes (the raylet's children) that run a task or an actor,
    as (pid, process title): what holds CPUs when neither a group nor an actor does, such as a
    task whose caller went away."""
    try:
        from ray._private import ray_constants  # noqa: PLC0415

        node = ray._private.worker._global_node
        raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    except Exception:  # noqa: BLE001 - Ray's internals moved: none named
        return []
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if ppid == raylet and title.startswith("ray::") and not title.startswith(RAY_OWN):
                found.append((int(proc.name), f"{title} (pid {proc.name})"))
    return found


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs: a disk that fills up (skipped where mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        gc.collect()  # Checkpoints map their shards: let go of them before unmounting
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)


def _lab(root: Path):
    why = hosts.unavailable()
    if why:
        pytest.skip(why)
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()  # the session's embedded Ray: a session holds one cluster at a time
    return hosts.lab(root)


@pytest.fixture
def lab(tmp_path):
    """Emulated hosts (:mod:`hosts`): skipped, saying why, where they cannot be made; removed
    after the test, which fails if anything of them is left."""
    with _lab(tmp_path) as made:
        yield made


@pytest.fixture(scope="module")
def module_lab(tmp_path_factory):
    """:func:`lab` shared by a module's tests."""
    with _lab(tmp_path_factory.mktemp("lab")) as made:
        yield made


def pytest_sessionfinish(session, exitstatus):
    """After the whole suite, nothing of the emulated hosts it made is left: no namespace,
    interface, mount (they live in the hosts' namespaces) or process. Another session's labs,
    running meanwhile, are that one's to check."""
    if not hosts.LAB_IDS:
        return
    left = hosts.leftovers(tuple(sorted(hosts.LAB_IDS)), hosts.ALL_NAMESPACES)
    if left:
        print(f"\nthe suite's emulated hosts left: {'; '.join(left)}", file=sys.stderr)
        session.exitstatus = 1


@pytest.fixture(scope="module")
def s3():
    """(filesystem, port): an S3FileSystem talking to a real S3 server (moto's server mode) on
    127.0.0.1, with bucket ``S3_BUCKET``. Its requests are counted with :func:`s3_requests`."""
    pafs = pytest.importorskip("pyarrow.fs")
    server_mod = pytest.importorskip("moto.server")
    import logging  # noqa: PLC0415

    saved = {k: os.environ.get(k) for k in ("AWS_EC2_METADATA_DISABLED", "NO_PROXY", "no_proxy")}
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = "127.0.0.1"
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        _, port = server.get_host_and_port()
        opts = dict(
            endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1", **S3_KEYS
        )
        pafs.S3FileSystem(allow_bucket_creation=True, **opts).create_dir(S3_BUCKET)
        yield pafs.S3FileSystem(**opts), port
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def node_python(tmp_path_factory):
    """The Python of a node that has Ray and raysinga's dependencies but not raysinga."""
    return node_env(tmp_path_factory.mktemp("node-env"))
