"""Reading Markdown as GitHub renders it: the links a page holds and the anchors its headings get.

Links inside code (fenced blocks, indented blocks, inline code spans) are text, not links, and are
left out. A heading's anchor is GitHub's: the heading's text lowercased, every character that is
not a letter, digit, `_`, `-` or a space dropped, spaces turned into hyphens, and `-1`, `-2`, ...
added to a repeated one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Link:
    """One relative link on a page: where it is and what it points at."""

    page: Path
    line: int
    target: str  # the path part, empty for a link to an anchor on the same page
    anchor: str  # after '#', empty when there is none


def _blank_code_spans(line: str, opener: str) -> tuple[str, str]:
    """`line` without its inline code; `opener` is the backtick run of a span still open from the line
    before ('' when none), and the one still open at the line's end is returned with the text."""
    kept, i = [], 0
    while i < len(line):
        if line[i] != "`":
            if not opener:
                kept.append(line[i])
            i += 1
            continue
        run = len(line[i:]) - len(line[i:].lstrip("`"))
        ticks = line[i : i + run]
        if not opener:
            opener = ticks
        elif ticks == opener:
            opener = ""
        i += run
    return "".join(kept), opener


def prose_lines(page: Path) -> list[tuple[int, str]]:
    """The page's lines outside code blocks, numbered from 1, with inline code spans (which may run on
    to the next line, as a paragraph's do) left out."""
    lines, in_fence, opener = [], False, ""
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if FENCE.match(line):
            in_fence, opener = not in_fence, ""
            continue
        if in_fence or line.startswith("    ") and not line.lstrip().startswith(("-", "*", "|")):
            continue
        if not line.strip():
            opener = ""  # a code span never crosses a blank line
        text, opener = _blank_code_spans(line, opener)
        lines.append((number, text))
    return lines


def links(page: Path) -> list[Link]:
    """Every link on the page that points inside the repository (no scheme)."""
    found = []
    for number, line in prose_lines(page):
        for match in LINK.finditer(line):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            path, _, anchor = target.partition("#")
            found.append(Link(page, number, path, anchor))
    return found


def anchor_of(heading: str) -> str:
    """GitHub's anchor for a heading's text (before any `-N` for a repeat)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def headings(page: Path) -> list[tuple[int, int, str]]:
    """(line number, level, anchor) of every heading on the page, repeats numbered as GitHub does."""
    seen: dict[str, int] = {}
    found = []
    in_fence = False
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else HEADING.match(line)
        if match:
            base = anchor_of(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.append((number, len(match.group(1)), base if count == 0 else f"{base}-{count}"))
    return found


def anchors(page: Path) -> set[str]:
    """Every anchor a link into the page may name."""
    return {anchor for _, _, anchor in headings(page)}


def section(page: Path, anchor: str) -> str:
    """The text under the heading with this anchor, up to the next heading at its level or above."""
    lines = page.read_text().splitlines()
    marks = headings(page)
    for i, (number, level, name) in enumerate(marks):
        if name == anchor:
            end = next((n for n, lv, _ in marks[i + 1 :] if lv <= level), len(lines) + 1)
            return "\n".join(lines[number - 1 : end - 1])
    raise KeyError(f"{page} has no heading with the anchor #{anchor}")
