"""Topology validation and parameter slicing (no Ray needed)."""

from __future__ import annotations

import pytest

from raysinga.actors.common.slicing import plan_slices, server_loads
from raysinga.config.topology import Topology, TopologyError

MLP = {
    "fc1/W": (784, 1024),
    "fc1/b": (1024,),
    "fc2/W": (1024, 1024),
    "fc2/b": (1024,),
    "out/W": (1024, 10),
    "out/b": (10,),
}


@pytest.mark.parametrize(
    "d,match",
    [
        ({"n_servers": 0}, r"topology.n_servers: expected an integer >= 1, got 0"),
        ({"workers_per_group": -2}, r"topology.workers_per_group"),
        ({"n_groups": 2.5}, r"topology.n_groups"),
        ({"preset": "ring"}, r"topology.preset: expected one of sandblaster, downpour"),
        ({"preset": "sandblaster", "n_groups": 2}, r"sandblaster preset has exactly one group"),
        ({"preset": "hogwild", "n_groups": 2, "workers_per_group": 2}, r"one worker per group"),
        ({"preset": "allreduce", "workers_per_group": 2, "n_servers": 1}, r"must equal"),
        ({"staleness": -1}, r"topology.staleness"),
        ({"preset": "hogwild", "n_groups": 2, "staleness": 2}, r"only the downpour preset bounds"),
        ({"staleness": 1}, r"topology.staleness: only the downpour .*one synchronous group"),
        ({"worker": {"cpus": 0}}, r"topology.worker: a worker must reserve"),
        ({"worker": {"cores": 1}}, r"topology.worker: expected a mapping of cpus"),
        ({"servers": 2}, r"topology: unknown key\(s\) \['servers'\]"),
    ],
)
def test_impossible_topologies_are_refused_with_the_key(d, match):
    with pytest.raises(TopologyError, match=match):
        Topology.from_dict(d)


def test_presets_and_totals():
    t = Topology.from_dict({"preset": "allreduce", "workers_per_group": 3})
    assert t.n_servers == 3 and t.synchronous
    d = Topology.from_dict(
        {"preset": "downpour", "n_groups": 2, "workers_per_group": 2, "server": {"cpus": 1}}
    )
    assert d.n_workers == 4 and not d.synchronous
    assert d.total() == {"CPU": 5.0}


def test_a_partial_resource_mapping_keeps_the_roles_defaults_for_the_rest():
    """A server or stub given only GPUs reserves no CPU (as one given nothing); a worker given
    only GPUs keeps its one CPU."""
    t = Topology.from_dict(
        {"server": {"gpus": 0.25}, "stub": {"memory": 1 << 20}, "worker": {"gpus": 0.5}}
    )
    assert (t.server.cpus, t.server.gpus) == (0.0, 0.25)
    assert (t.stub.cpus, t.stub.memory) == (0.0, 1 << 20)
    assert (t.worker.cpus, t.worker.gpus) == (1.0, 0.5)
    assert t.total() == {"CPU": 1.0, "GPU": 0.75, "memory": float(1 << 20)}


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
def test_slices_cover_every_parameter_once_and_balance_bytes(m):
    slices = plan_slices(MLP, 4, m, 1 << 20)
    for name, shape in MLP.items():
        pieces = sorted((s for s in slices if s.param == name), key=lambda s: s.start)
        assert pieces[0].start == 0 and pieces[-1].stop == __import__("math").prod(shape)
        assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:], strict=False))
        assert len({s.server for s in pieces}) == len(pieces)  # one piece per server
    loads = server_loads(slices, 4, m)
    assert max(loads) <= 1.05 * sum(loads) / m + 4 * 1024 * 10


def test_small_parameters_are_never_cut_and_plans_are_deterministic():
    slices = plan_slices(MLP, 4, 3, 64 << 20)
    assert len(slices) == len(MLP)
    assert slices == plan_slices(MLP, 4, 3, 64 << 20)
