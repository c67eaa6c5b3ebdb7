"""The key tables of ``docs/concepts.md``, drawn from the schema.

Each table sits between ``<!-- keys: NAME -->`` and ``<!-- /keys -->``; ``python -m
raysinga.config.docs docs/concepts.md`` writes them anew, and a test checks the file holds what
this module draws, so a key's default or meaning is stated in the schema and nowhere else.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from pydantic import BaseModel

from raysinga.data import kinds

from .compute import GpuConfig, PrecisionConfig
from .fault import FaultConfig
from .job import CheckpointConfig, DataConfig, DivergenceConfig, InitConfig, JobConfig
from .observe import MetricsConfig, MlflowConfig
from .section import key_table, shown_default
from .topology import Topology

SECTIONS: dict[str, type[BaseModel]] = {
    "job": JobConfig,
    "data": DataConfig,
    "topology": Topology,
    "checkpoint": CheckpointConfig,
    "fault": FaultConfig,
    "divergence": DivergenceConfig,
    "metrics": MetricsConfig,
    "mlflow": MlflowConfig,
    "init": InitConfig,
    "gpu": GpuConfig,
    "precision": PrecisionConfig,
}

BLOCK = re.compile(r"(<!-- keys: (?P<name>[\w.]+) -->\n)(?P<body>.*?)(<!-- /keys -->)", re.S)


def source_table() -> str:
    """The data source kinds: what each is, the keys it needs, and those it may have (with
    their defaults where they have one)."""
    rows = ["| `kind` | what | needs | may have (default) |", "|---|---|---|---|"]
    for name, model in kinds.SOURCES.items():
        fields = {k: v for k, v in model.model_fields.items() if k != "kind"}
        needs = [f"`{k}`" for k, v in fields.items() if v.is_required()]
        may = [
            f"`{k}`" + ("" if v.default is None else f" ({shown_default(v).strip('`')})")
            for k, v in fields.items()
            if not v.is_required()
        ]
        rows.append(
            f"| `{name}` | {_first_sentence(model.__doc__ or '')} | "
            f"{', '.join(needs)} | {', '.join(may)} |"
        )
    return "\n".join(rows)


def _first_sentence(doc: str) -> str:
    """A docstring's first sentence as Markdown: ``x`` and :mod:`x` become `x`."""
    text = " ".join(doc.split()).split(". ")[0].rstrip(".")
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def table(name: str) -> str:
    if name == "data.source":
        return source_table()
    return key_table(SECTIONS[name])


def drawn(text: str) -> str:
    """``text`` with every marked table drawn anew."""

    def draw(m: re.Match) -> str:
        return f"{m.group(1)}{table(m.group('name'))}\n{m.group(4)}"

    return BLOCK.sub(draw, text)


def main(argv: list[str]) -> int:
    for name in argv:
        p = Path(name)
        p.write_text(drawn(p.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
