"""The engine driven in this process: schedule -> launch -> collect until every sequence ends.

Each step is launched before the step before it is collected: a running row feeds the token
its previous step samples without that token passing through the host (as a worker does).
A sequence that ends on a token learned at a collect has one more step in flight already;
that step's token is dropped. A row the KV pool had no room for (the engine refuses it at
launch) goes back to the queue once its last token is known, and is recomputed from its
prompt and the tokens it had: seeded sampling draws from (seed, token index), so its output
is the same. When to stop is the worker's rule (`worker.state.SeqState.finish_after`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qmigrate.engine.rows import REFUSED, StepRow, num_new
from qmigrate.wire.protocol import Finish
from qmigrate.worker.state import SeqState

RUNNING = Finish.NONE


@dataclass(slots=True)
class OfflineSeq:
    prompt_ids: list[int]
    state: SeqState              # sampling parameters and the finish rule
    out: list[int] = field(default_factory=list)
    finish: Finish = RUNNING
    num_cached: int = 0          # prompt positions found in the prefix cache


def run_to_end(engine, seqs: list[OfflineSeq], on_step=None) -> None:
    """Run every sequence to its end on `engine` (seq ids are indices into `seqs`), within the
    engine's limits of rows and new tokens a step. `on_step(indices)`, if given, is called
    once with none before the first step, then after each step with the sequences that got a
    token in it."""
    max_seqs, max_tokens = engine.config.max_num_seqs, engine.config.max_num_batched_tokens
    waiting = deque(range(len(seqs)))
    running: dict[int, StepRow] = {}   # sequence -> the row of its next step
    pending = None
    if on_step is not None:
        on_step([])
    try:
        while waiting or running or pending is not None:
            rows = list(running.values())
            budget = max_tokens - sum(len(r.new_ids) or 1 for r in rows)
            while waiting and len(rows) < max_seqs and (_num_ids(seqs[waiting[0]]) <= budget or not rows):
                i = waiting.popleft()
                budget -= _num_ids(seqs[i])
                rows.append(_first_row(i, seqs[i]))
            nxt = engine.launch(rows, after=pending) if rows else None
            if nxt is not None and not nxt.placed and not nxt.partial and pending is None:
                raise RuntimeError(f"the KV pool ({engine.free_tokens} tokens free) cannot hold a step of "
                                   f"sequence {rows[0].seq_id} ({rows[0].start + num_new(rows[0])} positions)")
            running, refused = _next_rows(engine, seqs, rows, nxt) if nxt is not None else ({}, [])
            if pending is not None:
                got = _collect(engine, seqs, pending, running)
                if on_step is not None:
                    on_step(got)
            for i in refused:   # the pool had no room: recomputed from its prompt and the tokens it had
                if seqs[i].finish is RUNNING:
                    waiting.appendleft(i)
            pending = nxt
    finally:
        for i in range(len(seqs)):
            engine.release(i)


def _num_ids(seq: OfflineSeq) -> int:
    return len(seq.prompt_ids) + len(seq.out)


def _first_row(i: int, seq: OfflineSeq) -> StepRow:
    s = seq.state
    return StepRow(i, seq.prompt_ids + seq.out, 0, len(seq.out), s.temperature, s.top_p, s.top_k, s.seed)


def _next_rows(engine, seqs: list[OfflineSeq], rows: list[StepRow], launched) -> tuple[dict[int, StepRow], list[int]]:
    """The row of each sequence's step after `launched` (none for a sequence that ends with
    that step: a length limit is known in advance), and the sequences the pool refused.
    (Runs for every row of every step: kept to plain lookups.)"""
    running, refused, max_len = {}, [], engine.max_len
    partial, row_of = launched.partial, launched.row_of
    for row in rows:
        sid = row.seq_id
        seq = seqs[sid]
        if row.start == 0 and not seq.out:
            seq.num_cached = launched.cached.get(sid, 0)
        if sid in partial:   # its prompt goes on in the next step
            start = max(0, engine.cached_len(sid))
            running[sid] = StepRow(sid, (seq.prompt_ids + seq.out)[start:], start, row.index, row.temperature,
                                   row.top_p, row.top_k, row.seed)
        elif sid not in row_of:
            refused.append(sid)
        else:
            start, index = row.start + (len(row.new_ids) or 1), row.index + 1
            if index < seq.state.max_new_tokens and start + 1 < max_len:
                running[sid] = StepRow(sid, [], start, index, row.temperature, row.top_p, row.top_k, row.seed)
    return running, refused


def _collect(engine, seqs: list[OfflineSeq], pending, running: dict[int, StepRow]) -> list[int]:
    """Take a step's tokens into its sequences; end those whose token ends them. The
    sequences that got a token."""
    got, partial, max_len = [], pending.partial, engine.max_len
    for row, token in zip(pending.rows, engine.collect(pending)):
        sid = row.seq_id
        seq = seqs[sid]
        if seq.finish is not RUNNING or token == REFUSED or sid in partial:
            continue
        seq.out.append(token)
        got.append(sid)
        finish = seq.finish = seq.state.finish_after(token, row.index, row.start + (len(row.new_ids) or 1) + 1,
                                                     max_len)
        if finish is not RUNNING:
            running.pop(sid, None)
            engine.release(sid)   # a step of it still in flight is queued on the device before any reuse
    return got
