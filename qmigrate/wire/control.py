"""The messages that manage peers rather than sequences: the handshake (and the checked
fields of a Hello's info map), liveness, drains and exits, GPU reports, the feeder, stats,
and ingest's HTTP front processes."""

from __future__ import annotations

import typing
from dataclasses import field

from qmigrate.wire.limits import PROTOCOL_VERSION
from qmigrate.wire.packed import ProtocolError
from qmigrate.wire.registry import MsgType, message



@message(MsgType.HELLO)
class Hello:
    role: str
    name: str
    version: int = PROTOCOL_VERSION
    info: dict[str, typing.Any] = field(default_factory=dict)  # flat str -> int/float/str/bool


@message(MsgType.WELCOME)
class Welcome:
    version: int
    heartbeat_interval_s: float
    lease_timeout_s: float


@message(MsgType.REJECT)
class Reject:
    reason: str
    is_unknown_peer: bool = False   # "say hello first": may answer a message sent before a restart


@message(MsgType.HEARTBEAT)
class Heartbeat:
    name: str
    num_cached_seqs: int = 0
    free_kv_tokens: int = -1
    busy_ms: int = 0          # cumulative time spent running steps
    idle_ms: int = 0          # cumulative time spent with no batch to run
    lease_ids: bytes = b""    # int64: leases received and not yet answered; the router renews them
    held_bytes: int = -1      # device memory this worker holds (weights, KV pool, graphs); -1: unknown
    num_kv_imported: int = 0  # sequences that resumed here from KV shipped by another worker
    kv_arrived: bytes = b""   # int64: transfer ids of KV shipments received since the last heartbeat


@message(MsgType.PULSE)
class Pulse:
    """Worker to router, from a thread beside the worker's loop on a socket of its own: this
    process is alive, and its loop last came between two steps (or two prefill chunks)
    loop_age_ms ago. It keeps a worker whose step outlasts heartbeat_timeout_s alive; it
    renews no lease, so a step stuck past lease_timeout_s still loses them (and the worker)."""

    name: str                 # the worker it speaks for (its socket's identity is its own)
    loop_age_ms: int = 0


@message(MsgType.DRAIN)
class Drain:
    worker: str


@message(MsgType.DRAIN_ACK)
class DrainAck:
    ok: bool
    message: str


@message(MsgType.EXIT)
class Exit:
    reason: str


@message(MsgType.VRAM_REPORT)
class VramReport:
    node: str
    gpus: list[list[typing.Any]]  # [uuid, index, total, used, free, util_percent]

    def validate(self) -> None:
        for gpu in self.gpus:
            if (len(gpu) < 5 or type(gpu[0]) is not str or len(gpu[0]) > 256
                    or not all(type(x) is int and 0 <= x < 1 << 62 for x in gpu[1:5])):
                raise ProtocolError("gpus: expected [uuid, index, total, used, free, ...]")


@message(MsgType.FEED_LINES)
class FeedLines:
    lines: list[str]
    eof: bool = False


@message(MsgType.FEED_ACK)
class FeedAck:
    num_accepted: int
    message: str = ""


@message(MsgType.STATS_REQUEST)
class StatsRequest:
    pass


@message(MsgType.STATS)
class Stats:
    counters: dict[str, typing.Any]
    workers: list[list[typing.Any]] = field(default_factory=list)  # rows of observe.WORKER_COLUMNS
    gpus: list[list[typing.Any]] = field(default_factory=list)     # rows of observe.GPU_COLUMNS
    incarnation: int = 0   # drawn by the router at its start: another one is a restarted router (0: unknown)

# --- ingest and its HTTP front processes (http_processes >= 2) ----------------------------
# A front sends ingest `Submit`s (its requests' choices as specs, ROUTE_INGEST) and `Cancel`s;
# ingest answers each Submit with `FrontAdmit` and sends the front the `Replies` rows of its
# sequences. Sequence ids say which front holds a request (ingest.handoff).




@message(MsgType.FRONT_HELLO)
class FrontHello:
    """Front to ingest: it serves HTTP (error "": bound and ready), or why it cannot; then again
    every second while it runs, so that ingest can tell a front that stopped from a quiet one."""

    index: int
    pid: int
    error: str = ""


@message(MsgType.FRONT_STATUS)
class FrontStatus:
    """Ingest to fronts: workers the router last said can serve (/health), sent when it changes
    and to a front that says hello."""

    num_serving: int


@message(MsgType.FRONT_ADMIT)
class FrontAdmit:
    """Ingest to front, the answer to each of its Submits: every sequence of it is taken, or
    (is_accepted false) none is: max_pending wait for the router, and the front answers 429."""

    seq_ids: bytes            # int64: every sequence of the Submit
    is_accepted: bool


def info_int(info: dict, key: str, default: int, low: int = 0, high: int = 1 << 62) -> int:
    """An integer field of a Hello's `info` map, checked: absent gives the default; a
    value of another type or out of [low, high] is a ProtocolError."""
    value = info.get(key, default)
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"Hello.info[{key!r}]: expected an integer in [{low}, {high}], got {value!r}")
    return value


def info_str(info: dict, key: str, max_len: int = 512) -> str:
    value = info.get(key, "")
    if type(value) is not str or len(value) > max_len:
        raise ProtocolError(f"Hello.info[{key!r}]: expected a string of at most {max_len} characters")
    return value

