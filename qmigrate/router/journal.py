"""What the router and the detokenizer keep on disk to restart with nothing lost.

`Journal` is an append-only file of records (a 4-byte length, then the bytes); each append
is one write(2), so a record is in the page cache (and survives a kill of the process)
once `append` returns, and a record torn by a kill mid-write is ignored when read back.

`OutputLog` is the router's record of every accepted request whose output the detokenizer
has not yet confirmed printed to its end: its full form (to run it again from the prompt),
its name, the requests refused at ingest and the input's end. Plain data, no sockets.
An error is known by its number (the sequence id its request would have had), so two errors
under one request id are two records; the detokenizer confirms errors printed as it does
requests, and the oldest are forgotten past a bound as finished requests are.
"""

from __future__ import annotations

import os
import struct

from qmigrate.wire import protocol as P
from qmigrate.wire import codec

_LEN = struct.Struct("<I")


class Journal:
    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def read(self) -> list[bytes]:
        with open(self.path, "rb") as f:
            data = f.read()
        records, pos = [], 0
        while pos + _LEN.size <= len(data):
            (n,) = _LEN.unpack_from(data, pos)
            if pos + _LEN.size + n > len(data):
                break  # torn by a kill mid-write
            records.append(data[pos + _LEN.size:pos + _LEN.size + n])
            pos += _LEN.size + n
        return records

    def append(self, record: bytes) -> None:
        os.write(self.fd, _LEN.pack(len(record)) + record)

    def rewrite(self, records: list[bytes]) -> None:
        """Replace the contents at once (a new file renamed over the old one)."""
        tmp = self.path + ".new"
        with open(tmp, "wb") as f:
            for record in records:
                f.write(_LEN.pack(len(record)) + record)
        os.replace(tmp, self.path)
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def close(self) -> None:
        os.close(self.fd)


class OutputLog:
    def __init__(self):
        self.specs: dict[int, P.SeqSpec] = {}
        self.req_ids: dict[int, str] = {}
        self.extras: dict[int, tuple[int, str]] = {}  # seq_id -> (route, note), when not the defaults
        self.errors: dict[int | str, list[str]] = {}  # error id (or req_id) -> [req_id, message]
        self.num_requests = -1

    def __len__(self) -> int:
        return len(self.specs)

    def add(self, msg: P.Submit, num_taken: int) -> P.Submit | None:
        """Take the first num_taken requests, the errors and the end of input of a Submit;
        returns what was new in it (to journal and forward), or None."""
        seqs, req_ids, errors, error_ids, extras = [], [], [], [], []
        routes = P.unpack_u8(msg.routes, "routes").tolist()
        numbers = P.unpack_i64(msg.error_ids, "error_ids").tolist()
        for i, spec in enumerate(msg.seqs[:num_taken]):
            req_id = msg.req_ids[i] if i < len(msg.req_ids) else str(spec.seq_id)
            extra = (routes[i] if i < len(routes) else P.ROUTE_STDOUT, msg.notes[i] if i < len(msg.notes) else "")
            if spec.seq_id in self.specs:
                continue
            if not spec.is_valid:
                if spec.seq_id not in self.errors:  # the scheduler refused it too: say so
                    self.errors[spec.seq_id] = [req_id, "invalid request"]
                    errors.append([req_id, "invalid request"])
                    error_ids.append(spec.seq_id)
                continue
            self.specs[spec.seq_id], self.req_ids[spec.seq_id] = spec, req_id
            if extra != (P.ROUTE_STDOUT, ""):
                self.extras[spec.seq_id] = extra
            seqs.append(spec)
            req_ids.append(req_id)
            extras.append(extra)
        for i, pair in enumerate(msg.errors):
            number = numbers[i] if i < len(numbers) else -1
            key = number if number >= 0 else pair[0]
            if len(pair) == 2 and key not in self.errors:
                self.errors[key] = pair
                errors.append(pair)
                error_ids.append(number)
        closed = msg.num_requests if msg.num_requests >= 0 and self.num_requests < 0 else -1
        if closed >= 0:
            self.num_requests = closed
        if not (seqs or errors or closed >= 0):
            return None
        return P.Submit(seqs, req_ids, errors, closed, P.pack_u8([r for r, _ in extras]),
                        [n for _, n in extras], P.pack_i64(error_ids))

    def printed(self, seq_ids) -> bool:
        """Forget sequences printed to their end; True if any was known."""
        known = False
        for sid in seq_ids:
            known |= self.specs.pop(int(sid), None) is not None
            known |= self.errors.pop(int(sid), None) is not None
            self.req_ids.pop(int(sid), None)
            self.extras.pop(int(sid), None)
        return known

    def trim(self, max_kept: int, live) -> int:
        """Forget the oldest requests not in `live` while more than max_kept are kept, and the
        oldest errors past max_kept (only a detokenizer restart needs any of them)."""
        num = 0
        while len(self.errors) > max_kept:
            del self.errors[next(iter(self.errors))]
            num += 1
        for sid in list(self.specs):
            if len(self.specs) <= max_kept:
                break
            if sid not in live:
                self.printed([sid])
                num += 1
        return num

    def meta(self, seq_id: int) -> P.RequestMeta:
        spec = self.specs[seq_id]
        route, note = self.extras.get(seq_id, (P.ROUTE_STDOUT, ""))
        return P.RequestMeta(seq_id, self.req_ids[seq_id], P.pack_i32(spec.ids[:spec.prompt_len]), route, note)

    def error_messages(self) -> list[P.RequestError]:
        """Every error still owed to the detokenizer."""
        return [P.RequestError(r, m, key if type(key) is int else -1) for key, (r, m) in self.errors.items()]

    def snapshot(self) -> P.Submit:
        """Everything still owed, as one record: what a compacted journal holds."""
        extras = [self.extras.get(s, (P.ROUTE_STDOUT, "")) for s in self.specs]
        return P.Submit(list(self.specs.values()), [self.req_ids[s] for s in self.specs],
                        list(self.errors.values()), self.num_requests,
                        P.pack_u8([r for r, _ in extras]), [n for _, n in extras],
                        P.pack_i64([key if type(key) is int else -1 for key in self.errors]))

    def replay(self, records: list[bytes]) -> None:
        for record in records:
            msg = codec.decode(record)
            if isinstance(msg, P.Submit):
                self.add(msg, len(msg.seqs))
            elif isinstance(msg, P.Printed):
                self.printed(P.unpack_i64(msg.seq_ids, "seq_ids").tolist())
