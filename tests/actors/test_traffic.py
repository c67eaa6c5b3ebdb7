"""The bytes a group's step moves between nodes, counted from what its roles hand one another
(:mod:`actors.exchange.traffic`). Held against the interfaces of emulated hosts in
``tests/cluster/test_traffic_hosts.py``."""

from __future__ import annotations

from raysinga.actors.exchange.traffic import (
    block_step_bytes,
    group_step_bytes,
    host_names,
    per_host,
)


def test_a_group_on_one_node_moves_nothing():
    assert group_step_bytes("a", ["a", "a"], [0, 0], ["a"], [0], [0]) == {}


def test_remote_workers_return_their_gradients_and_remote_servers_get_their_slices():
    # stub and server 0 on a; workers on a and b; server 1 on c
    moved = group_step_bytes("a", ["a", "b"], [0, 100], ["a", "c"], [0, 40], [60, 40])
    assert moved == {
        ("b", "a"): 100,  # worker 1's gradient snapshot to the stub
        ("a", "c"): 40,  # server 1's slices
        ("a", "b"): 60,  # server 0's published values, pulled to worker 1's node
        ("c", "a"): 40,  # server 1's values, to worker 0's node
        ("c", "b"): 40,  # and to worker 1's
    }


def test_published_values_cross_to_each_reading_node_once():
    # three workers on b read server 0 (on a): one pull to b, not three
    moved = group_step_bytes("b", ["b", "b", "b"], [0, 0, 0], ["a"], [50], [80])
    assert moved == {("b", "a"): 50, ("a", "b"): 80}


def test_per_host_is_the_mean_per_step_in_and_out_by_host_name():
    step = (("n1", "n2", 100), ("n2", "n1", 30))
    names = {"n1": "10.0.0.1", "n2": "10.0.0.2"}
    assert per_host([step, step, ()], names, 3) == {
        "10.0.0.1": {"in": 20, "out": 67},
        "10.0.0.2": {"in": 67, "out": 20},
    }
    assert per_host([], names, 0) == {}


def test_hosts_are_named_by_address_and_nodes_sharing_one_by_their_id_too():
    nodes = [
        {"NodeID": "aaaaaaaa11", "NodeManagerAddress": "10.0.0.1", "Alive": True},
        {"NodeID": "bbbbbbbb22", "NodeManagerAddress": "10.0.0.2", "Alive": True},
        {"NodeID": "cccccccc33", "NodeManagerAddress": "10.0.0.2", "Alive": True},
        {"NodeID": "dddddddd44", "NodeManagerAddress": "10.0.0.1", "Alive": False},  # replaced
    ]
    assert host_names(nodes) == {
        "aaaaaaaa11": "10.0.0.1",
        "bbbbbbbb22": "10.0.0.2/bbbbbbbb",
        "cccccccc33": "10.0.0.2/cccccccc",
        "dddddddd44": "10.0.0.1",
    }


def test_summed_by_hosts_each_host_moves_what_ring_allreduce_moves():
    """Four hosts, a block and a server on each, P = 400 bytes cut evenly: each host sends
    its sum's three other quarters and pulls the three other servers' values, and is sent
    as much: 2 (W-1)/W P = 600 each way, as ring allreduce."""
    nodes = ["a", "b", "c", "d"]
    moved = block_step_bytes(
        nodes, [[0], [1], [2], [3]], [0] * 4, nodes, [[100] * 4] * 4, [100] * 4
    )
    out = per_host([[(s, d, n) for (s, d), n in moved.items()]], {}, 1)
    assert out == {h: {"in": 600, "out": 600} for h in nodes}


def test_a_block_member_elsewhere_sends_its_gradient_to_its_leader():
    # block [0, 1]: worker 1 landed on c (a replacement); its leader and the server on a
    moved = block_step_bytes(["a", "c"], [[0, 1]], [0, 300], ["a"], [[200]], [200])
    assert moved == {("c", "a"): 300, ("a", "c"): 200}
