"""Roles started as forks of one process that has done their imports once.

A worker process spends most of its start importing torch and transformers (seconds of CPU
each time), an ingest or a detokenizer a second importing transformers for its tokenizer. A
node with CPU workers starts one zygote, `python -m qmigrate.ops.zygote_process`, as it starts
any role (it dies with the node, ignores Ctrl-C); the zygote imports what those roles import and then
forks one child per role it is asked for (launch.start_roles says which). The child runs
`qmigrate role ROLE NAME ...` from there, exactly as an exec'd role would, in the node's
session and with its stdout and stderr. The zygote never touches CUDA, and GPU workers are
never forked: they start as processes of their own (a CUDA context does not survive a fork).

The node talks to its zygote over two pipes, one JSON object a line: `{"argv": [...]}` asks
for a child, `{"pid": N}` answers it, and `{"pid": N, "exit": CODE}` tells that a child ended
(CODE as subprocess gives it: the exit status, or minus the signal that killed it). SIGTERM
stops the zygote as it stops a node: it stops its children, reports their exits and only then
ends, so a node that waits for its roles waits for their clean-up too.
`Forked` shows such a child to the node as subprocess.Popen shows any other role.

A node whose own process already holds those imports (it was forked from a process that made
them, as the test suite starts its nodes) does not start a second interpreter to import them
again: its zygote is a fork of the node itself (`ForkedZygote`), which lets go of everything
the node holds (its handlers, exit hooks and open files) and runs the same loop.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import subprocess
import sys
import time

from qmigrate.ops import process
from qmigrate.ops.process import die_with


ZYGOTE_MODULE = "qmigrate.ops.zygote_process"


class Zygote:
    """The node's end: starts the zygote on first use, and again if it has died."""

    def __init__(self, spawn):
        self._spawn = spawn   # launch._spawn: how the node starts a role process
        self.proc: subprocess.Popen | None = None
        self._ask: int | None = None
        self._hear: int | None = None
        self._buffer = b""
        self.exits: dict[int, int] = {}   # pid -> exit code, of children that ended
        self.children: set[int] = set()

    def start(self) -> None:
        """Start the zygote unless it runs: it begins its imports at once."""
        if self._hear is None or self.proc is None or self.proc.poll() is not None:
            self._start()

    @property
    def forks_every_role(self) -> bool:
        """A zygote forked from the node has the node's stdin and is ready at once: it forks
        the router and an ingest that reads stdin too (a GPU worker never)."""
        return isinstance(self.proc, ForkedZygote)

    def fork(self, argv: list[str], *, stdin: bool = False) -> "Forked | None":
        """A child running `qmigrate *argv` (with the node's stdin: only from a zygote that
        forks every role); None if the zygote could not give one (it died before it
        answered): the caller then starts the role as a process of its own."""
        self.start()
        try:
            os.write(self._ask, (json.dumps({"argv": argv, **({"stdin": True} if stdin else {})}) + "\n").encode())
        except OSError:
            self._gone()
            return None
        while self._hear is not None:   # the first answer waits for the zygote's imports
            for message in self._read(None):
                if "exit" not in message:
                    self.children.add(message["pid"])
                    return Forked(self, message["pid"], argv)
        return None

    def _start(self) -> None:
        self.close()
        ask_r, ask_w = os.pipe()
        hear_r, hear_w = os.pipe()
        try:
            if process.holds_role_imports():   # this process holds the imports: the zygote is a fork of it
                self.proc = ForkedZygote(ask_r, hear_w)
            else:
                self.proc = self._spawn([sys.executable, "-m", ZYGOTE_MODULE, str(ask_r), str(hear_w)],
                                        subprocess.DEVNULL, pass_fds=(ask_r, hear_w))
        except BaseException:
            os.close(ask_w)
            os.close(hear_r)
            raise
        finally:
            os.close(ask_r)
            os.close(hear_w)
        self._ask, self._hear, self._buffer = ask_w, hear_r, b""

    def _read(self, timeout: float | None) -> list[dict]:
        """The messages that came within `timeout` (None: wait for at least one, or the end)."""
        messages: list[dict] = []
        while not messages and self._hear is not None:
            ready, _, _ = select.select([self._hear], [], [], timeout)
            if not ready:
                break
            chunk = os.read(self._hear, 65536)
            if not chunk:
                self._gone()
                break
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            messages = [json.loads(line) for line in lines if line]
        for m in messages:
            if "exit" in m:
                self.exits[m["pid"]] = m["exit"]
        return messages

    def _gone(self) -> None:
        """The zygote is gone or going. A zygote stopped by SIGTERM stops its children and
        reports each exit before it ends; those it did not report (it was killed outright, and
        the kernel sent them SIGTERM as it died, or they are the node's to have stopped first)
        are counted as ended so."""
        for fd in (self._ask, self._hear):
            if fd is not None:
                os.close(fd)
        self._ask = self._hear = None
        for pid in self.children - self.exits.keys():
            self.exits[pid] = -signal.SIGTERM

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code once it has ended (waiting up to `timeout`), else None. A
        zygote that died took its children with it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.exits and self._hear is not None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._read(left)
            if deadline is not None and time.monotonic() >= deadline:
                break
        return self.exits.get(pid)

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the zygote (its children are the node's to stop first)."""
        self._gone()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class PopenSignals:
    """subprocess.Popen's signal methods for a process object with `pid` and `poll()`: a
    process that has ended (its pid perhaps reused) is sent nothing."""

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            process.send_signal(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forked(PopenSignals):
    """A role forked by the zygote, with what the node uses of subprocess.Popen."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


class ForkedZygote(PopenSignals):
    """The zygote as a fork of this process (which has done its imports), with what the node
    uses of subprocess.Popen. The child keeps only the two pipes, its output and a copy of the
    node's stdin for the role that reads it (its own stdin is /dev/null); the node's signal
    handlers and exit hooks are dropped, SIGINT is ignored as for every role, and it dies
    with the node."""

    def __init__(self, ask: int, hear: int):
        self.args = ["qmigrate zygote"]
        self.returncode: int | None = None
        node = os.getpid()
        stops = (signal.SIGINT, signal.SIGTERM)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, stops)   # no node handler runs in the child
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            process.exit_as_main(lambda: self._become(node, ask, hear, mask))
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        self.pid = pid

    @staticmethod
    def _become(node: int, ask: int, hear: int, mask) -> None:
        import atexit
        atexit._clear()
        for sig in signal.valid_signals():
            try:
                if callable(signal.getsignal(sig)):
                    signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stdin = os.dup(0)   # kept for the role that reads it
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        keep = {0, 1, 2, ask, hear, stdin}
        open_fds = os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []   # Linux only
        for fd in map(int, open_fds):   # the node's files
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:   # the directory's own descriptor, closed already
                    pass
        die_with(node)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        # the zygote's program, run as `python -m` runs it, in this interpreter (which has its imports)
        sys.argv = [ZYGOTE_MODULE, str(ask), str(hear), str(stdin)]
        sys.modules.pop(ZYGOTE_MODULE, None)   # run as a program, not as the module imported here
        runpy.run_module(ZYGOTE_MODULE, run_name="__main__", alter_sys=True)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode
