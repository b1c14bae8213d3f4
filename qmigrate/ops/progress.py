"""A one-line progress display on stderr, redrawn in place; silent unless stderr is a terminal."""

from __future__ import annotations

import sys
import time

REDRAW_S = 0.5


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
        self.stream.write("\r" + line + "\033[K")
        self.stream.flush()
        self.is_drawn = True

    def clear(self) -> None:
        """Take the line away, so what is printed next starts on a clean line."""
        if self.is_drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.is_drawn = False
