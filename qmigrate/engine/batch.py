"""One step's rows, flattened into the arrays every runner reads.

Rows are concatenated token by token (no padding): row b's new tokens are
`ids[query_start[b]:query_start[b + 1]]` at positions `seq_lens[b] - n_b ...
seq_lens[b] - 1`, written to the pool at `slot_mapping`. `block_table` addresses each
row's past; `last[b]` is the index of row b's last token, whose logits are sampled.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from qmigrate.engine.kv.pool import BlockPool


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
        """Array operations over the whole step rather than a pass per row: a step of a full
        batch of decode rows plus a prompt has hundreds of rows, and per-row work on the host
        is time the device waits for."""
        num_rows = len(seq_ids)
        lens = np.fromiter((len(n) for n in new_ids), dtype=np.int32, count=num_rows)
        starts_a = np.asarray(starts, dtype=np.int64)
        query_start = np.zeros(num_rows + 1, dtype=np.int32)
        np.cumsum(lens, out=query_start[1:])
        seq_lens = (starts_a + lens).astype(np.int32)
        num_tokens = int(query_start[-1])
        if int(lens.max()) == 1:
            ids = np.fromiter((n[0] for n in new_ids), dtype=np.int64, count=num_rows)
            row = np.arange(num_rows)
            positions = starts_a
        else:
            ids = np.fromiter(itertools.chain.from_iterable(new_ids), dtype=np.int64, count=num_tokens)
            row = np.repeat(np.arange(num_rows), lens)                         # row of each token
            positions = starts_a[row] + np.arange(num_tokens) - query_start[row]
        held = np.fromiter((len(pool.blocks[s]) for s in seq_ids), dtype=np.int64, count=num_rows)
        short = np.flatnonzero(held * pool.block_size < seq_lens)
        if short.size:
            i = int(short[0])
            raise IndexError(f"sequence {seq_ids[i]} holds {held[i]} blocks, too few for {seq_lens[i]} positions")
        table = pool.block_table(seq_ids, pool.blocks_for(int(seq_lens.max())))
        bs = pool.block_size
        slots = table[row, positions // bs].astype(np.int64) * bs + positions % bs
        return cls(list(seq_ids), ids, positions, slots, query_start, seq_lens, table, int(lens.max()))

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
