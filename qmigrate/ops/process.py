"""What every role process does around its loop: freeze the startup heap, exit with one line,
and die with the process that started it."""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1


def _libc():
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc() if sys.platform.startswith("linux") else None


def die_with(parent: int) -> None:
    """SIGTERM this process when `parent` dies, even by SIGKILL (Linux; elsewhere nothing).
    Exits at once if the parent died before this took effect."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def freeze_heap() -> None:
    """Take what startup built (modules, the model, a tokenizer: hundreds of thousands of
    objects that live until exit) out of the garbage collector's sight. Left in, every full
    collection walks them all and pauses the loop at a step nobody chose. Called once, before
    serving; at exit they are handed back, so the interpreter's teardown frees them (extension
    modules that count their objects at exit would otherwise report them all as leaked)."""
    global _frozen
    gc.collect()
    gc.freeze()
    if not _frozen:
        _frozen = True
        atexit.register(gc.unfreeze)


_frozen = False


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
