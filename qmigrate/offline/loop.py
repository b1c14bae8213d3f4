"""The engine driven in this process: schedule -> launch -> collect until every sequence ends.

Each step is launched before the step before it is collected: a running row feeds the token
its previous step samples without that token passing through the host (as a worker does).
A sequence that ends on a token learned at a collect has one more step in flight already;
that step's token is dropped. A row the KV pool had no room for (the engine refuses it at
launch) goes back to the queue once its last token is known, and is recomputed from its
prompt and the tokens it had: seeded sampling draws from (seed, token index), so its output
is the same. When to stop is the worker's rule (`worker.core.SeqState.finish_after`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qmigrate.engine.rows import REFUSED, StepRow, num_new
from qmigrate.wire.protocol import Finish
from qmigrate.worker.core import SeqState


@dataclass(slots=True)
class OfflineSeq:
    prompt_ids: list[int]
    state: SeqState              # sampling parameters and the finish rule
    out: list[int] = field(default_factory=list)
    finish: Finish = Finish.NONE
    num_cached: int = 0          # prompt positions found in the prefix cache


def run_to_end(engine, seqs: list[OfflineSeq], on_step=None) -> None:
    """Run every sequence to its end on `engine` (seq ids are indices into `seqs`), within the
    engine's limits of rows and new tokens a step. `on_step(indices)`, if given, is called
    after each step with the sequences that got a token in it."""
    max_seqs, max_tokens = engine.config.max_batch, engine.config.max_batch_tokens
    waiting = deque(range(len(seqs)))
    running: dict[int, StepRow] = {}   # sequence -> the row of its next step
    refused: set[int] = set()          # rows the pool had no room for: queued again once collected
    pending = None
    try:
        while waiting or running or pending is not None:
            rows = list(running.values())
            budget = max_tokens - sum(num_new(r) for r in rows)
            while waiting and len(rows) < max_seqs and (_num_ids(seqs[waiting[0]]) <= budget or not rows):
                i = waiting.popleft()
                budget -= _num_ids(seqs[i])
                rows.append(_first_row(i, seqs[i]))
            nxt = engine.launch(rows, after=pending) if rows else None
            if nxt is not None and not nxt.placed and not nxt.partial and pending is None:
                raise RuntimeError(f"the KV pool ({engine.free_tokens} tokens free) cannot hold a step of "
                                   f"sequence {rows[0].seq_id} ({rows[0].start + num_new(rows[0])} positions)")
            running = {}
            for row in rows:
                running_row = _next_row(engine, seqs[row.seq_id], row, nxt)
                if running_row is not None:
                    running[row.seq_id] = running_row
                elif row.seq_id not in nxt.row_of and row.seq_id not in nxt.partial:
                    refused.add(row.seq_id)
            if pending is not None:
                got = _collect(engine, seqs, pending, running)
                if on_step is not None:
                    on_step(got)
            for i in refused:
                if seqs[i].finish is Finish.NONE:
                    waiting.appendleft(i)   # recomputed from its prompt and the tokens it had
            refused.clear()
            pending = nxt
    finally:
        for i in range(len(seqs)):
            engine.release(i)


def _num_ids(seq: OfflineSeq) -> int:
    return len(seq.prompt_ids) + len(seq.out)


def _first_row(i: int, seq: OfflineSeq) -> StepRow:
    s = seq.state
    return StepRow(i, seq.prompt_ids + seq.out, 0, len(seq.out), s.temperature, s.top_p, s.top_k, s.seed)


def _next_row(engine, seq: OfflineSeq, row: StepRow, launched) -> StepRow | None:
    """The row of the sequence's step after `row` (launched), or None: it ends with that step
    (a length limit is known in advance), or the pool refused it."""
    sid = row.seq_id
    if sid in launched.partial:   # its prompt goes on in the next step
        if row.start == 0 and not seq.out:
            seq.num_cached = launched.cached.get(sid, 0)
        start = max(0, engine.cached_len(sid))
        return StepRow(sid, (seq.prompt_ids + seq.out)[start:], start, row.index, row.temperature,
                       row.top_p, row.top_k, row.seed)
    if sid not in launched.row_of:
        return None
    if row.start == 0 and not seq.out:
        seq.num_cached = launched.cached.get(sid, 0)
    start = row.start + num_new(row)
    if row.index + 1 >= seq.state.max_new_tokens or start + 1 >= engine.max_len:
        return None
    return StepRow(sid, [], start, row.index + 1, row.temperature, row.top_p, row.top_k, row.seed)


def _collect(engine, seqs: list[OfflineSeq], pending, running: dict[int, StepRow]) -> list[int]:
    """Take a step's tokens into its sequences; end those whose token ends them. The
    sequences that got a token."""
    got = []
    for row, token in zip(pending.rows, engine.collect(pending)):
        sid = row.seq_id
        seq = seqs[sid]
        if sid in pending.partial or token == REFUSED or seq.finish is not Finish.NONE:
            continue
        seq.out.append(token)
        got.append(sid)
        seq.finish = seq.state.finish_after(token, row.index, row.start + num_new(row) + 1, engine.max_len)
        if seq.finish is not Finish.NONE:
            running.pop(sid, None)
            engine.release(sid)   # a step of it still in flight is queued on the device before any reuse
    return got
