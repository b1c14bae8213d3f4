"""Targets for a spawned world process that must set its own environment before it imports
what tests/tp_ranks.py imports: the parent's environment then never changes, which a test
running beside it in another thread could otherwise see."""

from __future__ import annotations

import os


def run_world_compiled(*args) -> None:
    """tp_ranks.run_world without Triton's interpreter (read when triton is first imported):
    on the CPU the ranks then take the torch reference path."""
    os.environ.pop("TRITON_INTERPRET", None)
    import tp_ranks
    tp_ranks.run_world(*args)
