"""Progress of long work that no Trainer's bar shows (docs/resume.md, "Progress"): plain lines,
a ``tqdm`` bar like Lightning's, and the marker lines a child process prints for its parent.
Torch-free; a write that fails (a closed stream, a broken pipe) is dropped."""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sys
import time
from collections.abc import Callable
from typing import Any, Final, Literal, NamedTuple, TextIO

from lightning_pilot.core import validate

#: What starts a progress line a child process prints (on stderr) for its parent.
MARKER: Final = "lightning-pilot-progress:"
#: The longest message shown; longer ones are cut.
MAX_MESSAGE: Final = 200
#: Lightning's ``TQDMProgressBar.BAR_FORMAT`` (Lightning 2.6.6), for bars of updates.
RATE_BAR_FORMAT: Final = (
    "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]"
)
#: The same without the rate and the time left: for a few tasks of a minute each.
BAR_FORMAT: Final = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"

# Control characters would redraw the terminal.
_CONTROL: Final = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_MARK: Final = re.compile(r"(\d{1,9})/(\d{1,9}) (.*)")

TrainerBar = Literal["tqdm", "other"] | None


def clean(text: object) -> str:
    """``str(text)`` on one line, control characters as spaces, at most ``MAX_MESSAGE`` long."""
    line = _CONTROL.sub(" ", str(text)).strip()
    return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 3] + "..."


class Mark(NamedTuple):
    """A child's progress: ``done`` of ``total`` units finished, and what it does now."""

    done: int
    total: int
    message: str


def marker_line(done: int, total: int, message: str) -> str:
    """The line a child prints for its parent (no newline)."""
    done = validate.integer("marker_line", "done", done, minimum=0)
    total = validate.integer("marker_line", "total", total, minimum=0)
    return f"{MARKER} {done}/{total} {clean(message)}"


def parse_marker(line: str) -> Mark | None:
    """The :class:`Mark` of a marker line, ``None`` for any other line (the child's own output)."""
    found = _MARK.fullmatch(line[len(MARKER) :].strip()) if line.startswith(MARKER) else None
    if found is None:
        return None
    done, total = int(found[1]), int(found[2])
    return Mark(min(done, total), total, clean(found[3]))


def is_terminal(stream: object) -> bool:
    """Whether ``stream`` is a terminal (``False`` for anything without a working ``isatty``)."""
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except Exception:  # a closed stream, a wrapper without isatty
        return False


def tqdm_available() -> bool:
    """Whether ``tqdm`` can be imported (Lightning depends on it; this module does not)."""
    return importlib.util.find_spec("tqdm") is not None


