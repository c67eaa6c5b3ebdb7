"""raysinga's metrics where a Ray cluster's operators look ([O]): a run on a `ray start` cluster
of emulated hosts (tests/hosts.py) records them through ``ray.util.metrics``, and the metrics
agent of every node exports them (each node's address and port as Ray publishes them). Read
off those endpoints while the run goes on: each role's series on the node it runs on, tagged by
run, role, index and group; counters that move; and after a worker SIGKILLed on its host, the
recovery counter up by one."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import hosts
import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

JOB = """
name: metered
seed: 4
model:
  input_shape: [64]
  layers:
    - {kind: dense, name: fc1, units: 64, activation: relu}
    - {kind: dense, name: out, units: 10}
data: {source: {kind: digits}, batch_size: 32}
updater: {name: sgd, lr: 0.05, momentum: 0.9}
train_steps: 100000
disp_freq: 100
test_freq: 0
checkpoint_frequency: 500
topology: {preset: sandblaster, n_servers: 1, workers_per_group: 2}
"""
# Ray's metrics collected (the emulated hosts turn it off for every other test), every node's
# agent exporting what it was handed every second (Ray's default: 10 s)
FAST = {"RAY_enable_metrics_collection": "1", "RAY_metrics_report_interval_ms": "1000"}

# Run in the head: every node's metrics endpoint, as Ray publishes it, read; raysinga's samples.
SCRAPE = """
import json, urllib.request, ray
ray.init(address="{address}", log_to_driver=False)
out = {{}}
for n in ray.nodes():
    if not n["Alive"]:
        continue
    url = "http://%s:%d/metrics" % (n["NodeManagerAddress"], n["MetricsExportPort"])
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out[n["NodeManagerAddress"]] = [
        l for l in text.splitlines() if l.startswith("ray_raysinga_")
    ]
print("@scraped " + json.dumps(out))
"""
SAMPLE = re.compile(r"^(?P<name>\w+)\{(?P<tags>.*)\} (?P<value>\S+)$")


def samples(lines: list[str]) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in lines:
        m = SAMPLE.match(line)
        if m:
            tags = dict(re.findall(r'(\w+)="([^"]*)"', m.group("tags")))
            out.append((m.group("name"), tags, float(m.group("value"))))
    return out


def scrape(head) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    r = head.python(SCRAPE.format(address=f"{head.address}:6379"), env=FAST, timeout=120)
    lines = [x for x in r.stdout.splitlines() if x.startswith("@scraped ")]
    assert lines, r.stdout
    line = lines[0]
    return {node: samples(lines) for node, lines in json.loads(line[9:]).items()}


def total(scraped: dict, name: str, **tags: str) -> float:
    """The sum of ``name``'s samples over every node whose tags include ``tags``."""
    return sum(
        v
        for rows in scraped.values()
        for n, t, v in rows
        if n == name and all(t.get(k) == want for k, want in tags.items())
    )


@pytest.fixture(scope="module")
def cluster(module_lab):
    """A head that holds no role (the driver runs there) and two 1-CPU hosts: the group's two
    workers need both. Ray's metrics exported every second."""
    made = hosts.ray_cluster(module_lab, [0, 1, 1], env=FAST)
    made[0].path("/mnt/shared/job.yaml").write_text(JOB)
    return made


def stop(head) -> None:
    """The run's driver stopped as a scheduler stops it (SIGTERM): it checkpoints and ends."""
    head.run(["pkill", "-TERM", "-f", "raysinga train"])


def steps_of(run, out: list[str]) -> Iterator[int]:
    """Each progress line's step, as the run prints it (every line kept in ``out``)."""
    for line in run.stdout:
        out.append(line)
        words = line.split()
        if words[:1] == ["step"] and "/" in words[1]:
            yield int(words[1].split("/")[0])


def recovered(head, tries: int = 5) -> dict:
    """A reading once the recovery's count is exported (the driver counts it as it writes the
    record; its node's agent exports it within a report or two), or the last of ``tries``."""
    for _ in range(tries):
        got = scrape(head)
        if total(got, "ray_raysinga_recoveries_total") > 0:
            break
        time.sleep(2)
    return got


