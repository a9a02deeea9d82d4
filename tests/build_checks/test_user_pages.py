"""The README and the docs describe the present: no issue numbers, commit hashes or dates (a dated "before"
or "until" is history, which the CHANGELOG and the records keep, each record with its own date)."""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# The user guide, and the internals pages too (kernels, testing, benchmarks, maintainers): all of docs/*.md.
PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
HISTORY = {
    "an issue number": re.compile(r"\bissues? #?\d+(?![\d.,%-])|(?<![\w&])#\d+\b", re.I),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    # 7 to 40 hex digits with a letter and a digit, not part of a number (1.5e-07) or a word
    "a commit hash": re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w.-])"),
}


def history(text: str) -> list[str]:
    """Each piece of history in ``text``: what it is and the line it is on."""
    return [
        f"{what} on line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for what, pattern in HISTORY.items()
        for m in pattern.finditer(text)
    ]


@pytest.mark.parametrize("page", PAGES)
def test_a_page_has_no_history(page):
    found = history((REPO / page).read_text())
    assert not found, f"{page} should describe the present (history goes in the CHANGELOG): " + "; ".join(found)


def test_the_check_finds_history_and_only_history():
    assert len(history("Until issue 51 (2026-11-30, at `83e5bc4`) W was copied; see #12.")) == 4
    assert not history("amax 1.0000002153053333e-39, 9.999999974752427e-07, sm_100a, 16x16, deadbeef words")
    assert not history("a tie-possible copy issues 20-38% more instructions")