class Reporter:
    """Progress that shows nothing: the base of :class:`LineReporter` and :class:`BarReporter`,
    and what :func:`choose_reporter` returns where nothing may be shown. A context manager that
    closes it."""

    def update(self, message: str, *, done: int | None = None) -> None:
        """Say what the work does now (``done`` units finished)."""

    def tick(self) -> None:
        """Called regularly while the work runs (a heartbeat, a bar's clock)."""

    def close(self, message: str | None = None, *, done: int | None = None) -> None:
        """End the progress, with a last message (and how many units were finished)."""

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class LineReporter(Reporter):
    """Plain lines ``<label>: <message> ... <elapsed> s`` on ``stream`` (default: ``sys.stderr``
    at the time of writing): the first at once, then at most one every ``min_interval_s`` (a
    newer message waits), the current one again after ``heartbeat_s`` without news, and the
    ``close`` message always.

    Example:
        >>> import io
        >>> clock = iter([0.0, 2.0, 7.0, 40.0, 41.0]).__next__
        >>> out = io.StringIO()
        >>> lines = LineReporter("Fit", stream=out, heartbeat_s=30.0, clock=clock)
        >>> lines.update("loading")  # the first line is written at once
        >>> lines.update("update 3 of 8", done=3)  # 2 s: kept until the interval has passed
        >>> lines.tick()  # 7 s: the pending message is written
        >>> lines.tick()  # 40 s: a heartbeat
        >>> lines.close("done")
        >>> print(out.getvalue(), end="")
        Fit: loading ... 0 s
        Fit: update 3 of 8 ... 7 s
        Fit: update 3 of 8 ... 40 s
        Fit: done ... 41 s
    """

    def __init__(
        self,
        label: str,
        *,
        stream: TextIO | None = None,
        min_interval_s: float = 5.0,
        heartbeat_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        owner = type(self).__name__
        self.label = clean(validate.text(owner, "label", label, max_length=MAX_MESSAGE))
        self.stream = stream
        self.min_interval_s = validate.number(owner, "min_interval_s", min_interval_s, minimum=0)
        self.heartbeat_s = validate.number(
            owner, "heartbeat_s", heartbeat_s, minimum=self.min_interval_s
        )
        self._clock = validate.callable_or_none(owner, "clock", clock, "clock() -> seconds")
        self._start: float | None = None
        self._written_at: float | None = None
        self._current: str | None = None
        self._pending = False
        self._closed = False

    def update(self, message: str, *, done: int | None = None) -> None:
        now = self._now()
        text = clean(message)
        self._pending = self._pending or text != self._current
        self._current = text
        if self._written_at is None or now - self._written_at >= self.min_interval_s:
            self._write(now)

    def tick(self) -> None:
        if self._current is None or self._written_at is None or self._closed:
            return
        now = self._now()
        waited = now - self._written_at
        if (self._pending and waited >= self.min_interval_s) or waited >= self.heartbeat_s:
            self._write(now)

    def close(self, message: str | None = None, *, done: int | None = None) -> None:
        if self._closed:
            return
        if message is not None:
            self._current, self._pending = clean(message), True
            self._write(self._now())
        self._closed = True

    def _now(self) -> float:
        assert self._clock is not None
        now = self._clock()
        if self._start is None:
            self._start = now
        return now

    def _write(self, now: float) -> None:
        if self._closed:
            return
        assert self._start is not None
        self._written_at, self._pending = now, False
        stream = self.stream if self.stream is not None else sys.stderr
        with contextlib.suppress(OSError, ValueError):  # progress is optional
            stream.write(f"{self.label}: {self._current} ... {now - self._start:.0f} s\n")
            stream.flush()


class BarReporter(Reporter):
    """A ``tqdm`` bar of ``total`` units set as Lightning's ``TQDMProgressBar`` sets its main
    bar, on ``file`` (default: ``sys.stdout``); the message is its postfix; with ``rate``,
    :data:`RATE_BAR_FORMAT`, else :data:`BAR_FORMAT`. ``ModuleNotFoundError`` without ``tqdm``.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> with BarReporter("Check", total=2, file=out) as bar:
        ...     bar.update("task 1 of 2", done=0)
        ...     bar.update("task 2 of 2", done=1)
        ...     bar.close("done", done=2)
        >>> "Check: 100%" in out.getvalue() and "2/2" in out.getvalue()
        True
    """

    def __init__(
        self,
        label: str,
        *,
        total: int,
        file: TextIO | None = None,
        position: int = 0,
        leave: bool = True,
        unit: str = "task",
        rate: bool = False,
    ) -> None:
        owner = type(self).__name__
        label = clean(validate.text(owner, "label", label, max_length=MAX_MESSAGE))
        total = validate.integer(owner, "total", total, minimum=0)
        position = validate.integer(owner, "position", position, minimum=0)
        leave = validate.boolean(owner, "leave", leave)
        unit = validate.text(owner, "unit", unit, max_length=40)
        rate = validate.boolean(owner, "rate", rate)
        from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

        self._bar: Any = tqdm(
            total=total,
            desc=label,
            file=file if file is not None else sys.stdout,
            dynamic_ncols=True,
            leave=leave,
            position=position,
            smoothing=0,
            unit=unit,
            bar_format=RATE_BAR_FORMAT if rate else BAR_FORMAT,
        )
        self._message = ""
        self._closed = False

    def update(self, message: str, *, done: int | None = None) -> None:
        if self._closed:
            return
        if clean(message) == self._message and done is not None and done >= self._bar.n:
            # Only the count moved: tqdm's own update redraws at most every 0.1 s.
            with contextlib.suppress(OSError, ValueError):
                self._bar.update(min(done, self._bar.total) - self._bar.n)
            return
        self._draw(message, done)

    def tick(self) -> None:
        if not self._closed:
            self._draw(None, None)  # the elapsed time moves on

    def close(self, message: str | None = None, *, done: int | None = None) -> None:
        if self._closed:
            return
        if message is not None or done is not None:
            self._draw(message, done)  # the last state, whatever tqdm's own pace skipped
        self._closed = True
        with contextlib.suppress(OSError, ValueError):
            self._bar.close()

    def _draw(self, message: str | None, done: int | None) -> None:
        if done is not None:
            self._bar.n = min(max(done, 0), self._bar.total)
        if message is not None:
            self._message = clean(message)
            self._bar.set_postfix_str(self._message, refresh=False)
        with contextlib.suppress(OSError, ValueError):  # a closed stream: progress is optional
            self._bar.refresh()


def choose_reporter(
    label: str,
    *,
    total: int,
    global_zero: bool,
    trainer_bar: TrainerBar,
    position: int = 0,
    stream: TextIO | None = None,
) -> Reporter:
    """The progress for work done around a Trainer: nothing off global rank 0; a
    :class:`BarReporter` of ``total`` units at ``position`` where the Trainer shows a ``tqdm``
    bar (``trainer_bar="tqdm"``; lines without ``tqdm``); plain lines on ``stream`` (default
    ``sys.stderr``) where it shows another bar (``"other"``), or none (``None``) but ``stream``
    is a terminal; else nothing.

    Example:
        >>> import io
        >>> type(choose_reporter("Job", total=2, global_zero=False, trainer_bar="tqdm")).__name__
        'Reporter'
        >>> type(choose_reporter("Job", total=2, global_zero=True, trainer_bar="other",
        ...                      stream=io.StringIO())).__name__
        'LineReporter'
        >>> type(choose_reporter("Job", total=2, global_zero=True, trainer_bar=None,
        ...                      stream=io.StringIO())).__name__
        'Reporter'
    """
    owner = "choose_reporter"
    validate.boolean(owner, "global_zero", global_zero)
    validate.choice(owner, "trainer_bar", trainer_bar, ("tqdm", "other"), optional=True)
    if not global_zero:
        return Reporter()
    if trainer_bar == "tqdm" and tqdm_available():
        return BarReporter(label, total=total, position=position)
    if trainer_bar is not None or is_terminal(stream if stream is not None else sys.stderr):
        return LineReporter(label, stream=stream)
    return Reporter()
