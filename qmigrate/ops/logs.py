"""Logging of every role: to stderr, each line naming the role, its name and its node."""

from __future__ import annotations

import logging
import sys
import time

LEVELS = ("debug", "info", "warning", "error")


class BadLevel(ValueError):
    pass


def parse_level(text: str) -> int:
    name = str(text).strip().lower()
    if name not in LEVELS:
        raise BadLevel(f"--log-level: expected one of {', '.join(LEVELS)}, got {text!r}")
    return getattr(logging, name.upper())


def setup(role: str, name: str, node: str, level: str) -> None:
    label = role if name == role else f"{role} {name}"
    where = f" on {node}" if node and node != name else ""
    logging.basicConfig(level=parse_level(level), stream=sys.stderr, force=True,
                        format=f"%(asctime)s qmigrate {label}{where}: %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    # Third-party libraries speak only when something is wrong.
    for noisy in ("transformers", "urllib3", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, parse_level(level)))


class Throttled:
    """A warning that a peer can repeat at will (malformed frames, say): of each kind (its
    format string) the first `first` are logged, then at most one line per `interval_s`,
    saying how many were left out before it. A flood of one kind hides no other kind."""

    MAX_KINDS = 256   # format strings are the code's own; past this many they share one count

    def __init__(self, logger: logging.Logger, first: int = 10, interval_s: float = 10.0,
                 clock=time.monotonic) -> None:
        self.logger, self.first, self.interval_s, self.clock = logger, first, interval_s, clock
        self.kinds: dict[str, list] = {}   # format -> [seen, left out since the last line, last line at]

    def allow(self, kind: str) -> int | None:
        """None: leave this one out; else log it, saying how many were left out before it."""
        if kind not in self.kinds and len(self.kinds) >= self.MAX_KINDS:
            kind = ""
        state = self.kinds.setdefault(kind, [0, 0, -float("inf")])
        state[0] += 1
        if state[0] <= self.first:
            return 0
        now = self.clock()
        if now - state[2] < self.interval_s:
            state[1] += 1
            return None
        left_out, state[1], state[2] = state[1], 0, now
        return left_out

    def warning(self, fmt: str, *args) -> None:
        left_out = self.allow(fmt)
        if left_out is None:
            return
        if left_out:
            fmt, args = fmt + " (and %d more like it not logged)", (*args, left_out)
        self.logger.warning(fmt, *args)

    def reset(self) -> None:
        self.kinds.clear()


# Every warning about what a peer or client sent that was dropped goes through this one
# throttle: each such path can be driven as fast as the sender likes.
dropped = Throttled(logging.getLogger("qmigrate"))


class _BadRequestLine(logging.Filter):
    """aiohttp logs each request it cannot parse (an over-long URL or header, bad bytes) with
    a full traceback; a client can send them at will. One throttled line each instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or not any(c.__name__ == "HttpProcessingError" for c in type(exc).__mro__):
            return True
        fmt = "bad HTTP request: %s"
        left_out = dropped.allow(fmt)
        if left_out is None:
            return False
        text = f"{record.getMessage()}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        record.msg, record.args = fmt, (text[:300],)
        if left_out:
            record.msg, record.args = fmt + " (and %d more like it not logged)", (text[:300], left_out)
        record.exc_info = record.exc_text = None
        return True


_bad_request_line = _BadRequestLine()


def quiet_bad_requests() -> None:
    """Install the one-line filter on aiohttp's server logger (idempotent)."""
    logging.getLogger("aiohttp.server").addFilter(_bad_request_line)
