"""The net's structure, as SINGA's visualisation gave it: JSON, and a drawing of the layer chain
(``raysinga graph CONFIG``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raysinga.config.job import JobConfig
from raysinga.nn.model import Net

FORMATS = (".png", ".svg")
SKIP = "#3b6fd1"  # the colour of a residual connection's arrow


def describe(cfg: JobConfig) -> dict[str, Any]:
    return {"name": cfg.name, **Net(cfg.model, dtype=cfg.dtype).describe()}


def _shape(s: list[int]) -> str:
    return "x".join(map(str, s)) or "scalar"


def _box_text(layer: dict[str, Any]) -> str:
    opts = ", ".join(f"{k}={v}" for k, v in layer["options"].items() if k != "from")
    if layer["options"].get("from"):
        opts = "sum of " + " + ".join(layer["options"]["from"]) + (", " + opts if opts else "")
    lines = [f"{layer['name']}  ({layer['kind']}{': ' + opts if opts else ''})"]
    lines.append(f"out {_shape(layer['output_shape'])}")
    if layer["param_count"]:
        shapes = ", ".join(_shape(s) for s in layer["params"].values())
        lines[-1] += f"   params {layer['param_count']:,} ({shapes})"
    return "\n".join(lines)


def draw(net: dict[str, Any], out: Path) -> None:
    """The layer chain top to bottom: input, one box per layer, the loss; a layer that sums
    earlier outputs (``from``) gets an arrow from each of them, drawn as an arc on the right
    where it skips layers."""
    from .plots import pyplot  # noqa: PLC0415 - matplotlib, only here

    plt = pyplot("graph")
    boxes = [f"input  {_shape(net['input_shape'])}"]
    boxes += [_box_text(ly) for ly in net["layers"]]
    boxes.append(f"loss: {net['loss']}   ({net['param_count']:,} parameters in all)")
    step = 1.0
    fig, ax = plt.subplots(figsize=(7.5, 0.9 * len(boxes) + 0.6), layout="constrained")
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.6, step * (len(boxes) - 1) + 0.6)
    ax.axis("off")
    colours = {"input": "#e8f0fe", "loss": "#fde8e8"}
    skips = 0
    for i, text in enumerate(boxes):
        y = step * (len(boxes) - 1 - i)
        kind = "input" if i == 0 else "loss" if i == len(boxes) - 1 else "layer"
        ax.text(
            0.5,
            y,
            text,
            ha="center",
            va="center",
            fontsize=9,
            family="monospace",
            bbox={
                "boxstyle": "round,pad=0.45",
                "facecolor": colours.get(kind, "#f2f2f2"),
                "edgecolor": "0.35",
            },
        )
        sources = net["layers"][i - 1]["options"].get("from") if 0 < i < len(boxes) - 1 else None
        previous = net["layers"][i - 2]["name"] if i > 1 else None
        if i and (not sources or previous in sources):
            ax.annotate(
                "",
                xy=(0.5, y + 0.3),
                xytext=(0.5, y + step - 0.3),
                arrowprops={"arrowstyle": "->", "color": "0.3"},
            )
        for src in sources or ():
            if src == previous:
                continue
            k = next(j for j, ly in enumerate(net["layers"]) if ly["name"] == src)
            y_src = step * (len(boxes) - 2 - k)
            lane = 0.91 if skips % 2 == 0 else 0.96  # skips side by side do not overlap
            skips += 1
            ax.plot([0.83, lane, lane], [y_src, y_src, y], color=SKIP, lw=1.2)
            ax.annotate(
                "", xy=(0.83, y), xytext=(lane, y), arrowprops={"arrowstyle": "->", "color": SKIP}
            )
    ax.set_title(f"{net['name']}: the net", fontsize=11)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def write_graph(cfg: JobConfig, out: str | Path | None = None) -> list[Path]:
    """``<out>.json`` and the drawing ``out`` (.png or .svg; default ``<name>-net.png``); only
    the JSON where ``out`` ends in .json (no matplotlib needed)."""
    path = Path(out) if out is not None else Path(f"{cfg.name}-net.png")
    drawing = path.suffix.lower() != ".json"
    if drawing and path.suffix.lower() not in FORMATS:
        raise ValueError(f"{path}: the drawing must be {' or '.join(FORMATS)} (or .json alone)")
    if drawing:
        try:
            from .plots import pyplot  # noqa: PLC0415

            pyplot("graph")  # before anything is written
        except RuntimeError as e:
            raise RuntimeError(
                f"{e}; -o {path.with_suffix('.json')} writes the JSON alone"
            ) from None
    net = describe(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    js = path.with_suffix(".json")
    js.write_text(json.dumps(net, indent=2) + "\n")
    if not drawing:
        return [js]
    draw(net, path)
    return [js, path]
