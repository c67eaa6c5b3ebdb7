"""What crosses between the driver and the roles, and among the roles: one place for all of it.

- **Role specs** (frozen): what a server, a worker or a stub is made from. The driver builds
  them once per placement; a role replaced after a loss gets the same spec again.
- **Doorbell messages** (named): the fixed-size records rung through FIFOs within a node
  (:mod:`.doorbell`), each a ``NamedTuple`` whose ``FORMAT`` is the struct format it travels in
  (a plain class attribute: an annotated one would be a field).
- **Step statistics**: one synchronous step of a group, as the stub measured it.

Nothing here imports the roles, so ``server``, ``worker`` and ``stub`` depend on this module and
not on one another.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from .buffers import Layout, ShmHandle
from .slicing import Slice

# --------------------------------------------------------------------------- role specs


@dataclass(frozen=True)
class ServerSpec:
    """Parameter server ``index``: it owns the slices with ``server == index``."""

    index: int
    model: dict[str, Any]
    dtype: str
    seed: int
    slices: tuple[Slice, ...]
    updater: dict[str, Any]
    tag: str  # names the run's shared-memory files
    device: str = "cpu"
    lr_scale: float = 1.0  # on every update's learning rate (JobConfig.lr_scale)
    wire: str = "f32"  # topology.wire: what its values are published as (actors.exchange.wire)
    inbox: bool = False  # topology.reduce hosts: it takes the blocks' sums in (actors.exchange.tcp)
    metrics: str | None = None  # the run's name, where it records Ray metrics (obs.raymetrics)


@dataclass(frozen=True)
class WorkerSpec:
    """Worker ``index`` of group ``group``: it computes its part of the group's batch."""

    index: int
    group: int
    model: dict[str, Any]
    dtype: str
    seed: int
    data: dict[str, Any]
    group_batch: int
    shuffle: bool
    slices: tuple[Slice, ...]
    n_servers: int
    n_groups: int
    tag: str
    device: str = "cpu"
    blas_threads: int = 1  # kernels.cpu_threads.compute_threads of the worker's CPUs
    validation: dict[str, Any] | None = None  # data.validation: held out of the training split
    graphs: str = "off"  # a GPU worker's steps as CUDA graphs: run.graph_step.graphs_mode
    precision: str = "f32"  # the matrix products' precision.compute (kernels.precision)
    wire: str = "f32"  # topology.wire: what gradients and values cross as (actors.exchange.wire)
    mirrors: bool = False  # topology.reduce hosts: it can take the servers' values in (.mirrors)
    metrics: str | None = None  # the run's name, where it records Ray metrics (obs.raymetrics)
    dw_row_blocks: int = 1  # a dense weight's gradient in blocks of rows (nn.layers.dw_row_blocks)


@dataclass(frozen=True)
class StubSpec:
    """The stub of group ``index``: it sums its workers' gradients and hands them to the
    servers. The role handles and their ``describe()`` answers are given beside the spec."""

    index: int
    shapes: dict[str, tuple[int, ...]]
    slices: tuple[Slice, ...]
    dtype: str
    clip_norm: float | None
    n_groups: int
    tag: str
    replay: int = 0  # steps of summed gradients logged for rebuilding a lost server
    block: int = 0  # topology.reduce: hosts: workers summed together per host (0: the stub sums)
    wire: str = "f32"  # topology.wire (actors.exchange.wire)
    metrics: str | None = None  # the run's name, where it records Ray metrics (obs.raymetrics)


@dataclass(frozen=True)
class Published:
    """A server's values as it published them (an object-store ref), for a worker on another
    node: handed over inside this, not as a call's argument, so that the worker fetches them
    itself, abortably. An argument is fetched before the call runs, and one whose owner's host
    went silent held the call, and every later call to that worker behind it, until Ray gave
    the owner up (about 150 s on emulated hosts), whatever was aborted meanwhile."""

    ref: Any


def mirror_seq(generation: int, version: int) -> int:
    """What a node's mirror of a server's values names them by (:mod:`actors.exchange.mirrors`): the
    version in the low 32 bits, and above it the generation of the server's values, which
    changes whenever they change other than by an update (loaded, restored, rewired), so that
    a mirror's values from before never pass for the same version after."""
    return generation << 32 | version & 0xFFFFFFFF


@dataclass(frozen=True)
class Pushed:
    """A server's values as it pushed them to a worker's inbox on each node that reads them
    (``topology.reduce: hosts``, :mod:`actors.exchange.mirrors`): after ``version`` updates, of
    ``generation`` (:func:`mirror_seq`); ``nbytes``: what each reader node was sent of them
    (compressed, under ``wire: *+zstd`` and ``*+delta``)."""

    version: int
    nbytes: int = 0
    generation: int = 0


@dataclass(frozen=True)
class MirrorAt:
    """A server's values in its mirror on a worker's node (:mod:`actors.exchange.mirrors`), to be
    read once the mirror holds those after ``version`` updates of server ``server``, of
    ``generation`` (:func:`mirror_seq`)."""

    handles: tuple[Any, Any]  # the ShmHandles of the server's two mirrors there, taken in turn
    version: int
    server: int
    generation: int = 0

    @property
    def handle(self) -> Any:
        """The mirror that takes the values after ``version`` updates in."""
        return self.handles[self.version % 2]

    @property
    def seq(self) -> int:
        """What that mirror names these values by, once it holds them."""
        return mirror_seq(self.generation, self.version)


