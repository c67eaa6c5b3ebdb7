"""A character-level text corpus every machine has without a download: the Python standard
library's own source files.

The corpus is built once and cached (``~/.cache/raysinga/data/``, keyed by the files' names and
contents): the ``.py`` files of the running Python's standard library, in sorted path order,
without test suites and third-party packages. Every ``valid_every``-th file goes to the
validation (``test``) split, the rest to training, so no file is in both. Each character is a
token: tab, newline and the 95 printable ASCII characters have ids 1..97 (a fixed vocabulary
of 98, whatever the files hold), every other character shares id 0. The token ids are stored
as one byte each, with the vocabulary beside them (``vocab.json``), and read back through a
memory map like any other data set.

Sample ``i`` of a split is the window of ``context + 1`` tokens starting at ``i * context``:
``x`` its first ``context`` tokens, ``y`` the ``context`` tokens that follow each (the next
character at every position). The sample order is the data set's business only through its
length, so it stays the batch plan's pure function of (seed, epoch).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa

from .sources import Dataset, check_indices

OTHER = "\x00"  # the token of every character outside the vocabulary's ASCII set
ASCII = "\t\n" + "".join(chr(c) for c in range(32, 127))
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
CORPORA = ("stdlib",)
FORMAT = 2  # bump when the cached files change meaning


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's source files in the corpus, in their fixed (sorted) order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(
        f
        for f in root.rglob("*.py")
        if not (SKIP_DIRS & set(f.relative_to(root).parts[:-1])) and f.is_file()
    )


def build_corpus(cache: Path | None = None, valid_every: int = 20, max_chars: int = 0) -> Path:
    """The directory holding the corpus (``train.u8``, ``test.u8``, ``vocab.json``), built
    once per content. ``max_chars`` (0: all) keeps the first files up to that many
    characters."""
    if valid_every < 2:
        raise ValueError(f"valid_every must be at least 2, got {valid_every}")
    files = stdlib_files()
    digest = hashlib.sha256(f"{FORMAT} {valid_every} {max_chars}".encode())
    texts = []
    total = 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if max_chars and total + len(text) > max_chars and texts:
            break
        texts.append(text)
        total += len(text)
        digest.update(f.name.encode() + b"\0" + text.encode("utf-8", "replace"))
    base = (cache or _cache_dir()) / f"stdlib-{digest.hexdigest()[:20]}"
    if (base / "vocab.json").is_file():
        return base
    if len(texts) < valid_every:
        raise ValueError(
            f"the corpus holds {len(texts)} files, so with valid_every {valid_every} no file "
            "goes to the validation split; lower valid_every or raise max_chars"
        )
    splits = {"train": [], "test": []}
    for i, text in enumerate(texts):
        splits["test" if i % valid_every == valid_every - 1 else "train"].append(text)
    vocab = OTHER + ASCII
    table = np.zeros(0x110000, np.uint8)  # a character's id, by code point
    table[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.uint8)
    base.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".text-", dir=base.parent))
    try:
        for split, parts in splits.items():
            codes = np.frombuffer("\n".join(parts).encode("utf-32-le"), np.uint32)
            table[codes].tofile(tmp / f"{split}.u8")
        meta = {"vocab": vocab, "files": len(texts), "valid_every": valid_every}
        (tmp / "vocab.json").write_text(json.dumps(meta))
        tmp.rename(base)  # whole or not at all; another process may have built it meanwhile
    except OSError:
        if not (base / "vocab.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return base


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "raysinga" / "data"


class TextDataset(Dataset):
    """Windows of ``context`` characters of a split of the corpus, with the next character at
    every position as labels: ``x`` and ``y`` int64 of shape ``(n, context)``."""

    def __init__(self, directory: Path, split: str, context: int) -> None:
        if not isinstance(context, int) or isinstance(context, bool) or context < 1:
            raise ValueError(f"context must be a positive integer, got {context!r}")
        meta = json.loads((Path(directory) / "vocab.json").read_text())
        self.vocab: str = meta["vocab"]
        self.context = context
        f = pa.memory_map(str(Path(directory) / f"{split}.u8"), "r")
        self._tokens = np.frombuffer(f.read_buffer(), np.uint8)
        self._n = max(0, (len(self._tokens) - 1) // context)
        if self._n == 0:
            raise ValueError(
                f"the {split} split has {len(self._tokens)} characters, fewer than one window "
                f"of context {context} + 1"
            )
        self.sample_shape = (context,)
        self.num_classes = len(self.vocab)
        self.label_dtype = np.dtype(np.int64)
        self.generated = True  # ids in [0, vocab) by construction: nothing to scan
        self._offsets = np.arange(context, dtype=np.int64)

    def __len__(self) -> int:
        return self._n

    def get(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        start = check_indices(indices, self._n) * self.context
        window = self._tokens[start[:, None] + np.arange(self.context + 1)]
        return window[:, :-1].astype(np.int64), window[:, 1:].astype(np.int64)

    def counts(self) -> np.ndarray:
        """How often each token occurs in the split."""
        return np.bincount(self._tokens, minlength=len(self.vocab))

    def decode(self, ids: np.ndarray) -> str:
        return Vocabulary(self.vocab).decode(ids)

    def encode(self, text: str) -> np.ndarray:
        return Vocabulary(self.vocab).encode(text)


class Vocabulary:
    """Characters to token ids and back; a character outside ``chars`` is id 0."""

    def __init__(self, chars: str = OTHER + ASCII) -> None:
        self.chars = chars
        self._index = {c: i for i, c in enumerate(chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        return np.array([self._index.get(c, 0) for c in text], np.int64)

    def decode(self, ids: np.ndarray) -> str:
        return "".join(self.chars[int(i)] for i in np.asarray(ids).reshape(-1))


def open_split(
    split: str, *, corpus: str, context: int, valid_every: int, max_chars: int
) -> TextDataset:
    """A split of a corpus (a ``text`` data spec's keys), built first where not cached."""
    if corpus not in CORPORA:
        raise ValueError(f"text corpus must be one of {list(CORPORA)}, got {corpus!r}")
    where = build_corpus(valid_every=valid_every, max_chars=max_chars)
    return TextDataset(where, split, context)


def unigram_bits(train: TextDataset, valid: TextDataset) -> float:
    """Bits per character of the validation split under the training split's character
    frequencies (add-one smoothed): what a model that ignores context achieves."""
    p = (train.counts() + 1.0) / (train.counts().sum() + len(train.vocab))
    c = valid.counts()
    return float(-(c * np.log2(p)).sum() / c.sum())
