"""Nodes started warm: `qmigrate` commands forked from one process that has done their imports.

A node with CPU workers spends most of its start in its zygote, importing torch and
transformers (seconds of CPU each time, qmigrate/ops/zygote.py). The suite starts many nodes,
so it keeps one process per test session, the mother (this file run as a script), that has
made those imports once. `popen` asks the mother to fork a `qmigrate` command with the
caller's stdin, stdout, stderr, environment and working directory; the command then runs as
`python -m qmigrate ...` would, and a node's zygote is a fork of the node itself (it holds the
imports already). `popen_python` does the same for a test's own script (`python SCRIPT ...`
or `python -c PROGRAM ...`) that runs qmigrate's roles with a part replaced. What the caller
gets is a child of the mother, not of the test process: `WarmProcess` shows it with what
tests use of subprocess.Popen, the mother telling its end.

A command whose environment differs from the mother's in a variable read at import
(`_READ_AT_IMPORT`), or any command while QMIGRATE_TEST_COLD is set, starts as a process of its
own instead (`subprocess.Popen`), as a user's does; so do the tests of the zygote, of signals
during a start and of serve's own start and stop.

The mother and a caller speak over a Unix socket, one connection a command: the request is
one JSON object with the three file descriptors beside it; the answers are `{"pid": N}`, then
`{"exit": CODE}` when the command ends (CODE as subprocess gives it).
"""

from __future__ import annotations

import io
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time

if __name__ == "__main__":   # the mother: the qmigrate the tests import, and not this directory
    sys.path[0] = sys.argv[3]

from qmigrate.ops.process import children_ended  # noqa: E402
from qmigrate.ops.zygote import PopenSignals  # noqa: E402

# Variables read when modules are imported or the interpreter starts: the mother imported with
# its own, so a command that sets them otherwise starts cold. Any other variable is the
# command's own (the child's environment is replaced before the command runs).
_READ_AT_IMPORT = ("PYTHON", "TRITON_", "TORCH_", "HF_", "TRANSFORMERS_", "CUDA_", "NCCL_",
                   "OMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_", "QMIGRATE_TEST_")


# --- the mother -------------------------------------------------------------------------------


def _mother(path: str, parent: int) -> None:
    import gc
    import signal

    from qmigrate.ops import process, zygote_process
    from qmigrate.ops.process import die_with
    die_with(parent)
    try:   # set up now: it finds the memory it writes titles to from the environment, which
        # a child replaces before it sets its own title
        from setproctitle import setproctitle
        setproctitle("qmigrate warm mother")
    except ImportError:
        pass
    zygote_process._preload()
    gc.collect()
    gc.freeze()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen(64)
    os.rename(path + ".tmp", path)   # ready: the caller waits for this name
    waiting: dict[int, socket.socket] = {}   # pid -> its caller's connection
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))   # no teardown of what gc.freeze holds
    while True:
        ready, _, _ = select.select([server], [], [], 0.05)
        for pid, code in children_ended():
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall((json.dumps({"exit": code}) + "\n").encode())
                except OSError:
                    pass
                conn.close()
        if not ready:
            continue
        conn, _ = server.accept()
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        ask = json.loads(data)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            server.close()
            for other in waiting.values():
                other.close()
            conn.close()
            process.exit_as_main(lambda: _command(ask, fds))
        for fd in fds:
            os.close(fd)
        conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        waiting[pid] = conn


