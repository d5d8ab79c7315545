"""Every relative link in the README and docs/ points at a file that exists, and at a heading there.

Anchors are GitHub's (tests/markdown_links.py), so a renamed heading or a moved section breaks
this test rather than a reader's click. Links to other sites are not fetched.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from markdown_links import anchors, links

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_reaches_its_file_and_heading(page):
    broken = []
    for link in links(page):
        target = (page.parent / link.target).resolve() if link.target else page
        where = f"{page.relative_to(ROOT)}:{link.line}: {link.target}{'#' + link.anchor if link.anchor else ''}"
        if not target.exists():
            broken.append(f"{where} (no such file)")
        elif link.anchor and target.suffix == ".md" and link.anchor not in anchors(target):
            broken.append(f"{where} (no such heading in {target.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_checker_reads_links_and_anchors_as_github_does(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## One stream: `reqscope bench`\n\n## Title\n\n"
        "See [it](#one-stream-reqscope-bench), [again](#title-1), ![img](pic.svg) and [site](https://x.org).\n\n"
        "```\n[not a link](nowhere.md)\n```\n\n"
        "Inline `[code](nowhere.md)` is text.\n"
    )
    assert anchors(page) == {"title", "one-stream-reqscope-bench", "title-1"}
    assert [(link.target, link.anchor) for link in links(page)] == [
        ("", "one-stream-reqscope-bench"),
        ("", "title-1"),
        ("pic.svg", ""),
    ]
