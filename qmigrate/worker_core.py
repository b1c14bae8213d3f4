"""What a worker does with a lease, without sockets: rows in, results and tokens out.

The worker keeps, per sequence it holds KV for, the sampling parameters from the full
form it first received; after that only diffs arrive (length and last token). A diff
for a sequence whose KV is not here (evicted, worker restarted) is answered NEED_IDS,
and the router resends the full form.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import protocol as P
from .engine.runner import REFUSED, Engine, StepRow
from .protocol import Finish

log = logging.getLogger(__name__)

ERROR = Finish.ERROR
MAX_TRANSFERS = 64  # shipments kept while their lease has not come


@dataclass(slots=True)
class SeqState:
    prompt_len: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_ids: list[list[int]]
    eos_ids: frozenset[int]
    tail: list[int] = field(default_factory=list)   # recent tokens, for stop sequences
    last_token: int = -1                            # sampled here, not yet in the KV

    @classmethod
    def from_spec(cls, spec: P.SeqSpec, ids: np.ndarray) -> "SeqState":
        keep = max((len(s) for s in spec.stop_ids), default=0)
        seed = spec.seed if spec.seed >= 0 else spec.seq_id
        tail = ids[spec.prompt_len:].tolist()[-keep:] if keep else []
        return cls(spec.prompt_len, spec.max_new_tokens, spec.temperature, spec.top_p, spec.top_k,
                   seed, spec.stop_ids, frozenset(spec.eos_ids), tail)

    def finish_after(self, token: int, index: int, length: int, max_len: int) -> Finish:
        """Status once `token`, generated token number `index`, joined a sequence of `length`."""
        if token in self.eos_ids:
            return Finish.EOS
        if self.stop_ids:
            self.tail.append(token)
            keep = max(len(s) for s in self.stop_ids)
            del self.tail[:-keep]
            if any(self.tail[-len(s):] == s for s in self.stop_ids if s):
                return Finish.STOP
        if index + 1 >= self.max_new_tokens or length >= max_len:
            return Finish.LENGTH
        return Finish.NONE


@dataclass(slots=True)
class Started:
    """A lease whose first step is on the device."""

    lease: P.Lease
    seq_ids: list[int]
    status: dict[int, Finish]
    out: dict[int, list[int]]
    rows: list[StepRow] = field(default_factory=list)
    first_index: dict[int, int] = field(default_factory=dict)
    resend: dict[int, list[int]] = field(default_factory=dict)
    pending: object = None


@dataclass(slots=True)
class Transfer:
    seq_id: int
    kv: torch.Tensor | None   # None: the owner had nothing to send
    arrived: float


class WorkerCore:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.seqs: dict[int, SeqState] = {}
        self.transfers: dict[int, Transfer] = {}
        self.num_steps = 0

    @property
    def free_tokens(self) -> int:
        return self.engine.free_tokens

    def drop(self, seq_ids) -> None:
        for sid in seq_ids:
            self.seqs.pop(int(sid), None)
            self.engine.release(int(sid))

    def receive_transfer(self, transfer_id: int, seq_id: int, kv: torch.Tensor | None) -> None:
        self.transfers[transfer_id] = Transfer(seq_id, kv, time.monotonic())
        if len(self.transfers) > MAX_TRANSFERS:
            oldest = min(self.transfers, key=lambda t: self.transfers[t].arrived)
            del self.transfers[oldest]

    def export(self, seq_id: int, num_tokens: int) -> torch.Tensor | None:
        """The KV to ship for seq_id, then forget it here; None if it is not held."""
        kv = None
        if self.engine.cached_len(seq_id) >= num_tokens > 0:
            kv = self.engine.export_kv(seq_id, num_tokens)
        self.drop([seq_id])
        return kv

    def awaited_transfers(self, lease: P.Lease) -> set[int]:
        return {s.transfer_id for s in lease.full if s.kv_from and s.transfer_id not in self.transfers}

    def run(self, lease: P.Lease) -> tuple[P.StepResult, P.Tokens]:
        return self.finish(self.start(lease))

    def start(self, lease: P.Lease, after: "Started | None" = None, between=None) -> "Started":
        """Launch the lease's first step and return at once. `after` is a lease started
        before and not yet finished: rows chained to it (CONTINUE) feed the tokens its step
        samples straight from the device, so the next step is queued before that one ends."""
        self.drop(P.unpack_i64(lease.drop_ids, "drop_ids"))
        seq_ids = P.unpack_i64(lease.seq_ids, "seq_ids").tolist()
        lengths = P.unpack_i32(lease.lengths, "lengths").tolist()
        last = P.unpack_i32(lease.last_tokens, "last_tokens").tolist()
        if not len(seq_ids) == len(lengths) == len(last):
            raise P.ProtocolError("lease arrays differ in length")
        full = {s.seq_id: s for s in lease.full}
        run = Started(lease, seq_ids, {sid: Finish.NONE for sid in seq_ids}, {sid: [] for sid in seq_ids})
        protect = set(seq_ids)
        for spec in lease.full:
            if spec.resend_from >= 0:
                run.resend[spec.seq_id] = spec.ids[spec.prompt_len + spec.resend_from:].tolist()
        for sid, length, token in zip(seq_ids, lengths, last):
            spec = full.get(sid)
            row = self._row(sid, length, token, spec, protect, after)
            if isinstance(row, StepRow):
                run.rows.append(row)
                run.first_index[sid] = row.index
            else:
                run.status[sid] = row
                if spec is not None:  # tokens before this point came from other workers
                    run.first_index[sid] = max(0, length - spec.prompt_len)
        if run.rows:
            run.pending = self.engine.launch(run.rows, after=after.pending if after else None, between=between)
        return run

    def finish(self, run: "Started") -> tuple[P.StepResult, P.Tokens]:
        """Wait for the lease's first step, run any further steps, and build its messages."""
        rows = run.rows
        for k in range(max(1, run.lease.num_steps)):
            if not rows:
                break
            tokens = self.engine.collect(run.pending) if k == 0 else self.engine.step(rows)
            self.num_steps += 1
            rows = self._advance(rows, tokens, run.status, run.out)
        return self._messages(run.lease.lease_id, run.seq_ids, run.first_index, run.status, run.out,
                              run.resend)

    def _row(self, sid: int, length: int, token: int, spec: P.SeqSpec | None, protect: set[int],
             after: "Started | None" = None):
        vocab = self.engine.vocab_size
        if spec is not None:
            ids = spec.ids
            if len(ids) != length or length == 0 or spec.prompt_len <= 0 or (ids >= vocab).any():
                log.warning("sequence %d: inconsistent or out-of-vocabulary full form", sid)
                return ERROR
            if length > self.engine.max_len:
                return ERROR
            state = self.seqs[sid] = SeqState.from_spec(spec, ids)
            start = self._take_transfer(spec, length, protect)
            new = ids[start:].tolist()
        elif length == P.CONTINUE:
            state = self.seqs.get(sid)
            in_flight = after is not None and sid in after.out
            if in_flight and after.pending is not None and sid in after.pending.row_of:
                start, new = self.engine.cached_len(sid), []   # fed on the device
            elif in_flight or state is None or state.last_token < 0 or self.engine.cached_len(sid) < 0:
                return Finish.NEED_IDS
            else:
                start, new = self.engine.cached_len(sid), [state.last_token]
            length = start + 1
        else:
            state = self.seqs.get(sid)
            if state is None or self.engine.cached_len(sid) < length - 1 or not 0 <= token < vocab:
                return Finish.NEED_IDS
            start, new = length - 1, [token]
        return StepRow(sid, new, start, length - state.prompt_len, state.temperature,
                       state.top_p, state.top_k, state.seed)

    def _take_transfer(self, spec: P.SeqSpec, length: int, protect: set[int]) -> int:
        """Positions whose KV arrived by transfer (0 when it did not: recompute)."""
        if not spec.kv_from:
            self.engine.release(spec.seq_id)
            return 0
        transfer = self.transfers.pop(spec.transfer_id, None)
        e = self.engine
        expected = (e.num_layers, 2, length - 1, e.num_kv_heads, e.head_dim)
        if transfer is None or transfer.kv is None or tuple(transfer.kv.shape) != expected \
                or not e.import_kv(spec.seq_id, transfer.kv, protect):
            e.release(spec.seq_id)
            return 0
        return length - 1

    def _advance(self, rows: list[StepRow], tokens: list[int], status, out) -> list[StepRow]:
        nxt = []
        for row, token in zip(rows, tokens):
            state = self.seqs.get(row.seq_id)
            if token == REFUSED or state is None:
                # no room in the pool (the router places it again), or a step queued behind
                # one that ended the sequence: nothing to report
                status[row.seq_id] = Finish.NEED_IDS
                self.drop([row.seq_id])
                continue
            state.last_token = token
            out[row.seq_id].append(token)
            length = row.start + max(1, len(row.new_ids)) + 1  # a row fed on the device has one new token
            code = state.finish_after(token, row.index, length, self.engine.max_len)
            status[row.seq_id] = code
            if code.is_finished:
                self.drop([row.seq_id])
            else:
                nxt.append(StepRow(row.seq_id, [token], length - 1, row.index + 1, row.temperature,
                                   row.top_p, row.top_k, row.seed))
        return nxt

    def _messages(self, lease_id, seq_ids, first_index, status, out, resend):
        counts = [len(out[sid]) for sid in seq_ids]
        flat = [t for sid in seq_ids for t in out[sid]]
        codes = [int(status[sid]) for sid in seq_ids]
        result = P.StepResult(lease_id, P.pack_i64(seq_ids), P.pack_i32(counts), P.pack_i32(flat),
                              P.pack_u8(codes), self.free_tokens, P.pack_i64(self.engine.take_evicted()))
        # For the detokenizer: new tokens, preceded by any tokens it may have missed.
        shown = [(sid, resend.get(sid, []) + out[sid], code) for sid, code in zip(seq_ids, codes)
                 if out[sid] or code == ERROR or sid in resend]
        starts = [first_index.get(sid, 0) - len(resend.get(sid, [])) for sid, _, _ in shown]
        tokens = P.Tokens(P.pack_i64([sid for sid, _, _ in shown]), P.pack_i32(starts),
                          P.pack_i32([len(ts) for _, ts, _ in shown]),
                          P.pack_i32([t for _, ts, _ in shown for t in ts]),
                          P.pack_u8([code for _, _, code in shown]))
        return result, tokens
