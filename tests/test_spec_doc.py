"""docs/spec.md is what cluster/spec_doc.py writes from the spec's models: a field added, renamed or
described anew shows up there (regenerate: python -m pdcluster.cluster.spec_doc > docs/spec.md)."""

from __future__ import annotations

from pathlib import Path

from pdcluster.cluster.spec_doc import render, sections

DOC = Path(__file__).resolve().parents[1] / "docs" / "spec.md"


def test_docs_spec_md_is_generated_from_the_models():
    assert DOC.read_text() == render(), "docs/spec.md is stale: python -m pdcluster.cluster.spec_doc > docs/spec.md"


def test_every_field_is_there_with_its_default_and_a_word_on_what_it_is():
    rows = [(path, row) for path, _, rows in sections() for row in rows]
    assert len(rows) > 80
    assert all(row[3] for _, row in rows), [f"{p}.{r[0]}" for p, r in rows if not r[3]]
    engine = {r[0]: r for p, r in rows if p == "engine"}
    assert engine["block_size"][2] == "`128`" and "extra" in engine  # the shared engine's defaults, engine.extra
    assert "| `extra` | dict[str, Any] | `{}` | more AsyncEngineArgs, passed as is |" in DOC.read_text()
