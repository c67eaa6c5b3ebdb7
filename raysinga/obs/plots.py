"""Pictures of a run from its ``metrics.jsonl``: loss and accuracy against step, and samples/s,
with checkpoints, failures and resizes marked (``raysinga plot RUN``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"


def load_records(run: str | Path) -> tuple[Path, list[dict[str, Any]]]:
    """The records of a run directory's ``metrics.jsonl`` (or of that file itself)."""
    path = Path(run)
    if path.is_dir():
        path = path / METRICS
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such metrics file (a run directory has {METRICS})")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON record ({e.msg})") from None
        if not isinstance(rec, dict) or "kind" not in rec:
            raise ValueError(f"{path}:{n}: a record needs a 'kind'")
        records.append(rec)
    return path, records


def pyplot(command: str = "plot") -> Any:
    """matplotlib's pyplot, drawing to files; a clear error naming ``raysinga <command>``
    where matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415 - optional: only plots need it
    except ImportError:
        raise RuntimeError(
            f"raysinga {command} needs matplotlib to draw: pip install matplotlib (in a "
            "raysinga checkout, pip install -e '.[plot]' does the same)"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _mark_events(ax: Any, records: list[dict[str, Any]]) -> None:
    """Vertical lines: checkpoints (grey, dotted), failures (red) with the step restored
    (red, dashed), resizes (green); each kind labelled once, for the legend."""
    seen: set[str] = set()

    def line(x: float, label: str, **style: Any) -> None:
        ax.axvline(x, label=None if label in seen else label, **style)
        seen.add(label)

    for r in records:
        kind, step = r.get("kind"), r.get("step")
        if not isinstance(step, (int, float)):
            continue
        if kind == "checkpoint":
            line(step, "checkpoint", color="0.55", linestyle=":", linewidth=1)
        elif kind == "failure":
            line(step, "failure", color="tab:red", linewidth=1.8)
            if isinstance(r.get("restored_from"), (int, float)):
                line(r["restored_from"], "restored from", color="tab:red", linestyle="--")
        elif kind == "resize":
            line(step, "resize", color="tab:green", linestyle="-.", linewidth=1.5)


def plot_run(run: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write ``loss.png`` and ``throughput.png`` for a run into ``out`` (default: the run
    directory); returns their paths."""
    path, records = load_records(run)
    train = [r for r in records if r["kind"] == "train" and "loss" in r]
    evals = [r for r in records if r["kind"] == "eval"]
    if not train and not evals:
        raise ValueError(f"{path}: no train or eval records to plot")
    out_dir = Path(out) if out is not None else path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    name = path.parent.name
    fig, ax = loss_figure(plt, records)
    written = [_save(plt, fig, ax, f"{name}: loss and accuracy", out_dir / "loss.png")]
    if any("samples_per_s" in r for r in train):
        fig, ax = throughput_figure(plt, records)
        lr = any(r["kind"] == "train" and "lr" in r for r in records)
        title = f"{name}: training throughput" + (" and learning rate" if lr else "")
        written.append(_save(plt, fig, ax, title, out_dir / "throughput.png"))
    return written


SPLIT_MARKS = {"valid": "^", "test": "o"}  # held-out splits and their markers


def loss_figure(plt: Any, records: list[dict[str, Any]]) -> tuple[Any, Any]:
    """Train, validation and test loss (a log scale where they span more than a decade), their
    accuracy on a second axis that spans at least ``ACCURACY_SPAN``, and the run's events."""
    train = [r for r in records if r["kind"] == "train" and "loss" in r]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(9, 5), layout="constrained")
    handles: list[Any] = []
    if train:
        handles += _series(ax, train, "loss", "-", "train loss")
    losses = [r["loss"] for r in train]
    for split, mark in SPLIT_MARKS.items():
        held = [r for r in evals if f"{split}_loss" in r]
        if held:
            handles += _series(ax, held, f"{split}_loss", f"{mark}-", f"{split} loss")
            losses += [r[f"{split}_loss"] for r in held]
    ax.set_yscale(loss_scale(losses))
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    _mark_events(ax, records)
    accs = {s: [r for r in evals if f"{s}_accuracy" in r] for s in SPLIT_MARKS}
    if any(accs.values()):
        ax2 = ax.twinx()
        for (split, acc), color in zip(accs.items(), ("tab:olive", "tab:purple"), strict=True):
            if acc:
                name = f"{split}_accuracy"
                handles += _series(ax2, acc, name, "s-", f"{split} accuracy", color=color)
        ax2.set_ylim(*accuracy_limits([r[f"{s}_accuracy"] for s in accs for r in accs[s]]))
        ax2.set_ylabel("accuracy")
    marks = [h for h in ax.get_legend_handles_labels()[0] if h not in handles]
    ax.legend(handles=handles + marks, loc="upper right")
    return fig, ax


def throughput_figure(plt: Any, records: list[dict[str, Any]]) -> tuple[Any, Any]:
    """Samples per second and, below it where the records carry it, the learning rate (a log
    scale where it spans more than a decade), with the run's events on both."""
    rate = [r for r in records if r["kind"] == "train" and "samples_per_s" in r]
    lrs = [r for r in records if r["kind"] == "train" and isinstance(r.get("lr"), (int, float))]
    if lrs:
        fig, (ax, lax) = plt.subplots(
            2, 1, figsize=(9, 6), layout="constrained", sharex=True, height_ratios=(3, 2)
        )
    else:
        fig, ax = plt.subplots(figsize=(9, 4), layout="constrained")
    _series(ax, rate, "samples_per_s", ".-", "samples/s")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    _mark_events(ax, records)
    ax.legend(loc="lower right")
    if lrs:
        _series(lax, lrs, "lr", "-", "learning rate", color="tab:green")
        lax.set_yscale(loss_scale([r["lr"] for r in lrs]))
        lax.set_ylabel("learning rate")
        lax.grid(alpha=0.3)
        _mark_events(lax, records)
        lax.set_xlabel("step")
    else:
        ax.set_xlabel("step")
    return fig, ax


ACCURACY_SPAN = 0.1  # the accuracy axis spans at least this much: a 0.3% wiggle stays small


def loss_scale(values: list[float]) -> str:
    """``"log"`` for positive values that span more than a factor of ten, else ``"linear"``."""
    finite = [v for v in values if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) > 10 * min(finite):
        return "log"
    return "linear"


def accuracy_limits(values: list[float]) -> tuple[float, float]:
    """The accuracy axis: up to 1 (or the highest value, if above), down to a little below the
    lowest value, and at least ``ACCURACY_SPAN`` tall, never below 0."""
    finite = [v for v in values if math.isfinite(v)] or [0.0]
    hi = max(1.0, max(finite))
    lo = min(min(finite) - 0.02, hi - ACCURACY_SPAN)
    return max(0.0, lo), hi


def _series(ax: Any, recs: list[dict[str, Any]], key: str, fmt: str, label: str, **style: Any):
    return ax.plot([r["step"] for r in recs], [r[key] for r in recs], fmt, label=label, **style)


def _save(plt: Any, fig: Any, ax: Any, title: str, path: Path) -> Path:
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