@dataclass(frozen=True)
class ServerAt:
    """A server's own buffer on a worker's node, to be read once it holds the values after
    ``version`` updates of server ``server`` (its sequence lock at ``2 * version``): for a
    step whose call went out before the step before it was done
    (:func:`actors.hostsum.stub_side.block_steps`)."""

    handle: Any  # the server's ShmHandle
    version: int
    server: int


def updates_later(source: MirrorAt | ServerAt, n: int) -> MirrorAt | ServerAt:
    """``source`` read ``n`` updates later: the values a step ``n`` steps after the one it
    was made for reads (:meth:`~actors.worker.Worker.compute_steps`)."""
    if not isinstance(source, (MirrorAt, ServerAt)):
        raise TypeError(f"a step ahead reads a server's values at a version, not {source!r}")
    return replace(source, version=source.version + n)


@dataclass(frozen=True)
class HostFrames:
    """A server's share of one step of a group summed by hosts (``topology.reduce: hosts``):
    the frames of the ``blocks`` blocks' leaders, each the block's sum of this server's slices
    in its order (as they cross: :func:`actors.exchange.wire.encode`), sent under ``epoch`` straight
    to the server's inbox (:mod:`actors.exchange.tcp`; :meth:`~actors.worker.Worker.host_sum`)."""

    epoch: int
    blocks: int


@dataclass(frozen=True)
class BlockSend:
    """What a block of one worker (``topology.reduce: hosts``) sends its gradient to, as it
    computes it: the servers' inboxes ``to`` (in server order, each ``(host, port, key)``),
    as block ``block`` (:class:`.worker_side.EarlySends`)."""

    to: tuple[tuple[str, int, bytes], ...]
    block: int
    # for each server, whether it sits on the worker's node: a worker there reads its values
    # in place, so the worker's parts for it wait until their layers are done, dx included
    beside: tuple[bool, ...] = ()


@dataclass(frozen=True)
class SummedGrads:
    """What a server on its stub's node sums its gradient from, in its own update: its
    workers' gradient buffers (``parts``, in worker order, each laid out as the parameters and
    then any state copies, :func:`worker_buffer_layout`), and the stub's log rows (``rows``,
    :class:`~actors.memory.replay.ReplayLog`), into whose row ``step % n_rows`` it writes its slices
    of the sum, marking its share of the row in the same file (the row is logged once every
    server's mark names the step). The stub's own pass over the gradients, summing them, is
    saved."""

    parts: tuple[ShmHandle, ...]
    rows: ShmHandle
    n_rows: int


# --------------------------------------------------------------------------- a worker's buffer

STATE_TAGS = "~state/tags"


def worker_buffer_layout(
    shapes: dict[str, tuple[int, ...]], dtype: str, state_shapes: dict[str, tuple[int, ...]]
) -> Layout:
    """A worker's shared buffer: its gradient, laid out as the parameters (what the stub and
    the servers sum: the first ``Layout.of(params).nbytes`` bytes), then, for a model with state
    of its own (batch norm's running statistics), two copies of that state, each tagged with the
    step whose start it is the state at (``STATE_TAGS``). They are written after each step in
    turn, so the copy of the step before is whole while the next is written. A worker that
    replaces a lost one takes the lost one's copy of the step its group redoes (from the stub,
    which maps the buffer or keeps its latest snapshot); a live worker redoing a step takes its
    own."""
    arrays = {p: (s, dtype) for p, s in shapes.items()}
    if state_shapes:
        for slot in (0, 1):
            arrays.update({_state_key(slot, n): (s, dtype) for n, s in state_shapes.items()})
        arrays[STATE_TAGS] = ((2,), "int64")
    return Layout.of(arrays)


def gradient_layout(layout: Layout) -> Layout:
    """A worker buffer's gradient part: ``layout`` without the state copies (the layout of the
    parameters, as the stub's sum and its log's rows are laid out)."""
    kept = [e for e in layout.entries if not e.name.startswith("~state")]
    return Layout.of({e.name: (e.shape, e.dtype) for e in kept})


def _state_key(slot: int, name: str) -> str:
    return f"~state{slot}/{name}"


def write_state_copy(views: dict[str, np.ndarray], state: dict[str, np.ndarray], at: int) -> None:
    """Copy ``state`` into the slot of step ``at`` (the state at that step's start); the tag
    says "being written" until the copy is whole."""
    slot = at % 2
    tags = views[STATE_TAGS]
    tags[slot] = -1
    for n, a in state.items():
        views[_state_key(slot, n)][...] = a
    tags[slot] = at


