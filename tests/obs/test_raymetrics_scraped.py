"""raysinga's metrics as Ray's own metrics endpoint exports them after a run, on a `ray start`
head of the test's own (Ray's metrics collected, reported every 10 s, Ray's default): each
role's counters at their totals once the run has ended, a run that ran well exporting no
divergence and no spares once ended, and a role replaced after a SIGKILL told from the one that
took its place. The driver is a process that lives on after its run (as a notebook's or a
tuner's does) until the test has read the endpoint.
(tests/cluster/test_metrics.py reads the metrics of a run on several hosts while it goes on.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import ray_start_cluster

pytestmark = [pytest.mark.slow, pytest.mark.ray_stop]

ROOT = Path(__file__).resolve().parents[2]
REPORT_S = 10.0  # Ray's default report interval: a process hands its agent what it recorded

# The run's driver: trains, prints what it did, then waits (its process alive, exporting the
# driver's metrics) until the test closes its stdin. ``kill_after_s``: at the first report that
# many seconds into training, SIGKILL worker 1 of group 0 (a spare takes its place).
DRIVER = """
import json, os, signal, sys, threading, time
import ray
from raysinga import config
from raysinga.distributed import DistributedTrainer
from raysinga.obs.events import Recovered, TrainStep

address, run_dir, kill_after_s, *sets = sys.argv[1:]
cfg = config.load({job!r}, [f"run_dir={{run_dir}}", *sets])
killed = []
def told(ev):
    if isinstance(ev, Recovered):
        print("@recovered " + json.dumps(ev.info), flush=True)
    if isinstance(ev, TrainStep) and float(kill_after_s) and not killed:
        killed.append(time.monotonic())
    elif isinstance(ev, TrainStep) and len(killed) == 1:
        if time.monotonic() - killed[0] > float(kill_after_s):
            pid = ray.get(trainer.workers[0][1].pid.remote())
            killed.append(pid)
            threading.Thread(target=os.kill, args=(pid, signal.SIGKILL)).start()
trainer = DistributedTrainer(cfg, address=address, fresh=True, on_event=told, log=None)
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


class Driver:
    """The driver's process, its output read as it comes (a full pipe would stall the run)."""

    def __init__(self, head, tmp_path: Path, name: str, kill_after_s: float, *sets: str) -> None:
        address, _, env = head
        code = DRIVER.format(job=str(ROOT / "examples" / "digits_mlp.yaml"))
        sets = (f"name={name}", "test_freq=0", *sets)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, address, str(tmp_path / name), str(kill_after_s), *sets],
            env={k: v for k, v in env.items() if k != "RAY_ADDRESS"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def said(self, marker: str, timeout_s: float = 300) -> str:
        """The rest of the driver's first line that starts with ``marker``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(marker):
                    return line[len(marker) :].strip()
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.2)
        raise AssertionError(f"no {marker!r} from the driver: {''.join(self.lines[-80:])}")

    def close(self) -> None:
        """The driver told to end (its run stopped as a scheduler stops one, if it goes on)."""
        if self.proc.poll() is None and not any(x.startswith("@ended") for x in self.lines):
            self.proc.send_signal(signal.SIGTERM)
            self.said("@ended ", timeout_s=120)
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.reader.join(timeout=10)


def test_after_a_run_every_roles_steps_counter_is_at_its_steps(head, tmp_path):
    """The roles are stopped at the run's end as soon as their last steps are taken: each one
    hands its agent what it recorded since its last report as it exits, so its counter ends
    at its steps (a role killed at once lost up to its last 10 s). A run that ran well
    exports no divergence and no spares ready once ended."""
    _, url, _ = head
    steps = 1500
    driver = Driver(head, tmp_path, "whole", 0, f"train_steps={steps}")
    try:
        ended = json.loads(driver.said("@ended "))
        assert ended == {"steps": steps}, ended
        # the roles' totals are there as they end; the driver, alive, reports every 10 s, and
        # its gauges only where it set them since its report before (the agent drops a gauge
        # not set for two reports): spares_ready as the run ended, once
        deadline = time.monotonic() + 3 * REPORT_S
        spares: list[float] = []
        while True:
            samples = scrape(url)
            counted = by_role(samples, "ray_raysinga_steps_total", "whole")
            spares += by_role(samples, "ray_raysinga_spares_ready", "whole").values()
            if counted.get(("driver", "", "")) == steps and spares[-1:] == [0.0]:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(1)
    finally:
        driver.close()
    want = {
        ("worker", "0", "0"): steps,
        ("worker", "1", "0"): steps,
        ("stub", "0", "0"): steps,
        ("server", "0", "0"): steps,  # its updates, by group
        ("driver", "", ""): steps,
    }
    assert counted == want
    diverged = by_role(samples, "ray_raysinga_divergence_events_total", "whole")
    assert diverged == {("driver", "", ""): 0.0}, diverged
    levels = {t["level"] for n, t, _ in samples if n == "ray_raysinga_divergence_events_total"}
    assert levels == {"diverged"}, levels
    assert spares[-1:] == [0.0], spares  # where the run's last report had 3


def test_a_replaced_roles_series_are_told_from_its_replacements(head, tmp_path):
    """Worker 1 SIGKILLed and a spare in its place: the killed process's counters stay where
    they were (Ray's agent keeps a counter of a process that ended, under its ``WorkerId``),
    and once the agent has dropped its gauges (two report intervals) no ``role_up`` stands
    beside them; every live role's process has ``role_up`` 1, the spare's as worker 1."""
    _, url, _ = head
    # killed once it has handed its agent its steps (every 10 s)
    driver = Driver(head, tmp_path, "replaced", 1.5 * REPORT_S, "train_steps=1000000")
    try:
        info = json.loads(driver.said("@recovered "))
        time.sleep(2 * REPORT_S + 5)
        first = scrape(url)
        time.sleep(REPORT_S + 2)
        second = scrape(url)
    finally:
        driver.close()

    def by_process(samples, name):
        return {
            t["WorkerId"]: ((t["role"], t["index"]), v)
            for n, t, v in samples
            if n == name and t.get("run") == "replaced"
        }

    steps, up = (
        by_process(second, "ray_raysinga_steps_total"),
        by_process(second, "ray_raysinga_role_up"),
    )
    assert info["role"] == "worker", info
    ended = {w: s for w, s in steps.items() if w not in up and s[0][0] != "driver"}
    assert [role for role, _ in ended.values()] == [("worker", "1")], (ended, up)
    (gone,) = ended
    assert by_process(first, "ray_raysinga_steps_total")[gone] == steps[gone]  # frozen
    live = sorted(role for role, v in up.values() if v == 1)
    assert live == [("server", "0"), ("stub", "0"), ("worker", "0"), ("worker", "1")], up
    for w, (role, _) in up.items():  # each live process steps on
        assert steps[w][1] > by_process(first, "ray_raysinga_steps_total")[w][1], (role, w)
