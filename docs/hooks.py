"""MkDocs hooks: the options page's table is generated from the settings schema, so it cannot drift."""
from __future__ import annotations

import pathlib
import sys
from typing import Any

ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
MARKER = "<!-- options-table: generated from the settings schema by docs/hooks.py -->"


def options_page_markdown(markdown: str) -> str:
    """The options page with its marker replaced by the table of every setting (pytest_qreport's schema)."""
    if ROOT not in sys.path:  # read from this checkout: the docs environment installs neither it nor torch
        sys.path.insert(0, ROOT)
    from pytest_qreport.checks import BUILTIN_CHECKS
    from pytest_qreport.core.settings import options_table

    if MARKER not in markdown:
        raise ValueError(f"the options page lost its marker {MARKER!r}")
    return markdown.replace(MARKER, options_table(BUILTIN_CHECKS))


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """MkDocs hook: fill in the options page."""
    if page.file.src_uri == "reference/options.md":
        return options_page_markdown(markdown)
    return markdown
