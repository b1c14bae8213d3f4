"""What the HTTP side and the ingest loop agree on, pure: the order of a request's hand-off and
its cancel, and, with several HTTP front processes, which front a sequence id belongs to.

Sequence ids of HTTP requests are ingest's random high part (bits 40 and up) with bit 39 set,
so never one of stdin's. With fronts, front K numbers its own below that: K in bits 32-38 and
a 32-bit counter that wraps, so ingest routes a row to its front from the seq_id alone.
"""

from __future__ import annotations

import numpy as np

from qmigrate.config import MAX_HTTP_PROCESSES
from qmigrate.wire import protocol as P

HTTP_BIT = 1 << 39
FRONT_SHIFT = 32
MAX_FRONTS = MAX_HTTP_PROCESSES   # bits 32-38
FRONT_ID_BITS = FRONT_SHIFT  # a front's counter
THREAD_ID_BITS = 39          # the in-thread server's counter


def http_route(prompt) -> int:
    """Where an HTTP request's text goes: back to ingest, with its token ids if it asked."""
    return P.ROUTE_INGEST_IDS if prompt.return_token_ids else P.ROUTE_INGEST


def front_base(id_base: int, index: int) -> int:
    """The high part of front `index`'s sequence ids (ingest's `id_base`: bits 40 and up)."""
    assert 0 <= index < MAX_FRONTS
    return id_base | HTTP_BIT | index << FRONT_SHIFT


def front_index(seq_ids: np.ndarray) -> np.ndarray:
    """The front each sequence belongs to, -1 for one that is not an HTTP request's."""
    ids = seq_ids.astype(np.int64, copy=False)
    return np.where(ids & HTTP_BIT != 0, (ids >> FRONT_SHIFT) & (MAX_FRONTS - 1), -1)


def reply_rows(msg: P.Replies) -> list[tuple]:
    """(seq_id, text, finish code, tokens so far, prompt tokens found cached or -1[, its tokens'
    logprobs, its prompt's[, its token ids]]) a row: what HttpServer.deliver takes, in the
    ingest loop and in a front alike."""
    ids = P.unpack_i64(msg.seq_ids).tolist()
    cached = P.unpack_i32(msg.cached_tokens).tolist() if msg.cached_tokens else [-1] * len(ids)
    rows = zip(ids, msg.texts, P.unpack_u8(msg.finish).tolist(), P.unpack_i32(msg.num_tokens).tolist(), cached)
    if msg.lp_width < 0 and msg.prompt_width < 0 and not msg.id_counts:
        return list(rows)
    lps, prompts = logprobs_of(msg)
    if not msg.id_counts:
        return [(*row, lp, prompt) for row, lp, prompt in zip(rows, lps, prompts)]
    return [(*row, lp, prompt, tokens) for row, lp, prompt, tokens in zip(rows, lps, prompts, token_ids_of(msg))]


def token_ids_of(msg: P.Replies) -> list[list[int]]:
    """Per row of a Replies: the token ids it carries (empty: none)."""
    counts, ids = P.unpack_i32(msg.id_counts).tolist(), P.unpack_i32(msg.token_ids).tolist()
    out, pos = [], 0
    for count in counts:
        out.append(ids[pos:pos + count])
        pos += count
    return out


def logprobs_of(msg: P.Replies) -> tuple[list, list]:
    """Per row of a Replies: its tokens' (id, values, top ids) (values None: none; None: the
    row has no logprobs), and its prompt's [(values, top ids)] (None: none), as lists."""
    n = len(msg.texts)
    lps, prompts = [None] * n, [None] * n
    if msg.lp_width >= 0:
        counts, ids = P.unpack_i32(msg.lp_counts).tolist(), P.unpack_i32(msg.lp_token_ids).tolist()
        values, top = P.unpack_logprob_block(msg.lp_values, msg.lp_top_ids, len(ids), msg.lp_width, 1)
        known = (~np.isnan(values[:, 0])).tolist()
        values, top = values.tolist(), top.tolist()
        pos = 0
        for i, count in enumerate(counts):
            if count:
                lps[i] = [(ids[j], values[j], top[j]) if known[j] else (ids[j], None, None)
                          for j in range(pos, pos + count)]
            pos += count
    if msg.prompt_width >= 0:
        counts = P.unpack_i32(msg.prompt_counts).tolist()
        values, top = P.unpack_logprob_block(msg.prompt_values, msg.prompt_top_ids, sum(counts), msg.prompt_width, 2)
        values, top = values.tolist(), top.tolist()
        pos = 0
        for i, count in enumerate(counts):
            if count:
                prompts[i] = list(zip(values[pos:pos + count], top[pos:pos + count]))
            pos += count
    return lps, prompts


def rows_of(msg: P.Replies, rows: np.ndarray) -> P.Replies:
    """The Replies of only these rows (indices, in order)."""
    ids, finish = P.unpack_i64(msg.seq_ids), P.unpack_u8(msg.finish)
    cached = P.pack_i32(P.unpack_i32(msg.cached_tokens)[rows]) if msg.cached_tokens else b""
    out = P.Replies(P.pack_i64(ids[rows]), P.pack_u8(finish[rows]),
                    P.pack_i32(P.unpack_i32(msg.num_tokens)[rows]), [msg.texts[i] for i in rows.tolist()], cached)
    if msg.lp_width < 0 and msg.prompt_width < 0 and not msg.id_counts:
        return out
    keep = np.zeros(len(ids), dtype=bool)
    keep[rows] = True
    return P.replies_rows(msg, out, keep)


def split_by_front(msg: P.Replies) -> dict[int, P.Replies | None]:
    """Front index -> its part of `msg`; None when every row is that front's (send the frame as
    it came). Rows of no front (stdin's requests) go nowhere."""
    owners = front_index(P.unpack_i64(msg.seq_ids))
    if not owners.size:
        return {}
    first = int(owners[0])
    if (owners == first).all():
        return {} if first < 0 else {first: None}
    return {int(k): rows_of(msg, np.flatnonzero(owners == k)) for k in np.unique(owners) if k >= 0}


class HandoffOrder:
    """A request's cancel never overtakes its hand-off. Requests are numbered as they are
    queued, and taken in that order, so one numbered past the last taken is not taken yet: its
    cancel is remembered and the request dropped when taken. Counters wrap at 2**bits; the ids
    compared share every bit above."""

    def __init__(self, bits: int):
        self.mask, self.half = (1 << bits) - 1, 1 << (bits - 1)
        self.withdrawn: set[int] = set()
        self.last_taken: int | None = None
        self.num_withdrawn = 0

    def is_taken(self, seq_id: int) -> bool:
        return self.last_taken is not None and (self.last_taken - seq_id) & self.mask < self.half

    def cancel(self, seq_ids) -> list[int]:
        """The ids already taken (cancel them now); the others are dropped when taken."""
        now = []
        for seq_id in seq_ids:
            if self.is_taken(seq_id):
                now.append(seq_id)
            else:
                self.withdrawn.add(seq_id)
        return now

    def take(self, seq_id: int) -> bool:
        """Record `seq_id` as taken; False if it was cancelled before (drop it)."""
        self.last_taken = seq_id
        if seq_id in self.withdrawn:
            self.withdrawn.discard(seq_id)
            self.num_withdrawn += 1
            return False
        return True
