"""Session-wide test setup: the suite's own Ray, skipping `gpu` tests where no GPU is usable,
the order of tests that replace the session's Ray, and the fixtures tests share. Helpers that
are not fixtures live in ``helpers.py``."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    S3_BUCKET,
    S3_KEYS,
    free_port,
    group_of,
    local_cluster,
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
    before the first test. A ``ray start --head`` found through Ray's address file is used as it
    is; else one is started as a user starts it (Ray's default temporary directory, so its
    address file is written; the default port where free), and stopped after the session.
    Yields its address and the pids of its GCS and raylet where started here, or None where
    no such test runs."""
    if not any("users_ray" in item.keywords for item in request.session.items):
        yield None
        return
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
    moment after it is killed) before the next test asks for them: a test whose actors or
    placement groups keep holding CPUs fails, naming what holds them, and the session's Ray is
    started again for the next test."""
    ray = start_ray()
    yield ray
    if ray.is_initialized():
        held = cpus_held(ray, wait_s=CPU_RELEASE_S)
        if held:
            # the next test gets a whole Ray of its own: one leak fails one test
            ray.shutdown()
            pytest.fail(f"the test left Ray CPUs held: {held}", pytrace=False)


CPU_RELEASE_S = 60.0  # how long a finished test's CPUs may take to come back


def cpus_held(ray, wait_s: float) -> str:
    """What still holds CPUs of the session's Ray after ``wait_s`` seconds ("" once none is):
    the CPUs in use, the placement groups not removed and the actors not dead (detached ones,
    which hold no CPU here, left out)."""
    import time  # noqa: PLC0415

    deadline = time.monotonic() + wait_s
    while True:
        total = ray.cluster_resources().get("CPU", 0.0)
        free = ray.available_resources().get("CPU", 0.0)
        if free >= total or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if free >= total:
        return ""
    from ray.util import placement_group_table  # noqa: PLC0415

    groups = [
        f"{g.get('name') or g.get('placement_group_id')} ({g.get('state')})"
        for g in placement_group_table().values()
        if g.get("state") != "REMOVED"
    ]
    actors = []
    with contextlib.suppress(Exception):  # Ray's actor table (no public getter without a dashboard)
        from ray._private import state  # noqa: PLC0415

        for a in state.actors().values():
            if a.get("State") != "DEAD" and not a.get("IsDetached"):
                actors.append(f"{a.get('ActorClassName')} (pid {a.get('Pid')}, {a.get('State')})")
    return (
        f"{total - free:g} of {total:g} CPUs in use {wait_s:g} s after it ended; placement "
        f"groups {groups or 'none'}; live actors {actors or 'none'}; Ray workers busy here "
        f"{_busy_workers() or 'none'}"
    )


RAY_OWN = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")  # not a task's


def _busy_workers() -> list[str]:
    """This machine's Ray worker processes that run a task or an actor (their process titles:
    ``ray::IDLE`` for a pooled worker), with their pids: what holds CPUs when neither a group
    nor an actor does, such as a task whose caller went away."""
    busy = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if title.startswith("ray::") and not title.startswith(RAY_OWN):
                busy.append(f"{title} (pid {proc.name})")
    return busy


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


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head with no CPUs and two 2-CPU nodes."""
    with local_cluster(2, 2) as c:
        yield c


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
