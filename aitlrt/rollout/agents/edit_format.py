"""Aider's ``diff`` edit format, read and written in one place: the SEARCH/REPLACE block's marker lines as Aider
matches them (``aider.coders.editblock_coder``: HEAD, DIVIDER, UPDATED), so that the rewards that read a model's
answer (``aitlrt.rewards``) and the oracle that writes one (``aitlrt.warmstart.oracle``) agree with Aider on what a
block is.

A block, as Aider's own examples write it::

    path/to/file.py
    ```python
    <<<<<<< SEARCH
    old lines
    =======
    new lines
    >>>>>>> REPLACE
    ```

Aider accepts 5 to 9 marker characters and a stray ``>`` after SEARCH, not after REPLACE (its UPDATED line is
``>{5,9} REPLACE`` alone): a block closed by ``>>>>>>> REPLACE>`` is none, to Aider and to the rewards alike, so
that no format term pays a block Aider never applies.
"""

from __future__ import annotations

import re

SEARCH, DIVIDER, REPLACE = "<<<<<<< SEARCH", "=======", ">>>>>>> REPLACE"
"""The marker lines as the oracle writes them (Aider's own spelling)."""
_HEAD, _DIVIDER, _UPDATED = r"<{5,9} SEARCH>?", r"={5,9}", r">{5,9} REPLACE"
"""The marker lines as Aider reads them (``HEAD``, ``DIVIDER``, ``UPDATED``)."""
_MARKER = re.compile(rf"^({_HEAD}|{_DIVIDER}|{_UPDATED})\s*$")
_BLOCK = re.compile(rf"^{_HEAD}[ \t]*\n(.*?)^{_DIVIDER}[ \t]*\n(.*?)^{_UPDATED}[ \t]*$", re.M | re.S)
"""A whole block: its HEAD, DIVIDER and UPDATED lines in order, with the SEARCH and REPLACE texts as its groups."""


def is_marker(line: str) -> bool:
    """Whether Aider reads ``line`` (indentation aside) as one of a block's marker lines: text holding such a line
    cannot be written inside a block."""
    return _MARKER.match(line.strip()) is not None


def edit_blocks(text: str) -> list[tuple[str, str]]:
    """The (SEARCH, REPLACE) texts of the whole blocks in ``text``, in order; a block cut before its UPDATED line
    (an answer that stops after ``<<<<<<< SEARCH``) is none."""
    return _BLOCK.findall(text)
