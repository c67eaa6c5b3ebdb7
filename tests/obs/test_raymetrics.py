"""raysinga's metrics through Ray's metrics agent (raysinga/obs/raymetrics.py), without Ray:
what each event of a run records, under which tags, and nothing at all where they are off.
(tests/cluster/test_metrics.py reads them off a cluster's nodes.)"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from raysinga.obs import raymetrics
from raysinga.obs.events import CheckpointCommitted, Notice, Recovered, RunStarted, TrainStep
from raysinga.run.divergence import EarlyLevel


class Fake:
    """A ``ray.util.metrics`` object that keeps what it is handed."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def inc(self, value, tags):
        self.calls.append((self.name, "inc", value, tags))

    def set(self, value, tags):
        self.calls.append((self.name, "set", value, tags))

    def observe(self, value, tags):
        self.calls.append((self.name, "observe", value, tags))

    def _record(self, value, tags):  # under Counter.inc, which refuses 0
        self.calls.append((self.name, "record", value, tags))


@pytest.fixture
def calls(monkeypatch):
    got: list = []
    monkeypatch.setattr(raymetrics, "_metric", lambda name: Fake(name, got))
    return got


def test_every_metric_is_declared_with_its_kind_and_tags():
    for name, (kind, doc, tags) in raymetrics.METRICS.items():
        assert kind in ("counter", "gauge", "histogram") and doc, name
        assert not set(tags) & set(raymetrics.BASE_TAGS), name


def test_a_roles_steps_are_tagged_by_run_role_index_and_group(calls):
    rec = raymetrics.Recorder("r", "worker", 1, 0)
    rec.step({"fetch": 0.5, "compute": 0.25})
    rec.ended()
    tags = {"run": "r", "role": "worker", "index": "1", "group": "0"}
    assert [c for c in calls if c[0] != "role_up"] == [
        ("phase_seconds", "observe", 0.5, {**tags, "phase": "fetch"}),
        ("phase_seconds", "observe", 0.25, {**tags, "phase": "compute"}),
        ("steps", "inc", 1.0, tags),
    ]
    up = [c for c in calls if c[0] == "role_up"]
    assert up[0] == ("role_up", "set", 1.0, tags) and up[-1] == ("role_up", "set", 0.0, tags)


def test_a_step_kept_for_later_is_recorded_at_the_flush_as_it_would_have_been(calls):
    """A role on doorbells records its step after ringing it done (``later``, then ``flush``):
    nothing before the flush, then what :meth:`step` records, in the order kept."""

    def steps() -> list:  # role_up comes from a thread of its own, at its own time
        return [c for c in calls if c[0] != "role_up"]

    now, kept = raymetrics.Recorder("r", "server", 0), raymetrics.Recorder("r", "server", 0)
    now.step({"update": 0.5}, group=1)
    now.step({"update": 0.25}, group=2)
    expected = steps()
    now.ended()
    calls.clear()
    kept.later({"update": 0.5}, group=1)
    kept.later({"update": 0.25}, group=2)
    assert calls == []
    kept.flush()
    kept.flush()  # nothing twice
    assert steps() == expected and len(expected) == 4
    kept.ended()


def test_a_role_is_up_from_its_first_step_while_it_lives_and_down_as_it_ends(calls):
    """Ray's agent drops a gauge its process did not set for two report intervals: role_up is
    set again every second; a spare (no step yet) is not up; a spare that takes a lost
    worker's place records as that worker."""
    spare = raymetrics.Recorder("r", "worker", 0, 0)
    assert not calls
    spare.adopt(1)
    spare.step({"compute": 0.1})
    t0 = time.monotonic()
    while sum(c[0] == "role_up" for c in calls) < 3 and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    spare.ended()
    spare.ended()  # again at the process's exit: nothing more
    time.sleep(1.5 * raymetrics.UP_EVERY_S)
    up = [(c[2], c[3]["index"]) for c in calls if c[0] == "role_up"]
    assert up[:3] == [(1.0, "1")] * 3 and up[3:] == [(0.0, "1")], up
    assert time.monotonic() - t0 >= 1.9 * raymetrics.UP_EVERY_S  # every second, not at once
    assert {c[3]["index"] for c in calls} == {"1"}


