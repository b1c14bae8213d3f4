"""Structured output's matchers (hub/masks.py) in a process of their own beside a GPU worker
(`MaskProcess`; its loop is `serve`), or spread over several by sequence id (`MaskShards`),
behind `MaskThread`'s calls.

Why a process: filling a step's masks is mostly the library's work on its own threads, which
leave the interpreter's lock, but the Python around it (taking each row's token, ordering the
rows, the EOS fallback) holds the lock for a fraction of a millisecond a step. On a thread of the
worker's, that time is taken from the worker's own Python, and a GPU worker's step is bound by
its Python: measured on an H200, the worker's host time per step rose from 2.35 to 3.31 ms with
a tenth of its rows constrained, while it waited for the masks only 0.39 ms of that
(docs/benchmarks-history.md). In a process of their own the matchers share no lock with the
worker: the worker sends each collected step's tokens of the constrained rows, goes on with its
own work, and reads the masks back into its pinned buffer when it queues the sampling. What that
gained on the H200 (the 10% mix's plain calls at 1.34x of plain's TPOT, median, against 1.50x),
and where the rest of a constrained step's time goes: docs/benchmarks-history.md.

The process is the worker's child: it is given a socket and nothing else, compiles the
grammars it is told of itself (the worker compiles them too, to refuse one past the time
limit; here the same grammar compiles again), and ends when the socket closes, so a worker
that dies leaves nothing behind. Its messages are the protocol's (wire/masks.py), answered in
the order asked; only a set, a share and a fill have answers, a fill's as one raw frame: the
masks and a trailer, read straight into the worker's pinned buffer; or, for a fill that names
a turn of the region the worker shared with it (`MaskShare`, hub/mask_shared.py), the trailer
alone, the masks having gone to that region before its word (the device waits for the word:
engine/grammar.py).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

from qmigrate.hub.mask_shared import SharedMasks
from qmigrate.hub.masks import TRAILER_BYTES, Matchers, MaskThread
from qmigrate.wire import codec
from qmigrate.wire import protocol as P

log = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 8 << 20   # a step's masks (6 KB a row with a 49k vocabulary) sent whole
ANSWER_TIMEOUT_S = 60.0         # the longest the worker waits for an answer (beyond a grammar's compile)


class MaskProcess:
    """The worker's side of the matchers' own process: the same calls as `Matchers`, sent over
    the socket; `start` asks for a step's masks and `result` reads them (waiting for them, at
    most ANSWER_TIMEOUT_S: a process that stops answering stops its worker, which the node
    starts again)."""

    arrange = staticmethod(MaskThread.arrange)

    def __init__(self, tokenizer_path: str, trust_remote_code: bool, vocab_size: int, timeout_s: float,
                 threads: int = 0) -> None:
        """`threads`: the libraries' threads there (0: their default)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (mine, theirs):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        # the child imports this very package, whatever its working directory holds
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        start = f"import sys; sys.path.insert(0, {root!r}); from qmigrate.hub.mask_process import main; main()"
        self.proc = subprocess.Popen([sys.executable, "-c", start, str(theirs.fileno()), str(threads)],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(mine.detach())
        self.answer_timeout_s = ANSWER_TIMEOUT_S + timeout_s   # a set may wait for its grammar's compile
        self._send(P.MaskOpen(str(tokenizer_path), bool(trust_remote_code), int(vocab_size), float(timeout_s)))
        self.waiting: list | None = None    # the fill asked for and not yet read: [answer, seconds]
        self.warmed: set[tuple] = set()     # grammars it was told to compile
        self.shared: SharedMasks | None = None   # where it writes masks the device waits for (`share`)
        self.trailer = np.zeros(TRAILER_BYTES, dtype=np.uint8)   # a shared fill's answer

    def _send(self, msg) -> None:
        try:
            self.conn.send_bytes(codec.encode(msg))
        except OSError as exc:
            raise RuntimeError(f"structured output's mask process has ended ({exc})") from None

    def _recv(self, into=None):
        """The next answer (a message), or its bytes read into `into`."""
        try:
            if not self.conn.poll(self.answer_timeout_s):
                raise RuntimeError(f"structured output's mask process did not answer within "
                                   f"{self.answer_timeout_s:g} s")
            if into is not None:
                return self.conn.recv_bytes_into(into)
            return codec.decode(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise RuntimeError(f"structured output's mask process has ended (exit code {self.proc.poll()})") \
                from exc

    def warm(self, grammar: str, eos_ids) -> None:
        """Compile `grammar` there now (on its pool), so that the first `set` finds it built."""
        key = (grammar, tuple(sorted(eos_ids)))
        if key not in self.warmed:
            self.warmed.add(key)
            self._send(P.MaskWarm(grammar, P.pack_i32(eos_ids)))

    def set(self, seq_id: int, fresh, eos_ids, generated) -> bool:
        """`Matchers.set` there, of `fresh`'s grammar (the copy itself stays here)."""
        self.join()
        self._send(P.MaskSet(seq_id, fresh.grammar, P.pack_i32(eos_ids), P.pack_i32(generated)))
        answer = self._recv()
        if not isinstance(answer, P.MaskSetAck):
            raise RuntimeError(f"structured output's mask process answered a set with {type(answer).__name__}")
        return answer.ok

    def forget(self, seq_id: int) -> None:
        self._send(P.MaskForget(seq_id))

    def share(self, rows: int, width: int) -> SharedMasks | None:
        """A region shared with the process, for fills of up to `rows` rows of `width` words
        that name a turn of it (`start`); None where the process could not map it."""
        self.join()
        region = SharedMasks(rows, width)
        self._send(P.MaskShare(region.path, rows, width))
        answer = self._recv()
        if not (isinstance(answer, P.MaskSetAck) and answer.ok):
            region.close()
            return None
        self.shared = region
        return region

    def note(self, noted) -> None:
        seq_ids, index, tokens = noted
        self._send(P.MaskNote(P.pack_i64(seq_ids), P.pack_i64(index), P.pack_i32(tokens)))

    def start(self, noted, seq_ids, index, bits: np.ndarray, answer: np.ndarray | None,
              turn: int = -1, job: int = 0) -> list:
        """Ask for the masks of seq_ids (at index) after the matchers take `noted` (`note`'s
        lists, or None); `result` reads them into `answer` (uint8: the rows of `bits`, then
        TRAILER_BYTES). With a `turn` (and `answer` None) they go to that turn of the shared
        region, and its word is set to `job` once they are there."""
        self.join()
        taken = noted or ((), (), ())
        self._send(P.MaskFill(P.pack_i64(seq_ids), P.pack_i64(index), bits.shape[1],
                              P.pack_i64(taken[0]), P.pack_i64(taken[1]), P.pack_i32(taken[2]), turn, job))
        self.waiting = handle = [self.trailer if answer is None else answer, None]
        return handle

    def result(self, job: list) -> float:
        """Wait for a job's masks (in its `answer`); the seconds it took there."""
        if job[1] is None:
            answer = job[0]
            self._recv(memoryview(answer))
            took, failed = answer[-TRAILER_BYTES:].view(np.float64)
            if failed:
                raise RuntimeError("structured output's mask process failed to fill a step's masks (its log says why)")
            job[1] = float(took)
            if self.waiting is job:
                self.waiting = None
        return job[1]

    def ready(self, job: list) -> bool:
        """Whether `result` would not wait for the job (its answer has come)."""
        return job[1] is not None or (self.waiting is job and self.conn.poll(0))

    def join(self) -> None:
        if self.waiting is not None:
            self.result(self.waiting)

    def close(self) -> None:
        self.conn.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.shared is not None:
            self.shared.close()
            self.shared = None


class MaskShards:
    """The matchers spread over several processes of their own, by sequence id, behind
    `MaskProcess`'s calls: a step's masks asked of each at once, so that each takes its rows'
    tokens and fills their masks beside the others (a process's Python between the libraries'
    calls runs on one core). A step's rows are asked for process by process (`arrange`), so each
    process's masks are a run of the step's rows of bits; its answer's trailer lands on the next
    run's first bytes, so answers are read in process order, each before the next overwrites it."""

    def __init__(self, processes: int, tokenizer_path: str, trust_remote_code: bool, vocab_size: int,
                 timeout_s: float) -> None:
        from qmigrate.hub.grammars import mask_threads
        threads = max(1, mask_threads() // processes)
        self.shards = [MaskProcess(tokenizer_path, trust_remote_code, vocab_size, timeout_s, threads)
                       for _ in range(processes)]

    def _index(self, seq_id: int) -> int:
        """The process that keeps a sequence's matcher."""
        return seq_id % len(self.shards)

    def _of(self, seq_id: int) -> MaskProcess:
        return self.shards[self._index(seq_id)]

    def arrange(self, found: list) -> list:
        return sorted(found, key=lambda row_seq: (self._index(row_seq[1]), row_seq[0]))

    def _split(self, noted) -> list:
        """`note`'s lists, split by process (None where a process has none)."""
        parts = [([], [], []) for _ in self.shards]
        for s, i, t in zip(*noted):
            part = parts[self._index(s)]
            part[0].append(s)
            part[1].append(i)
            part[2].append(t)
        return [part if part[0] else None for part in parts]

    def warm(self, grammar: str, eos_ids) -> None:
        for shard in self.shards:
            shard.warm(grammar, eos_ids)

    def set(self, seq_id: int, fresh, eos_ids, generated) -> bool:
        self.join()
        return self._of(seq_id).set(seq_id, fresh, eos_ids, generated)

    def forget(self, seq_id: int) -> None:
        self._of(seq_id).forget(seq_id)

    def note(self, noted) -> None:
        self.join()
        for shard, part in zip(self.shards, self._split(noted)):
            if part is not None:
                shard.note(part)

    def runs(self, seq_ids) -> list[tuple[int, int]]:
        """(first, end) of each process's run of a step's rows (seq_ids in `arrange`'s order)."""
        out, at = [], 0
        for k in range(len(self.shards)):
            end = at
            while end < len(seq_ids) and self._index(seq_ids[end]) == k:
                end += 1
            out.append((at, end))
            at = end
        return out

    def start(self, noted, seq_ids, index, bits: np.ndarray, answer: np.ndarray | None,
              turn: int = -1, job: int = 0) -> list:
        """Each process's run of rows (seq_ids in `arrange`'s order) and the tokens it notes;
        with a `turn`, each writes its run to the first rows of that turn of its own region."""
        self.join()
        parts = self._split(noted) if noted else [None] * len(self.shards)
        row_bytes, jobs = bits.shape[1] * 4, []
        for k, (shard, (at, end)) in enumerate(zip(self.shards, self.runs(seq_ids))):
            if end > at or parts[k] is not None or turn >= 0:   # every word moves on, run or not
                view = None if answer is None else answer[at * row_bytes:end * row_bytes + TRAILER_BYTES]
                jobs.append((shard, shard.start(parts[k], seq_ids[at:end], index[at:end], bits[at:end], view,
                                                turn, job)))
        return jobs

    def result(self, jobs: list) -> float:
        """Wait for every process's masks, in process order; the longest that one took there."""
        return max((shard.result(job) for shard, job in jobs), default=0.0)

    def ready(self, jobs: list) -> bool:
        return all(shard.ready(job) for shard, job in jobs)

    def join(self) -> None:
        for shard in self.shards:   # in order: see the class's docstring
            shard.join()

    def close(self) -> None:
        for shard in self.shards:
            shard.close()


class _Server:
    """The matchers' process: its compiler, its matchers, and a handler per message type."""

    def __init__(self, conn: Connection, opened: P.MaskOpen, threads: int = 0) -> None:
        from qmigrate.hub.grammars import Compiler
        self.conn = conn
        self.compiler = Compiler.for_model(opened.tokenizer_path, opened.trust_remote_code, opened.vocab_size,
                                           opened.timeout_s, prepare=True)
        if threads:
            self.compiler.family_size = threads
        self.matchers = Matchers(threads or None)
        self.bits = np.empty((0, 0), dtype=np.uint32)   # rows of masks, and room for the trailer
        self.shared: SharedMasks | None = None           # the worker's region, where it gave one
        self.handlers = {P.MaskFill: self.fill, P.MaskSet: self.set, P.MaskNote: self.note,
                         P.MaskForget: self.forget, P.MaskWarm: self.warm, P.MaskShare: self.share}

    def handle(self, msg) -> None:
        handler = self.handlers.get(type(msg))
        if handler is None:
            log.error("dropped a %s: not a message for the matchers' process", type(msg).__name__)
        else:
            handler(msg)

    def fill(self, msg: P.MaskFill) -> None:
        seq_ids, index, width = P.unpack_i64(msg.seq_ids).tolist(), P.unpack_i64(msg.index).tolist(), msg.width
        began, failed = time.perf_counter(), 0.0
        shared = self.shared if msg.turn >= 0 else None
        if shared is not None and (len(seq_ids) > shared.rows or width != shared.width):
            log.error("a fill of %d rows of %d words does not fit the shared region", len(seq_ids), width)
            shared.word[0] = msg.job   # the device must not wait for it forever: the worker stops
            self.conn.send_bytes(np.array([0.0, 1.0]).tobytes())
            return
        if shared is None and (self.bits.shape[0] < len(seq_ids) + 1 or self.bits.shape[1] != width):
            rows = max(len(seq_ids), 2 * self.bits.shape[0]) + -(-TRAILER_BYTES // (4 * width))  # + the trailer
            self.bits = np.empty((rows, width), dtype=np.uint32)
        rows = self.bits[:len(seq_ids)] if shared is None else shared.turns[msg.turn][:len(seq_ids)]
        try:
            if msg.noted_seq_ids:
                self.matchers.note(P.unpack_i64(msg.noted_seq_ids).tolist(), P.unpack_i64(msg.noted_index).tolist(),
                                   P.unpack_i32(msg.noted_tokens).tolist())
            self.matchers.fill(seq_ids, index, rows)
        except Exception:  # noqa: BLE001 -- the worker stops with it; the reason goes to the log
            log.exception("filling masks")
            rows[:] = 0xFFFFFFFF   # the device may sample these before the worker hears: nothing forbidden
            failed = 1.0
        if shared is not None:   # the masks first, then the word the device waits for
            shared.word[0] = msg.job
            self.conn.send_bytes(np.array([time.perf_counter() - began, failed]).tobytes())
            return
        answer = self.bits.reshape(-1).view(np.uint8)
        end = rows.size * 4
        answer[end:end + TRAILER_BYTES].view(np.float64)[:] = (time.perf_counter() - began, failed)
        self.conn.send_bytes(memoryview(answer[:end + TRAILER_BYTES]))

    def set(self, msg: P.MaskSet) -> None:
        from qmigrate.hub.grammars import GrammarError
        eos = P.unpack_i32(msg.eos_ids).tolist()
        try:
            ok = self.matchers.set(msg.seq_id, self.compiler.matcher(msg.grammar, eos), eos,
                                   P.unpack_i32(msg.generated).tolist())
        except GrammarError as exc:
            log.warning("sequence %d: %s", msg.seq_id, exc)
            ok = False
        except Exception:  # noqa: BLE001 -- the tokenizer or the library failed: this sequence's error
            log.exception("sequence %d: its grammar's matcher", msg.seq_id)
            ok = False
        self.conn.send_bytes(codec.encode(P.MaskSetAck(ok)))

    def note(self, msg: P.MaskNote) -> None:
        self.matchers.note(P.unpack_i64(msg.seq_ids).tolist(), P.unpack_i64(msg.index).tolist(),
                           P.unpack_i32(msg.tokens).tolist())

    def forget(self, msg: P.MaskForget) -> None:
        self.matchers.forget(msg.seq_id)

    def warm(self, msg: P.MaskWarm) -> None:
        self.compiler.start(msg.grammar, P.unpack_i32(msg.eos_ids).tolist())

    def share(self, msg: P.MaskShare) -> None:
        try:
            self.shared = SharedMasks.attach(msg.path, msg.rows, msg.width)
        except OSError as exc:
            log.warning("the worker's shared region: %s", exc)
        self.conn.send_bytes(codec.encode(P.MaskSetAck(self.shared is not None)))


def serve(conn: Connection, threads: int = 0) -> None:
    """The matchers' process: answer the worker's messages until it closes the socket."""
    import llguidance.hf  # noqa: F401 -- imported whole here, not by two pool threads at once (transformers' lazy modules)
    opened = codec.decode(conn.recv_bytes())
    if not isinstance(opened, P.MaskOpen):
        raise SystemExit(f"the matchers' process expected MaskOpen first, got {type(opened).__name__}")
    server = _Server(conn, opened, threads)
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, ConnectionResetError):   # closed, with or without an answer unread
            return
        try:
            msg = codec.decode(data)
        except P.ProtocolError as exc:
            log.error("dropped a malformed message: %s", exc)
            continue
        server.handle(msg)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="masks %(levelname)s %(message)s")
    serve(Connection(int(sys.argv[1])), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    # Nothing is left to write: the interpreter's teardown of the libraries (their thread pools,
    # torch) would take most of a second, which a worker that stops or restarts waits for.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
