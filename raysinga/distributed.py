"""The distributed trainer: servers, worker groups and stubs as Ray actors, driven from here.

The driver never touches parameters or gradients: servers create and update them, workers read
them in place, stubs sum gradients. The driver hands each group a chunk of steps, keeps groups
within the staleness bound, asks a worker to evaluate, reports progress, and tears everything
down on success, failure or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from . import data_identity, run_state
from .actors import cluster
from .actors.errors import ActorLost, get_all
from .actors.server import ParamServer
from .actors.slicing import plan_slices
from .actors.stub import Stub
from .actors.worker import Worker
from .checkpoint import Checkpoint, CheckpointError, storage, writer
from .checkpoint.lock import RunLock
from .checkpoint.manage import prune
from .config import JobConfig
from .cursor import DataCursor
from .model import Net
from .optim import make_optimizer
from .trainer import MetricsLog, NonFiniteLoss, TrainResult, _format, open_data

ROLE_CLASSES = {"server": ParamServer, "worker": Worker, "stub": Stub}


class FailuresExceeded(RuntimeError):
    """More roles were lost than ``fault.max_failures`` allows: every failure, and where the
    run can be resumed from."""

    def __init__(self, failures: list[dict[str, Any]], fault: Any, root: Any) -> None:
        window = f" within {fault.window_s:g} s" if fault.window_s else ""
        lines = [
            f"{len(failures)} failure(s){window}, more than fault.max_failures "
            f"({fault.max_failures}); the run stops:"
        ]
        for f in failures:
            when = time.strftime("%H:%M:%S", time.localtime(f["time"]))
            lines.append(f"  {when} at step {f['step']}: {f['error']}")
        lines.append(f"continue from the newest valid checkpoint in {root} with --resume")
        super().__init__("\n".join(lines))
        self.failures = failures


class _Grow(Exception):  # noqa: N818 - a signal within the driver, not an error
    """The loop stopped at a step boundary, checkpoint committed, to grow the topology."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


