"""Names that come from data, made safe for the reports they are written into.

A class folder or a generated name is whatever the data holds: `[click](http://…)`,
`<img src=x onerror=…>` or `=HYPERLINK("http://…")`. Written as they are, the first is a
link and the second markup in a Prefect markdown artifact or evaluation.md, and the third a
formula when the confusion CSV is opened in a spreadsheet. Every name is shown as text.
"""

from __future__ import annotations

import html
import re

# Markdown's punctuation that can start or end markup (CommonMark's escapable set less
# what html.escape already turns into entities).
_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_{}\[\]()#+\-.!|~:=])")
# A spreadsheet reads a cell starting with one of these as a formula (OWASP's list).
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_FORMULA_GUARD = "'"


def markdown_text(text: str) -> str:
    """`text` as literal text in markdown, table cells included: HTML escaped, markdown
    punctuation backslash-escaped, line breaks as spaces."""
    flat = " ".join(text.splitlines())
    return _MARKDOWN_PUNCTUATION.sub(r"\\\1", html.escape(flat, quote=True))


def csv_cell(text: str) -> str:
    """`text` as a CSV cell no spreadsheet evaluates: a leading formula character is
    guarded with a quote (undo with `from_csv_cell`)."""
    return _FORMULA_GUARD + text if text.startswith(_FORMULA_START + (_FORMULA_GUARD,)) else text


def from_csv_cell(cell: str) -> str:
    """The text csv_cell was given."""
    guarded = cell.startswith(_FORMULA_GUARD) and cell[1:].startswith(
        _FORMULA_START + (_FORMULA_GUARD,)
    )
    return cell[1:] if guarded else cell
