"""A one-line progress display on stderr, redrawn in place; silent unless stderr is a terminal."""

from __future__ import annotations

import sys
import time
from collections import deque

REDRAW_S = 0.5
RATE_WINDOW_S = 5.0
CLEAR_LINE = "\r\033[K"


def format_line(name: str, done: int, total: int | None, tokens_per_s: float, queued: int | None,
                in_flight: int | None = None, unit: str = "requests") -> str:
    parts = [f"{done}/{total} {unit} done" if total else f"{done} {unit} done"]
    if in_flight is not None:
        parts.append(f"{in_flight} running")
    if queued is not None:
        parts.append(f"queue {queued}")
    parts.append(f"{tokens_per_s:,.0f} tok/s")
    return f"{name}: " + ", ".join(parts)


class ProgressLine:
    def __init__(self, name: str, stream=None, enabled: bool | None = None):
        self.name = name
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.shown_at = 0.0
        self.is_drawn = False

    def due(self, now: float | None = None) -> bool:
        return self.enabled and (now if now is not None else time.monotonic()) - self.shown_at >= REDRAW_S

    def show(self, done: int, total: int | None, tokens_per_s: float, queued: int | None = None,
             in_flight: int | None = None, unit: str = "requests") -> None:
        if not self.enabled:
            return
        self.shown_at = time.monotonic()
        line = format_line(self.name, done, total, tokens_per_s, queued, in_flight, unit)
        self.stream.write(CLEAR_LINE + line)
        self.stream.flush()
        self.is_drawn = True

    def clear(self) -> None:
        """Take the line away, so what is printed next starts on a clean line."""
        if self.is_drawn:
            self.stream.write(CLEAR_LINE)
            self.stream.flush()
            self.is_drawn = False


class TokenRate:
    """Tokens per second from a running total sampled now and then: the tokens counted over the
    last RATE_WINDOW_S, over the time they took. Time before the window's first new tokens
    (loading, waiting for work) is not counted."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, total: int) -> float:
        if self.samples and total < self.samples[-1][1]:
            self.samples.clear()  # the total restarted (a router that restarted)
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        while len(self.samples) > 1 and self.samples[0][1] == self.samples[1][1]:
            self.samples.popleft()
        (then, before) = self.samples[0]
        return (total - before) / (now - then) if now > then else 0.0


class TerminalWriter:
    """Writes output text; at a terminal it first clears the line, so a progress line drawn
    there (by another process, on stderr) never runs into the output."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.prefix = CLEAR_LINE if _is_tty(self.stream) else ""

    def __call__(self, text: str) -> None:
        self.stream.write(self.prefix + text if self.prefix else text)
        self.stream.flush()


def _is_tty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