def read_state_copy(views: dict[str, np.ndarray], names: Sequence[str], at: int) -> dict | None:
    """The state copied for the start of step ``at``, or None where neither slot holds it."""
    if STATE_TAGS not in views:
        return None
    tags = views[STATE_TAGS]
    for slot in (0, 1):
        if int(tags[slot]) == at:
            out = {n: np.array(views[_state_key(slot, n)], copy=True) for n in names}
            if int(tags[slot]) == at:  # not rewritten while it was read
                return out
    return None


# --------------------------------------------------------------------------- doorbell messages


@dataclass(frozen=True)
class Wiring:
    """A role's doorbells for one chunk of steps (``serve``): it hears ``n_go`` :class:`Go`
    messages of chunk ``chunk`` on ``go`` before each step, rings its done message on ``done``
    after it, then rings ``then`` (other roles' go doorbells), if anything.

    With the stub between every hand-over, a role hears one go from the stub and rings nothing
    else. Where the servers sum the gradients, the roles ring one another and ring no done
    message (``done`` empty; each ``serve`` call returns what it measured): a worker hears each
    server's go and rings every server when its part is written; a server hears every worker's
    go and rings every worker's go for the next step once its update is done. So a worker
    starts no step before every server has finished the last one, and the stub, hearing a
    server fail, finds the workers' gradients still those of the failed step."""

    chunk: int
    go: str
    done: str
    n_go: int = 1
    then: tuple[str, ...] = ()
    next_step: int = 0  # the ``then`` messages carry step + this (0 from a worker, 1 a server)


class Go(NamedTuple):
    """Run ``step`` now: stub -> worker or server; where the servers sum the gradients, also
    worker -> server (its part of ``step`` is written) and server -> worker (``step``'s
    parameters are updated). ``chunk`` names the chunk of steps it belongs to: one left in a
    doorbell by a chunk that failed is told apart from the next chunk's."""

    FORMAT = "<qq"
    step: int
    chunk: int = 0


class WorkerDone(NamedTuple):
    """Worker -> stub: its part of ``step`` is computed (``failed``: it raised; the Ray call
    carries the error)."""

    FORMAT = "<qqqddddd"
    STATS = ("loss", "fetch", "compute", "start", "end")  # what the worker measured, by name
    part: int
    step: int
    failed: int
    loss: float
    fetch: float
    compute: float
    start: float  # wall clock when the worker began the step
    end: float  # and when it finished


class ServerDone(NamedTuple):
    """Server -> stub: its slices are updated for ``step``."""

    FORMAT = "<qqqd"
    server: int
    step: int
    failed: int
    seconds: float


# --------------------------------------------------------------------------- step statistics

TIMINGS = ("fetch", "compute", "gather", "dispatch", "collect", "average", "update", "server")


@dataclass(frozen=True)
class StepStats:
    """One step of a group: the summed loss of its workers and where the time went (seconds).

    ``fetch``/``compute``: the slowest worker's read of the parameters and its forward and
    backward; ``gather``: the rest of the wait for the workers, split into ``dispatch`` (reaching
    the last one) and ``collect`` (hearing back); ``average``: summing the gradients (and
    clipping); ``update``: the servers' update, of which ``server`` is the slowest server's own
    time; ``total``: the whole step. ``grad_norm`` is there where clipping computed it.
    ``traffic``: the bytes the step moved between nodes, ``(from node, to node, bytes)`` per
    route (:mod:`.traffic`); empty where the group shares one node.
    """

    step: int
    loss: float
    fetch: float
    compute: float
    gather: float
    dispatch: float
    collect: float
    average: float
    update: float
    server: float
    total: float
    grad_norm: float | None = None
    traffic: tuple[tuple[str, str, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["grad_norm"] is None:
            del out["grad_norm"]
        if not out["traffic"]:
            del out["traffic"]
        return out


# --------------------------------------------------------------------------- shared helpers


def node_id() -> str:
    """The Ray node this role runs on."""
    import ray  # noqa: PLC0415 - roles run under Ray; the module imports without it

    return ray.get_runtime_context().get_node_id()


def node_ip() -> str:
    """The address of the Ray node this role runs on (where its peers on other nodes reach
    it)."""
    import ray  # noqa: PLC0415

    return ray.util.get_node_ip_address()


def visible_gpus() -> str | None:
    """The GPUs this role sees (``CUDA_VISIBLE_DEVICES``, as Ray sets it for a role given a
    share of one): a spare that takes over a GPU role's place is given the same."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def server_layouts(slices: Sequence[Slice], n_servers: int, dtype: str) -> list[Layout]:
    """Each server's buffer layout: its slices, flat, in slice order."""
    return [
        Layout.of({s.name: ((s.size,), dtype) for s in slices if s.server == k})
        for k in range(n_servers)
    ]


def server_slices(
    params: dict[str, np.ndarray], slices: Sequence[Slice], server: int, layout: Layout
) -> np.ndarray:
    """Server ``server``'s slices of full-parameter arrays ``params`` (a summed gradient),
    laid out by ``layout`` (its :func:`server_layouts` entry), as its ``update`` takes them
    from another node."""
    out = np.zeros(layout.nbytes, np.uint8)
    views = layout.views(out)
    for s in slices:
        if s.server == server:
            views[s.name][...] = params[s.param].reshape(-1)[s.start : s.stop]
    return out
