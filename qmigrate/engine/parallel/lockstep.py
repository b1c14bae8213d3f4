"""The ranks of a tensor-parallel worker in lockstep: rank 0 decides, the others follow.

Rank 0 runs the whole engine (placement, eviction, sampling, the block tables); every
other rank holds only its runner and a pool of the same blocks for its own KV heads. Before
each forward pass, KV export or KV import, rank 0 sends the others a command over the host
(gloo) group: a fixed header of int64s, then one int64 payload (the step's arrays, or the
slots of a sequence), then any tensor that goes with it. The followers then run the same
forward pass (their collectives meet rank 0's), or take part in the KV move.

KV moves through rank 0: an export gathers every rank's heads there and a import scatters
them from there, so what travels between workers is the whole model's KV in the usual
layout [layers, 2, tokens, kv_heads, head_dim], whatever the world size on either side.
"""

from __future__ import annotations

import numpy as np
import torch

from qmigrate.engine import fp8
from qmigrate.engine.batch import StepBatch
from qmigrate.engine.kv.pool import bits

FORWARD, EXPORT, IMPORT, STOP = 1, 2, 3, 4
HEADER = 8


def _header(tp, values=()) -> list[int]:
    h = torch.zeros(HEADER, dtype=torch.int64)
    if tp.is_leader:
        h[:len(values)] = torch.tensor(values, dtype=torch.int64)
    return tp.broadcast_host(h).tolist()


def _send_ints(tp, arrays) -> None:
    tp.broadcast_host(torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.int64).ravel() for a in arrays])))


def _recv_ints(tp, n: int) -> np.ndarray:
    return tp.broadcast_host(torch.empty(n, dtype=torch.int64)).numpy()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)   # gloo moves bytes of any dtype


def _flat(pool) -> torch.Tensor:
    """The pool's KV by slot, as bytes where it is e4m3 (kv/pool.py: bits)."""
    return bits(pool.kv).view(pool.num_layers, 2, -1, pool.num_kv_heads, pool.head_dim)


def _local_kv(pool, slots: np.ndarray) -> torch.Tensor:
    """This rank's KV at `slots`, [layers, 2, n, kv heads here, head_dim] on the CPU."""
    index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(pool.device)
    return _flat(pool).index_select(2, index).cpu().contiguous().view(pool.dtype)


