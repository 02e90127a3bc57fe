"""Reading JSONL text: lines split at ``"\\n"`` only.

``json.dumps(..., ensure_ascii=False)`` writes U+0085, U+2028 and U+2029 raw inside strings, and
``str.splitlines()`` breaks lines at them too, cutting such a record in two; every reader of JSONL in
astrl goes through :func:`numbered_lines` instead, and so do the one-item-a-line text files (prompts,
replayed probes, reply lexicon word lists), whose items may hold the same characters.
"""

from __future__ import annotations

from collections.abc import Iterator


def numbered_lines(text: str) -> Iterator[tuple[int, str]]:
    """The non-blank lines of ``text`` with their 1-based line numbers, split at ``"\\n"`` only."""
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            yield number, line
