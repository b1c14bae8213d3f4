"""What a worker does with a lease, without sockets: rows in, results and tokens out.

The worker keeps, per sequence it holds KV for, the sampling parameters from the full
form it first received; after that only diffs arrive (length and last token). A diff
for a sequence whose KV is not here (evicted, worker restarted) is answered NEED_IDS,
and the router resends the full form.

A prompt longer than the engine's `prefill_tokens_per_step` fills its KV over several steps
that also carry the decode rows. Until its last part has run, the sequence's ids stay here
(`filling`) and each lease reports it with no token; the router leases it on as any
sequence whose KV is here (a diff or a chained row), and the worker feeds it its next part.
Its first token is sampled in the step of its last part.

Its bookkeeping types are in `state.py`; the messages it builds from them, in `reports.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from qmigrate.wire import protocol as P
from qmigrate.engine.controls import Controls
from qmigrate.hub.grammars import GrammarError
from qmigrate.engine.kv.pool import landed
from qmigrate.engine.rows import REFUSED, StepRow
from qmigrate.engine.engine import Engine
from qmigrate.wire.protocol import Finish
from qmigrate.ops.trace import OFF
from qmigrate.worker.reports import step_result, tokens_of, unrun_result
from qmigrate.worker.state import SeqState, Started, Transfer

log = logging.getLogger(__name__)

ERROR = Finish.ERROR
MAX_TRANSFERS = 64  # shipments kept while their lease has not come


class WorkerCore:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.seqs: dict[int, SeqState] = {}
        self.transfers: dict[int, Transfer] = {}
        self.arrived: list[int] = []   # transfer ids received since the router was last told
        # seq_id -> (ids, cache salt, positions found cached) of a prompt not all in the KV yet
        self.filling: dict[int, tuple[np.ndarray, str, int]] = {}
        self.num_steps = 0
        self.num_kv_imported = 0   # sequences resumed from shipped KV (a failed import recomputes)
        self.pulled: dict[int, int] = {}   # seq_id -> prompt positions a prefix pull brought, this lease
        self.trace = OFF   # the worker's step timeline (`trace.py`), when it keeps one

    @property
    def free_tokens(self) -> int:
        return self.engine.free_tokens

    def drop(self, seq_ids) -> None:
        for sid in seq_ids:
            self.seqs.pop(int(sid), None)
            self.filling.pop(int(sid), None)
            self.engine.release(int(sid))

    def receive_transfer(self, transfer_id: int, seq_id: int, kv: torch.Tensor | None, start: int = 0) -> None:
        self.transfers[transfer_id] = Transfer(seq_id, kv, time.monotonic(), start)
        self.arrived.append(transfer_id)
        if len(self.transfers) > MAX_TRANSFERS:
            oldest = min(self.transfers, key=lambda t: self.transfers[t].arrived)
            del self.transfers[oldest]

    def export(self, seq_id: int, num_tokens: int, start: int = 0) -> torch.Tensor | None:
        """The KV of positions [start, num_tokens) to ship for seq_id, then forget it here;
        None if it is not held."""
        return landed(*self.export_started(seq_id, num_tokens, start))

    def export_started(self, seq_id: int, num_tokens: int, start: int = 0) -> tuple[torch.Tensor | None, object]:
        """As `export`, without waiting for the device: the KV is in the tensor once the
        returned event has passed (None: now)."""
        kv = copied = None
        if self.engine.cached_len(seq_id) >= num_tokens > start >= 0:
            kv, copied = self.engine.export_kv_started(seq_id, num_tokens, start)
        self.drop([seq_id])
        return kv, copied

    def export_prefix_started(self, keys: list[int]) -> tuple[torch.Tensor | None, object]:
        """The KV of the leading blocks of `keys` cached here, for another worker's sequence
        (a prefix pull); nothing here is dropped. None when not even the first is held."""
        return self.engine.export_prefix_started(keys)

    def unrun(self, lease: P.Lease) -> P.StepResult:
        """The answer to a lease withdrawn before it started (`reports.unrun_result`)."""
        return unrun_result(lease, self.free_tokens)

    def awaited_transfers(self, lease: P.Lease) -> set[int]:
        return {s.transfer_id for s in lease.full if s.kv_from and s.transfer_id not in self.transfers}

    def run(self, lease: P.Lease) -> tuple[P.StepResult, P.Tokens]:
        return self.finish(self.start(lease))

    def start(self, lease: P.Lease, after: "Started | None" = None, between=None) -> "Started":
        """Launch the lease's first step and return at once. `after` is a lease started
        before and not yet finished: rows chained to it (CONTINUE) feed the tokens its step
        samples straight from the device, so the next step is queued before that one ends."""
        self.drop(P.unpack_i64(lease.drop_ids, "drop_ids"))
        self.pulled.clear()
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
                if row.is_finished:
                    run.ended.add(sid)
                if spec is not None:  # tokens before this point came from other workers
                    run.first_index[sid] = max(0, length - spec.prompt_len)
        if run.rows:
            if self.filling:   # prompts under way take the step's prompt budget before new ones
                run.rows.sort(key=lambda r: r.seq_id not in self.filling)
            run.pending = self.engine.launch(run.rows, after=after.pending if after else None, between=between)
            for sid, n in self.pulled.items():   # not prefilled: found cached, on another worker
                run.pending.cached.setdefault(sid, n)
            run.cached = run.pending.cached
            if self.trace is not OFF:
                prompts = [r for r in run.rows if len(r.new_ids) > 1]
                self.trace("prompts", len(prompts), sum(len(r.new_ids) for r in prompts), sum(run.cached.values()))
            self._track_filling(run, run.pending, full)
        return run

    def _track_filling(self, run: "Started", pending, full: dict[int, P.SeqSpec]) -> None:
        """Keep the ids of prompts the step ran only part of; forget those it finished. A
        prompt's cached positions are reported with its first token (once)."""
        partial, filling = pending.partial, self.filling
        if not (partial or filling):
            return
        for r in pending.rows:
            sid = r.seq_id
            if sid in partial:
                if sid not in filling and sid in full:
                    filling[sid] = full[sid].ids, full[sid].cache_salt, pending.cached.get(sid, -1)
                run.cached.pop(sid, None)
            elif r.new_ids and (entry := filling.pop(sid, None)) is not None:
                if entry[2] >= 0:
                    run.cached[sid] = entry[2]
                else:
                    run.cached.pop(sid, None)

    def finish(self, run: "Started", on_step=None, revoked: frozenset[int] | None = frozenset(),
               on_last_launch=None) -> tuple[P.StepResult, P.Tokens]:
        """Wait for the lease's first step, run any further steps, and build its messages.

        A lease of num_steps > 1 runs up to that many steps, each launched before the last
        is collected. After every step but the last, on_step(tokens) gets that step's Tokens
        for the detokenizer (streaming stays one step behind) and returns the rows revoked so
        far (`revoked`: None for every row). A revoked row stops at the next step not yet
        launched, keeping the tokens it produced; its KV stays here, as after any step.
        Once its last step is launched, on_last_launch() may launch the next lease behind it
        (`run.pending` is then that last step, which the next lease's chained rows feed from),
        so the device does not wait for the host between two leases. While it returns True
        (nothing started behind yet) it is called again and again until the steps are done:
        a lease that arrives meanwhile still starts before the device runs dry.
        Returns the StepResult of the whole lease and the Tokens not yet given to on_step."""
        pending, launched, more, behind = run.pending, 1, True, None
        while pending is not None:
            nxt = None
            if more and launched < max(1, run.lease.num_steps):
                self.engine.settle(pending)   # its masks filled while the tokens before went out
                rows = self._continuing(run, pending, revoked)
                nxt = self.engine.launch(rows, after=pending) if rows else None
                if nxt is not None:
                    self._track_filling(run, nxt, {})
                self.trace("launch", len(rows))
                launched += 1
            if more and (nxt is None or launched >= run.lease.num_steps):
                more = False
                run.pending = nxt or pending
                if on_last_launch is not None and on_last_launch():
                    behind = on_last_launch
            self.trace("collect_begin", len(pending.rows))
            tokens = self.engine.collect(pending, behind)
            self.trace("collect_end")
            self.num_steps += 1
            lps, prompts = self.engine.take_logprobs(pending)
            run.prompt_lps.update(prompts)
            self._advance(run, pending.rows, tokens, pending.partial, lps)
            pending = nxt
            if pending is not None and on_step is not None:
                revoked = on_step(tokens_of(run, final=False))
        return step_result(run, self.engine), tokens_of(run, final=True)

    def _continuing(self, run: "Started", pending, revoked: frozenset[int] | None) -> list[StepRow]:
        """Rows of the next step of a multi-step lease, fed the tokens `pending` samples.
        (Runs every step for every row: kept to plain lookups.)"""
        if revoked is None:
            return []
        seqs, ended, max_len, rows = self.seqs, run.ended, self.engine.max_len, []
        if pending.partial:
            rows = [self._next_part(r) for r in pending.rows
                    if r.seq_id in pending.partial and r.seq_id not in revoked and r.seq_id in seqs]
        for i in pending.placed:
            r = pending.rows[i]
            sid = r.seq_id
            if sid in ended or sid in revoked or sid in pending.partial or (state := seqs.get(sid)) is None:
                continue
            start = r.start + (len(r.new_ids) or 1)
            if r.index + 1 >= state.max_new_tokens or start + 1 >= max_len:
                continue  # ends with the step in flight (a length limit is known in advance)
            rows.append(StepRow(sid, [], start, r.index + 1, r.temperature, r.top_p, r.top_k, r.seed,
                                num_logprobs=r.num_logprobs))
        return rows

    def _next_part(self, r: StepRow) -> StepRow:
        """The row that carries the rest of a prompt the step of `r` ran only part of."""
        ids, start = self.filling[r.seq_id][0], max(0, self.engine.cached_len(r.seq_id))
        return dataclasses.replace(r, new_ids=ids[start:].tolist(), start=start)

    def _row(self, sid: int, length: int, token: int, spec: P.SeqSpec | None, protect: set[int],
             after: "Started | None" = None):
        vocab = self.engine.shape.vocab_size
        if spec is not None:
            ids = spec.ids
            if len(ids) != length or length == 0 or spec.prompt_len <= 0 or (ids >= vocab).any():
                log.warning("sequence %d: inconsistent or out-of-vocabulary full form", sid)
                return ERROR
            if length > self.engine.max_len:
                return ERROR
            matcher = None
            if spec.grammar:   # compiled on a pool thread (cached by grammar); the step never waits for it
                try:
                    matcher = self.engine.grammars.ready(spec.grammar, spec.eos_ids)
                    if matcher is None and spec.kv_from:
                        # a moved sequence whose KV comes here: handed back, it would lose the
                        # shipment, so its grammar is waited for (once per grammar on a worker)
                        matcher = self.engine.grammars.matcher(spec.grammar, spec.eos_ids)
                except GrammarError as exc:
                    log.warning("sequence %d: %s", sid, exc)
                    return ERROR
                if matcher is None:   # still compiling: the router leases it again (with its full form)
                    return Finish.NEED_IDS
            state = self.seqs[sid] = SeqState.from_spec(spec, ids)
            self.filling.pop(sid, None)
            start = self._take_transfer(spec, length, protect)
            # after the transfer, which may release the sequence here (and its controls with it)
            self.engine.set_controls(sid, Controls.of_spec(spec), ids, spec.prompt_len)
            if matcher is not None and not self.engine.set_grammar(sid, matcher, spec.eos_ids,
                                                                   ids[spec.prompt_len:]):
                self.drop([sid])
                return ERROR
            new = ids[start:].tolist()
        elif sid in self.filling and (state := self.seqs.get(sid)) is not None \
                and length in (P.CONTINUE, len(self.filling[sid][0])):
            ids, salt, _ = self.filling[sid]
            start = max(0, self.engine.cached_len(sid))
            new, length = ids[start:].tolist(), len(ids)
            return StepRow(sid, new, start, length - state.prompt_len, state.temperature,
                           state.top_p, state.top_k, state.seed, salt, state.num_logprobs)
        elif length == P.CONTINUE:
            state = self.seqs.get(sid)
            if state is None:  # dropped here meanwhile (the router took it back): resend it whole
                return Finish.NEED_IDS
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
                       state.top_p, state.top_k, state.seed, spec.cache_salt if spec is not None else "",
                       state.num_logprobs, state.num_prompt_logprobs)

    def _take_transfer(self, spec: P.SeqSpec, length: int, protect: set[int]) -> int:
        """Positions whose KV arrived by transfer (0 when it did not: recompute)."""
        if not spec.kv_from:
            self.engine.release(spec.seq_id)
            return 0
        transfer = self.transfers.pop(spec.transfer_id, None)
        e = self.engine
        start = 0 if transfer is None else transfer.start
        expected = (e.shape.num_layers, 2, e.shape.num_kv_heads, e.shape.head_dim)
        if start and (not e.can_import_from or start % e.pool.block_size
                      or e.admit(spec.seq_id, spec.ids[:length], spec.cache_salt) < start):
            transfer = None   # what was not shipped is not cached here (any more): recompute
        # All the KV but the last token's (a sequence that moved), or fewer positions (a
        # prefix pulled from a worker that holds it cached): the rest is computed here.
        kv = None if transfer is None else transfer.kv
        if kv is None or transfer.seq_id != spec.seq_id or kv.dim() != 5 \
                or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != expected \
                or not 0 < kv.shape[2] <= length - 1 - start \
                or not e.import_kv(spec.seq_id, kv, protect, start):
            e.release(spec.seq_id)
            return 0
        self.num_kv_imported += 1
        if start + kv.shape[2] < length - 1:
            self.pulled[spec.seq_id] = start + kv.shape[2]
        return start + kv.shape[2]

    def _advance(self, run: "Started", rows: list[StepRow], tokens: list[int], partial=frozenset(),
                 lps=None) -> None:
        status, out, ended, seqs, max_len = run.status, run.out, run.ended, self.seqs, self.engine.max_len
        for row, token in zip(rows, tokens):
            sid = row.seq_id
            if sid in ended or sid in partial:
                continue  # ended by an earlier step, or its prompt goes on in a later step
            state = seqs.get(sid)
            if token == REFUSED or state is None:
                # no room in the pool (the router places it again), or a step queued behind
                # one that ended the sequence: nothing more to report
                self.drop([sid])
                if out[sid]:
                    # Earlier steps of this lease produced tokens, and the detokenizer may have
                    # shown them: report them, and that the KV is gone (as an eviction).
                    if sid not in run.lost:
                        run.lost.append(sid)
                else:
                    status[sid] = Finish.NEED_IDS
                continue
            state.last_token = token
            out[sid].append(token)
            if state.num_logprobs >= 0:
                run.lps.setdefault(sid, []).append(lps.get(sid) if lps else None)
            length = row.start + (len(row.new_ids) or 1) + 1   # tokens, the new one included
            code = state.finish_after(token, row.index, length, max_len)
            status[sid] = code
            if code is not Finish.NONE:
                ended.add(sid)
                self.drop([sid])
