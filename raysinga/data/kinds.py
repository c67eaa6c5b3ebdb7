"""Every data set kind a job's ``data.source`` can name, and :func:`load_dataset`, which opens
one split of a source.

Each kind's keys, with their types, defaults, bounds and meaning, are stated once, in its spec
model below; the job file is checked against them before Ray starts (on a cluster the files may
live only on the workers' nodes, so nothing is opened then), and :func:`load_dataset` reads its
values from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .arrow import ArrowDataset, ParquetDataset
from .builtin import SPLITS, TeacherDataset, digits
from .cache import DEFAULT_BLOCK_BYTES, DEFAULT_CACHE_BYTES, CacheSpec
from .errors import DataError
from .sources import Dataset, NpyDataset, NpzDataset
from .text import CORPORA, open_split

SampleShape = list[Annotated[int, Field(gt=0)]]


def _seed() -> Any:
    return Field(0, ge=0, le=2**64 - 1, description="the seed of its sampling")


def _sample_shape() -> Any:
    return Field(
        None,
        min_length=1,
        description="the shape of one sample, where the file stores samples flat",
        json_schema_extra={"expected": "a list of positive integers"},
    )


def _file(default: Any = ..., *, description: str) -> Any:
    return Field(
        default,
        min_length=1,
        description=description,
        json_schema_extra={"expected": "a file path or name"},
    )


class SourceSpec(BaseModel):
    """What every kind has: its ``kind``. A subclass states one kind's keys."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    kind: str


class Digits(SourceSpec):
    """scikit-learn's handwritten digits, split stratified by class."""

    kind: Literal["digits"]
    test_fraction: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="the share of each class held out as the test split",
        json_schema_extra={"expected": "a number in (0, 1)"},
    )
    seed: int = _seed()
    sample_shape: SampleShape | None = _sample_shape()


class FileSource(SourceSpec):
    """Data files: ``test`` holds the keys that differ for the held-out split (without it
    there is no test split)."""

    sample_shape: SampleShape | None = _sample_shape()
    num_classes: int | None = Field(None, ge=1, description="classes, where labels miss some")
    test: dict[str, Any] | None = Field(None, description="the held-out split's keys")


class Npy(FileSource):
    """NumPy ``.npy`` files: one of samples, one of labels."""

    kind: Literal["npy"]
    x: str = _file(description="the .npy file of samples")
    y: str = _file(description="the .npy file of labels")


class Npz(FileSource):
    """A NumPy ``.npz`` archive holding both arrays."""

    kind: Literal["npz"]
    path: str = _file(description="the .npz archive")
    x_key: str = _file("x", description="the samples' array in it")
    y_key: str = _file("y", description="the labels' array in it")


class Columns(FileSource):
    """An Arrow IPC or Parquet file. A path that is a URI (``s3://bucket/key?...``) is read by
    byte range through the node's block cache (:mod:`.cache`)."""

    path: str = _file(description="the file: a local path or a pyarrow URI")
    x: str | list[Annotated[str, Field(min_length=1)]] = Field(
        "x",
        min_length=1,
        description="the samples' column, or several scalar columns gathered into a vector",
        json_schema_extra={"expected": "a column name, or a list of them"},
    )
    y: str = _file("y", description="the labels' column")
    cache_chunks: int | None = Field(None, ge=1, description="record batches kept decoded")
    cache_dir: str | None = Field(
        None, min_length=1, description="the node's block cache (~/.cache/raysinga/data)"
    )
    cache_bytes: int = Field(
        DEFAULT_CACHE_BYTES,
        description="the block cache's bound, in bytes",
        json_schema_extra={"expected": "an integer number of bytes"},
    )
    block_bytes: int = Field(
        DEFAULT_BLOCK_BYTES,
        description="its block size, in bytes",
        json_schema_extra={"expected": "an integer number of bytes"},
    )

    @model_validator(mode="after")
    def _cache_fits(self) -> Columns:
        try:
            self.cache()
        except ValueError as e:  # its message starts with the key it refuses
            raise SpecError(str(e).split()[0], str(e)) from None
        return self

    def cache(self) -> CacheSpec:
        return CacheSpec(self.cache_dir, self.cache_bytes, self.block_bytes)

    @property
    def cache_given(self) -> bool:
        """Whether the spec names a cache setting (a local file needs none)."""
        return bool({"cache_dir", "cache_bytes", "block_bytes"} & self.model_fields_set)


