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
(CODE as subprocess gives it: the exit status, or minus the signal that killed it).
`Forked` shows such a child to the node as subprocess.Popen shows any other role.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time


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

    def fork(self, argv: list[str]) -> "Forked | None":
        """A child running `qmigrate *argv`; None if the zygote could not give one (it died
        before it answered): the caller then starts the role as a process of its own."""
        self.start()
        try:
            os.write(self._ask, (json.dumps({"argv": argv}) + "\n").encode())
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
            self.proc = self._spawn([sys.executable, "-m", "qmigrate.ops.zygote_process", str(ask_r), str(hear_w)],
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
        """The zygote is gone or going: its children were sent SIGTERM as it died (or are the
        node's to have stopped first), and are counted as ended so."""
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


class Forked:
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

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