def _command(ask: dict, fds: list[int]) -> None:
    """In the forked child: become `python -m qmigrate *argv` with the caller's files."""
    if ask["session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(ask["cwd"])
    os.environ.clear()
    os.environ.update(ask["env"])
    tempfile.tempdir = None   # TMPDIR is read again
    argv = ask["argv"]
    python = ask.get("python")   # `python *argv`: a script's path or -c and a program first
    try:
        from setproctitle import setproctitle
        shown = (["-c", *argv[2:]] if argv[0] == "-c" else argv) if python else ["-m", "qmigrate", *argv]
        setproctitle(" ".join([sys.executable, *shown]))
    except ImportError:
        pass
    if python:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            import runpy
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        return
    sys.argv = ["qmigrate", *argv]
    from qmigrate.cli import app
    app(argv, prog_name="qmigrate")


# --- the caller's end ---------------------------------------------------------------------------


class _Mother:
    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.path: str | None = None
        self.env: dict[str, str] = {}
        self._dir: str | None = None
        self._lock = threading.Lock()

    def spawn(self) -> None:
        """Start the mother now (it imports while the session collects its tests), unless
        every command is to start cold."""
        with self._lock:
            if not os.environ.get("QMIGRATE_TEST_COLD") and self.proc is None:
                self._spawn()

    def address(self) -> str:
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                self._spawn()
            self._wait_ready()
            return self.path

    def _spawn(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="qm-warm-", dir="/tmp")
        self.path = os.path.join(self._dir, "mother.sock")
        self.env = dict(os.environ)
        import qmigrate
        root = os.path.dirname(os.path.dirname(os.path.abspath(qmigrate.__file__)))
        self.proc = subprocess.Popen([sys.executable, __file__, self.path, str(os.getpid()), root],
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the warm mother did not start (exit {self.proc.poll()})")
            time.sleep(0.02)

    def stop(self) -> None:
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
            if self._dir is not None:
                import shutil
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None


MOTHER = _Mother()


def warm(env: dict[str, str]) -> bool:
    """Whether a command with this environment may start warm."""
    if os.environ.get("QMIGRATE_TEST_COLD"):
        return False
    if MOTHER.proc is None:
        base = os.environ
    else:
        base = MOTHER.env
    keys = {k for k in set(env) | set(base) if k.startswith(_READ_AT_IMPORT)}
    return all(env.get(k) == base.get(k) for k in keys)


def popen(args: list[str], *, stdin=None, stdout=None, stderr=None, text: bool = False, env: dict | None = None,
          cwd=None, start_new_session: bool = False, cold: bool = False):
    """`python -m qmigrate *args` started warm where it may be (a WarmProcess), else (or when
    `cold`) a subprocess.Popen of its own; the keywords mean what subprocess.Popen's mean."""
    env = dict(os.environ if env is None else env)
    if cold or not warm(env):
        return subprocess.Popen([sys.executable, "-m", "qmigrate", *args], stdin=stdin, stdout=stdout,
                                stderr=stderr, text=text, env=env, cwd=cwd, start_new_session=start_new_session)
    return WarmProcess(args, stdin=stdin, stdout=stdout, stderr=stderr, text=text, env=env, cwd=cwd,
                       start_new_session=start_new_session)


def popen_python(args: list[str], *, stdin=None, stdout=None, stderr=None, text: bool = False,
                 env: dict | None = None, cwd=None, start_new_session: bool = False):
    """`python *args` (a script and its arguments, or -c, a program and its arguments) that
    imports the qmigrate the tests import, started warm where it may be, as `popen` does a
    command. Cold, it finds that qmigrate through PYTHONPATH (this process's sys.path)."""
    env = dict(os.environ if env is None else env)
    if not warm(env):
        env["PYTHONPATH"] = os.pathsep.join(sys.path)
        return subprocess.Popen([sys.executable, *args], stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                env=env, cwd=cwd, start_new_session=start_new_session)
    return WarmProcess(args, stdin=stdin, stdout=stdout, stderr=stderr, text=text, env=env, cwd=cwd,
                       start_new_session=start_new_session, python=True)


def _ends(spec, target: int, for_writing_by_child: bool):
    """(the fd the child gets, the caller's end or None, an fd to close here after the fork)."""
    if spec is None:
        return target, None, None
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        return (w, r, w) if for_writing_by_child else (r, w, r)
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        return fd, None, fd
    if isinstance(spec, int):
        return spec, None, None
    return spec.fileno(), None, None


class WarmProcess(PopenSignals):
    """A command forked by the mother, with what tests use of subprocess.Popen."""

    def __init__(self, args, *, stdin, stdout, stderr, text, env, cwd, start_new_session, python=False):
        self.args = [sys.executable, *([] if python else ["-m", "qmigrate"]), *args]
        self.returncode: int | None = None
        self._text = text
        ends = [_ends(stdin, 0, False), _ends(stdout, 1, True), _ends(stderr, 2, True)]
        ask = {"argv": list(args), "env": env, "cwd": str(cwd or os.getcwd()), "session": start_new_session,
               "python": python}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(MOTHER.address())
            socket.send_fds(self._conn, [json.dumps(ask).encode()], [e[0] for e in ends])
        finally:
            for _, _, close in ends:
                if close is not None:
                    os.close(close)
        self._buffer = b""
        self.pid = self._read(60)["pid"]
        self.stdin = self._file(ends[0][1], "wb")
        self.stdout = self._file(ends[1][1], "rb")
        self.stderr = self._file(ends[2][1], "rb")
        self._readers: dict[str, threading.Thread] = {}
        self._output: dict[str, list] = {}

    def _file(self, fd, mode):
        if fd is None:
            return None
        raw = io.open(fd, mode)
        if not self._text:
            return raw
        return io.TextIOWrapper(raw, write_through=True) if "w" in mode else io.TextIOWrapper(raw)

    def _read(self, timeout: float | None) -> dict | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._conn], [], [], left)
            if not ready:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError("the warm mother went away")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        return self._wait(0)

    def _wait(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            message = self._read(timeout)
            if message is not None:
                self.returncode = message["exit"]
                self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._wait(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None):
        if self.stdin is not None and not self.stdin.closed:
            stdin = self.stdin
            def feed():
                try:
                    if input:
                        stdin.write(input)
                except BrokenPipeError:
                    pass
                finally:
                    try:
                        stdin.close()
                    except BrokenPipeError:
                        pass
            self._readers["stdin"] = threading.Thread(target=feed, daemon=True)
            self._readers["stdin"].start()
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and name not in self._readers:
                self._output[name] = []
                self._readers[name] = threading.Thread(target=lambda s=stream, o=self._output[name]: o.append(s.read()),
                                                       daemon=True)
                self._readers[name].start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._readers.values():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = [("".join if self._text else b"".join)(self._output[n]) if n in self._output else None
               for n in ("stdout", "stderr")]
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None:
                stream.close()
        return out[0], out[1]



if __name__ == "__main__":
    _mother(sys.argv[1], int(sys.argv[2]))
