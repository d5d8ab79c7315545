"""The headline figures have one source, docs/lab/headline.json, and everything shown agrees with it.

The README's performance table, docs/performance.md's "Today's figures" and the chart
docs/headline.svg are written from the JSON by `scripts/headline_chart`; these tests render them
again from the JSON and compare, so a hand edit of any of them, or a JSON edit without the rerun,
fails here. Each row is also held to the lab entry it links to: the entry must carry the row's
date and every figure the row shows.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest
from markdown_links import section

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "headline_chart"


def _load_script():
    loader = importlib.machinery.SourceFileLoader("headline_chart", str(SCRIPT))
    spec = importlib.util.spec_from_loader("headline_chart", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


headline_chart = _load_script()
HEADLINE = headline_chart.load()


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT)


def test_the_readme_table_is_the_one_the_json_gives():
    assert headline_chart.table_in(headline_chart.README) == headline_chart.readme_table(HEADLINE), (
        "README.md's headline table disagrees with docs/lab/headline.json; run scripts/headline_chart"
    )


def test_performance_md_shows_the_same_figures_as_the_readme():
    shown = headline_chart.table_in(headline_chart.PERFORMANCE)
    assert shown == headline_chart.performance_table(HEADLINE), (
        "docs/performance.md's Today's figures disagree with docs/lab/headline.json; run scripts/headline_chart"
    )
    # The same cells in both, only the links differ by the page's folder.
    assert shown == headline_chart.table_in(headline_chart.README).replace("](docs/", "](")


def test_the_checked_in_chart_is_the_one_the_json_gives():
    assert headline_chart.CHART.read_text() == headline_chart.svg(HEADLINE), (
        "docs/headline.svg is stale against docs/lab/headline.json; run scripts/headline_chart"
    )


def test_the_headline_keeps_at_most_five_rows_each_with_a_figure_a_command_and_a_link():
    rows = [line for line in headline_chart.readme_table(HEADLINE).splitlines()[2:]]
    assert 1 <= len(rows) <= 5
    for row, line in zip(HEADLINE.rows, rows, strict=True):
        assert f"**{headline_chart.number(row.figure)}** {row.unit}" in line
        assert f"`{row.command}`" in line
        assert f"]({row.link})" in line


@pytest.mark.parametrize("row", HEADLINE.rows, ids=lambda row: row.name)
def test_each_row_is_what_its_lab_entry_measured(row):
    path, _, anchor = row.link.partition("#")
    entry = section(ROOT / path, anchor)
    assert row.date in entry, f"{row.link} does not say the date {row.date}"
    assert row.command in entry or row.command.split(" --")[0] in entry, f"{row.link} does not name {row.command}"
    figures = [row.figure] + [peer.figure for peer in row.peers]
    for figure in figures:
        assert headline_chart.number(figure) in entry, f"{row.link} does not show {headline_chart.number(figure)}"
    for peer in row.peers:
        if peer.ratio is not None:
            assert f"{peer.ratio:.2f}x" in entry, f"{row.link} does not report the ratio {peer.ratio:.2f}x"


def test_each_bar_is_its_figure_over_the_panels_largest():
    root = ElementTree.fromstring(headline_chart.svg(HEADLINE))
    widths = [float(rect.get("width")) for rect in root.iter("{http://www.w3.org/2000/svg}rect")][1:]  # the backdrop
    expected = []
    for row in HEADLINE.rows:
        figures = [row.figure] + [peer.figure for peer in row.peers]
        expected += [round(headline_chart.BAR_W * f / max(figures), 1) for f in figures]
    assert widths == expected


def test_a_figure_changed_in_the_json_alone_is_caught_and_named(tmp_path):
    raw = json.loads(headline_chart.DATA.read_text())
    raw["rows"][2]["figure"] += 1.0
    changed = tmp_path / "headline.json"
    changed.write_text(json.dumps(raw))
    done = _run("--data", str(changed), "--check")
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        f"{name} disagrees with headline.json; run scripts/headline_chart"
        for name in ("README.md", "docs/performance.md", "docs/headline.svg")
    ]
    assert _run("--check").returncode == 0


def test_the_ratio_shown_is_the_benchmarks_where_it_gave_one_else_the_figures():
    peers = {peer.name: peer for row in HEADLINE.rows for peer in row.peers}
    one_stream = HEADLINE.rows[0]
    assert "**3.26x** transformers" in headline_chart.comparison(one_stream)  # bench's own, not 98.6 / 30.4 = 3.24
    worked_out = one_stream.figure / peers["llama.cpp"].figure
    assert f"**{worked_out:.2f}x** llama.cpp" in headline_chart.comparison(one_stream)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda raw: raw["rows"][0].update(better="faster"), "rows[0].better is 'faster'; give 'higher' or 'lower'"),
        (lambda raw: raw["rows"][1].pop("command"), "rows[1] lacks command; add them"),
        (lambda raw: raw["rows"][0]["peers"][0].update(figure=0), "rows[0]: every figure (the row's and each peer's)"),
        (lambda raw: raw["rows"].extend(raw["rows"][:1]), "has 6 rows; the headline keeps at most 5"),
    ],
)
def test_a_malformed_json_is_one_line_naming_what_to_fix(tmp_path, change, message):
    raw = json.loads(headline_chart.DATA.read_text())
    change(raw)
    bad = tmp_path / "headline.json"
    bad.write_text(json.dumps(raw))
    done = _run("--data", str(bad), "--check")
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("headline_chart: error: ") and message in done.stderr
