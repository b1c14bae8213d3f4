"""Constrained rows in a pipelined step: the rows that sit it out, and their return.

A step is launched before the step it follows is collected: a running row's input is the
token that step samples, fed on the device. A constrained row's mask needs that token on the
host first (its matcher takes it), so a step holding such a row could sample only once the
step before is collected, and every plain row of the step would wait for the host's grammar
work with it while the device idles.

Instead, in a step that also has a row without a grammar, a constrained row whose last token
is still on the device sits that step out: it runs nothing and samples nothing, and stays in
`Pending.rows`, unplaced, with its sequence in `Pending.sat_out`. Whoever drives the engine
gives it to the next step as it was (no new ids, the same start and index). By the time that
step is launched its token has been collected, so the engine feeds it from the host: its mask
is filled beside the forward pass, and no step waits on the host for a grammar. A constrained
row so samples at most every other step while plain rows share its batch; plain rows keep
every step. Where every row of a step is constrained there is nothing to gain, and none sits
out: that step samples once the one before is collected (`Engine._note_grammars`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qmigrate.engine.batch import StepBatch
from qmigrate.engine.rows import REFUSED, Pending, StepRow
from qmigrate.engine.sampling import host_arrays


def split(engine, rows: list[StepRow], after: Pending) -> tuple[list[StepRow], list[StepRow], set[int]]:
    """(rows that run, rows that sit out, sequences that come back) of a step launched after
    `after`. A row that sat `after` out comes back with its last token as its new id (known on
    the host: the step that sampled it is collected if it is not yet). A row sits out when it
    is fed from `after`, not collected yet, its matcher has not taken that token, and the step
    has a row without a grammar."""
    back: set[int] = set()
    if after.sat_out:
        known = last_tokens(engine, after)
        rows = list(rows)
        for i, r in enumerate(rows):
            if not r.new_ids and r.seq_id in known:
                rows[i] = dataclasses.replace(r, new_ids=[known[r.seq_id]])
                back.add(r.seq_id)
    grammars = engine.grammars
    if not grammars or after.result is not None or not engine.runner.can_feed:
        return rows, [], back   # its tokens are on the host, or will be before any row samples
    run, sit, plain, row_of = [], [], False, after.row_of
    for r in rows:
        consumed = grammars.consumed(r.seq_id)
        if consumed is None:
            plain = True
        elif not r.new_ids and r.seq_id in row_of and consumed < r.index:
            sit.append(r)
            continue
        run.append(r)
    if not (sit and plain):
        return rows, [], back
    return run, sit, back


def note(pending: Pending, sitting: list[StepRow], after: Pending) -> None:
    """`sitting` sat out the step `pending`: kept among its rows, unplaced, their last tokens
    to be read from `after`."""
    pending.rows = pending.rows + sitting   # a new list: the caller's stays as it gave it
    pending.sat_out = dict.fromkeys((r.seq_id for r in sitting), REFUSED)
    pending.sat_out_from = after


def last_tokens(engine, step: Pending) -> dict[int, int]:
    """seq_id -> last token of the rows that sat `step` out, collecting the step that sampled
    them if need be; the reference to that step is dropped once they are read (one step holds
    no chain of the steps before it)."""
    src = step.sat_out_from
    if src is not None:
        tokens = engine.collect(src)
        step.sat_out = {sid: tokens[src.placed[src.row_of[sid]]] for sid in step.sat_out}
        step.sat_out_from = None
    return step.sat_out


def may_join(engine, rows: list[StepRow], taken: list[int]) -> bool:
    """Whether rows that come back (one known token each) may join a step built the array way
    (`Engine._continue`) beside the sequences `taken`: each decodes at the position where its
    KV ends, within the context, once in the step."""
    length, max_len = engine.pool.length, engine.max_len
    ids = [r.seq_id for r in rows]
    return (len(set(ids)) == len(ids) and not set(ids).intersection(taken)
            and all(len(r.new_ids) == 1 and length.get(r.seq_id) == r.start and r.start + 1 <= max_len
                    for r in rows))


def joined(pool, batch: StepBatch, params, asks, rows: list[StepRow]):
    """(batch, params, asks) of a step built the array way with `rows` (that come back, their
    blocks placed) after its own rows: each a decode row of its known token."""
    more = StepBatch.build(pool, [r.seq_id for r in rows], [r.new_ids for r in rows], [r.start for r in rows])
    extra = host_arrays([r.temperature for r in rows], [r.top_p for r in rows], [r.top_k for r in rows],
                        [r.seed for r in rows], [r.index for r in rows])
    params = tuple(np.concatenate((a, b)) for a, b in zip(params, extra))
    theirs = np.fromiter((r.num_logprobs for r in rows), dtype=np.int32, count=len(rows))
    if asks is not None or (theirs >= 0).any():
        mine = asks if asks is not None else np.full(batch.num_rows, -1, dtype=np.int32)
        asks = np.concatenate((mine, theirs))
    return batch.followed_by(more), params, asks
