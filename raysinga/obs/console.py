"""Events as the lines a user reads: rendered here, at the edge, and nowhere else.

:func:`render` is the one place a line of console text is made from an event;
:class:`TextLog` hands those lines to a ``log(line)`` callback (``print`` by default, a list's
``append`` in tests). The progress bar (:mod:`raysinga.obs.progress`) renders through it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .events import (
    CheckpointCommitted,
    Evaluated,
    Event,
    EventHub,
    Notice,
    Recovered,
    Resized,
    RoleLost,
    RunStarted,
    Subscriber,
    TrainStep,
)


def readable(n: float) -> str:
    """Bytes as a console shows them: 512 B, 3.1 kB, 4.2 MB, 1.05 GB (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def step_head(step: int, total: int) -> str:
    return f"step {step:>{len(str(total))}}/{total}"


def render(ev: Event) -> str | None:
    """The console line of an event, or None for events with nothing to say."""
    if isinstance(ev, Notice):
        return ev.text
    if isinstance(ev, TrainStep):
        line = (
            f"{step_head(ev.step, ev.total)}  epoch {ev.epoch}  loss {ev.loss:.4f}  "
            f"lr {ev.lr:.4g}  {ev.samples_per_s:,.0f} samples/s"
        )
        if ev.net:  # the host that moves the most, in and out, per step
            host, io = max(ev.net.items(), key=lambda kv: kv[1]["in"] + kv[1]["out"])
            line += f"  net {readable(io['in'])} in, {readable(io['out'])} out per step ({host})"
        return line
    if isinstance(ev, Evaluated):
        m, parts = ev.metrics, []
        for split in ("valid", "test"):
            if f"{split}_loss" in m:
                bits = f"{split}_bits"
                parts.append(f"{split}_loss {m[f'{split}_loss']:.4f}")
                parts += [f"({m[bits]:.3f} bits per token)"] if bits in m else []
                acc = f"{split}_accuracy"
                parts += [f"{acc} {m[acc]:.4f}"] if acc in m else []
        return f"{step_head(ev.step, ev.total)}  {'  '.join(parts)}"
    if isinstance(ev, RunStarted):
        return f"raysinga: training {ev.name!r} on {ev.where}"
    if isinstance(ev, CheckpointCommitted):
        if ev.in_background:
            how = f"training waited {ev.blocked_s * 1e3:.0f} ms; written in {ev.seconds:.2f} s"
        else:
            how = f"written in {ev.seconds:.2f} s"
        return f"raysinga: checkpoint step {ev.step} -> {ev.path} ({how})"
    if isinstance(ev, RoleLost):
        # The driver hears of a group's steps only as each chunk of them ends: a loss in a
        # chunk is placed in that chunk, whose end the recovery's step may be anywhere before
        where = f"at step {ev.step}"
        if ev.chunk is not None:
            where = f"in steps {ev.chunk[0]} to {ev.chunk[1]} (its group's chunk under way)"
        return (
            f"raysinga: {ev.error} {where}; recovering (failure {ev.count} of at most {ev.limit})"
        )
    if isinstance(ev, Recovered):
        r = ev.info
        whence = {
            "replaced": "where the group's servers stood",
            "rebuilt and replayed": "where the group's servers stood",
            "restarted": "every role restarted",
        }.get(r.get("recovery", ""), "")
        return (
            f"raysinga: recovered in {r['restore_s']:.2f} s from step {r['restored_from']}"
            f"{f', {whence}' if whence else ''} ({r['steps_redone']} step(s) to redo)"
        )
    if isinstance(ev, Resized):
        r = ev.info
        return (
            f"raysinga: grew to {r['groups']} group(s) x {r['workers']} worker(s) at step "
            f"{r['step']} in {r['resize_s']:.2f} s"
        )
    return None


class TextLog:
    """A subscriber that passes each event's console line to ``log``."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log

    def __call__(self, ev: Event) -> None:
        line = render(ev)
        if line is not None:
            self.log(line)


def hub_for(
    log: Callable[[str], None] | None, on_event: Subscriber | Iterable[Subscriber] | None
) -> EventHub:
    """The hub of a trainer: ``log`` gets each event as a console line (None: no text), then
    each of ``on_event`` gets the event itself."""
    subs: list[Subscriber] = [] if log is None else [TextLog(log)]
    if callable(on_event):
        subs.append(on_event)
    elif on_event is not None:
        subs.extend(on_event)
    return EventHub(subs)
