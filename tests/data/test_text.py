"""The character corpus built from the standard library's source: split by file, a fixed
vocabulary stored with the data, windows with the next character as labels, built once."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raysinga.data import BatchPlan, load_dataset
from raysinga.data.text import ASCII, OTHER, TextDataset, build_corpus, stdlib_files, unigram_bits


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small corpus (the first files up to 300,000 characters) in a cache of its own."""
    return build_corpus(tmp_path_factory.mktemp("cache"), valid_every=4, max_chars=300_000)


def test_the_files_are_split_by_file_in_a_fixed_order(corpus):
    files = stdlib_files()
    assert files == sorted(files) and all("test" not in f.parts[-2:-1] for f in files)
    meta = json.loads((corpus / "vocab.json").read_text())
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files[: meta["files"]]]
    train = TextDataset(corpus, "train", 16)
    valid = TextDataset(corpus, "test", 16)
    train_text = train.decode(np.fromfile(corpus / "train.u8", np.uint8))
    valid_text = valid.decode(np.fromfile(corpus / "test.u8", np.uint8))

    def clean(t: str) -> str:
        return "".join(c if c in ASCII else OTHER for c in t)

    assert valid_text == "\n".join(clean(t) for t in texts[3::4])
    assert train_text == "\n".join(clean(t) for i, t in enumerate(texts) if i % 4 != 3)


def test_the_vocabulary_is_fixed_and_stored_with_the_data(corpus):
    meta = json.loads((corpus / "vocab.json").read_text())
    assert meta["vocab"] == OTHER + ASCII and len(meta["vocab"]) == 98
    ds = TextDataset(corpus, "train", 8)
    assert ds.num_classes == 98 and ds.encode("def f():\n").tolist() == [
        meta["vocab"].index(c) for c in "def f():\n"
    ]
    assert ds.decode(ds.encode("é")) == OTHER  # outside the vocabulary: the one shared id


def test_a_sample_is_a_window_with_the_next_character_as_labels(corpus):
    ds = TextDataset(corpus, "train", 32)
    tokens = np.fromfile(corpus / "train.u8", np.uint8)
    assert len(ds) == (len(tokens) - 1) // 32 and ds.sample_shape == (32,)
    x, y = ds.get(np.array([0, 7, len(ds) - 1]))
    assert x.shape == y.shape == (3, 32) and x.dtype == y.dtype == np.int64
    np.testing.assert_array_equal(x[1], tokens[7 * 32 : 8 * 32])
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    assert y[2, -1] == tokens[len(ds) * 32]
    with pytest.raises(IndexError):
        ds.get(np.array([len(ds)]))


def test_any_slice_of_any_batch_is_the_same_rows_as_the_whole_batch(corpus):
    ds = TextDataset(corpus, "train", 16)
    plan = BatchPlan(len(ds), batch_size=12, seed=5)
    for step in (0, 3, plan.steps_per_epoch + 1):
        whole = ds.get(plan.indices(step))[0]
        parts = [ds.get(plan.indices(step, part=p, parts=3))[0] for p in range(3)]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    again = BatchPlan(len(ds), batch_size=12, seed=5)
    assert (again.indices(9) == plan.indices(9)).all()  # a pure function of (seed, step)


def test_the_corpus_is_built_once(corpus, tmp_path):
    stamp = (corpus / "train.u8").stat().st_mtime_ns
    assert build_corpus(corpus.parent, valid_every=4, max_chars=300_000) == corpus
    assert (corpus / "train.u8").stat().st_mtime_ns == stamp
    other = build_corpus(corpus.parent, valid_every=5, max_chars=300_000)
    assert other != corpus  # another split is another corpus


def test_the_unigram_baseline_is_the_cross_entropy_of_character_frequencies(corpus):
    train, valid = TextDataset(corpus, "train", 16), TextDataset(corpus, "test", 16)
    bits = unigram_bits(train, valid)
    assert 3.0 < bits < 7.0  # between a few common characters and uniform over 98 (6.6)


def test_a_text_spec_loads_both_splits_and_names_bad_values():
    spec = {"kind": "text", "context": 64, "valid_every": 5, "max_chars": 200_000}
    train, test = load_dataset(spec), load_dataset(spec, "test")
    assert train.sample_shape == test.sample_shape == (64,) and len(train) > len(test) > 0
    with pytest.raises(ValueError, match="text corpus must be one of"):
        load_dataset({**spec, "corpus": "shakespeare"})
    with pytest.raises(ValueError, match="context must be a positive integer"):
        load_dataset({**spec, "context": 0})
    with pytest.raises(ValueError, match="unknown key"):
        load_dataset({**spec, "contxt": 3})
    with pytest.raises(ValueError, match="no file goes to the validation split"):
        load_dataset({**spec, "valid_every": 500})
