"""lightning_pilot.core.progress: plain lines at most every few seconds, a tqdm bar set like
Lightning's, the marker lines of a child process, and which of them is shown where."""

from __future__ import annotations

import io
import sys

import pytest

from lightning_pilot.core import progress
from lightning_pilot.core.progress import (
    MARKER,
    MAX_MESSAGE,
    BarReporter,
    LineReporter,
    Mark,
    Reporter,
    choose_reporter,
    clean,
    marker_line,
    parse_marker,
)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_lines_are_spaced_by_the_minimum_interval(clock: Clock) -> None:
    out = io.StringIO()
    lines = LineReporter("Job", stream=out, min_interval_s=5.0, heartbeat_s=30.0, clock=clock)
    lines.update("loading")
    clock.now += 1
    lines.update("building")  # 1 s after a line: held back
    lines.tick()
    clock.now += 1
    lines.update("fitting")  # the newer message replaces the one held back
    assert _lines(out) == ["Job: loading ... 0 s"]
    clock.now += 3
    lines.tick()  # 5 s after the last line: the pending message
    lines.tick()  # nothing new
    assert _lines(out) == ["Job: loading ... 0 s", "Job: fitting ... 5 s"]
    clock.now += 6
    lines.update("checking")  # past the interval: at once
    assert _lines(out)[-1] == "Job: checking ... 11 s"
    lines.update("checking")  # the same message again: nothing pending
    clock.now += 29
    lines.tick()
    assert len(_lines(out)) == 3
    clock.now += 1
    lines.tick()  # 30 s without news: the heartbeat repeats it with the time
    assert _lines(out)[-1] == "Job: checking ... 41 s"
    lines.close("done")
    lines.update("after close")
    lines.tick()
    lines.close("again")
    assert _lines(out)[-1] == "Job: done ... 41 s"
    assert len(_lines(out)) == 5


def test_a_line_per_update_with_no_interval(clock: Clock) -> None:
    out = io.StringIO()
    lines = LineReporter("Job", stream=out, min_interval_s=0, clock=clock)
    for step in range(3):
        clock.now += 0.4
        lines.update(f"step {step}")
    lines.close()
    assert _lines(out) == ["Job: step 0 ... 0 s", "Job: step 1 ... 0 s", "Job: step 2 ... 1 s"]


def test_lines_go_to_the_stderr_of_the_moment(
    clock: Clock, capsys: pytest.CaptureFixture[str]
) -> None:
    LineReporter("Job", clock=clock).update("running")
    assert capsys.readouterr() == ("", "Job: running ... 0 s\n")


def test_a_stream_that_fails_never_breaks_the_work(clock: Clock) -> None:
    closed = io.StringIO()
    closed.close()
    lines = LineReporter("Job", stream=closed, clock=clock)
    lines.update("running")  # ValueError: I/O operation on closed file, dropped
    lines.close("done")

    class Broken(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    LineReporter("Job", stream=Broken(), clock=clock).update("running")


def test_messages_stay_on_one_line_and_short() -> None:
    assert clean("a\nb\rc\x1b[31md\u2028e") == "a b c [31md e"
    cut = clean("x" * 500)
    assert len(cut) == MAX_MESSAGE
    assert cut.endswith("...")
    out = io.StringIO()
    LineReporter("Job", stream=out).update("one\ntwo")
    assert out.getvalue().count("\n") == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"label": ""}, ValueError, r"LineReporter\(label=''\) is invalid: expected 1 to 200"),
        ({"label": 3}, TypeError, r"LineReporter\(label=3\) is invalid"),
        ({"min_interval_s": -1}, ValueError, r"min_interval_s=-1\) is invalid: expected a finite"),
        ({"min_interval_s": float("nan")}, ValueError, r"min_interval_s=nan\) is invalid"),
        (
            {"heartbeat_s": 1.0},
            ValueError,
            r"heartbeat_s=1.0\) is invalid: expected a finite .* >= 5",
        ),
        ({"clock": 3}, TypeError, r"clock=3\) is invalid: expected clock\(\) -> seconds"),
    ],
)
def test_line_reporter_arguments(kwargs: dict[str, object], error: type, match: str) -> None:
    options: dict[str, object] = {"label": "Job"} | kwargs
    with pytest.raises(error, match=match):
        LineReporter(**options)  # type: ignore[arg-type]


def test_markers_round_trip() -> None:
    line = marker_line(1, 3, "task 2 of 3, resume: loading\nthe checkpoint")
    assert line == f"{MARKER} 1/3 task 2 of 3, resume: loading the checkpoint"
    assert parse_marker(line + "\n") == Mark(1, 3, "task 2 of 3, resume: loading the checkpoint")
    assert parse_marker(f"{MARKER} 9/3 more than all") == Mark(3, 3, "more than all")
    for other in (
        "Epoch 0: 100%|##########| 8/8",  # the child's own output
        f"{MARKER} x/3 not a count",
        f"{MARKER} 1/3",
        f"  {MARKER} 1/3 indented",
        f"{MARKER} {'9' * 12}/3 too many digits",
    ):
        assert parse_marker(other) is None, other
    with pytest.raises(ValueError, match=r"marker_line\(done=-1\) is invalid"):
        marker_line(-1, 3, "x")