class DistributedTrainer:
    """Runs a :class:`JobConfig` on a Ray cluster with the config's topology."""

    def __init__(
        self,
        cfg: JobConfig,
        log: Callable[[str], None] = print,
        classes: dict[str, type] | None = None,
        address: str | None = None,
        resume: bool | str = False,
        init_from: str | None = None,
        fresh: bool = False,
        gather: bool = True,
    ) -> None:
        """``resume``: True continues the newest valid checkpoint of the run (an error if there
        is none), ``"auto"`` continues one if there is one; ``init_from``: a checkpoint whose
        parameters start a new run, matched by name; ``fresh``: delete the run's checkpoints
        first; ``gather``: return the final parameters in the result (small models)."""
        if resume not in (False, True, "auto"):
            raise ValueError(f"resume must be True, False or 'auto', got {resume!r}")
        if sum(map(bool, (resume, init_from, fresh))) > 1:
            raise ValueError("resume, init_from and fresh exclude one another")
        self.cfg, self.log, self.address = cfg, log, address
        self.resume, self.init_from, self.fresh, self.gather = resume, init_from, fresh, gather
        self.full_topo = self.topo = cfg.topology  # as configured; as running (elastic)
        self.classes = {**ROLE_CLASSES, **(classes or {})}
        self.net = Net(cfg.model, dtype=cfg.dtype)
        train, _ = open_data(cfg, self.net, log)  # the workers load their own copies
        self.n_train = len(train)
        self.data = data_identity.identity(train, cfg.data.batch_size, cfg.data.shuffle)
        if cfg.data.batch_size < self.topo.workers_per_group:
            raise ValueError(
                f"data.batch_size {cfg.data.batch_size} is smaller than "
                f"topology.workers_per_group {self.topo.workers_per_group}"
            )
        self.shapes = self.net.param_shapes()
        # Workers given GPUs compute on them, servers given GPUs run their optimizer there
        # (device: cpu keeps both on the CPU all the same).
        self.worker_device = "gpu" if self.topo.worker.gpus and cfg.device != "cpu" else "cpu"
        self.server_device = "gpu" if self.topo.server.gpus and cfg.device != "cpu" else "cpu"
        self.updater = {k: v for k, v in cfg.updater.items() if k != "clip_norm"}
        self.schedule = make_optimizer(self.updater).schedule  # for the lr in progress lines
        self.slices = plan_slices(
            self.shapes, self.net.dtype.itemsize, self.topo.n_servers, self.topo.slice_bytes
        )
        self.run_dir = Path(cfg.run_path)
        self.ck_root = storage.resolve(cfg.checkpoint_dir)
        self.lock: RunLock | None = None
        self.source: run_state.Source | None = None  # what this run starts from, if anything
        self.start_info: dict[str, Any] | None = None  # its run state (resume)
        self.steps0: list[int] = [0] * self.topo.n_groups
        self.cursor = DataCursor()
        self.history0: list[dict[str, Any]] = []
        self.pending: dict[str, Any] | None = None  # the checkpoint being written
        self.saved: list[dict[str, Any]] = []  # per checkpoint: step, path, blocked, seconds
        self.stop_signal: int | None = None
        self.seed = cfg.seed
        # Checkpointed steps (made or resumed from), each with its groups' steps: asynchronous
        # groups at [T-2, T] are saved as step T, which the state [T, T] must later replace.
        self.saved_at: dict[int, tuple[int, ...]] = {}
        self.init_names: dict[str, str] = {}
        self.start_ck: Checkpoint | None = None  # opened with size checks, in the driver
        self.tag = ""  # names the shared-memory files of the roles spawned last
        self.progress = 0  # the most steps a group has done (as far as the driver knows)
        self.failures: list[dict[str, Any]] = []  # lost roles recovered from, with their cost
        self.events: list[dict[str, Any]] = []  # those failures, and resizes
        self.adopting: list[Any] = []  # the object-store registry's calls still running
        self.metrics: MetricsLog | None = None  # the loop's, while it runs
        self.t_grow = 0.0  # when room to grow back was last looked for
        self.max_chunk = 1 << 30
        self.servers: list[Any] = []
        self.chunks: dict[Any, tuple[int, int, int]] = {}  # the loop's chunks still running
        self.workers: list[list[Any]] = []
        self.stubs: list[Any] = []
        self.placement: cluster.Placement | None = None

    # ------------------------------------------------------------------ start and stop
    def start(self) -> None:
        cluster.connect(self.address)
        self._place()  # first: the number of groups that fit decides the data cursor
        self.steps0 = [0] * self.topo.n_groups  # a resume sets its own
        self._open_checkpoints()
        self._launch()

    def _sizes(self) -> list[Any]:
        full, fc = self.full_topo, self.cfg.fault
        return cluster.shrunk(
            full, fc.min_groups or full.n_groups, fc.min_workers or full.workers_per_group
        )

    def _place(self) -> None:
        """Reserve the configured topology, or where it does not fit (an elastic run, after a
        loss) the largest smaller form within ``fault.min_groups`` / ``fault.min_workers``."""
        sizes = self._sizes()
        if len(sizes) == 1:
            cluster.check_fits(self.full_topo)
            self.topo, self.placement = self.full_topo, cluster.place(self.full_topo)
            return
        nodes = cluster.live_nodes()
        fitting = [t for t in sizes if cluster.packs(t, nodes)]
        if not fitting:
            cluster.check_fits(sizes[-1])  # names what is missing
            fitting = sizes[-1:]  # the total fits, the nodes may not: let Ray say
        for i, t in enumerate(fitting):
            last = i + 1 == len(fitting)
            try:  # Ray has the last word: a node just lost may still be listed for a moment
                self.placement = cluster.place(t, timeout_s=30.0 if last else 10.0)
            except cluster.ResourceError:
                if last:
                    raise
                continue
            self.topo = t
            if t != self.full_topo:
                f = self.full_topo
                self.log(
                    f"raysinga: room for {t.n_groups} group(s) x {t.workers_per_group} "
                    f"worker(s) of the configured {f.n_groups} x {f.workers_per_group}; "
                    "the batch is split over the workers there are"
                )
            return

    def _room_to_grow(self) -> bool:
        """Whether the live nodes hold a larger topology than the one running."""
        nodes = cluster.live_nodes()
        best = next((t for t in self._sizes() if cluster.packs(t, nodes)), None)
        return best is not None and best.n_workers > self.topo.n_workers

    def _launch(self) -> None:
        """Spawn every role in the reserved placement, load the start checkpoint (if any) and
        wire the groups."""
        if self.placement is None:
            self._place()
        cfg, topo = self.cfg, self.topo
        p = self.placement
        assert p is not None
        self.tag = tag = f"{cfg.name}-{uuid.uuid4().hex[:8]}"
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
                self.seed,
                self.slices,
                updater,
                tag,
                self.server_device,
            )
            for k in range(topo.n_servers)
        ]
        if self.source is not None:
            self._verify_start()
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
                    self.seed,
                    cfg.data.source,
                    cfg.data.batch_size,
                    cfg.data.shuffle,
                    self.slices,
                    topo.n_servers,
                    topo.n_groups,
                    tag,
                    self.worker_device,
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
        if self.source is not None:  # before the servers first publish their values
            self._restore()
        c = self.cfg.checkpoint
        if (self.cfg.checkpoint_frequency or self.cfg.checkpoint_every_seconds) and (
            c.compression is None
        ):  # periodic checkpoints: the servers map their snapshot images now, in the background
            self._get([s.prepare_snapshots.remote() for s in self.servers], "server")
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

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every actor and free the placement group; safe to call twice and after
        failures. ``graceful``: each actor first unlinks its shared memory itself (up to 5 s);
        otherwise (after a lost role, when the others may hang on it) they are killed at once.
        Files not unlinked by their actors are removed by tag."""
        import ray  # noqa: PLC0415
        from ray.util.placement_group import remove_placement_group  # noqa: PLC0415

        actors = [*self.stubs, *(w for row in self.workers for w in row), *self.servers]
        done: list[Any] = []
        if actors and graceful:
            calls = [a.shutdown.remote() for a in actors]
            done, _ = ray.wait(calls, num_returns=len(actors), timeout=5)
        for a in actors:
            ray.kill(a)
        if actors and len(done) < len(actors):  # some could not unlink their files themselves
            cluster.remove_shared_files(self.tag)
        for ref in self.chunks:  # ended with their actors: fetched, so Ray does not report
            with contextlib.suppress(Exception):  # each as an unhandled error
                ray.get(ref, timeout=5)
        self.chunks = {}
        if self.placement is not None:
            remove_placement_group(self.placement.pg)
        self.servers, self.workers, self.stubs, self.placement = [], [], [], None

    def _get(self, refs: list[Any], role: str, group: int | None = None) -> list[Any]:
        return get_all(refs, role, group)

    # ------------------------------------------------------------------ checkpoints: where from
    def _open_checkpoints(self) -> None:
        """Take the run's writer lock and decide what the run starts from."""
        cfg = self.cfg
        self.lock = RunLock(self.ck_root).acquire()
        try:
            src, ck = run_state.open_run(self.ck_root, cfg, self.resume, self.fresh, self.log)
            if src is not None and ck is not None:
                self._adopt(src, ck)
            elif self.init_from is not None:
                src, ck, names = run_state.open_init(self.init_from, self.shapes, self.log)
                self.source, self.start_ck, self.init_names = src, ck, {n: n for n in names}
        except BaseException:
            self.lock.release()
            self.lock = None
            raise

    def _adopt(self, src: run_state.Source, ck: Checkpoint) -> None:
        """Start from ``ck``, a checkpoint of this run: steps, data cursor, seed, history."""
        info = run_state.run_info(ck)
        run_state.check_fits(ck, self.shapes, self.net.dtype)
        data_identity.check_resume(ck, info, self.data)
        self.steps0, self.cursor = run_state.cursor_for(info, self.topo.n_groups)
        if len(info["steps"]) != self.topo.n_groups:
            self.log(
                f"raysinga: {len(info['steps'])} group(s) saved, {self.topo.n_groups} "
                f"now: all start at step {self.steps0[0]}, skipping the batches the faster "
                "groups had taken"
            )
        self.seed = int(info["rng"]["seed"])
        self.history0 = [r for r in info["history"] if r.get("step", 0) <= max(self.steps0)]
        self.source, self.start_info, self.start_ck = src, info, ck
        self.saved_at = {ck.step: tuple(int(s) for s in info["steps"])}
        self.log(
            f"raysinga: resuming {self.cfg.name!r} at step {max(self.steps0)} from {src.label}"
        )

    def _verify_start(self) -> None:
        """Hash the start checkpoint's files in full, the servers sharing the work. A resume
        from a corrupt checkpoint falls back to the next older valid one (before any worker
        exists: the seed it was saved with is the one workers get)."""
        assert self.source is not None and self.start_ck is not None
        if self.start_info is None:  # --init-from: no fallback
            self._verify_on_servers(self.source, self.start_ck)
            return
        src, ck = run_state.verify_start(
            self.ck_root, self.cfg, self.source, self.start_ck, self._verify_on_servers, self.log
        )
        if ck is not self.start_ck:
            self._adopt(src, ck)

    def _verify_on_servers(self, src: run_state.Source, ck: Checkpoint) -> None:
        files = [f["file"] for f in ck.manifest["files"]]
        plan = run_state.plan_verification(files, len(self.servers))
        errors = self._get(
            [s.verify.remote(src, plan[k]) for k, s in enumerate(self.servers)], "server"
        )
        if any(errors):
            raise CheckpointError("; ".join(e for e in errors if e))

    def _restore(self) -> None:
        """Load the start checkpoint (verified) into the servers and the workers (state and
        data cursor)."""
        assert self.source is not None and self.start_ck is not None
        resume = self.start_info is not None
        names = None if resume else self.init_names
        t0 = time.perf_counter()
        self._get([s.load.remote(self.source, resume, names) for s in self.servers], "server")
        ck = self.start_ck
        state_names = list(self.net.state_shapes())
        calls = []
        for g, row in enumerate(self.workers):
            for i, w in enumerate(row):
                st = run_state.worker_state(ck, g, i, state_names)
                calls.append(w.restore.remote(st, self.cursor if resume else DataCursor()))
        self._get(calls, "worker")
        self.log(f"raysinga: loaded {self.source.label} in {time.perf_counter() - t0:.2f} s")

    # ------------------------------------------------------------------ checkpoints: writing
    def _checkpoint(self, done: list[int], history: list[dict[str, Any]]) -> None:
        """Snapshot every role at this step boundary and let the servers write in the
        background; the previous checkpoint, if still writing, is finished first."""
        self._finish_checkpoint(wait=True)
        step = max(done)
        if self.saved_at.get(step) == tuple(done):
            return
        replace = step in self.saved_at
        cfg = self.cfg
        t0 = time.perf_counter()
        tmp = writer.begin(self.ck_root, step, replace=replace)
        try:
            infos = self._get(
                [
                    s.snapshot.remote(tmp, k, cfg.checkpoint.compression)
                    for k, s in enumerate(self.servers)
                ],
                "server",
            )
            states = {}
            for g, row in enumerate(self.workers):
                for i, st in enumerate(self._get([w.get_state.remote() for w in row], "worker", g)):
                    states[(g, i)] = st
            optimizer = run_state.merge_optimizer([i["optimizer"] for i in infos])
        except BaseException:
            storage.remove_dir(tmp)
            raise
        meta = run_state.run_meta(
            cfg, done, self.cursor, optimizer, history, step, seed=self.seed, data=self.data
        )
        self.saved_at[step] = tuple(done)
        self.pending = {
            "step": step,
            "replace": replace,
            "tmp": tmp,
            "states": states,
            "meta": meta,
            "records": [None] * len(self.servers),
            "blocked": time.perf_counter() - t0,
            "t0": t0,
        }

    def _finish_checkpoint(self, wait: bool) -> None:
        """Commit the checkpoint being written once every server's shard is durable (``wait``:
        block until then). A failed write removes the partial checkpoint and raises."""
        p = self.pending
        if p is None:
            return
        todo = [k for k, r in enumerate(p["records"]) if r is None]
        try:
            got = self._get([self.servers[k].snapshot_result.remote(wait) for k in todo], "server")
            for k, r in zip(todo, got, strict=True):
                p["records"][k] = r
            if any(r is None for r in p["records"]):
                return
            self.pending = None
            state = writer.write_shard(
                p["tmp"],
                len(self.servers),
                run_state.state_tensors(p["states"]),
                self.cfg.checkpoint.compression,
            )
            path = writer.commit(
                p["tmp"], p["step"], [*p["records"], state], p["meta"], replace=p["replace"]
            )
        except BaseException as e:
            from ray.exceptions import ObjectLostError  # noqa: PLC0415

            if isinstance(e, (ActorLost, ObjectLostError)):
                self.pending = p  # its directory goes once every role is stopped (recovery)
                raise
            self.pending = None
            for k in todo:  # let the other servers' writes end before the directory goes
                with contextlib.suppress(Exception):
                    self._get([self.servers[k].snapshot_result.remote(True)], "server")
            storage.remove_dir(p["tmp"])
            if isinstance(e, Exception):
                raise CheckpointError(
                    f"checkpoint of step {p['step']} failed, nothing was committed: {e}"
                ) from e
            raise
        seconds = time.perf_counter() - p["t0"]
        # training waited at the step boundary, then in the next update for the servers' copy
        blocked = p["blocked"] + max(r.get("update_waited", 0.0) for r in p["records"])
        self.saved.append(
            {"step": p["step"], "path": str(path), "blocked": blocked, "seconds": seconds}
        )
        self.log(
            f"raysinga: checkpoint step {p['step']} -> {path} (training waited "
            f"{blocked * 1e3:.0f} ms; written in {seconds:.2f} s)"
        )
        if self.metrics is not None:
            self.metrics.record(
                {
                    "kind": "checkpoint",
                    "step": p["step"],
                    "blocked_ms": round(blocked * 1e3, 3),
                    "seconds": round(seconds, 3),
                }
            )
        c = self.cfg.checkpoint
        deleted = prune(self.ck_root, c.keep_last, c.keep_every, lock=False, known_valid=p["step"])
        if c.object_store:
            key = run_state.registry_key(self.cfg.name, self.ck_root)
            run_state.keep_in_object_store(key, p["step"], str(path), deleted, self.adopting)

    @contextlib.contextmanager
    def _stop_signals(self) -> Iterator[None]:
        """SIGTERM (preemption, ``ray job stop``) or Ctrl-C: finish the steps under way,
        checkpoint, stop. A second signal stops at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, frame: Any) -> None:
            if self.stop_signal is not None:
                for sig, h in old.items():
                    signal.signal(sig, h)
                raise KeyboardInterrupt
            self.stop_signal = signum
            self.log(
                f"raysinga: {signal.Signals(signum).name}: stopping at the next step boundary"
                + (" after a checkpoint" if self.cfg.checkpoint.final else "")
                + "; signal again to stop at once"
            )

        old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> TrainResult:
        from ray.exceptions import ObjectLostError  # noqa: PLC0415

        try:
            self.start()
            with self._stop_signals():
                while True:
                    try:
                        return self._loop()
                    except (ActorLost, ObjectLostError) as e:
                        self._recover(e)
                    except _Grow as g:
                        self._grow(g.step)
        finally:
            try:
                self.shutdown()
                self._abandon_pending()  # a failure elsewhere: never commit half of it
                run_state.wait_adopted(self.adopting, self.log)
            finally:
                if self.lock is not None:
                    self.lock.release()
                    self.lock = None

    # ------------------------------------------------------------------ failures
    def _recover(self, e: BaseException) -> None:
        """A role or its node was lost: stop everything, restart every role from the newest
        checkpoint (the object store's copy when it is at least as new as the newest on
        disk), and let the loop go on; more failures than ``fault.max_failures`` (within
        ``fault.window_s``) stop the run with a summary of all of them."""
        t0, detected = time.perf_counter(), time.time()
        lost_at = self.progress
        was = self.topo
        what = {
            "role": getattr(e, "role", "object"),
            "index": getattr(e, "index", None),
            "group": getattr(e, "group", None),
            "error": str(e).splitlines()[0] if str(e) else type(e).__name__,
        }
        fc = self.cfg.fault
        recent = [
            f for f in self.failures if not fc.window_s or detected - f["time"] <= fc.window_s
        ]
        if len(recent) + 1 > fc.max_failures:
            raise FailuresExceeded(
                self.failures + [{"step": lost_at, "time": detected, **what}], fc, self.ck_root
            ) from e
        self.log(
            f"raysinga: {what['error']} at step {lost_at}; recovering "
            f"(failure {len(recent) + 1} of at most {fc.max_failures})"
        )
        lost = [*self.stubs, *(w for row in self.workers for w in row), *self.servers]
        self.shutdown(graceful=False)
        self._abandon_pending()
        self._place()
        self._restart_from_newest()
        died = cluster.first_death(lost)  # by now Ray has recorded the death
        restored = self.progress
        rec = {
            "kind": "failure",
            "step": lost_at,
            **what,
            "time": detected,
            "died": died,  # as Ray recorded it (None: not known)
            "detection_s": None if died is None else max(0.0, detected - died),
            "restored_from": restored,
            "source": self.source.label if self.source is not None else "the start",
            "steps_redone": max(0, lost_at - restored),
            "restore_s": time.perf_counter() - t0,
            **self._sizes_record(was),
        }
        self.failures.append(rec)
        self._note(rec)
        self.log(
            f"raysinga: recovered in {rec['restore_s']:.2f} s from step {restored} "
            f"({rec['steps_redone']} step(s) to redo)"
        )

    def _restart_from_newest(self) -> None:
        """Spawn every role (placed already) from the newest checkpoint: the object store's copy
        when it is at least as new as the newest on disk."""
        src, ck, _ = run_state.find_resume(
            self.ck_root, self.cfg.name, self.cfg.checkpoint.object_store
        )
        if src is not None and ck is not None:
            self._adopt(src, ck)
        else:  # nothing committed yet: from the start (or the --init-from checkpoint) again
            self._start_over()
        self.progress = max(self.steps0)
        self._launch()

    def _sizes_record(self, was: Any) -> dict[str, Any]:
        now = self.topo
        out = {"groups": now.n_groups, "workers": now.workers_per_group}
        if (was.n_groups, was.workers_per_group) != (now.n_groups, now.workers_per_group):
            out["resized_from"] = {"groups": was.n_groups, "workers": was.workers_per_group}
        return out

    def _note(self, rec: dict[str, Any]) -> None:
        """Keep an event (a failure, a resize) in the run's history; a restart from an older
        checkpoint must not forget it."""
        self.events.append(rec)
        seen = {(f["kind"], f["time"]) for f in self.history0 if "time" in f}
        self.history0 += [f for f in self.events if (f["kind"], f["time"]) not in seen]

    def _grow(self, step: int) -> None:
        """At a step boundary with a committed checkpoint of it: restart every role in the
        largest topology the cluster now holds."""
        t0, was = time.perf_counter(), self.topo
        self.shutdown()
        self._place()
        self._restart_from_newest()
        rec = {
            "kind": "resize",
            "step": step,
            "time": time.time(),
            "restored_from": self.progress,
            "resize_s": time.perf_counter() - t0,
            **self._sizes_record(was),
        }
        self._note(rec)
        self.log(
            f"raysinga: grew to {self.topo.n_groups} group(s) x {self.topo.workers_per_group} "
            f"worker(s) at step {step} in {rec['resize_s']:.2f} s"
        )

    def _abandon_pending(self) -> None:
        """A checkpoint being written when the run failed is never committed: its directory
        goes once the servers are stopped (a write in flight ends with its server; a stray
        one is removed by the next prune)."""
        if self.pending is not None:
            p, self.pending = self.pending, None
            storage.remove_dir(p["tmp"])

    def _start_over(self) -> None:
        if self.start_info is not None:  # resumed, but its checkpoint is gone since
            raise CheckpointError(f"{self.ck_root}: the checkpoint this run resumed from is gone")
        self.steps0, self.cursor = [0] * self.topo.n_groups, DataCursor()
        self.history0, self.saved_at = [], {}

    def _chunk_end(self, s: int) -> int:
        cfg = self.cfg
        ends = [cfg.train_steps, (s // cfg.disp_freq + 1) * cfg.disp_freq, s + self.max_chunk]
        if cfg.test_freq:
            ends.append((s // cfg.test_freq + 1) * cfg.test_freq)
        nxt = cfg.next_checkpoint(s)
        if nxt is not None:
            ends.append(nxt)
        if self.topo.staleness is not None and self.topo.n_groups > 1:
            ends.append(s + max(1, self.topo.staleness))
        return min(ends)

    def _loop(self) -> TrainResult:
        import ray  # noqa: PLC0415

        cfg, topo = self.cfg, self.topo
        G, total = topo.n_groups, cfg.train_steps
        done = list(self.steps0)
        self.progress = max(done)
        pending: dict[Any, tuple[int, int, int]] = {}
        self.chunks = pending  # for shutdown, should the loop end with an error
        result = TrainResult({}, {}, list(self.history0))
        window: list[dict[str, float]] = []
        t_window = t_ckpt = time.perf_counter()
        self.log(
            f"raysinga: training {cfg.name!r} on Ray: {topo.preset}, {topo.n_servers} "
            f"server(s), {G} group(s) x {topo.workers_per_group} worker(s), "
            f"{len(self.slices)} slices, {total} steps per group, batch {cfg.data.batch_size}"
        )
        barrier = cfg.next_checkpoint(max(done))
        hold = False  # a checkpoint (by time), a stop or a resize is due: let chunks end
        grow = False  # the cluster has room for more workers or groups than are running
        self.t_grow = time.perf_counter()

        def launch(g: int) -> None:
            s = done[g]
            if s >= total or hold or (barrier is not None and s >= barrier):
                return
            e = self._chunk_end(s)
            if topo.staleness is not None and G > 1 and e - 1 - min(done) > topo.staleness:
                return  # too far ahead of the slowest group: wait for it
            pending[self.stubs[g].run.remote(s, e)] = (g, s, e)

        with (
            MetricsLog(self.run_dir, result, self.cfg.tensorboard) as metrics,
            self._recording(metrics),
        ):
            record = metrics.record
            while True:
                for g in range(G):
                    if all(v[0] != g for v in pending.values()):
                        launch(g)
                if not pending:  # every group is held or finished: a step boundary for all
                    finished = all(d >= total for d in done)
                    if self.stop_signal is not None or finished:
                        if cfg.checkpoint.final:
                            self._checkpoint(done, result.history)
                        self._finish_checkpoint(wait=True)
                        if finished:
                            break
                        raise run_state.Preempted(self.stop_signal, max(done), self.saved)
                    self._checkpoint(done, result.history)
                    if grow:
                        self._finish_checkpoint(wait=True)
                        raise _Grow(max(done))
                    barrier, hold, t_ckpt = (
                        cfg.next_checkpoint(max(done)),
                        False,
                        time.perf_counter(),
                    )
                    continue
                ready, _ = ray.wait(list(pending), num_returns=1)
                g, s, e = pending.pop(ready[0])
                recs = self._get(ready, "stub", g)[0]
                self._check_finite(recs, g)  # before a checkpoint can take what follows
                window += recs
                done[g] = e
                self.progress = max(done)
                self._tune_chunks(window)
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
                # between chunks (a synchronous group's servers are busy serving during one)
                self._finish_checkpoint(wait=False)
                every = cfg.checkpoint_every_seconds
                if self.stop_signal is not None or (
                    every and time.perf_counter() - t_ckpt >= every
                ):
                    hold = True
                if self.topo != self.full_topo and (
                    time.perf_counter() - self.t_grow >= cfg.fault.grow_check_s
                ):
                    self.t_grow = time.perf_counter()
                    grow = self._room_to_grow()
                    hold = hold or grow
        if self.gather:
            result.params = self.gather_params()
        return result

    def _check_finite(self, recs: list[dict[str, float]], g: int) -> None:
        """A non-finite loss (or gradient norm, where clipping computes it) stops the run."""
        group = g if self.topo.n_groups > 1 else None
        for r in recs:
            for what, key in (("loss", "loss"), ("gradient norm", "grad_norm")):
                v = r.get(key)
                if v is not None and not math.isfinite(v):
                    raise NonFiniteLoss(v, r["step"], group, what, first_step=self.steps0[g])

    @contextlib.contextmanager
    def _recording(self, metrics: MetricsLog) -> Iterator[None]:
        """Committed checkpoints go into the metrics log while the loop runs."""
        self.metrics = metrics
        try:
            yield
        finally:
            self.metrics = None

    def _tune_chunks(self, window: list[dict[str, float]]) -> None:
        """Keep chunks (steps run between two visits of this loop) near a second, so that a
        stop signal or a time-based checkpoint is acted on soon."""
        if window:
            per_step = max(sum(r["total"] for r in window) / len(window), 1e-4)
            self.max_chunk = max(1, int(1.0 / per_step))

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
        rec = {
            "kind": "train",
            "step": step,
            "epoch": ((step - 1) * self.topo.n_groups) // plan_steps,
            "loss": mean["loss"],
            "lr": self._lr(step - 1),
            "samples_per_s": len(window) * self.cfg.data.batch_size / max(dt, 1e-9),
        }
        if window and "grad_norm" in window[-1]:  # the window's last step, as in the trainer
            rec["grad_norm"] = window[-1]["grad_norm"]
        rec["ms"] = {k: round(v * 1e3, 3) for k, v in mean.items() if k != "loss"}
        return rec

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