def test_every_node_exports_the_runs_metrics_and_a_recovery_counts_once(cluster):
    head, *nodes = cluster
    args = ["raysinga", "train", "/mnt/shared/job.yaml", "--address", f"{head.address}:6379"]
    run = head.popen([*args, "--set", "run_dir=/mnt/shared/metered"], env=FAST)
    metrics = head.path("/mnt/shared/metered/metrics.jsonl")
    seen: list[dict] = []
    killed, out, read = None, [], 0.0
    for step in steps_of(run, out):
        # two readings while the run steps, the second some reports and seconds after the first
        # ended: the lines come through a pipe, so those read just after a reading may be old,
        # and an agent exports what it was handed once a second
        if (step >= 600 and not seen) or (len(seen) == 1 and time.monotonic() - read > 5):
            seen.append(scrape(head))
            read = time.monotonic()
        elif len(seen) == 2 and killed is None:
            placed = hosts.placed_roles(head, nodes)
            killed = next(r for r in placed if r["cls"] == "Worker")
            hosts.sigkill_role(nodes, killed)
        elif killed is not None and len(seen) == 2 and '"failure"' in metrics.read_text():
            seen.append(recovered(head))  # recovered and stepping again
            stop(head)
    run.wait(timeout=600)
    text = "".join(out)
    assert len(seen) == 3 and killed is not None, (len(seen), killed, text[-3000:])
    assert run.returncode == 128 + 15, (run.returncode, text[-3000:])  # stopped by SIGTERM
    first, before, after = seen
    report = json.dumps({k: [s for s in v if "_bucket" not in s[0]] for k, v in first.items()})
    run_tags = {"run": "metered"}
    # each role's series on its own node: the workers' on the two hosts, tagged by index
    for w in ("0", "1"):
        where = [
            node
            for node, rows in first.items()
            for n, t, _ in rows
            if n == "ray_raysinga_steps_total" and t.get("role") == "worker" and t["index"] == w
        ]
        assert len(set(where)) == 1 and where[0] in {h.address for h in nodes}, report
    w_steps = total(first, "ray_raysinga_steps_total", role="worker", **run_tags)
    assert w_steps >= 2 * 150, report  # both workers, most of 200 steps each
    for role in ("server", "stub", "driver"):
        assert total(first, "ray_raysinga_steps_total", role=role, **run_tags) > 0, (role, report)
    compute = total(first, "ray_raysinga_phase_seconds_count", role="worker", phase="compute")
    assert compute >= w_steps * 0.9, report  # one observation per step
    assert total(first, "ray_raysinga_phase_seconds_count", role="stub", phase="update") > 0
    # gauges: a node's agent drops one its process has not exported for two report intervals
    # (Ray's gauge TTL), which a loaded host can miss: seen in one of the readings
    for gauge in ("loss", "samples_per_second"):
        got = [total(s, f"ray_raysinga_{gauge}", role="driver", **run_tags) for s in seen]
        assert max(got) > 0, (gauge, got, report)
    # checkpoints every 500 steps: committed in the background, counted by the time of the last
    assert total(after, "ray_raysinga_checkpoints_total", role="driver") >= 1, report
    assert total(after, "ray_raysinga_checkpoint_seconds_count", role="server") >= 1, report
    assert total(after, "ray_raysinga_checkpoint_bytes_total", role="server") > 0, report
    assert total(first, "ray_raysinga_wire_bytes_total", role="stub") > 0, report
    # values that move
    for role in ("worker", "stub", "driver"):
        a = total(first, "ray_raysinga_steps_total", role=role)
        b = total(before, "ray_raysinga_steps_total", role=role)
        assert b > a, (role, a, b)
    # the recovery counted once, by how, with its duration
    assert total(before, "ray_raysinga_recoveries_total") == 0
    assert total(after, "ray_raysinga_recoveries_total", lost="worker") == 1, text
    assert total(after, "ray_raysinga_recovery_seconds_count") == 1
    lines = head.path("/mnt/shared/metered/metrics.jsonl").read_text().splitlines()
    (ev,) = [r for r in map(json.loads, lines) if r["kind"] == "failure"]
    kind = ev["recovery"]
    assert total(after, "ray_raysinga_recoveries_total", kind=kind) == 1, (kind, text)


def test_metrics_ray_false_records_none(cluster):
    head, *_ = cluster
    args = ["raysinga", "train", "/mnt/shared/job.yaml", "--address", f"{head.address}:6379"]
    sets = ["run_dir=/mnt/shared/unmetered", "name=unmetered", "metrics.ray=false"]
    run = head.popen([*args, *(x for s in sets for x in ("--set", s))], env=FAST)
    scraped, out = None, []
    for step in steps_of(run, out):
        if step >= 600 and scraped is None:
            scraped = scrape(head)
            stop(head)
    run.wait(timeout=600)
    assert run.returncode == 128 + 15 and scraped is not None, "".join(out)
    names = {t.get("run") for rows in scraped.values() for _, t, _ in rows}
    assert "unmetered" not in names and names, names  # (the first test's run is there)
