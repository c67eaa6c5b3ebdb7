"""The distributed trainer: servers, worker groups and stubs as Ray actors, driven from here.

The driver never touches parameters or gradients: servers create and update them, workers read
them in place, stubs sum gradients. The driver hands each group a chunk of steps, keeps groups
within the staleness bound, asks a worker to evaluate, reports progress, and tears everything
down on success, failure or Ctrl-C.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .actors import cluster
from .actors.errors import get_all
from .actors.server import ParamServer
from .actors.slicing import plan_slices
from .actors.stub import Stub
from .actors.worker import Worker
from .config import JobConfig
from .data import load_dataset
from .model import Net
from .optim import make_optimizer
from .trainer import MetricsLog, TrainResult, _check_fits, _format

ROLE_CLASSES = {"server": ParamServer, "worker": Worker, "stub": Stub}


class DistributedTrainer:
    """Runs a :class:`JobConfig` on a Ray cluster with the config's topology."""

    def __init__(
        self,
        cfg: JobConfig,
        log: Callable[[str], None] = print,
        classes: dict[str, type] | None = None,
        address: str | None = None,
    ) -> None:
        self.cfg, self.log, self.address = cfg, log, address
        self.topo = cfg.topology
        self.classes = {**ROLE_CLASSES, **(classes or {})}
        self.net = Net(cfg.model, dtype=cfg.dtype)
        train = load_dataset(cfg.data.source, split="train")
        _check_fits(self.net, train)
        self.n_train = len(train)
        if cfg.data.batch_size < self.topo.workers_per_group:
            raise ValueError(
                f"data.batch_size {cfg.data.batch_size} is smaller than "
                f"topology.workers_per_group {self.topo.workers_per_group}"
            )
        self.shapes = self.net.param_shapes()
        self.updater = {k: v for k, v in cfg.updater.items() if k != "clip_norm"}
        self.schedule = make_optimizer(self.updater).schedule  # for the lr in progress lines
        self.slices = plan_slices(
            self.shapes, self.net.dtype.itemsize, self.topo.n_servers, self.topo.slice_bytes
        )
        self.run_dir = Path(cfg.run_dir or Path("runs") / cfg.name)
        self.servers: list[Any] = []
        self.workers: list[list[Any]] = []
        self.stubs: list[Any] = []
        self.placement: cluster.Placement | None = None

    # ------------------------------------------------------------------ start and stop
    def start(self) -> None:
        cfg, topo = self.cfg, self.topo
        cluster.connect(self.address)
        cluster.check_fits(topo)
        self.placement = p = cluster.place(topo)
        tag = f"{cfg.name}-{uuid.uuid4().hex[:8]}"
        model, dtype = cfg.model.to_dict(), cfg.dtype
        updater = self.updater
        self.servers = [
            cluster.spawn(
                self.classes["server"],
                p,
                p.servers[k],
                topo.server,
                k,
                model,
                dtype,
                cfg.seed,
                self.slices,
                updater,
                tag,
            )
            for k in range(topo.n_servers)
        ]
        self.workers = [
            [
                cluster.spawn(
                    self.classes["worker"],
                    p,
                    p.workers[g][i],
                    topo.worker,
                    i,
                    g,
                    model,
                    dtype,
                    cfg.seed,
                    cfg.data.source,
                    cfg.data.batch_size,
                    cfg.data.shuffle,
                    self.slices,
                    topo.n_servers,
                    topo.n_groups,
                    tag,
                )
                for i in range(topo.workers_per_group)
            ]
            for g in range(topo.n_groups)
        ]
        server_infos = self._get([s.describe.remote() for s in self.servers], "server")
        worker_infos = [
            self._get([w.describe.remote() for w in row], "worker", g)
            for g, row in enumerate(self.workers)
        ]
        worker_nodes = {w["node"] for row in worker_infos for w in row}
        for k, (s, info) in enumerate(zip(self.servers, server_infos, strict=True)):
            remote = bool(worker_nodes - {info["node"]})
            info["ref"] = self._get([s.set_remote_readers.remote(remote)], "server", k)[0]
        self.stubs = [
            cluster.spawn(
                self.classes["stub"],
                p,
                p.stubs[g],
                topo.stub,
                g,
                self.workers[g],
                self.servers,
                worker_infos[g],
                server_infos,
                self.shapes,
                self.slices,
                dtype,
                cfg.clip_norm,
                topo.n_groups,
                tag,
            )
            for g in range(topo.n_groups)
        ]
        self._get([s.describe.remote() for s in self.stubs], "stub")

    def shutdown(self) -> None:
        """Stop every actor (each unlinks its shared memory if it still can) and free the
        placement group; safe to call twice and after failures."""
        import ray  # noqa: PLC0415
        from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

        actors = [*self.stubs, *(w for row in self.workers for w in row), *self.servers]
        if actors:
            ray.wait([a.shutdown.remote() for a in actors], num_returns=len(actors), timeout=5)
        for a in actors:
            ray.kill(a)
        if self.placement is not None:
            remove_placement_group(self.placement.pg)
        self.servers, self.workers, self.stubs, self.placement = [], [], [], None

    def _get(self, refs: list[Any], role: str, group: int | None = None) -> list[Any]:
        return get_all(refs, role, group)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> TrainResult:
        self.start()
        try:
            return self._loop()
        finally:
            self.shutdown()

    def _chunk_end(self, s: int) -> int:
        cfg = self.cfg
        ends = [cfg.train_steps, (s // cfg.disp_freq + 1) * cfg.disp_freq]
        if cfg.test_freq:
            ends.append((s // cfg.test_freq + 1) * cfg.test_freq)
        if self.topo.staleness is not None and self.topo.n_groups > 1:
            ends.append(s + max(1, self.topo.staleness))
        return min(ends)

    def _loop(self) -> TrainResult:
        import ray  # noqa: PLC0415

        cfg, topo = self.cfg, self.topo
        G, total = topo.n_groups, cfg.train_steps
        done = [0] * G
        pending: dict[Any, tuple[int, int, int]] = {}
        result = TrainResult({}, {})
        window: list[dict[str, float]] = []
        t_window = time.perf_counter()
        self.log(
            f"raysinga: training {cfg.name!r} on Ray: {topo.preset}, {topo.n_servers} "
            f"server(s), {G} group(s) x {topo.workers_per_group} worker(s), "
            f"{len(self.slices)} slices, {total} steps per group, batch {cfg.data.batch_size}"
        )

        def launch(g: int) -> None:
            s = done[g]
            if s >= total:
                return
            e = self._chunk_end(s)
            if topo.staleness is not None and G > 1 and e - 1 - min(done) > topo.staleness:
                return  # too far ahead of the slowest group: wait for it
            pending[self.stubs[g].run.remote(s, e)] = (g, s, e)

        with MetricsLog(self.run_dir, result) as metrics:
            record = metrics.record
            for g in range(G):
                launch(g)
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                g, s, e = pending.pop(ready[0])
                window += self._get(ready, "stub", g)[0]
                done[g] = e
                if g == 0 and (e % cfg.disp_freq == 0 or e == total):
                    rec = self._train_record(e, window, time.perf_counter() - t_window)
                    record(rec)
                    self.log(_format(rec, total))
                    window, t_window = [], time.perf_counter()
                if g == 0 and ((cfg.test_freq and e % cfg.test_freq == 0) or e == total):
                    ev = self._get(
                        [self.stubs[0].evaluate.remote(cfg.data.eval_batch_size)], "stub", 0
                    )[0]
                    if ev:
                        rec = {"kind": "eval", "step": e, **ev}
                        record(rec)
                        self.log(_format(rec, total))
                    t_window = time.perf_counter()
                for h in range(G):
                    if h == g or all(v[0] != h for v in pending.values()):
                        launch(h)
        result.params = self.gather_params()
        return result

    def _train_record(self, step: int, window: list[dict[str, float]], dt: float) -> dict:
        n = max(len(window), 1)
        mean = {
            k: sum(r[k] for r in window) / n
            for k in (
                "loss",
                "fetch",
                "compute",
                "gather",
                "dispatch",
                "collect",
                "average",
                "update",
                "server",
                "total",
            )
        }
        plan_steps = max(self.n_train // self.cfg.data.batch_size, 1)
        return {
            "kind": "train",
            "step": step,
            "epoch": ((step - 1) * self.topo.n_groups) // plan_steps,
            "loss": mean["loss"],
            "lr": self._lr(step - 1),
            "samples_per_s": len(window) * self.cfg.data.batch_size / max(dt, 1e-9),
            "ms": {k: round(v * 1e3, 3) for k, v in mean.items() if k != "loss"},
        }

    def _lr(self, step: int) -> float:
        return self.schedule(step)

    def gather_params(self) -> dict[str, np.ndarray]:
        """Whole parameters assembled from the servers' slices (small models, tests)."""
        values: dict[str, np.ndarray] = {}
        for vals in self._get([s.values.remote() for s in self.servers], "server"):
            values.update(vals)
        out = {}
        for p, shape in self.shapes.items():
            pieces = sorted((s for s in self.slices if s.param == p), key=lambda s: s.start)
            out[p] = np.concatenate([values[s.name] for s in pieces]).reshape(shape)
        return out
