"""What the router reads out of messages and builds into them (pure: no sockets): a worker's
state from its hello, the rows of a Tokens a worker may send on, a lease from the scheduler's
grant, a VRAM report's entries, and what a token of KV costs to ship per worker."""

from __future__ import annotations

import numpy as np

from qmigrate.router.scheduler import WorkerState
from qmigrate.wire import protocol as P


def worker_state(msg: P.Hello, kv_bytes_per_token: int, num_params: int) -> tuple[WorkerState, int, str]:
    """A worker's state from its hello's info, its leases in flight and its device; a field
    of the wrong type or out of range is a ProtocolError."""
    info = msg.info
    inflight = P.info_int(info, "inflight", 2, 1, 64)
    device = P.info_str(info, "device", 64)
    state = WorkerState(
        msg.name, max_seqs=P.info_int(info, "max_seqs", 64, 1, 1 << 20),
        max_tokens=P.info_int(info, "max_tokens", 8192, 1, 1 << 30), inflight=inflight,
        kv_endpoint=P.info_str(info, "kv_endpoint"), gpu_uuid=P.info_str(info, "gpu_uuid"),
        kv_bytes_per_token=kv_bytes_per_token, num_params=num_params,
        kv_tokens=P.info_int(info, "kv_tokens", 0),
        prefill_tokens_per_s=P.info_int(info, "prefill_tokens_per_s", 0, 0, 1 << 40),
        block_size=P.info_int(info, "block_size", 16, 1, 1 << 16),
        is_caching=bool(P.info_int(info, "prefix_cache", 0, 0, 1)),
        held_bytes=P.info_int(info, "held_bytes", 0))
    return state, inflight, device


def kv_bytes_per_token(topo, costs) -> dict[str, int]:
    """Per worker, the bytes one token of its KV ships as (none without the model's costs); a
    worker with kv_cache_dtype fp8 ships its KV in e4m3 (a receiver of another dtype converts)."""
    return {w.name: costs.kv_bytes_per_token(
        "float8_e4m3fn" if w.kv_cache_dtype != "auto" else topo.model.dtype_for(w.device))
        for w in topo.workers} if costs else {}


def kept_rows(msg: P.Tokens, seq_ids: np.ndarray, mine: list[bool]) -> P.Tokens:
    """The rows of `msg` whose `mine` is true, their tokens and logprobs with them."""
    keep = np.array(mine)
    counts = P.unpack_i32(msg.counts)
    tokens = P.unpack_i32(msg.tokens)[np.repeat(keep, counts)]
    kept = P.Tokens(P.pack_i64(seq_ids[keep]), P.pack_i32(P.unpack_i32(msg.start)[keep]),
                    P.pack_i32(counts[keep]), P.pack_i32(tokens), P.pack_u8(P.unpack_u8(msg.finish)[keep]),
                    P.pack_i32(P.unpack_i32(msg.cached_tokens)[keep]) if msg.cached_tokens else b"")
    return P.logprob_rows(msg, kept, keep)


def lease_of(grant, request_no: int, timeout_s: float) -> P.Lease:
    """The Lease message of a scheduler's grant: rows as diffs, full specs where it has them."""
    rows = grant.rows
    return P.Lease(
        grant.lease_id, request_no, timeout_s,
        P.pack_i64([r.seq_id for r in rows]), P.pack_i32([r.length for r in rows]),
        P.pack_i32([r.last_token for r in rows]), [r.spec for r in rows if r.spec is not None],
        P.pack_i64(grant.drop_ids), grant.num_steps)


def is_vram_entry(gpu: list) -> bool:
    """A VRAM report's GPU entry the router takes: [uuid, index, total, used, free, ...] with
    numbers >= 0, free at most total, total above 0."""
    numbers = gpu[1:5] if len(gpu) >= 5 else ()
    return (isinstance(gpu[0], str) and len(numbers) == 4
            and all(type(x) is int and x >= 0 for x in numbers) and 0 <= gpu[4] <= gpu[2] and gpu[2] > 0)