def _store_kv(pool, slots: np.ndarray, kv: torch.Tensor) -> None:
    pool.clean(slots // pool.block_size)   # rank 0's pool zeroes a block as it hands it out; here on first use
    index = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(pool.device)
    _flat(pool).index_copy_(2, index, bits(fp8.saturate(kv, pool.dtype)).to(pool.device))


class Leader:
    """Rank 0's runner (a `Runner`): the fast runner, with every forward pass and KV move
    sent to the other ranks first."""

    def __init__(self, runner, engine):
        self.inner, self.engine, self.tp = runner, engine, engine.tp

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def can_feed(self) -> bool:
        return self.inner.can_feed

    def attach(self, pool, capture: bool = True) -> None:
        """Rank 0's own runner only: the followers attach theirs as they build their engines."""
        self.inner.attach(pool, capture)

    def eager_sizes(self) -> list[int]:
        return self.inner.eager_sizes()

    def forward(self, batch: StepBatch, feed=None) -> torch.Tensor:
        tp = self.tp
        rows, src, tokens = feed if feed is not None else ((), (), None)
        num_fed = 0 if tokens is None else int(tokens.shape[0])
        _header(tp, (FORWARD, batch.num_rows, batch.num_tokens, batch.block_table.shape[1], batch.max_query_len,
                     len(rows), num_fed))
        _send_ints(tp, (batch.ids, batch.positions, batch.slot_mapping, batch.query_start, batch.seq_lens,
                        batch.block_table, rows, src))
        if tokens is not None:
            tp.broadcast_device(tokens.contiguous())   # the fed tokens never visit the host
        return self.inner.forward(batch) if feed is None else self.inner.forward(batch, feed=feed)

    def export_kv(self, seq_id: int, num_tokens: int | None = None, start: int = 0) -> tuple[torch.Tensor, None]:
        """Every rank's KV heads of the sequence's positions [start, num_tokens), on the CPU
        (gathered here: the tensor holds it on return)."""
        kv = self._gather_kv(seq_id, num_tokens)
        return (kv[:, :, start:].contiguous() if start else kv), None

    def _gather_kv(self, seq_id: int, num_tokens: int | None) -> torch.Tensor:
        pool, tp, layout = self.engine.pool, self.tp, self.tp.layout
        length = pool.length[seq_id]
        n = length if num_tokens is None else num_tokens
        if not 0 < n <= length:
            raise ValueError(f"sequence {seq_id}: cannot export {n} of {length} positions")
        slots = pool.slots(seq_id, 0, n)
        _header(tp, (EXPORT, n))
        _send_ints(tp, (slots,))
        local = _local_kv(pool, slots)
        parts = [p.view(local.dtype).view(local.shape) for p in tp.gather_host(_bytes(local))]
        full = local.new_empty(local.shape[:3] + (self.engine.shape.num_kv_heads, local.shape[4]))
        for rank, part in enumerate(parts):
            heads = layout.kv_heads(rank)
            if layout.kv_owner(heads.start) == rank:   # a replicated head is taken from its first rank
                full[:, :, :, heads.start:heads.stop] = part
        return full

    def import_kv(self, seq_id: int, kv: torch.Tensor, protect=frozenset(), start: int = 0) -> bool:
        """Place shipped KV of every head: rank 0 allocates the blocks and keeps its heads,
        the others get the slots and the whole tensor and keep theirs. Only from position 0
        (the engine does not offer more: `can_import_from`), and never cached."""
        if start:
            raise ValueError("a tensor-parallel worker takes shipped KV from position 0 only")
        pool, tp = self.engine.pool, self.tp
        if kv.dim() != 5 or kv.shape[3] != self.engine.shape.num_kv_heads:
            raise ValueError(f"KV of shape {tuple(kv.shape)}: the model has {self.engine.shape.num_kv_heads} KV heads")
        kv = fp8.saturate(kv, pool.dtype)
        mine = tp.layout.kv_heads(0)
        if not pool.load(seq_id, kv[:, :, :, mine.start:mine.stop].contiguous(), protect):
            return False
        n = kv.shape[2]
        _header(tp, (IMPORT, n))
        _send_ints(tp, (pool.slots(seq_id, 0, n),))
        tp.broadcast_host(_bytes(kv).reshape(-1))
        return True

    def stop(self) -> None:
        _header(self.tp, (STOP,))


@torch.inference_mode()
def follow(engine) -> None:
    """A follower rank's loop: do what rank 0 says until it says stop."""
    tp, pool, runner = engine.tp, engine.pool, engine.runner
    mine = tp.layout.kv_heads(tp.rank)
    kv_shape = (pool.num_layers, 2, engine.shape.num_kv_heads, pool.head_dim)
    while True:
        cmd, *h = _header(tp)
        if cmd == FORWARD:
            b, t, w, max_query_len, f, num_fed = h[:6]
            a = _recv_ints(tp, 3 * t + 2 * b + 1 + b * w + 2 * f)
            cut = np.cumsum([t, t, t, b + 1, b, b * w, f])
            ids, positions, slots, query_start, seq_lens, table, rows, src = np.split(a, cut)
            batch = StepBatch([0] * b, ids, positions, slots, query_start.astype(np.int32),
                              seq_lens.astype(np.int32), table.astype(np.int32).reshape(b, w), max_query_len)
            pool.clean(batch.block_table)
            feed = None
            if num_fed:
                tokens = tp.broadcast_device(torch.empty(num_fed, dtype=torch.int64, device=tp.device))
                feed = (rows, src, tokens)
            runner.forward(batch) if feed is None else runner.forward(batch, feed=feed)
        elif cmd == EXPORT:
            slots = _recv_ints(tp, h[0])
            tp.gather_host(_bytes(_local_kv(pool, slots)))
        elif cmd == IMPORT:
            n = h[0]
            slots = _recv_ints(tp, n)
            numel = n * int(np.prod(kv_shape)) * pool.kv.element_size()
            raw = tp.broadcast_host(torch.empty(numel, dtype=torch.uint8))
            layers, two, heads, dim = kv_shape
            kv = raw.view(pool.dtype).view(layers, two, n, heads, dim)
            _store_kv(pool, slots, kv[:, :, :, mine.start:mine.stop])
        elif cmd == STOP:
            return
        else:
            raise RuntimeError(f"tensor-parallel rank {tp.rank}: unknown command {cmd} from rank 0")
