"""Loading parameters into a different model by name (SINGA-12, "parameter reuse").

Checkpoint names are mapped to the target's names (strip a prefix, then rename exact names or
prefixes ending in ``/``); the report says what matched, what the target lacks from the
checkpoint (missing), what the checkpoint has that the target does not use (unexpected), and what
has the wrong shape. Strict mode, used for resume, refuses anything but a perfect match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .format import CheckpointError


@dataclass
class MatchReport:
    matched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # target names with no checkpoint tensor
    unexpected: list[str] = field(default_factory=list)  # checkpoint names the target lacks
    mismatched: list[tuple[str, tuple, tuple]] = field(default_factory=list)  # name, ckpt, target

    @property
    def perfect(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        lines = [
            f"matched {len(self.matched)}, missing {len(self.missing)}, unexpected "
            f"{len(self.unexpected)}, shape-mismatched {len(self.mismatched)}"
        ]
        lines += [f"  missing (initialised fresh): {n}" for n in self.missing]
        lines += [f"  unexpected (ignored): {n}" for n in self.unexpected]
        lines += [
            f"  shape mismatch: {n}: checkpoint {list(a)}, model {list(b)}"
            for n, a, b in self.mismatched
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "matched": self.matched,
            "missing": self.missing,
            "unexpected": self.unexpected,
            "mismatched": [[n, list(a), list(b)] for n, a, b in self.mismatched],
        }


def map_name(name: str, rename: dict[str, str] | None, strip_prefix: str | None) -> str:
    if strip_prefix and name.startswith(strip_prefix):
        name = name[len(strip_prefix) :]
    for old, new in (rename or {}).items():
        if name == old:
            return new
        if old.endswith("/") and name.startswith(old):
            return new + name[len(old) :]
    return name


def match(
    arrays: dict[str, np.ndarray],
    target: dict[str, tuple[int, ...]],
    rename: dict[str, str] | None = None,
    strip_prefix: str | None = None,
    strict: bool = False,
) -> tuple[dict[str, np.ndarray], MatchReport]:
    """Checkpoint ``arrays`` renamed onto ``target`` (name -> shape); returns what to load and
    the report. ``strict`` raises on any difference, listing every mismatched name."""
    report, out, seen = MatchReport(), {}, set()
    for name, a in arrays.items():
        t = map_name(name, rename, strip_prefix)
        if t in seen:
            raise CheckpointError(f"two checkpoint tensors map to {t!r}; fix the renames")
        seen.add(t)
        if t not in target:
            report.unexpected.append(name)
        elif tuple(a.shape) != tuple(target[t]):
            report.mismatched.append((t, tuple(a.shape), tuple(target[t])))
        else:
            report.matched.append(t)
            out[t] = a
    report.missing = [n for n in target if n not in seen]
    if strict and not report.perfect:
        raise CheckpointError(
            "the checkpoint does not fit this model (use --init-from to "
            f"load what matches):\n{report}"
        )
    return out, report
