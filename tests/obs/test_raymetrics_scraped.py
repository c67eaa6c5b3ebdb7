"""raysinga's metrics as Ray's own metrics endpoint exports them after a run, on a `ray start`
head of the test's own (Ray's metrics collected, reported every 10 s, Ray's default): each
role's counters at their totals once the run has ended. The driver is a process that lives on
after its run (as a notebook's or a tuner's does) until the test has read the endpoint.
(tests/cluster/test_metrics.py reads the metrics of a run on several hosts while it goes on.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import ray_start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.ray_stop]

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
REPORT_S = 10.0  # Ray's default report interval: a process hands its agent what it recorded

# The run's driver: trains, prints what it did, then waits (its process alive, exporting the
# driver's metrics) until the test closes its stdin. ``kill_at``: SIGKILL worker 1 of group 0
# at that step (a spare takes its place).
DRIVER = """
import json, signal, sys
sys.path.insert(0, {tests!r})
from helpers import signal_worker_at
from raysinga import config
from raysinga.distributed import DistributedTrainer
from raysinga.obs.events import Recovered

address, run_dir, kill_at, *sets = sys.argv[1:]
cfg = config.load({job!r}, [f"run_dir={{run_dir}}", *sets])
def told(ev):
    if isinstance(ev, Recovered):
        print("@recovered " + json.dumps(ev.info), flush=True)
trainer = DistributedTrainer(cfg, address=address, fresh=True, on_event=told, log=None)
if int(kill_at):
    signal_worker_at(trainer, int(kill_at), signal.SIGKILL)
try:
    result = trainer.fit()
    step = max(r["step"] for r in result.history if r["kind"] == "train")
    print("@ended " + json.dumps({{"steps": step}}), flush=True)
except BaseException as e:  # stopped by the test's SIGTERM
    print("@ended " + json.dumps({{"stopped": type(e).__name__}}), flush=True)
sys.stdin.readline()
"""
SAMPLE = re.compile(r"^(?P<name>ray_raysinga_\w+)\{(?P<tags>.*)\} (?P<value>\S+)$")


@pytest.fixture(scope="module")
def head():
    """A head with room for the digits job and its spares, Ray's metrics on; its metrics
    endpoint's URL (as Ray publishes it) and the environment of a driver that joins it."""
    import ray

    ray.shutdown()  # two Rays at once are too much for two cores; later tests restart it
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "RAY_enable_metrics_collection": "1",
    }
    with ray_start_cluster([], env, head_cpus=4) as (address, _, _):
        env = {**env, "RAY_AUTH_MODE": "token"}  # a driver joins with `ray start`'s token
        nodes = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import json, ray; ray.init(address={address!r}, log_to_driver=False); "
                "print(json.dumps(ray.nodes()))",
            ],
            env={k: v for k, v in env.items() if k != "RAY_ADDRESS"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert nodes.returncode == 0, nodes.stderr
        (node,) = json.loads(nodes.stdout.splitlines()[-1])
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        yield address, url, env


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """raysinga's samples on the endpoint: (name, tags, value)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            tags = dict(re.findall(r'(\w+)="([^"]*)"', m.group("tags")))
            out.append((m.group("name"), tags, float(m.group("value"))))
    return out


def by_role(samples, name: str, run: str) -> dict[tuple[str, str, str], float]:
    """``name``'s samples of ``run`` summed by role, index and group (over Ray's
    ``WorkerId``: each process exports its own series)."""
    out: dict[tuple[str, str, str], float] = {}
    for n, t, v in samples:
        if n == name and t.get("run") == run:
            key = (t["role"], t["index"], t["group"])
            out[key] = out.get(key, 0.0) + v
    return out


def start(head, tmp_path: Path, name: str, kill_at: int, *sets: str) -> subprocess.Popen:
    address, _, env = head
    code = DRIVER.format(tests=str(TESTS), job=str(ROOT / "examples" / "digits_mlp.yaml"))
    sets = (f"name={name}", "test_freq=0", *sets)
    return subprocess.Popen(
        [sys.executable, "-c", code, address, str(tmp_path / name), str(kill_at), *sets],
        env={k: v for k, v in env.items() if k != "RAY_ADDRESS"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )


def wait_for(driver: subprocess.Popen, marker: str, timeout_s: float = 300) -> str:
    """The driver's line that starts with ``marker`` (its output so far, on a failure)."""
    seen = []
    deadline = time.monotonic() + timeout_s
    for line in driver.stdout:
        seen.append(line)
        if line.startswith(marker):
            return line[len(marker) :].strip()
        assert time.monotonic() < deadline, "".join(seen[-50:])
    raise AssertionError(f"the driver ended before {marker}: {''.join(seen[-80:])}")


def done(driver: subprocess.Popen) -> None:
    driver.stdin.close()
    driver.wait(timeout=120)


def test_after_a_run_every_roles_steps_counter_is_at_its_steps(head, tmp_path):
    """The roles are stopped at the run's end as soon as their last steps are taken: each one
    hands its agent what it recorded since its last report as it exits, so its counter ends
    at its steps (a role killed at once lost up to its last 10 s)."""
    _, url, _ = head
    steps = 1500
    driver = start(head, tmp_path, "whole", 0, f"train_steps={steps}")
    try:
        ended = json.loads(wait_for(driver, "@ended "))
        assert ended == {"steps": steps}, ended
        # the roles' totals are there as they end; the driver, alive, reports every 10 s
        deadline = time.monotonic() + 3 * REPORT_S
        while True:
            samples = scrape(url)
            counted = by_role(samples, "ray_raysinga_steps_total", "whole")
            if counted.get(("driver", "", "")) == steps or time.monotonic() > deadline:
                break
            time.sleep(1)
    finally:
        done(driver)
    want = {
        ("worker", "0", "0"): steps,
        ("worker", "1", "0"): steps,
        ("stub", "0", "0"): steps,
        ("server", "0", "0"): steps,  # its updates, by group
        ("driver", "", ""): steps,
    }
    assert counted == want
