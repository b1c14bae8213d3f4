"""`qmigrate bench serve` from several processes, so the client does not time itself.

One asyncio process sends calls one after another: before the server sees the last of 1,024
calls sent at once, the client has spent hundreds of milliseconds on the others (connections,
request bytes, event reading), and every call's TTFT counts that wait. Here each of N client
processes takes every N-th call and runs it as `send_all` does alone, from a start time the
parent sets once every process has its calls encoded. The arrival times are drawn once, in
the parent, so a run's arrivals are the same whatever N is. `time.perf_counter` is the
system's monotonic clock, the same in every process, so records merge as they are.

A concurrency limit is shared out among the processes (each keeps its share); the progress
line reads counters the processes write.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import wait

from qmigrate.bench.serve_data import ServeRequest
from qmigrate.bench.serve_stats import CallRecord
from qmigrate.ops.process import die_with

START_AFTER_S = 0.05   # from the last process ready to the run's start
STARTUP_TIMEOUT_S = 60.0


def default_processes() -> int:
    """A process for every 4 cores, at most 8: none on a small machine, whose cores the
    server needs."""
    return max(1, min(8, (os.cpu_count() or 1) // 4))


def shares(total: int | None, n: int) -> list[int | None]:
    """`total` split into n parts that differ by at most one (None: no limit for any); n is
    at most total, so no part is 0 (which would mean no limit)."""
    if total is None:
        return [None] * n
    assert n <= total, (n, total)
    return [total // n + (i < total % n) for i in range(n)]


class ClientProcesses:
    """N processes, each with a `Client` of its own, that run calls on command."""

    def __init__(self, n: int, base_url: str, model: str, *, extensions: bool, sessions_as: str, logprobs: int = -1):
        ctx = mp.get_context("spawn")   # no copy of the parent's event loop or sockets
        self.calls = ctx.Array("q", n, lock=False)    # calls ended, per process
        self.tokens = ctx.Array("q", n, lock=False)   # tokens received, per process
        self.procs, self.conns = [], []
        for i in range(n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_child, name=f"bench-client-{i}", daemon=True,
                               args=(theirs, os.getpid(), i, base_url, model, extensions, sessions_as,
                                     self.calls, self.tokens, logprobs))
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)

    def run(self, requests: list[ServeRequest], offsets: list[float], salt: str | None,
            max_concurrency: int | None, progress=None) -> tuple[list[CallRecord], float]:
        """Every call, process i taking calls i, i+N, ...; returns (records, t0)."""
        n = len(self.procs)
        for i, (conn, limit) in enumerate(zip(self.conns, shares(max_concurrency, n))):
            self.calls[i] = self.tokens[i] = 0
            conn.send(("load", requests[i::n], offsets[i::n], salt, limit))
        for conn in self.conns:
            self._answer(conn, STARTUP_TIMEOUT_S)   # "ready": its bodies are encoded
        t0 = time.perf_counter() + START_AFTER_S
        for conn in self.conns:
            conn.send(("go", t0))
        total = sum(r.num_calls for r in requests)
        parts: dict[int, list[CallRecord]] = {}
        while len(parts) < n:
            for conn in wait([c for i, c in enumerate(self.conns) if i not in parts], timeout=0.25):
                parts[self.conns.index(conn)] = self._answer(conn, 0)
            if progress is not None and progress.due():
                now = time.perf_counter()
                progress.show(sum(self.calls), total, sum(self.tokens) / max(now - t0, 1e-9))
        return [rec for i in range(n) for rec in parts[i]], t0

    def _answer(self, conn, timeout: float):
        if not conn.poll(timeout):
            raise RuntimeError("a bench client process did not answer")
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            raise RuntimeError("a bench client process died") from None
        if kind == "error":
            raise RuntimeError(f"a bench client process failed: {value}")
        return value

    def close(self, wait_s: float = 5.0) -> None:
        """Ends the processes: idle ones at once; busy ones (a run stopped by an error or
        Ctrl-C) are terminated after wait_s."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(wait_s)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def _child(conn, parent: int, index: int, base_url: str, model: str, extensions: bool, sessions_as: str,
           calls, tokens, logprobs: int = -1) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the parent stops it, or its death does
    die_with(parent)
    from qmigrate.bench.serve_client import Client
    from qmigrate.bench.serve_send import send_all

    def on_call(rec: CallRecord) -> None:
        calls[index] += 1
        tokens[index] += rec.output_tokens or len(rec.chunks)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with Client(base_url, model, extensions=extensions, sessions_as=sessions_as,
                          logprobs=logprobs) as client:
            while (command := await loop.run_in_executor(None, conn.recv)) is not None:
                _, requests, offsets, salt, limit = command
                client.salt = salt
                try:
                    bodies = client.bodies(requests)
                except Exception as exc:  # noqa: BLE001 -- reported to the parent
                    conn.send(("error", f"{type(exc).__name__}: {exc}"))
                    continue
                conn.send(("ready", None))
                command = await loop.run_in_executor(None, conn.recv)
                if command is None:
                    return
                records: list[CallRecord] = []
                await send_all(client, requests, bodies, offsets, command[1], limit, records, on_call)
                conn.send(("records", records))

    try:
        asyncio.run(main())
    except (EOFError, OSError):   # the parent went away
        pass
