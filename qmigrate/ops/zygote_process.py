"""The zygote's own process (`python -m qmigrate.ops.zygote_process ASK HEAR`): it imports what
the roles it forks import, then forks one child per request of its node, and tells the node
when each ends. The node's end of it, and what the lines on the two pipes say: ops/zygote.py."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
from typing import NoReturn

from qmigrate.ops import process
from qmigrate.ops.process import children_ended, die_with


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


def _child(argv: list[str], zygote: int, fds: tuple[int, ...], stdin: int | None = None) -> NoReturn:
    """The forked child: `qmigrate *argv`, ending as that process would (its exit status, a
    traceback for an uncaught exception, the interpreter's own exit: atexit, flushed output).
    `stdin`: the node's stdin kept by a zygote forked from the node, for the role that reads it."""
    if stdin is not None:
        os.dup2(stdin, 0)
    for fd in fds:
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # SIGINT stays ignored, as for every role
    die_with(zygote)
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
    buffer = b""
    while True:
        ready, _, _ = select.select([ask], [], [], 0.2)
        for pid, code in children_ended():   # report every child that ended
            os.write(hear, (json.dumps({"pid": pid, "exit": code}) + "\n").encode())
        if not ready:
            continue
        chunk = os.read(ask, 65536)
        if not chunk:   # the node closed its end: it has stopped its roles
            return
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in filter(None, lines):
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:   # unwinds this stack: nothing below runs in the child
                _child(request["argv"], me, kept, stdin if request.get("stdin") else None)
            os.write(hear, (json.dumps({"pid": pid}) + "\n").encode())


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