def test_a_groups_steps_record_their_phases_and_bytes_by_route(calls):
    rec = raymetrics.Recorder("r", "stub", 0, 0)
    step = dict(fetch=1.0, compute=2.0, gather=3.0, average=4.0, update=5.0)
    records = [SimpleNamespace(**step, traffic=(("n1", "n2", 100), ("n2", "n1", 40)))] * 2
    rec.steps(records, {"n1": "198.18.0.3", "n2": "198.18.0.4"}.get)
    wire = [(c[2], c[3]["host"], c[3]["peer"]) for c in calls if c[0] == "wire_bytes"]
    assert wire == [(100.0, "198.18.0.3", "198.18.0.4"), (40.0, "198.18.0.4", "198.18.0.3")] * 2
    phases = [c[3]["phase"] for c in calls if c[0] == "phase_seconds"]
    assert phases == list(step) * 2
    assert ("steps", "inc", 2.0) == calls[-1][:3]


def test_the_runs_events_become_its_metrics(calls):
    seen = raymetrics.RunMetrics("r", spares=lambda: 3)
    seen(RunStarted("r", "Ray", 100, 20))
    seen(EarlyLevel(23, 2.3))  # the guard's early level: a healthy run's, no event of its own
    seen(TrainStep(40, 100, 1, 0.5, 0.1, 1000.0))
    seen(CheckpointCommitted(40, "/x", 0.01, 0.2, True))
    info = {"recovery": "replaced", "role": "worker", "detection_s": 0.5, "restore_s": 0.25}
    seen(Recovered(info))
    seen(Notice("nothing to record"))
    healthy = [c for c in calls if c[0] == "divergence_events"]
    seen.diverged()
    seen.ended()
    got = {(c[0], c[1]): (c[2], c[3]) for c in calls}
    base = {"run": "r", "role": "driver", "index": "", "group": ""}
    assert got[("loss", "set")] == (0.5, base)
    assert got[("samples_per_second", "set")] == (1000.0, base)
    assert got[("steps", "inc")] == (20.0, base)  # from where the run started
    assert [c[2] for c in calls if c[0] == "spares_ready"] == [3.0, 0.0]  # none once ended
    assert got[("checkpoints", "inc")] == (1.0, base)
    assert got[("checkpoint_seconds", "observe")] == (0.2, base)
    assert got[("recoveries", "inc")] == (1.0, {**base, "kind": "replaced", "lost": "worker"})
    assert got[("recovery_seconds", "observe")] == (0.75, {**base, "kind": "replaced"})
    diverged = {**base, "level": "diverged"}
    assert healthy == [("divergence_events", "record", 0.0, diverged)]  # 0 from the start
    assert got[("divergence_events", "inc")] == (1.0, diverged)


def test_off_records_nothing(calls):
    rec = raymetrics.Recorder(None, "worker", 0, 0)
    rec.step({"compute": 1.0})
    rec.inc("steps")
    rec.checkpoint(1.0, 10)
    assert calls == [] and not rec.on


