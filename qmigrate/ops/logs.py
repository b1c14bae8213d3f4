"""Logging of every role: to stderr, each line naming the role, its name and its node."""

from __future__ import annotations

import logging
import sys

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
