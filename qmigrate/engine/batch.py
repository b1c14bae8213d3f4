"""One step's rows, flattened into the arrays every runner reads.

Rows are concatenated token by token (no padding): row b's new tokens are
`ids[query_start[b]:query_start[b + 1]]` at positions `seq_lens[b] - n_b ...
seq_lens[b] - 1`, written to the pool at `slot_mapping`. `block_table` addresses each
row's past; `last[b]` is the index of row b's last token, whose logits are sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kvcache import BlockPool


@dataclass(slots=True)
class StepBatch:
    seq_ids: list[int]
    ids: np.ndarray            # int64 [T]
    positions: np.ndarray      # int64 [T]
    slot_mapping: np.ndarray   # int64 [T]
    query_start: np.ndarray    # int32 [B + 1]
    seq_lens: np.ndarray       # int32 [B]
    block_table: np.ndarray    # int32 [B, W]
    max_query_len: int

    @property
    def num_rows(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    @property
    def last(self) -> np.ndarray:
        return self.query_start[1:] - 1

    @classmethod
    def build(cls, pool: BlockPool, seq_ids: list[int], new_ids: list[list[int]],
              starts: list[int]) -> "StepBatch":
        lens = np.fromiter((len(n) for n in new_ids), dtype=np.int32, count=len(new_ids))
        starts_a = np.asarray(starts, dtype=np.int64)
        query_start = np.zeros(len(seq_ids) + 1, dtype=np.int32)
        np.cumsum(lens, out=query_start[1:])
        seq_lens = (starts_a + lens).astype(np.int32)
        if int(lens.max()) == 1:
            ids = np.fromiter((n[0] for n in new_ids), dtype=np.int64, count=len(new_ids))
            positions = starts_a
            slots = np.fromiter((pool.slot(s, p) for s, p in zip(seq_ids, starts)),
                                dtype=np.int64, count=len(seq_ids))
        else:
            ids = np.concatenate([np.asarray(n, dtype=np.int64) for n in new_ids])
            positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
            slots = np.concatenate([pool.slots(s, st, st + n) for s, st, n in zip(seq_ids, starts, lens)])
        width = pool.blocks_for(int(seq_lens.max()))
        return cls(list(seq_ids), ids, positions, slots, query_start, seq_lens,
                   pool.block_table(seq_ids, width), int(lens.max()))

    def continued(self, pool: BlockPool, seq_ids: list[int], rows: np.ndarray) -> "StepBatch":
        """The decode step after this one for its rows `rows` (in that order), each
        sequence one token further; what `build` gives for the same rows, derived with array
        operations instead of a pass over each sequence's blocks. The pool must already hold
        a block for every row's new position. Input ids are left 0 (the caller feeds them)."""
        n, bs = len(rows), pool.block_size
        starts = self.seq_lens[rows].astype(np.int64)
        width = pool.blocks_for(int(starts.max()) + 1)
        table = self.block_table[rows]
        if table.shape[1] < width:
            table = np.pad(table, ((0, 0), (0, width - table.shape[1])))
        elif table.shape[1] > width:
            table = table[:, :width]
        # A row whose new position opens a block: that block's column is new to the table.
        for i in np.flatnonzero(starts % bs == 0).tolist():
            table[i, starts[i] // bs] = pool.blocks[seq_ids[i]][starts[i] // bs]
        slots = table[np.arange(n), starts // bs].astype(np.int64) * bs + starts % bs
        return StepBatch(list(seq_ids), np.zeros(n, dtype=np.int64), starts, slots,
                         np.arange(n + 1, dtype=np.int32), (starts + 1).astype(np.int32), table, 1)
