"""The zygote's own process (`python -m qmigrate.ops.zygote_process ASK HEAR`): it imports what
the roles it forks import, then forks one child per request of its node, and tells the node
when each ends. The node's end of it, and what the lines on the two pipes say: ops/zygote.py."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from typing import NoReturn

from qmigrate.ops import process
from qmigrate.ops.process import children_ended, die_with, end_by_signal, send_signal

STOP_GRACE_S = 10.0   # longer than a node's own: while the node lives, it is the one that kills


def _preload() -> None:
    """What the forked roles import before they serve: torch, transformers' model and
    tokenizer classes, the roles' own modules and the command line that runs them. Nothing
    here initializes CUDA."""
    import torch  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401
    import qmigrate.cli  # noqa: F401
    import qmigrate.detokenizer.loop  # noqa: F401
    import qmigrate.ingest.loop  # noqa: F401
    import qmigrate.worker.loop  # noqa: F401
    process.roles_imported()


def _child(argv: list[str], zygote: int, fds: tuple[int, ...], stdin: int | None, mask) -> NoReturn:
    """The forked child: `qmigrate *argv`, ending as that process would (its exit status, a
    traceback for an uncaught exception, the interpreter's own exit: atexit, flushed output).
    `stdin`: the node's stdin kept by a zygote forked from the node, for the role that reads it.
    `mask`: the signal mask to restore once the child's own handlers are set."""
    if stdin is not None:
        os.dup2(stdin, 0)
    for fd in fds:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # SIGINT stays ignored, as for every role
    die_with(zygote)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    sys.argv = ["qmigrate", *argv]
    from qmigrate.cli import app
    app(argv, prog_name="qmigrate")   # raises SystemExit with the command's status
    raise SystemExit(0)


def main(ask: int, hear: int, stdin: int | None = None) -> None:
    """Fork a child for each request on `ask`, and tell `hear` its pid and its end. `stdin`:
    the node's stdin, which a zygote forked from the node keeps for the role that reads it."""
    import gc
    import warnings
    try:
        from setproctitle import setproctitle
        setproctitle("qmigrate zygote")
    except ImportError:
        pass
    if not process.holds_role_imports():
        _preload()
    gc.collect()
    gc.freeze()   # the children share these pages: no collection of theirs writes to them
    # Python 3.12 warns of a fork in a process with threads; the only other thread here is the
    # BLAS library's idle pool, which is made safe across fork by the library itself.
    warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
    me = os.getpid()
    kept = (ask, hear) if stdin is None else (ask, hear, stdin)   # what a child closes
    live: set[int] = set()
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    buffer = b""
    while not stopping:
        ready, _, _ = select.select([ask], [], [], 0.2)
        _report(children_ended(), live, hear)
        if not ready or stopping:
            continue
        chunk = os.read(ask, 65536)
        if not chunk:   # the node closed its end: it has stopped its roles
            _stop_children(live, hear)
            _flush()
            os._exit(0)
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in filter(None, lines):
            request = json.loads(line)
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM,))   # the child's is its own
            pid = os.fork()
            if pid == 0:   # unwinds this stack: nothing below runs in the child
                _child(request["argv"], me, kept, stdin if request.get("stdin") else None, mask)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            live.add(pid)
            _send(hear, {"pid": pid})
    _stop_children(live, hear)
    _flush()
    end_by_signal(signal.SIGTERM)


def _flush() -> None:
    """Before the zygote ends without the interpreter's teardown, which has nothing of the
    zygote's to do and would print what the libraries it imported leave behind."""
    sys.stdout.flush()
    sys.stderr.flush()


def _send(hear: int, message: dict) -> None:
    try:
        os.write(hear, (json.dumps(message) + "\n").encode())
    except OSError:   # the node is gone: nobody to tell
        pass


def _report(ended: list[tuple[int, int]], live: set[int], hear: int) -> None:
    """Tell the node of every child that ended."""
    for pid, code in ended:
        live.discard(pid)
        _send(hear, {"pid": pid, "exit": code})


def _stop_children(live: set[int], hear: int) -> None:
    """SIGTERM stops the zygote (its node stopping, or dead): it stops its children first and
    waits for them, so that a node which waits for its roles waits for their clean-up too
    (their children, their temp directories), not only for the zygote. One that lingers past
    STOP_GRACE_S is killed."""
    for pid in live:
        send_signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while live:
        _report(children_ended(), live, hear)
        if live and time.monotonic() > deadline:
            for pid in live:
                send_signal(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.02)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
