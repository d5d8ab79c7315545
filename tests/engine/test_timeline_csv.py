"""Reading, validating and writing the `event,time_ms,detail` request-timeline CSV."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minengine.engine.metrics import MetricsInputError
from minengine.engine.timeline import TimelineEvent
from minengine.record.timeline_csv import (
    TimelineFile,
    TimelineFileError,
    format_timeline,
    parse_timeline,
    read_timeline,
    write_timeline,
)

WORKED_EXAMPLE = Path(__file__).parent.parent / "data" / "request-timeline.csv"

GOOD = (
    "event,time_ms,detail\n"
    "client_send,0,sent\n"
    "first_visible_token,190,token 1\n"
    "last_visible_token,3915,token 150\n"
)


def test_reads_the_worked_example():
    timeline = read_timeline(WORKED_EXAMPLE)
    assert (timeline.send_ms, timeline.first_token_ms, timeline.last_token_ms) == (0, 190, 3915)
    assert [e.name for e in timeline.events] == [
        "client_send",
        "server_arrival",
        "scheduler_admit",
        "first_visible_token",
        "last_visible_token",
    ]
    assert timeline.time_of("scheduler_admit") == 45


def test_tolerates_bom_spaces_column_order_and_missing_detail(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(
        "\ufefftime_ms , event\n 0 , client_send\n12.5,first_visible_token\n"
        "40,last_visible_token\n",
        encoding="utf-8",
    )
    timeline = read_timeline(path)
    assert timeline.first_token_ms == 12.5
    assert timeline.events[0].detail == ""


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("event,detail\nclient_send,x\n", "missing time_ms"),
        ("", "missing event, time_ms"),
        (GOOD + "client_send,5,again\n", "'client_send' appears more than once"),
        (GOOD.replace("client_send,0,sent\n", ""), "lacks required event(s): client_send"),
        (
            "event,time_ms,detail\nclient_send,0,\n",
            "first_visible_token, last_visible_token",
        ),
        (GOOD.replace("190", "1.9e2ms"), "line 3: time_ms '1.9e2ms'"),
        (GOOD.replace("190", ""), "line 3: time_ms ''"),
        (GOOD.replace("190", "nan"), "time_ms=nan"),
        (GOOD.replace("3915", "100"), "out of order"),
        (GOOD.replace(",0,sent", ",200,sent"), "out of order"),
        (GOOD + ",7,nameless\n", "empty name"),
    ],
)
def test_broken_files_are_rejected_with_one_line(text, fragment):
    with pytest.raises(TimelineFileError) as info:
        parse_timeline(text, source="t.csv")
    message = str(info.value)
    assert fragment in message and message.startswith("t.csv")
    assert "\n" not in message
    assert isinstance(info.value, MetricsInputError)


def test_missing_file(tmp_path):
    with pytest.raises(TimelineFileError, match="no timeline file at"):
        read_timeline(tmp_path / "absent.csv")


def test_write_then_read_round_trips(tmp_path):
    original = read_timeline(WORKED_EXAMPLE)
    path = tmp_path / "copy.csv"
    write_timeline(path, original)
    assert read_timeline(path) == original
    assert path.read_text() == WORKED_EXAMPLE.read_text()  # same bytes as the hand-written file


def test_format_quotes_details_with_commas():
    timeline = TimelineFile(
        (
            TimelineEvent("client_send", 0.0, "a, b"),
            TimelineEvent("first_visible_token", 0.1, 'say "hi"'),
            TimelineEvent("last_visible_token", 2.0),
        )
    )
    text = format_timeline(timeline)
    assert text.splitlines() == [
        "event,time_ms,detail",
        'client_send,0,"a, b"',
        'first_visible_token,0.1,"say ""hi"""',
        "last_visible_token,2,",
    ]
    assert parse_timeline(text) == timeline


_details = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp")), max_size=20)


@given(
    st.lists(st.floats(-1e9, 1e9), min_size=3, max_size=3).map(sorted),
    st.lists(_details, min_size=3, max_size=3),
)
def test_any_valid_timeline_round_trips(times, details):
    names = ("client_send", "first_visible_token", "last_visible_token")
    timeline = TimelineFile(tuple(map(TimelineEvent, names, times, details)))
    assert parse_timeline(format_timeline(timeline)) == timeline
