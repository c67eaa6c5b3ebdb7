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
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from raysinga.model import ModelSpec, Net
from raysinga.optim import make_optimizer
from raysinga.trainer import check_finite_state

from .buffers import SEQ, Attachments, Layout, SharedBuffer, ShmHandle, UpdateGuard, with_seq
from .device import ServerDevice
from .doorbell import Doorbell
from .errors import reports_role
from .slicing import Slice


def node_id() -> str:
    import ray  # noqa: PLC0415 - actors run under Ray; the module imports without it

    return ray.get_runtime_context().get_node_id()


class ParamServer:
    role = "server"

    def __init__(
        self,
        index: int,
        model: dict[str, Any],
        dtype: str,
        seed: int,
        slices: list[Slice],
        updater: dict[str, Any],
        tag: str,
        device: str = "cpu",
    ) -> None:
        self.index = index
        self.slices = [s for s in slices if s.server == index]
        net = Net(ModelSpec.from_dict(model), dtype=dtype)
        self.layout = Layout.of({s.name: ((s.size,), dtype) for s in self.slices})
        self.node = node_id()
        self.buf = SharedBuffer(f"{tag}-server{index}", with_seq(self.layout), self.node)
        # Asynchronous groups read the values while others update them: readers copy under
        # this sequence lock, whose counter is also the version (updates applied) of the slices.
        self.guard = UpdateGuard(self.buf.arrays[SEQ])
        for s in self.slices:
            self.buf.arrays[s.name][...] = net.init_param(s.param, seed).reshape(-1)[
                s.start : s.stop
            ]
        self.shapes = net.param_shapes()
        self.optimizer = make_optimizer(updater)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")  # background writes
        self._writer: Future[dict[str, Any]] | None = None
        self._snap: dict[tuple[str, int], np.ndarray] = {}  # snapshot buffers, reused
        self._image: Any = None  # the shard image snapshots are copied into, reused
        self._preparing: Future[None] | None = None
        self._copied: threading.Event | None = None  # set once a snapshot's copy is taken
        self._copy_wait = 0.0  # seconds the update after the last snapshot waited for its copy
        # Servers work while the workers wait for them, so spread updates over the node's cores.
        self.pool = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)))
        self.remote_readers = False
        self._published: Any = None
        self._attached = Attachments()
        self.gpu: ServerDevice | None = None  # device "gpu": the optimizer runs on a GPU
        if device == "gpu":
            self.gpu = ServerDevice(self.layout, self.buf)
        elif device != "cpu":
            raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")

    @reports_role
    def describe(self) -> dict[str, Any]:
        return {"node": self.node, "handle": self.buf.handle()}

    @reports_role
    def set_remote_readers(self, remote: bool) -> Any:
        """Whether some reader sits on another node; if so, publish snapshots from now on."""
        self.remote_readers = remote
        return self._publish()

    def _publish(self) -> Any:
        if not self.remote_readers:
            return None
        import ray  # noqa: PLC0415

        self._published = ray.put(self.buf.snapshot())
        return self._published

    @reports_role
    def serve(self, start: int, stop: int, go: str, done: str, grads: ShmHandle) -> int:
        """Apply updates for steps ``start .. stop-1`` as the stub rings (same node only)."""
        from .worker import GO, SERVER_DONE  # noqa: PLC0415 - one place for message formats

        go_bell, done_bell = Doorbell(go, GO), Doorbell(done, SERVER_DONE)
        try:
            for step in range(start, stop):
                (asked,) = go_bell.wait()
                if asked != step:
                    raise RuntimeError(f"stub rang for step {asked}, expected {step}")
                _, _, seconds = self._update(step, grads)
                done_bell.ring(self.index, step, 0, seconds)
        except BaseException:
            done_bell.ring(self.index, -1, 1, 0.0)
            raise
        finally:
            go_bell.close()
            done_bell.close()
        return stop - start

    @reports_role
    def update(self, step: int, grads: ShmHandle | np.ndarray) -> tuple[int, Any, float]:
        return self._update(step, grads)

    def _update(self, step: int, grads: ShmHandle | np.ndarray) -> tuple[int, Any, float]:
        """Apply a summed gradient; ``grads`` is the stub's full-parameter buffer (same node) or
        this server's slices laid out as in :attr:`layout` (another node).

        Returns ``(version, snapshot ref or None, seconds spent)``.
        """
        t0 = time.perf_counter()
        if self._copied is not None:  # a checkpoint's copy of the values must come first
            self._copied.wait()
            self._copied = None
            self._copy_wait = time.perf_counter() - t0
        if isinstance(grads, ShmHandle):
            full = self._attached.views(grads)
            g = {s.name: full[s.param].reshape(-1)[s.start : s.stop] for s in self.slices}
        else:
            g = self.layout.views(grads)
        if self.gpu is not None:
            g = self.gpu.upload_grads({s.name: g[s.name] for s in self.slices})
            for s in self.slices:
                self.optimizer.update(step, s.name, self.gpu.values[s.name], g[s.name])
            with self.guard:
                self.gpu.publish()
        else:
            with self.guard:
                for s in self.slices:
                    self.optimizer.update(
                        step, s.name, self.buf.arrays[s.name], g[s.name], self.pool
                    )
        ref = self._publish()
        return self.guard.version, ref, time.perf_counter() - t0

    @reports_role
    def latest(self) -> tuple[int, Any]:
        """The current version and its published snapshot (None without remote readers)."""
        return self.guard.version, self._published

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
        self._join_writer()  # the driver waits for the previous one; never run two at once
        t0 = time.perf_counter()
        st = self.optimizer.state_dict()
        on_device = None
        if self.gpu is not None:  # slots copied down on a stream of their own
            st = {**st}
            st["slots"], on_device = self.gpu.snapshot_slots(st["slots"])
        live = self._tensors(st)
        self._copied = copied = threading.Event()
        self._copy_wait = 0.0

        def write() -> dict[str, Any]:
            try:
                return self._write_snapshot(live, tmp, shard, compression, copied, on_device)
            finally:
                copied.set()  # whatever failed, the next update must not wait for ever

        self._writer = self._io.submit(write)
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
        self,
        live: list,
        tmp: Any,
        shard: int,
        compression: str | None,
        copied: threading.Event,
        on_device: Any = None,
    ) -> dict[str, Any]:
        from raysinga.checkpoint import writer  # noqa: PLC0415

        try:
            if on_device is not None:  # the slots' device-to-host copy (a CUDA event)
                on_device.synchronize()
            image = self._image_for(live) if compression is None else None
            tensors = image.place(live, self.pool) if image is not None else self._copies(live)
        finally:
            copied.set()  # updates may go on (after a failure too: it is reported at the end)
        # On the copy, off the training path: a non-finite state is never committed.
        check_finite_state(((i.name, a) for i, a in tensors), self.guard.version)
        return writer.write_shard(tmp, shard, tensors, compression, image)

    def _tensors(self, st: dict[str, Any], slot_names: tuple[str, ...] | None = None) -> list:
        """This server's shard as (info, live array) pairs: slices, then optimizer slots. With
        ``slot_names``, the slots the optimizer will have, as untouched placeholders."""
        from raysinga import run_state  # noqa: PLC0415

        values = {s.name: self.buf.arrays[s.name] for s in self.slices}
        slots: dict[str, dict[str, np.ndarray]] = {}
        if slot_names is None:
            for key, a in st["slots"].items():
                name, _, slot = key.rpartition("/")
                slots.setdefault(name, {})[slot] = np.asarray(a)
        else:
            for s in self.slices:
                a = values[s.name]
                slots[s.name] = {n: np.empty(a.shape, a.dtype) for n in slot_names}
        return run_state.slice_tensors(self.slices, self.shapes, values, slots, self.guard.version)

    def _image_for(self, live: list) -> Any:
        """The shard image to copy ``live`` into: the one kept from the last checkpoint (or
        prepared at start) when the layout still fits, else a new one; None where Arrow's
        layout cannot be used (the copies then go to plain buffers)."""
        from raysinga.checkpoint import writer  # noqa: PLC0415

        if self._preparing is not None:
            self._preparing.exception()
            self._preparing = None
        if self._image is None or not self._image.fits(live):
            self._image = None
            try:
                self._image = writer.ShardImage(live)
            except ValueError:
                return None
        return self._image

    @reports_role
    def prepare_snapshots(self) -> None:
        """Lay out and map the shard image in the background now, so that the first checkpoint
        costs training no more than the later ones (periodic checkpoints, no compression)."""
        from raysinga.checkpoint import writer  # noqa: PLC0415

        placeholders = self._tensors({}, self.optimizer.slot_names())

        def prepare() -> None:
            with contextlib.suppress(ValueError):
                self._image = writer.ShardImage(placeholders)

        self._preparing = self._io.submit(prepare)

    def _copies(self, live: list) -> list:
        """Copies of ``live`` in buffers kept from one checkpoint to the next (already paged
        in: a fresh allocation would cost page faults on every checkpoint), filled in chunks on
        the update pool's threads."""
        keys = [(i.name, i.start) for i, _ in live]
        if list(self._snap) != keys or any(
            self._snap[k].shape != a.shape or self._snap[k].dtype != a.dtype
            for k, (_, a) in zip(keys, live, strict=True)
        ):
            self._snap = {k: np.empty_like(a) for k, (_, a) in zip(keys, live, strict=True)}
        from raysinga.checkpoint import writer  # noqa: PLC0415

        writer.copy_in_chunks(
            [(self._snap[k], a) for k, (_, a) in zip(keys, live, strict=True)], self.pool
        )
        return [(i, self._snap[k]) for k, (i, _) in zip(keys, live, strict=True)]

    @reports_role
    def snapshot_result(self, wait: bool = True) -> dict[str, Any] | None:
        """The shard record of the background write (with ``update_waited``: the seconds an
        update waited for the copy); None while it runs (``wait=False``). A failed write raises
        here, naming the file."""
        if self._writer is None:
            raise RuntimeError("no checkpoint write was started")
        if not wait and not self._writer.done():
            return None
        fut, self._writer = self._writer, None
        return {**fut.result(), "update_waited": self._copy_wait}

    def _join_writer(self) -> None:
        if self._writer is not None:
            fut, self._writer = self._writer, None
            fut.exception()  # a failure was (or will be) reported through snapshot_result

    @reports_role
    def verify(self, source: Any, files: list[str]) -> str | None:
        """Hash ``files`` of a checkpoint (this server's share of the check) against its
        manifest: None when they match, else what is wrong (the driver then falls back)."""
        from raysinga.checkpoint import CheckpointError  # noqa: PLC0415

        try:
            source.verify_files(source.open(verify="fast"), files)
        except CheckpointError as e:
            return str(e)
        return None

    @reports_role
    def load(self, source: Any, resume: bool, names: Any = None) -> int:
        """Overwrite this server's slices from a checkpoint (already verified), whatever
        slicing wrote it.

        ``resume``: parameters, optimizer slots, update counts, schedule and hyperparameters
        (the checkpoint's are authoritative). Otherwise (``--init-from``) only the parameters in
        ``names`` (model name -> checkpoint name); the rest keep their initial values.
        Returns the number of elements loaded.
        """
        from raysinga import run_state  # noqa: PLC0415

        ck = source.open(verify="fast")
        loaded = 0
        for s in self.slices:
            stored = s.param if resume else (names or {}).get(s.param)
            if stored is None:
                continue
            self.buf.arrays[s.name][...] = ck.flat_range(stored, s.start, s.stop)
            loaded += s.size
        if resume:
            opt = run_state.run_info(ck)["optimizer"]
            slots, counts = {}, {}
            for s in self.slices:
                counts[s.name] = int(opt["counts"].get(s.param, 0))
                for slot in run_state.slot_names(ck, s.param):
                    slots[f"{s.name}/{slot}"] = ck.flat_range(f"{s.param}/{slot}", s.start, s.stop)
            self.optimizer.load_state_dict(
                {
                    "name": opt["name"],
                    "hparams": opt["hparams"],
                    "schedule": opt["schedule"],
                    "slots": slots,
                    "counts": counts,
                }
            )
            self.guard.set_version(max(counts.values(), default=0))
        if self.gpu is not None:
            self.gpu.reload()
        self._publish()
        return loaded

    @reports_role
    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        self._join_writer()
        self._io.shutdown(wait=True)
        self.pool.shutdown(wait=False)
        self._attached.close()
        if self.gpu is not None:
            self.gpu.close()
        self.buf.close()