def _bar_text(out: io.StringIO) -> list[str]:
    return [part for part in out.getvalue().replace("\n", "\r").split("\r") if part.strip()]


def test_the_bar_is_set_like_lightnings() -> None:
    out = io.StringIO()
    bar = BarReporter("Check", total=3, file=out, position=0)
    tqdm_bar = bar._bar
    assert callable(tqdm_bar.dynamic_ncols)  # dynamic_ncols=True: tqdm keeps its size reader
    assert (tqdm_bar.leave, tqdm_bar.smoothing, tqdm_bar.pos) == (True, 0, 0)
    bar.update("task 1 of 3", done=0)
    bar.update("task 2 of 3", done=1)
    bar.tick()
    bar.update("task 3 of 3", done=9)  # never past the total
    bar.close("done", done=3)
    bar.close("again")
    parts = _bar_text(out)
    assert parts[0].startswith("Check:   0%|")
    assert any("1/3" in part and "task 2 of 3" in part for part in parts)
    assert parts[-1].startswith("Check: 100%|")
    assert "3/3" in parts[-1]
    assert parts[-1].rstrip().endswith(", done]")
    assert out.getvalue().endswith("\n")  # left on screen (leave=True)


def test_a_bar_of_updates_has_lightnings_rate_and_draws_its_last_count() -> None:
    out = io.StringIO()
    bar = BarReporter("Fit", total=200, file=out, leave=False, unit="update", rate=True)
    for step in range(1, 201):
        bar.update("", done=step)  # tqdm redraws at its own pace (0.1 s): not every step
    drawn = _bar_text(out)
    assert len(drawn) < 50
    bar.close(done=200)
    drawn = _bar_text(out)
    assert "200/200 [00:00<00:00" in drawn[-1]
    assert "update/s]" in drawn[-1]
    assert out.getvalue().endswith("\r")  # leave=False: cleared


def test_the_bar_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match=r"BarReporter\(total=-1\) is invalid"):
        BarReporter("Check", total=-1, file=io.StringIO())
    with pytest.raises(TypeError, match=r"BarReporter\(leave=1\) is invalid: expected True or"):
        BarReporter("Check", total=1, file=io.StringIO(), leave=1)  # type: ignore[arg-type]


@pytest.fixture
def no_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())


@pytest.mark.usefixtures("no_terminal")
def test_what_is_shown_where(monkeypatch: pytest.MonkeyPatch) -> None:
    def shown(**kwargs: object) -> str:
        options: dict[str, object] = {"total": 2, "global_zero": True, "trainer_bar": None}
        reporter = choose_reporter("Job", **(options | kwargs))  # type: ignore[arg-type]
        reporter.close()
        return type(reporter).__name__

    # Never on another rank, whatever the Trainer shows.
    for bar in ("tqdm", "other", None):
        assert shown(global_zero=False, trainer_bar=bar, stream=Tty()) == "Reporter"
    assert shown(trainer_bar="tqdm") == "BarReporter"
    assert shown(trainer_bar="other") == "LineReporter"  # a Rich bar: plain lines
    assert shown(trainer_bar=None) == "Reporter"  # no bar and not a terminal: quiet
    assert shown(trainer_bar=None, stream=Tty()) == "LineReporter"
    monkeypatch.setattr(sys, "stderr", Tty())
    assert shown(trainer_bar=None) == "LineReporter"  # sys.stderr is the default stream
    monkeypatch.setattr(progress, "tqdm_available", lambda: False)
    assert shown(trainer_bar="tqdm") == "LineReporter"
    with pytest.raises(ValueError, match=r"choose_reporter\(trainer_bar='rich'\) is invalid"):
        shown(trainer_bar="rich")
    with pytest.raises(TypeError, match=r"choose_reporter\(global_zero=1\) is invalid"):
        shown(global_zero=1)


def test_is_terminal_of_odd_streams() -> None:
    class Raises:
        def isatty(self) -> bool:
            raise ValueError("I/O operation on closed file")

    assert progress.is_terminal(Tty())
    assert not progress.is_terminal(io.StringIO())
    assert not progress.is_terminal(Raises())
    assert not progress.is_terminal(object())


def test_the_silent_reporter_takes_every_call() -> None:
    with Reporter() as quiet:
        quiet.update("x", done=1)
        quiet.tick()
        quiet.close("y", done=2)
