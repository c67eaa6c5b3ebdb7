"""The parameter server: owns slices of parameters, their optimizer state and their versions.

A server creates the initial values of its own slices (a pure function of the seed and the
parameter name), so parameters never pass through the driver. ``update`` applies a group's summed
gradient to every slice in place and bumps the slices' version; readers on the server's node see
the new values through shared memory (asynchronous groups copy them under a sequence lock, so a
step never mixes two versions of a server's values), readers elsewhere through a snapshot in the
object store.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from raysinga.kernels.cpu_memory import retain_freed_memory
from raysinga.nn.model import ModelSpec, Net
from raysinga.obs.raymetrics import Recorder
from raysinga.optim.grads import sum_into
from raysinga.optim.optimizers import make_optimizer

from .common.buffers import SEQ, Attachments, Layout, SharedBuffer, ShmHandle, UpdateGuard, with_seq
from .common.device import ServerDevice
from .common.errors import reports_role
from .common.protocol import (
    HostFrames,
    ServerDone,
    ServerSpec,
    SummedGrads,
    Wiring,
    node_id,
    node_ip,
    visible_gpus,
)
from .exchange.doorbell import Abortable, Steps
from .exchange.fence import Fence
from .exchange.tcp import Inbox
from .exchange.wire import parts_of, wire_bytes, words
from .hostsum import server_side
from .memory import shard as server_shard
from .memory.copies import CopyBuffer, ServerCopies
from .memory.grads_in import SumViews, step_gradient
from .memory.snapshots import Snapshots
from .memory.values_out import ValueReaders


class ParamServer(Abortable, Fence):
    role = "server"

    def __init__(self, spec: ServerSpec) -> None:
        retain_freed_memory()  # each update's temporaries reuse the last one's pages
        self.index = spec.index
        self.label = f"{spec.tag} server {spec.index}"  # the run (name and id), the role
        self.slices = [s for s in spec.slices if s.server == spec.index]
        # the driver ran the user's own layers once as it read the job (nn.checks.probe)
        net = Net(ModelSpec.from_dict(spec.model, probe=False), dtype=spec.dtype)
        self.layout = Layout.of({s.name: ((s.size,), spec.dtype) for s in self.slices})
        self.node = node_id()
        self.buf = SharedBuffer(f"{spec.tag}-server{spec.index}", with_seq(self.layout), self.node)
        # Asynchronous groups read the values while others update them: readers copy under
        # this sequence lock, whose counter is also the version (updates applied) of the slices.
        self.guard = UpdateGuard(self.buf.arrays[SEQ])
        for s in self.slices:
            self.buf.arrays[s.name][...] = net.init_param(s.param, spec.seed).reshape(-1)[
                s.start : s.stop
            ]
        self.shapes = net.param_shapes()
        self.optimizer = make_optimizer(spec.updater)
        self.optimizer.lr_scale = spec.lr_scale
        # Servers work while the workers wait for them, so spread updates over the node's cores.
        self.pool = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)))
        self.snaps = Snapshots(self.pool)
        self.copies = ServerCopies()  # of its state, fetched by its group's stub
        self.tag = spec.tag
        self.parts = parts_of(self.layout)  # as its slices cross (reduce: hosts)
        # on other nodes: set_remote_readers
        self.readers = ValueReaders(spec.index, spec.wire, self.parts)
        self.rec = Recorder(spec.metrics, "server", spec.index)
        # group -> the last step of it applied: a step applied once is not applied again (a
        # replaced stub of an asynchronous group redoes its step from the servers' lowest)
        self.applied: dict[int, int] = {}
        self._attached = Attachments()
        self.sums = SumViews()  # where it sums the workers' gradients itself
        self.wire = spec.wire
        # the blocks' sum (reduce: hosts) by slice name, reused (views made once: per part, a
        # layout's views cost more than the part's sum)
        self.host_sum: dict[str, np.ndarray] | None = None
        # reduce: hosts: the blocks' leaders send their sums of its slices here
        # (actors.exchange.tcp)
        self.inbox = Inbox(node_ip()) if spec.inbox else None
        self.gpu: ServerDevice | None = None  # device "gpu": the optimizer runs on a GPU
        if spec.device == "gpu":
            self.gpu = ServerDevice(self.layout, self.buf)
        elif spec.device != "cpu":
            raise ValueError(f"device must be 'cpu' or 'gpu', got {spec.device!r}")

    def __repr__(self) -> str:  # how Ray's dashboard and log prefixes name this actor
        return f"ParamServer({self.label})"

    @reports_role
    def describe(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "pid": os.getpid(),  # where `raysinga status` shows it, to find the process
            "handle": self.buf.handle(),
            "gpu": self.gpu is not None,
            "gpus": visible_gpus() if self.gpu is not None else None,
            # what a reader elsewhere pulls
            "published_bytes": wire_bytes(self.layout, self.wire)
            if words(self.wire) != "f32"
            else self.buf.layout.nbytes,
            "inbox": self.inbox.contact if self.inbox is not None else None,
        }

    @reports_role
    def warm(self, updater: dict[str, Any]) -> float:
        """A spare's: two updates of a scratch slice by an optimizer like its own (``updater``),
        so that on a GPU its kernels are loaded before it takes over; returns the seconds."""
        t0 = time.perf_counter()
        xp = np if self.gpu is None else self.gpu.cp
        dtype = self.layout.entries[0].dtype if self.layout.entries else "float32"
        opt = make_optimizer(updater)
        scratch, grad = xp.zeros(256, dtype), xp.ones(256, dtype)
        opt.update(1, "scratch", scratch, grad)
        opt.update(2, "scratch", scratch, grad)
        if self.gpu is not None:
            self.gpu.cp.cuda.get_current_stream().synchronize()
        return time.perf_counter() - t0

    @reports_role
    def set_remote_readers(
        self,
        remote: bool,
        nodes: list[str] | None = None,
        pushes: list[tuple[str, int, bytes]] | None = None,
    ) -> Any:
        """Whether some reader sits on another node; if so, publish snapshots from now on.
        ``nodes``: the readers' nodes, each to get a copy of its own (see :meth:`_publish`);
        ``pushes``: instead, the inbox on each of them to push the values to (their mirrors,
        :mod:`.mirrors`), now and after each update."""
        self.readers.set(remote, nodes, pushes)
        return self.publish()

    def publish(self) -> Any:
        """Hand this server's values to its readers on other nodes (:mod:`.values_out`)."""
        return self.readers.publish(
            {s.name: self.buf.arrays[s.name] for s in self.slices},
            self.buf.flat,
            self.guard.version,
            self.check_abort,
        )

    @reports_role
    def serve(
        self, start: int, stop: int, wiring: Wiring, grads: ShmHandle | SummedGrads, epoch: int = 0
    ) -> list[tuple[float, float, float]]:
        """Apply updates for steps ``start .. stop-1`` as they are rung for (same node only)
        by a stub of ``epoch`` (an older one's is refused: :mod:`.fence`). Returns, for each
        step, when it was rung for and when it was done (wall clock, before its done message),
        and the seconds its update took."""
        self.admit(epoch, f"serve steps {start}-{stop - 1} (server {self.index})")
        src = (
            self.sums.use(grads, self.slices, self.index)
            if isinstance(grads, SummedGrads)
            else grads
        )

        def step_fn(step: int) -> tuple[tuple[float, float, float], ServerDone]:
            heard = time.time()
            seconds = self._update(step, src)[2]
            return (heard, time.time(), seconds), ServerDone(self.index, step, 0, seconds)

        failed = ServerDone(self.index, -1, 1, 0.0)  # wakes the stub at once
        steps = Steps(wiring, ServerDone, self.check_abort)
        return steps.run(start, stop, step_fn, failed, self.rec.flush)

    @reports_role
    def update_steps(
        self, start: int, stop: int, frames: HostFrames, group: int = 0, epoch: int = 0
    ) -> list[tuple[int, Any, float, float]]:
        """Group ``group``'s updates of steps ``start .. stop-1`` summed by hosts, each as
        :meth:`update` applies it, in one call (:func:`.stub_side.block_steps`): each step's
        blocks' sums are taken in from this server's inbox as they come. Returns, for each
        step, what :meth:`update` returns and when (wall clock) it was done."""
        out = []
        for step in range(start, stop):
            version, ref, seconds = self.update(step, frames, group, epoch)
            out.append((version, ref, seconds, time.time()))
        return out

    @reports_role
    def update(
        self, step: int, grads: Any, group: int = 0, epoch: int = 0
    ) -> tuple[int, Any, float]:
        """:meth:`_update`, for a stub of ``epoch`` (an older one's is refused: :mod:`.fence`)."""
        self.admit(epoch, f"update of step {step} from group {group} (server {self.index})")
        try:
            return self._update(step, grads, group)
        finally:
            self.rec.flush()

    def _update(
        self, step: int, grads: ShmHandle | np.ndarray | SumViews, group: int = 0
    ) -> tuple[int, Any, float]:
        """Apply group ``group``'s summed gradient of ``step`` (once: a step of the group
        already applied is skipped); ``grads`` is the stub's full-parameter buffer (same
        node), this server's slices laid out as in :attr:`layout` (another node), or the
        workers' gradients, summed here (:class:`SummedGrads`).

        Returns ``(version, snapshot ref or None, seconds spent)``.
        """
        t0 = time.perf_counter()
        if step <= self.applied.get(group, -1):
            return self.guard.version, self.readers.published, 0.0
        if isinstance(grads, HostFrames):
            if self.gpu is None and not self.optimizer.bf16_copies:
                publish = server_side.update_by_parts(self, step, grads)
                self.applied[group] = step
                return self._updated(group, step, t0, publish)
            grads = server_side.blocks_sum(self, step, grads)  # all in before anything changes
        self.applied[group] = step
        self.snaps.wait_for_copy()  # a checkpoint's copy of the values must come first
        self.copies.wait_for_copy()  # and a copy kept for a rebuild
        with self.snaps.updating():  # a checkpoint's write in the background pauses
            g, parts = step_gradient(grads, step, self.slices, self.layout, self._attached)
            if self.gpu is not None:
                # summing the workers' gradients itself: into the log's row, marked as on the CPU
                # (being written, then written once the update is done)
                with grads.writing(step) if parts else contextlib.nullcontext():
                    for name, ps in parts.items():
                        sum_into(g[name], ps)
                    g = self.gpu.upload_grads({s.name: g[s.name] for s in self.slices})
                    for s in self.slices:
                        self.optimizer.update(step, s.name, self.gpu.values[s.name], g[s.name])
                    with self.guard:
                        self.gpu.publish()
            elif parts:
                with self.guard, grads.writing(step):
                    self.optimizer.update_summed(step, self.buf.arrays, g, parts, self.pool)
            else:
                with self.guard:
                    self.optimizer.update_all(step, self.buf.arrays, g, self.pool)
        return self._updated(group, step, t0, self.publish)

    def _updated(
        self, group: int, step: int, t0: float, publish: Callable[[], Any]
    ) -> tuple[int, Any, float]:
        """After group ``group``'s update of ``step``: noted in the order a rebuild replays
        in, the values handed to the readers elsewhere (``publish``), a copy of the state
        started where one is due. Returns what :meth:`_update` returns."""
        self.copies.note(self.guard.version, group, step)
        ref = publish()
        if self.copies.due(self.guard.version):
            self._start_copy()
        seconds = time.perf_counter() - t0
        self.rec.later({"update": seconds}, group=group)  # recorded by the caller
        return self.guard.version, ref, seconds

    def _start_copy(self) -> None:
        """A copy of this server's state at its current version, taken in the background."""
        values = {s.name: self.buf.arrays[s.name] for s in self.slices}
        version, applied = self.guard.version, dict(self.applied)
        self.copies.copy_now(version, self.optimizer, applied, values, self.gpu)

    # ------------------------------------------------------------------ rebuilds
    @reports_role
    def keep_copies(self, every: int, shared: bool = False) -> ShmHandle | None:
        """Take a copy of this server's state now and every ``every`` updates, for its group's
        stub (:mod:`actors.memory.replay`). ``shared``: the stub is on this node and maps the
        copies' buffer, whose handle this returns; else it fetches each copy."""
        values = {s.name: self.buf.arrays[s.name] for s in self.slices}
        tag, slots = f"{self.tag}-copies-server{self.index}", self.optimizer.slot_names()
        rows = 16 * every + 64  # the order of far more updates than come between two copies
        make = lambda: CopyBuffer(tag, self.node, values, slots, rows)  # noqa: E731
        handle = self.copies.keep(every, shared, make)
        self._start_copy()
        return handle

    @reports_role
    def next_copy(self, after: int) -> dict[str, Any] | None:
        """The newest copy of this server's state once past version ``after`` (a call of the
        ``copies`` group, which waits beside the updates; None when none came meanwhile)."""
        return self.copies.next_copy(after)

    @reports_role
    def load_copy(self, state: dict[str, Any]) -> int:
        """Take over a lost server's state from its copy (then the logged steps since are
        replayed through :meth:`update`). Returns the copy's version."""
        for s in self.slices:
            self.buf.arrays[s.name][...] = state["values"][s.name]
        self.optimizer.load_state_dict(state["optimizer"])  # slots go up at their next update
        self.applied = {int(g): int(s) for g, s in state.get("applied", {}).items()}
        if self.gpu is not None:
            self.gpu.reload()
        self.guard.set_version(int(state["version"]))
        self.readers.forget()
        self.publish()
        return int(state["version"])

    @reports_role
    def next_step(self, group: int) -> int | None:
        """The first step of ``group`` this server has not applied (None: none applied since
        it started or loaded a checkpoint)."""
        last = self.applied.get(group)
        return None if last is None else last + 1

    @reports_role
    def latest(self) -> tuple[int, Any]:
        """The current version and its published snapshot (None without remote readers)."""
        return self.guard.version, self.readers.published

    @reports_role
    def values(self) -> dict[str, np.ndarray]:
        """Copies of this server's slices by slice name (for tests and small models)."""
        return {s.name: self.buf.arrays[s.name].copy() for s in self.slices}

    # ------------------------------------------------------------------ checkpoints
    @reports_role
    def snapshot(self, tmp: Any, shard: int, compression: str | None) -> dict[str, Any]:
        """Take this server's slices and their optimizer slots at this step boundary and write
        them as shard ``shard`` of the checkpoint being made in ``tmp``, in the background.

        Returns at once with the optimizer's description (for the manifest). The state is
        copied to memory on a helper thread while the workers compute the next step's
        gradients; the next update waits for that copy if it is not done yet (:meth:`_update`),
        then the copy is written while training goes on. :meth:`snapshot_result` gives the
        shard's record.
        """
        self.snaps.join()  # the driver waits for the previous one; never run two at once
        t0 = time.perf_counter()
        st = self.optimizer.state_dict()
        on_device = None
        if self.gpu is not None:  # slots copied down on a stream of their own
            st = {**st}
            st["slots"], on_device = self.gpu.snapshot_slots(st["slots"], "checkpoints")
        live = self._shard(server_shard.by_slice(st["slots"]))
        self.snaps.start(
            lambda copied: self._write_snapshot(live, tmp, shard, compression, copied, on_device)
        )
        counts = {s.param: int(st["counts"].get(s.name, 0)) for s in self.slices}
        return {
            "optimizer": {
                "name": st["name"],
                "hparams": st["hparams"],
                "schedule": st["schedule"],
                "counts": counts,
            },
            "seconds": time.perf_counter() - t0,
        }

    def _write_snapshot(
        self, live: Any, tmp: Any, shard: int, compression: str | None, copied: Any, on_device: Any
    ) -> dict[str, Any]:
        """On the helper thread: the shard written (:meth:`.Snapshots.write`), and recorded."""
        t0, version = time.perf_counter(), self.guard.version  # still until the copy is taken
        record = self.snaps.write(live, version, tmp, shard, compression, copied, on_device)
        self.rec.checkpoint(time.perf_counter() - t0, record.get("size", 0))
        return record

    def _shard(self, slots: dict[str, dict[str, np.ndarray]]) -> server_shard.Tensors:
        """This server's shard as (info, live array) pairs: slices, then optimizer ``slots``
        (by slice name, then slot name)."""
        values = {s.name: self.buf.arrays[s.name] for s in self.slices}
        return server_shard.shard_tensors(
            self.slices, self.shapes, values, slots, self.guard.version
        )

    @reports_role
    def prepare_snapshots(self) -> None:
        """Lay out and map the shard image in the background now, so that the first checkpoint
        costs training no more than the later ones (periodic checkpoints, no compression)."""
        names = self.optimizer.slot_names()
        placeholders = {  # the slots the optimizer will have, never read
            s.name: {n: np.empty(s.size, self.buf.arrays[s.name].dtype) for n in names}
            for s in self.slices
        }
        self.snaps.prepare(self._shard(placeholders))

    @reports_role
    def snapshot_result(self, wait: bool = True) -> dict[str, Any] | None:
        """The shard record of the background write (with ``update_waited``: the seconds an
        update waited for the copy); None while it runs (``wait=False``). A failed write raises
        here, naming the file."""
        return self.snaps.result(wait)

    @reports_role
    def verify(self, source: Any, files: list[str]) -> str | None:
        """Hash ``files`` of a checkpoint (this server's share of the check) against its
        manifest: None when they match, else what is wrong (the driver then falls back)."""
        return server_shard.verify(source, files)

    @reports_role
    def load(self, source: Any, resume: bool, names: Any = None, own_hparams: bool = False) -> int:
        """Overwrite this server's slices from a checkpoint (already verified), whatever
        slicing wrote it.

        ``resume``: parameters, optimizer slots, update counts, schedule and hyperparameters
        (the checkpoint's are authoritative). Otherwise (``--init-from``) only the parameters in
        ``names`` (model name -> checkpoint name); the rest keep their initial values.
        ``own_hparams`` (a fork): as a resume, but under this server's optimizer
        hyperparameters and schedule (the job's), not the checkpoint's.
        Returns the number of elements loaded.
        """
        self.applied = {}
        loaded, opt = server_shard.load_slices(source, self.slices, self.buf.arrays, resume, names)
        if opt is not None:
            if own_hparams:
                mine = self.optimizer.state_dict()
                opt = {**opt, "hparams": mine["hparams"], "schedule": mine["schedule"]}
            self.optimizer.load_state_dict(opt)
            self.guard.set_version(max(opt["counts"].values(), default=0))
        self.readers.forget()
        if self.gpu is not None:
            self.gpu.reload()
        self.publish()
        return loaded

    @reports_role
    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        if self.inbox is not None:
            self.inbox.close()
        self.readers.close()
        self.snaps.close()
        self.copies.close()
        self.pool.shutdown(wait=False)
        self._attached.close()
        if self.gpu is not None:
            self.gpu.close()
        self.buf.close()
