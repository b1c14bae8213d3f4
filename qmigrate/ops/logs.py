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
    """A warning that a peer can repeat at will (malformed frames, say): the first `first` are
    logged, then at most one line per `interval_s`, saying how many were left out before it."""

    def __init__(self, logger: logging.Logger, first: int = 10, interval_s: float = 10.0,
                 clock=time.monotonic) -> None:
        self.logger, self.first, self.interval_s, self.clock = logger, first, interval_s, clock
        self.num = self.num_left_out = 0
        self.last_at = -float("inf")

    def warning(self, fmt: str, *args) -> None:
        self.num += 1
        if self.num > self.first:
            now = self.clock()
            if now - self.last_at < self.interval_s:
                self.num_left_out += 1
                return
            self.last_at = now
            if self.num_left_out:
                fmt, args = fmt + " (and %d more like it not logged)", (*args, self.num_left_out)
            self.num_left_out = 0
        self.logger.warning(fmt, *args)
