"""The key tables of docs/concepts.md are the schema's: drawn from it, and checked against it."""

from __future__ import annotations

from pathlib import Path

from raysinga.config import docs

CONCEPTS = Path(__file__).resolve().parents[2] / "docs" / "concepts.md"


def test_the_docs_key_tables_are_drawn_from_the_schema():
    text = CONCEPTS.read_text()
    assert docs.drawn(text) == text, (
        "docs/concepts.md's key tables differ from the schema: run "
        "`python -m raysinga.config.docs docs/concepts.md`"
    )


def test_every_section_and_source_kind_has_its_table():
    marked = [m.group("name") for m in docs.BLOCK.finditer(CONCEPTS.read_text())]
    assert sorted(marked) == sorted([*docs.SECTIONS, "data.source"])


def test_a_table_names_every_key_with_its_default():
    table = docs.table("fault")
    assert "| `max_failures` | `3` |" in table and "| `recovery` | `replace` |" in table
    assert "| `train_steps` | required |" in docs.table("job")
    sources = docs.table("data.source")
    assert "| `npy` |" in sources and "`x`, `y`" in sources and "`hidden` (64)" in sources
