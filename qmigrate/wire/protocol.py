"""Every message that crosses a socket, in one namespace (their encoding is in codec.py).

The messages live beside this module by what they carry: sequences.py (a sequence's full
form, submits, leases, results, tokens, replies, KV shipments), control.py (handshake,
liveness, drains, stats, ingest's fronts), masks.py (a GPU worker and its structured output
matchers' process); registry.py numbers the message types, limits.py
holds the bounds, finish.py the finish codes, packed.py the packed arrays. Roles import
them from here.

A message is a frozen dataclass. On the wire it is one msgpack array: the message type (a
small integer) followed by the fields in declaration order. Fields are only ever appended,
so a decoder accepts extra trailing fields from a newer peer and fills missing trailing
fields that have defaults. The protocol version travels in `Hello`.

Token ids travel as packed little-endian int32 (`pack_i32`), sequence ids as int64. Nothing
here executes data: decoding is msgpack with hard size limits, then a type check of every
field. A message that fails either raises `ProtocolError`; roles log it and go on.
"""

from __future__ import annotations

from qmigrate.wire.control import (
    Hello, Welcome, Reject, Heartbeat, Pulse, Drain, DrainAck, Exit, VramReport, FeedLines, FeedAck,
    StatsRequest, Stats, FrontHello, FrontStatus, FrontAdmit, info_int, info_str,
)
from qmigrate.wire.finish import (
    Finish,
)
from qmigrate.wire.limits import (
    PROTOCOL_VERSION, MAX_MESSAGE_BYTES, MAX_ARRAY_LEN, MAX_ID, MAX_STR, CONTINUE, ROUTE_STDOUT,
    ROUTE_INGEST, ROUTE_INGEST_IDS, INGEST_ROUTES, MAX_REPLY_TEXT, SUBMIT_MAX_SEQS, SUBMIT_MAX_IDS, MAX_NEW_TOKENS, MAX_TOP_K,
    MAX_TEMPERATURE, MAX_SEED, MAX_STOP_SEQS, MAX_STOP_LEN, MAX_REQ_ID, MAX_CACHE_SALT, MAX_PENALTY,
    MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, MAX_LOGIT_BIAS, MAX_BIAS, TIER_STATS, MAX_NOTE,
    MAX_N, MAX_LOGPROBS, MAX_CHOICES,
)
from qmigrate.wire.packed import (
    LOGPROB_FLOOR, ProtocolError, logprob_rows, logprob_text, logprob_value, pack_f32, pack_i32, pack_i64, pack_logprob_refs, pack_u8,
    replies_rows, replies_with_ids, replies_with_logprobs, unpack_f32, unpack_i32, unpack_i64, unpack_ids,
    unpack_array, unpack_logprob_block, unpack_u8,
)
from qmigrate.wire.masks import (
    MaskOpen, MaskWarm, MaskSet, MaskSetAck, MaskForget, MaskNote, MaskFill, MaskShare,
)
from qmigrate.wire.registry import (
    MESSAGE_TYPES, MsgType, message,
)
from qmigrate.wire.sequences import (
    SeqSpec, submit_count, WorkRequest, Lease, StepResult, Tokens, Submit, SubmitAck, RequestMeta,
    RequestError, InputClosed, ShipKV, KVHeader, Revoke, Cancel, Replies, Resync, Printed,
    check_logprobs, rows_agree,
)

__all__ = [
    "Hello", "Welcome", "Reject", "Heartbeat", "Pulse", "Drain", "DrainAck", "Exit", "VramReport",
    "FeedLines", "FeedAck", "StatsRequest", "Stats", "FrontHello", "FrontStatus", "FrontAdmit",
    "info_int", "info_str", "Finish", "PROTOCOL_VERSION", "MAX_MESSAGE_BYTES", "MAX_ARRAY_LEN",
    "MAX_ID", "MAX_STR", "CONTINUE", "ROUTE_STDOUT", "ROUTE_INGEST", "ROUTE_INGEST_IDS", "INGEST_ROUTES",
    "MAX_REPLY_TEXT",
    "SUBMIT_MAX_SEQS", "SUBMIT_MAX_IDS", "MAX_NEW_TOKENS", "MAX_TOP_K", "MAX_TEMPERATURE",
    "MAX_SEED", "MAX_STOP_SEQS", "MAX_STOP_LEN", "MAX_REQ_ID", "MAX_CACHE_SALT", "MAX_PENALTY",
    "MIN_REPETITION_PENALTY", "MAX_REPETITION_PENALTY", "MAX_LOGIT_BIAS", "MAX_BIAS", "TIER_STATS",
    "MAX_NOTE", "MAX_N", "MAX_LOGPROBS", "MAX_CHOICES", "ProtocolError", "logprob_rows", "pack_f32",
    "LOGPROB_FLOOR", "logprob_text", "logprob_value", "pack_i32", "pack_i64", "pack_logprob_refs", "pack_u8", "replies_rows", "replies_with_ids",
    "replies_with_logprobs",
    "unpack_f32", "unpack_i32", "unpack_i64", "unpack_ids", "unpack_array", "unpack_logprob_block", "unpack_u8",
    "MESSAGE_TYPES", "MsgType", "message", "SeqSpec", "submit_count", "WorkRequest", "Lease",
    "StepResult", "Tokens", "Submit", "SubmitAck", "RequestMeta", "RequestError", "InputClosed",
    "ShipKV", "KVHeader", "Revoke", "Cancel", "Replies", "Resync", "Printed", "check_logprobs",
    "rows_agree", "MaskOpen", "MaskWarm", "MaskSet", "MaskSetAck", "MaskForget", "MaskNote", "MaskFill", "MaskShare",
]
