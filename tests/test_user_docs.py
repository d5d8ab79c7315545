"""The user docs describe the tool as it is today; dated runs live in the lab book (docs/lab/).

README.md, the guide, engine.md, serving.md, performance.md and openmp-wait-policy.md carry, outside
code (sample output may hold a date), no dates, no commit hashes, no paths of a development machine
(`/tmp`, `../shared`), no notes on how a figure was worked out rather than what it is, and no
references to the issues the work came from. A failure names the page and line: move the run to
its lab page (keeping its command) and leave a present-tense sentence with a link.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_links import prose_lines

ROOT = Path(__file__).resolve().parent.parent
USER_DOCS = [ROOT / "README.md"] + [
    ROOT / "docs" / name for name in ("guide.md", "engine.md", "serving.md", "performance.md", "openmp-wait-policy.md")
]
OUTSIDE_WORDS = {
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    "a /tmp path": re.compile(r"/tmp\b"),
    "a ../shared path": re.compile(r"\.\./shared"),
    "a note on how it was worked out": re.compile(r"not committed|this session|other helpers", re.IGNORECASE),
    "the issue it came from": re.compile(r"\bissue'?s?\b.*\btargets?\b|\bthe seeds?'?s?\b", re.IGNORECASE),
}


def _findings(page: Path, root: Path = ROOT) -> list[str]:
    return [
        f"{page.relative_to(root)}:{number}: {what}: {line.strip()[:100]}"
        for number, line in prose_lines(page)
        for what, pattern in OUTSIDE_WORDS.items()
        if pattern.search(line)
    ]


@pytest.mark.parametrize("page", USER_DOCS, ids=lambda page: page.name)
def test_the_user_docs_hold_today_and_no_words_from_outside_the_project(page):
    findings = _findings(page)
    assert not findings, "move these to docs/lab/ or say them in the project's words:\n" + "\n".join(findings)


def test_the_check_finds_a_dated_run_a_hash_and_a_harness_but_not_sample_output(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Measured on 2026-12-05 at d02b258 with a /tmp harness.\n\n"
        "Against the serving issue's targets, the seeds' points.\n\n"
        '```\n{"measured_at": "2026-12-01 10:16 UTC"}\n```\n\n'
        'The call `search({"check_in": "2022-01-01"})` and a span that runs on: `POST 200\n'
        "req-ae19691e92dc46b9 ms=1213.0` to the next line.\n"
    )
    found = {finding.split(": ")[1] for finding in _findings(page, tmp_path)}
    assert found == {"a date", "a commit hash", "a /tmp path", "the issue it came from"}