class Arrow(Columns):
    """An Arrow IPC file (local, or a URI read through the node's block cache)."""

    kind: Literal["arrow"]


class Parquet(Columns):
    """A Parquet file (local, or a URI read through the node's block cache)."""

    kind: Literal["parquet"]


class Teacher(SourceSpec):
    """A synthetic set labelled by a fixed random teacher network. The labels are exact (the
    bounds keep every sum an integer below 2**53); the test split is ``n_test`` fresh samples
    after the training ones."""

    kind: Literal["teacher"]
    n: int = Field(ge=1, le=2**63 - 1, description="training samples")
    dim: int = Field(ge=1, le=2**32, description="features of a sample")
    num_classes: int = Field(ge=2, description="classes")
    seed: int = _seed()
    hidden: int = Field(64, ge=2, le=2**20, description="the teacher's hidden units")
    noise: float = Field(
        0.0,
        ge=0,
        le=1,
        description="the share of labels drawn at random",
        json_schema_extra={"expected": "a probability in [0, 1]"},
    )
    n_test: int | None = Field(None, ge=1, le=2**63 - 1, description="test samples (n // 5)")
    sample_shape: SampleShape | None = _sample_shape()

    @property
    def test_size(self) -> int:
        return self.n_test if self.n_test is not None else max(1, self.n // 5)

    @model_validator(mode="after")
    def _numbered(self) -> Teacher:
        if self.n + self.test_size >= 2**63:
            raise SpecError(
                "n",
                f"{self.n} training and {self.test_size} test samples (n_test) are more than "
                "the teacher can number (2**63)",
            )
        return self


class Text(SourceSpec):
    """Characters of the Python standard library's own source files."""

    kind: Literal["text"]
    corpus: Literal[CORPORA] = Field(
        "stdlib",
        description="the corpus",
        json_schema_extra={"expected": f"one of {list(CORPORA)}"},
    )
    context: int = Field(
        128,
        ge=1,
        description="characters of a sample",
        json_schema_extra={"expected": "a positive integer"},
    )
    valid_every: int = Field(20, ge=2, description="every N-th file is validation text")
    max_chars: int = Field(0, ge=0, description="the corpus's first N characters (0: all)")


SOURCES: dict[str, type[SourceSpec]] = {
    cls.model_fields["kind"].annotation.__args__[0]: cls
    for cls in (Digits, Npy, Npz, Arrow, Parquet, Teacher, Text)
}


class SpecError(ValueError):
    """A rule across the keys of a source spec, naming the ``key`` it refuses."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class UnknownKind(ValueError):
    """A spec whose ``kind`` is missing or names no kind."""

    def __init__(self, kind: Any) -> None:
        what = "has no 'kind'" if kind is None else f"has unknown kind {kind!r}"
        super().__init__(f"data set spec {what}; allowed kinds: {sorted(SOURCES)}")
        self.kind = kind


def source_spec(spec: Any, split: str = "train") -> SourceSpec:
    """``spec`` validated against its kind's keys as ``split`` reads it: the test split of a
    file source with its ``test`` keys laid over the rest. Raises :class:`UnknownKind`, or
    pydantic's ``ValidationError`` for keys or values the kind refuses."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"a data set spec is a mapping, got {type(spec).__name__}")
    kind = spec.get("kind")
    if kind not in SOURCES:
        raise UnknownKind(kind)
    if split != "train" and issubclass(SOURCES[kind], FileSource):
        spec = held_out_keys(spec)
    return SOURCES[kind].model_validate(dict(spec))


def held_out_keys(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A file source's keys for its test split: the spec with its ``test`` entry laid over."""
    base = {k: v for k, v in spec.items() if k != "test"}
    test = spec.get("test")
    if test is None:
        raise ValueError(
            f"data set spec of kind {spec['kind']!r} has no 'test' entry, so there is no test "
            'split; add e.g. "test": {"x": ..., "y": ...} with the held-out files'
        )
    if not isinstance(test, Mapping):
        raise ValueError(f"'test' must be a mapping of keys, got {type(test).__name__}")
    return {**base, **test}


def has_split(spec: Mapping[str, Any], split: str) -> bool:
    """Whether ``load_dataset(spec, split)`` has data: built-in sets always do; files need a
    ``"test"`` entry for the test split."""
    kind = SOURCES.get(spec.get("kind"))
    built_in = kind is not None and not issubclass(kind, FileSource)
    return split == "train" or built_in or "test" in spec


def load_dataset(spec: Mapping[str, Any], split: str = "train") -> Dataset:
    """Build a data set from a config mapping, e.g. ``{"kind": "npy", "x": path, "y": path}``.

    The kinds and their keys are the spec models above (``docs/data.md`` lists them). Errors
    name the offending kind or key and what is allowed, because specs come from YAML.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    where = "data set spec" if split == "train" else "data set spec with its 'test' entry"
    try:
        src = source_spec(spec, split)
    except ValidationError as e:
        raise ValueError(spec_problem(e, spec["kind"], where)) from None
    try:
        return _open(src, split)
    except DataError as e:  # the file does not know which split it was opened for
        raise e.at(split=split) from None
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{split} split, {e}") from None


def spec_problem(e: ValidationError, kind: str, where: str) -> str:
    """The first thing wrong with a spec of ``kind``, on one line (the job file's checks say
    it with the whole key path; this is for a spec handed to :func:`load_dataset`)."""
    errors = e.errors(include_url=False)
    missing = [x["loc"][0] for x in errors if x["type"] == "missing" and len(x["loc"]) == 1]
    if missing:
        return f"{where}: kind {kind!r} needs key(s) {missing}"
    unknown = sorted(str(x["loc"][-1]) for x in errors if x["type"] == "extra_forbidden")
    if unknown:
        allowed = sorted(SOURCES[kind].model_fields)
        return f"{where}: unknown key(s) {unknown} for kind {kind!r}; allowed: {allowed}"
    x = errors[0]
    error = (x.get("ctx") or {}).get("error")
    if isinstance(error, SpecError):
        return f"{where}: {error.key}: {error}"
    key = ".".join(map(str, x["loc"]))
    info = SOURCES[kind].model_fields.get(str(x["loc"][0])) if x["loc"] else None
    extra = info.json_schema_extra if info is not None else None
    if isinstance(extra, dict) and "expected" in extra:
        return f"{where}: {kind} {key} must be {extra['expected']}, got {x['input']!r}"
    return f"{where}: {kind} {key}: {x['msg']}, got {x['input']!r}"


def _shape(shape: list[int] | None) -> tuple[int, ...] | None:
    return None if shape is None else tuple(shape)


def _open(src: SourceSpec, split: str) -> Dataset:
    if isinstance(src, Digits):
        return digits(
            split,
            test_fraction=src.test_fraction,
            seed=src.seed,
            sample_shape=_shape(src.sample_shape),
        )
    if isinstance(src, Teacher):
        size, offset = (src.n, 0) if split == "train" else (src.test_size, src.n)
        return TeacherDataset(
            size,
            src.dim,
            src.num_classes,
            seed=src.seed,
            hidden=src.hidden,
            noise=src.noise,
            offset=offset,
            sample_shape=_shape(src.sample_shape),
        )
    if isinstance(src, Text):
        return open_split(
            split,
            corpus=src.corpus,
            context=src.context,
            valid_every=src.valid_every,
            max_chars=src.max_chars,
        )
    assert isinstance(src, FileSource)
    common: dict[str, Any] = {
        "sample_shape": _shape(src.sample_shape),
        "num_classes": src.num_classes,
    }
    if isinstance(src, Npy):
        return NpyDataset(src.x, src.y, **common)
    if isinstance(src, Npz):
        return NpzDataset(src.path, src.x_key, src.y_key, **common)
    assert isinstance(src, Columns)
    if src.cache_chunks is not None:
        common["cache_chunks"] = src.cache_chunks
    if src.cache_given:
        common["cache"] = src.cache()
    cls = ArrowDataset if isinstance(src, Arrow) else ParquetDataset
    return cls(src.path, src.x, src.y, **common)
