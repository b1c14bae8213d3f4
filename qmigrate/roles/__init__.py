"""One module per role: a short socket loop around a pure core."""

from __future__ import annotations

import sys
from typing import Callable


def run_until_fatal(serve: Callable[[], None]) -> int:
    """Run a role's loop; a fatal condition it raises as SystemExit("why") prints one line."""
    try:
        serve()
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 1
        raise
    return 0
