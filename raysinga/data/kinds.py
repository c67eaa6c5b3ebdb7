"""Every data set kind a job's ``data.source`` can name, the keys each takes, and
:func:`load_dataset`, which opens one split of a source."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .arrow import ArrowDataset, ParquetDataset
from .builtin import SPLITS, TeacherDataset, digits
from .cache import DEFAULT_BLOCK_BYTES, DEFAULT_CACHE_BYTES, CacheSpec
from .check import DataError
from .sources import Dataset, NpyDataset, NpzDataset
from .text import open_split

# kind -> (required keys, optional keys). Files may carry a "test" entry for the held-out split.
_FILE_COMMON = ("sample_shape", "num_classes", "test")
# The node's block cache for a path that is a URI (raysinga.data.cache); unused for local files.
_REMOTE = ("cache_dir", "cache_bytes", "block_bytes")
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "digits": ((), ("test_fraction", "seed", "sample_shape")),
    "npy": (("x", "y"), _FILE_COMMON),
    "npz": (("path",), ("x_key", "y_key", *_FILE_COMMON)),
    "arrow": (("path",), ("x", "y", "cache_chunks", *_REMOTE, *_FILE_COMMON)),
    "parquet": (("path",), ("x", "y", "cache_chunks", *_REMOTE, *_FILE_COMMON)),
    "teacher": (("n", "dim", "num_classes"), ("seed", "hidden", "noise", "n_test", "sample_shape")),
    "text": ((), ("corpus", "context", "valid_every", "max_chars")),
}


def check_keys(kind: str, spec: Mapping[str, Any], where: str) -> None:
    required, optional = KINDS[kind]
    missing = [k for k in required if k not in spec]
    if missing:
        raise ValueError(f"{where}: kind {kind!r} needs key(s) {missing}; got {sorted(spec)}")
    unknown = sorted(set(spec) - {"kind", *required, *optional})
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {unknown} for kind {kind!r}; "
            f"allowed: {sorted({'kind', *required, *optional})}"
        )


def _shape(spec: Mapping[str, Any]) -> tuple[int, ...] | None:
    shape = spec.get("sample_shape")
    return None if shape is None else tuple(int(s) for s in shape)


def _file_spec(spec: Mapping[str, Any], split: str) -> dict[str, Any]:
    """The keys for ``split``: the spec itself for train, the spec overlaid with "test" for test."""
    base = {k: v for k, v in spec.items() if k != "test"}
    if split == "train":
        return base
    test = spec.get("test")
    if test is None:
        raise ValueError(
            f"data set spec of kind {spec['kind']!r} has no 'test' entry, so there is no test "
            'split; add e.g. "test": {"x": ..., "y": ...} with the held-out files'
        )
    if not isinstance(test, Mapping):
        raise ValueError(f"'test' must be a mapping of keys, got {type(test).__name__}")
    merged = {**base, **test}
    check_keys(spec["kind"], merged, "data set spec 'test' entry")
    return merged


def has_split(spec: Mapping[str, Any], split: str) -> bool:
    """Whether ``load_dataset(spec, split)`` has data: built-in sets always do; files need a
    ``"test"`` entry for the test split."""
    return split == "train" or spec.get("kind") in ("digits", "teacher", "text") or "test" in spec


def load_dataset(spec: Mapping[str, Any], split: str = "train") -> Dataset:
    """Build a data set from a config mapping, e.g. ``{"kind": "npy", "x": path, "y": path}``.

    Kinds: digits, npy, npz (path, x_key, y_key), arrow / parquet (path, x, y; a path that is a
    URI such as ``s3://bucket/key?endpoint_override=...`` is read through the node's block cache:
    cache_dir, cache_bytes, block_bytes, :mod:`raysinga.data.remote`), teacher (n, dim,
    num_classes, seed, hidden, noise, n_test), text (corpus, context, valid_every, max_chars:
    :mod:`raysinga.data.text`). All but text take an optional sample_shape. For files,
    ``"test": {...}`` holds the keys that differ for the held-out split. The teacher's test split is
    ``n_test`` (default ``n // 5``) fresh samples of the same teacher, after the training samples.
    Errors name the offending kind or key and what is allowed, because specs come from YAML.
    """
    if not isinstance(spec, Mapping):
        raise ValueError(f"a data set spec is a mapping, got {type(spec).__name__}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    kind = spec.get("kind")
    if kind not in KINDS:
        what = "has no 'kind'" if kind is None else f"has unknown kind {kind!r}"
        raise ValueError(f"data set spec {what}; allowed kinds: {sorted(KINDS)}")
    check_keys(kind, spec, "data set spec")
    try:
        return _open(kind, spec, split)
    except DataError as e:  # the file does not know which split it was opened for
        raise e.at(split=split) from None
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{split} split, {e}") from None


def _open(kind: str, spec: Mapping[str, Any], split: str) -> Dataset:
    if kind == "digits":
        return digits(
            split,
            test_fraction=float(spec.get("test_fraction", 0.2)),
            seed=int(spec.get("seed", 0)),
            sample_shape=_shape(spec),
        )
    if kind == "teacher":
        n = int(spec["n"])
        size, offset = (n, 0) if split == "train" else (int(spec.get("n_test", max(1, n // 5))), n)
        return TeacherDataset(
            size,
            int(spec["dim"]),
            int(spec["num_classes"]),
            seed=int(spec.get("seed", 0)),
            hidden=int(spec.get("hidden", 64)),
            noise=float(spec.get("noise", 0.0)),
            offset=offset,
            sample_shape=_shape(spec),
        )

    if kind == "text":
        return open_split(spec, split)

    s = _file_spec(spec, split)
    common: dict[str, Any] = {"sample_shape": _shape(s), "num_classes": s.get("num_classes")}
    if kind == "npy":
        return NpyDataset(s["x"], s["y"], **common)
    if kind == "npz":
        return NpzDataset(s["path"], s.get("x_key", "x"), s.get("y_key", "y"), **common)
    cls = ArrowDataset if kind == "arrow" else ParquetDataset
    if "cache_chunks" in s:
        common["cache_chunks"] = int(s["cache_chunks"])
    if any(k in s for k in _REMOTE):
        common["cache"] = CacheSpec(
            s.get("cache_dir"),
            s.get("cache_bytes", DEFAULT_CACHE_BYTES),
            s.get("block_bytes", DEFAULT_BLOCK_BYTES),
        )
    return cls(s["path"], s.get("x", "x"), s.get("y", "y"), **common)
