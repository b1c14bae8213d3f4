"""What every role process does around its loop: freeze the startup heap, exit with one line,
die with the process that started it, and tidy up before SIGTERM ends it."""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
import threading
from typing import Callable, NoReturn

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


def before_sigterm(fn: Callable[[], None]) -> None:
    """Run `fn` when SIGTERM comes (as a node stops its roles), then end as the signal would
    have ended the process: its exit status still says SIGTERM. A role dies of the signal
    without unwinding, so what must not outlive it (a trace's last stretch, a tensor-parallel
    worker's follower ranks and their directory) is registered here. Called from the main
    thread; elsewhere it does nothing (only the main thread may set a handler)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if not _at_sigterm:
        signal.signal(signal.SIGTERM, _tidy_and_end)
    _at_sigterm.append(fn)


_at_sigterm: list[Callable[[], None]] = []


def forget_sigterm() -> None:
    """In a child forked from a process that registered clean-ups: none of them is its own."""
    _at_sigterm.clear()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _tidy_and_end(signum, frame) -> None:
    # A node stopping sends SIGTERM to its whole group and then to each role, and a zygote to its
    # children: the second must not cut the clean-up short (a stuck one ends by SIGKILL, which a
    # node sends after its grace)
    signal.signal(signum, signal.SIG_IGN)
    for fn in _at_sigterm:
        try:
            fn()
        except Exception as exc:   # the rest still runs, and the process still ends
            print(f"at SIGTERM: {type(exc).__name__}: {exc}", file=sys.stderr)
    end_by_signal(signum)


def end_by_signal(signum: int) -> NoReturn:
    """End this process as `signum` ends it, its exit status saying so, without the
    interpreter's teardown."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)   # not reached: the signal ends it


def send_signal(pid: int, sig: int) -> None:
    """Signal `pid`, if it is still there."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


_role_imports = False


def roles_imported() -> None:
    """Say that this process holds what the roles import (the zygote's preload ran here)."""
    global _role_imports
    _role_imports = True


def holds_role_imports() -> bool:
    """Whether this process, or the one it was forked from, did the zygote's imports: a zygote
    started from here is then a fork of it (ops/zygote.py)."""
    return _role_imports


def exit_as_main(run) -> NoReturn:
    """Run `run()` in a forked process and end it as the interpreter ends a script, without
    returning into the frames it was forked from: its exit status (SystemExit's code, 1 and a
    traceback for another exception), non-daemon threads joined, atexit run, output flushed."""
    try:
        run()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 -- reported as an uncaught exception would be
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()   # what the interpreter does first at exit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code & 0xFF)


def children_ended() -> list[tuple[int, int]]:
    """(pid, exit code as subprocess gives it) of each child that has ended, without waiting."""
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))
