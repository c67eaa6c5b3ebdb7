"""Placing roles: which smaller topologies an elastic run tries, which fit the nodes, and where
a spare of a GPU role looks. Roles spread over several machines are tried on emulated hosts
(tests/cluster/test_role_loss.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from raysinga import config
from raysinga.actors.placement import packs, shrunk, spare_env, spawn_spare
from raysinga.config.topology import Resources, Topology

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def job(tmp_path, topology):
    return config.load(
        EXAMPLES / "digits_mlp.yaml",
        [
            "train_steps=30",
            "disp_freq=15",
            "test_freq=0",
            f"run_dir={tmp_path}",
            f"topology={topology}",
        ],
    )


def test_shrunk_lists_smaller_topologies_fewer_workers_first():
    t = Topology(preset="downpour", n_groups=2, workers_per_group=3)
    got = [(s.n_groups, s.workers_per_group) for s in shrunk(t, 1, 2)]
    assert got == [(2, 3), (2, 2), (1, 3), (1, 2)]
    assert shrunk(t, 2, 3) == [t]


def test_packs_checks_every_bundle_against_some_node():
    two = Topology(workers_per_group=2)  # two 1-CPU worker bundles; server and stub ride along
    assert packs(two, [{"CPU": 2.0}])
    assert packs(two, [{"CPU": 1.0}, {"CPU": 1.0}])
    assert not packs(two, [{"CPU": 1.0}, {"CPU": 0.5}])  # 1.5 CPUs, but no half bundles
    gpu = Topology(workers_per_group=2, worker=Resources(cpus=1, gpus=0.5))
    assert packs(gpu, [{"CPU": 2.0, "GPU": 1.0}])
    assert not packs(gpu, [{"CPU": 4.0}])
    own = Topology(workers_per_group=1, server=Resources(cpus=2))  # a server bundle of its own
    assert not packs(own, [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}])
    assert packs(own, [{"CPU": 1.0}, {"CPU": 2.0}])


class _Env:  # sent by value: a spare's process with an environment of its own is a new one
    def gpus(self) -> tuple[str | None, list]:
        import os

        import ray

        return os.environ.get("CUDA_VISIBLE_DEVICES"), ray.get_gpu_ids()


def test_a_spare_of_a_gpu_role_sees_the_gpus_it_is_given_and_holds_none(ray_session):
    """A spare holds no resources of Ray's; one standing in for a GPU role is handed the lost
    role's GPUs through its environment, which Ray leaves alone in a role given no GPU."""
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    node = ray.get_runtime_context().get_node_id()
    gpu_spare, cpu_spare = (spawn_spare(_Env, node, gpus=g) for g in ("3", None))
    try:
        assert ray.get(gpu_spare.gpus.remote()) == ("3", [])
        seen, held = ray.get(cpu_spare.gpus.remote())
        assert seen != "3" and held == []
    finally:
        for a in (gpu_spare, cpu_spare):
            ray.kill(a)


def test_a_gpu_spare_keeps_its_gpus_where_ray_blanks_them_in_a_role_without_gpus(ray_session):
    """Older Ray, and clusters that set RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1, blank
    CUDA_VISIBLE_DEVICES in a role given no GPU (G4 defect 4). Here the override is forced on
    over the spare's own environment: a plain role loses its variable, the spare keeps it."""
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    forced = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}
    envs = ({"CUDA_VISIBLE_DEVICES": "3", **forced}, {**spare_env("3"), **forced})
    actors = [
        ray.remote(_Env).options(num_cpus=0, runtime_env={"env_vars": e}).remote() for e in envs
    ]
    try:
        plain, spare = ray.get([a.gpus.remote() for a in actors])
        assert plain[0] != "3"  # the hazard is real in this Ray
        assert spare == ("3", [])
    finally:
        for a in actors:
            ray.kill(a)
