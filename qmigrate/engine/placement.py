"""Placing a step's rows in the paged pool: blocks for each row's new positions, evicting
sequences outside the step (least recently used first) and, when that is not enough, refusing
rows of the step itself: prefills first (largest first), then decode rows from the end."""

from __future__ import annotations

from qmigrate.engine.kv.pool import BlockPool
from qmigrate.engine.rows import StepRow, num_new


def place(pool: BlockPool, rows: list[StepRow], max_len: int, protect=()) -> list[int]:
    """Blocks for every row that can have them; the indices of the rows that run.
    Sequences in `protect` (and the rows') are never evicted for room."""
    lost = set()
    for i, r in enumerate(rows):
        cached = pool.cached_len(r.seq_id)
        if r.start > 0 and cached < r.start:
            raise ValueError(f"sequence {r.seq_id}: KV for {r.start} positions is not here")
        if r.start + num_new(r) > max_len:
            raise ValueError(f"sequence {r.seq_id}: {r.start + num_new(r)} positions exceed {max_len}")
        if r.start == 0 and cached > 0:
            pool.release(r.seq_id)
        elif cached >= 0 and not pool.truncate(r.seq_id, r.start):
            lost.add(i)   # no block for a copy of its shared last block
    need = {i: _blocks_needed(pool, r) for i, r in enumerate(rows) if i not in lost}
    protect = {r.seq_id for r in rows} | set(protect)
    running = [i for i in range(len(rows)) if i not in lost]
    if not pool.make_room(sum(need.values()), protect):
        running = _refuse(pool, rows, need, running)
    for i in running:
        r = rows[i]
        pool.grow(r.seq_id, r.start + num_new(r))
        pool.touch(r.seq_id)
    return running


def _blocks_needed(pool: BlockPool, r: StepRow) -> int:
    held = len(pool.blocks.get(r.seq_id, ()))
    return max(0, pool.blocks_for(r.start + num_new(r)) - held)


def _refuse(pool: BlockPool, rows, need, running) -> list[int]:
    prefills = sorted((i for i in running if len(rows[i].new_ids) > 1), key=lambda i: -need[i])
    decodes = [i for i in reversed(running) if len(rows[i].new_ids) <= 1]
    refused = set()
    for i in prefills + decodes:
        if pool.num_free_blocks >= sum(need[j] for j in running if j not in refused):
            break
        refused.add(i)
        pool.release(rows[i].seq_id)
    return [i for i in running if i not in refused]