def test_the_grafana_dashboard_is_built_only_from_these_metrics():
    import json
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
    dash = json.loads(doc.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = set()
    for e in exprs:
        for m in re.finditer(r"ray_raysinga_(\w+)", e):
            name = re.sub(r"_(total|bucket|count|sum)$", "", m.group(1))
            assert name in raymetrics.METRICS, (name, e)
            kind = raymetrics.METRICS[name][0]
            assert m.group(1).endswith("_total") == (kind == "counter"), e
            assert m.group(1).endswith("_bucket") <= (kind == "histogram"), e
            used.add(name)
    assert used == set(raymetrics.METRICS)  # every metric has a panel
    assert all('run=~"$run"' in e for e in exprs)


# A run's phases as Ray's agent exported them, in quarter-decade buckets (examples/digits_mlp.yaml
# on a `ray start` head, two loaded cores, 3000 steps): each one's median and 95th percentile,
# in seconds, taken as the geometric middle of the bucket that held it
MEASURED = {
    "worker fetch": (4.2e-5, 7.5e-5),
    "worker compute": (7.5e-4, 4.2e-3),
    "server update": (4.2e-4, 7.5e-4),
    "stub fetch": (4.2e-5, 1.3e-4),
    "stub gather": (7.5e-4, 4.2e-3),
}


def bucket(seconds: float) -> int:
    """The bucket that counts ``seconds`` (Prometheus's ``le``: at most its bound)."""
    return next(
        (i for i, b in enumerate(raymetrics.SECONDS) if seconds <= b), len(raymetrics.SECONDS)
    )


def midpoint(i: int) -> float:
    """Where Ray's agent counts an observation of bucket ``i``, as it rebuilds the histogram
    from the bucket counts a process hands it (OpenTelemetryMetricRecorder, Ray 2.60: half the
    first bound; the middle of two bounds; twice the last bound past it)."""
    b = raymetrics.SECONDS
    return b[0] / 2 if i == 0 else (b[i - 1] + b[i]) / 2 if i < len(b) else 2 * b[-1]


def test_the_buckets_separate_fast_phases_from_slow_and_a_median_from_its_tail():
    for phase, (p50, p95) in MEASURED.items():
        assert bucket(p50) < bucket(p95), phase  # histogram_quantile tells them apart
    assert bucket(MEASURED["worker fetch"][1]) < bucket(MEASURED["worker compute"][0])
    assert bucket(MEASURED["server update"][0]) < bucket(MEASURED["worker compute"][0])


def test_an_observation_is_counted_within_the_bounds_docs_observe_md_gives():
    """docs/observe.md: from 10 us to 20 s Ray's agent counts an observation between 0.7 and
    1.75 times itself (so a mean from _sum / _count is as good); a worker's fetch of 0.04 ms
    was counted as 0.5 ms with buckets from 1 ms."""
    assert raymetrics.SECONDS[0] == 1e-5 and 20 in raymetrics.SECONDS
    for lo, hi in zip(raymetrics.SECONDS, raymetrics.SECONDS[1:], strict=False):
        if hi <= 20:
            at = midpoint(bucket(hi))
            assert 0.7 - 1e-9 <= at / hi and at / lo <= 1.75 + 1e-9, (lo, hi)
    assert 0.7 <= midpoint(bucket(4e-5)) / 4e-5 <= 1.75


def drawn_in(expr: str) -> str | None:
    """The unit of what a panel's query draws: seconds, bytes or bytes per second; None for a
    count, a rate of steps or a loss (any unit but those)."""
    if "_seconds_bucket" in expr:
        return "s"
    if "_bytes_total" in expr:
        return "Bps" if "rate(" in expr else "bytes"
    return None


def test_each_panel_draws_each_series_in_its_own_unit_on_an_axis_of_that_unit():
    """A panel whose series differ in unit gives each its unit, its axis and the axis's label
    (one override per series): Grafana draws one axis per unit."""
    import json
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
    for panel in json.loads(doc.read_text())["panels"]:
        config = panel["fieldConfig"]
        default = config["defaults"].get("unit")
        overrides = {
            o["matcher"]["options"]: {p["id"]: p["value"] for p in o["properties"]}
            for o in config["overrides"]
            if o["matcher"]["id"] == "byFrameRefID"
        }
        units = {}
        for t in panel["targets"]:
            unit = overrides.get(t["refId"], {}).get("unit", default)
            want = drawn_in(t["expr"])
            if want is not None:
                assert unit == want, (panel["title"], t["refId"], unit)
            else:
                assert unit not in ("s", "bytes", "Bps"), (panel["title"], t["refId"], unit)
            units[t["refId"]] = unit
        if len(set(units.values())) > 1:
            for ref in units:
                set_here = overrides.get(ref, {})
                assert {"unit", "custom.axisPlacement", "custom.axisLabel"} <= set(set_here), (
                    panel["title"],
                    ref,
                )
