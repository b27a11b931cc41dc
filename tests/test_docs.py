"""The README's backend table is the one generated from the declarations."""

from pathlib import Path

from attnzoo import docs

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_backend_table_matches_the_declarations():
    text = README.read_text()
    assert docs.render(text) == text, "the README's backend table is stale: run python -m attnzoo.docs"
