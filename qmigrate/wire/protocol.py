"""Every message that crosses a socket (their encoding is in codec.py).

A message is a frozen dataclass. On the wire it is one msgpack array: the message type (a
small integer) followed by the fields in declaration order. Fields are only ever appended,
so a decoder accepts extra trailing fields from a newer peer and fills missing trailing
fields that have defaults. The protocol version travels in `Hello`.

Token ids travel as packed little-endian int32 (`pack_i32`), sequence ids as int64. Nothing
here executes data: decoding is msgpack with hard size limits, then a type check of every
field. A message that fails either raises `ProtocolError`; roles log it and go on.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass, field

import numpy as np

from qmigrate.wire.packed import (  # noqa: F401 (re-exported)
    ProtocolError, _unpack, logprob_rows, pack_f32, pack_i32, pack_logprob_refs, replies_rows,
    replies_with_logprobs, unpack_logprob_block, pack_i64, pack_u8, unpack_f32, unpack_i32, unpack_i64, unpack_ids,
    unpack_u8,
)

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20  # control and token messages; KV payloads travel as extra frames
MAX_ARRAY_LEN = 1 << 20
MAX_ID = (1 << 31) - 1
MAX_STR = 1 << 16            # characters in any string field
CONTINUE = -1
ROUTE_STDOUT = 0   # a request's text is printed by the detokenizer
ROUTE_INGEST = 1   # a request's text goes back to the ingest node that took it (HTTP)
MAX_REPLY_TEXT = 1 << 16
# One Submit carries up to this many prompts, and this many ids in all (16 MiB): a burst
# reaches the router in a few acknowledged messages, so its first leases are full ones.
SUBMIT_MAX_SEQS = 512
SUBMIT_MAX_IDS = 1 << 22
# A request's bounds on the wire: the codec refuses a SeqSpec past them, and ingest refuses
# such a request with its own error before it is sent (ingest.prompts uses these names).
MAX_NEW_TOKENS = 1 << 30
MAX_TOP_K = 1 << 30
MAX_TEMPERATURE = 2.0     # OpenAI's bound, on every input path (HTTP, stdin JSONL, a topology's default)
MAX_SEED = (1 << 63) - 1
MAX_STOP_SEQS = 64         # stop sequences of one request
MAX_STOP_LEN = 64          # token ids of one stop sequence (and of the EOS list)
MAX_REQ_ID = 256           # characters of a request id
MAX_CACHE_SALT = 256       # characters of a request's cache_salt
MAX_PENALTY = 2.0          # presence and frequency penalties are in [-2, 2] (OpenAI's bounds)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0   # 1 is off
MAX_LOGIT_BIAS = 1024      # entries of a request's logit_bias
MAX_BIAS = 100.0           # a logit_bias value is in [-100, 100] (OpenAI's bounds)
# A worker's KV tiers, as StepResult.tier_stats carries them: blocks held and hits (blocks a
# prompt started on) per tier, and bytes copied into the host tier and back out of it
TIER_STATS = ("gpu_blocks", "gpu_hits", "host_blocks", "host_hits", "host_bytes_in", "host_bytes_out")
MAX_NOTE = 1024            # characters of a request's note and of an error message
# One HTTP request fans out into one engine request per choice: `n` per prompt (at most
# MAX_N), prompts × n at most MAX_CHOICES (one Submit's worth), checked before any is queued.
MAX_N = 128
# Log probabilities: the sampled token's and up to MAX_LOGPROBS alternatives' (vLLM's max_logprobs)
MAX_LOGPROBS = 20
MAX_CHOICES = SUBMIT_MAX_SEQS

class MsgType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    REJECT = 3
    HEARTBEAT = 4
    WORK_REQUEST = 5
    LEASE = 6
    STEP_RESULT = 7
    TOKENS = 8
    SUBMIT = 9
    SUBMIT_ACK = 10
    REQUEST_META = 11
    REQUEST_ERROR = 12
    INPUT_CLOSED = 13
    SHIP_KV = 14
    KV_HEADER = 15
    DRAIN = 16
    DRAIN_ACK = 17
    EXIT = 18
    VRAM_REPORT = 19
    FEED_LINES = 20
    FEED_ACK = 21
    STATS_REQUEST = 22
    STATS = 23
    REVOKE = 24
    CANCEL = 30
    REPLIES = 31
    RESYNC = 35
    PRINTED = 36
    PULSE = 37
    FRONT_HELLO = 38
    FRONT_STATUS = 39
    FRONT_ADMIT = 40


class Finish(enum.IntEnum):
    """How a sequence stands after a step, and how a request ended. In a worker's results NONE
    runs on, NEED_IDS asks for a resend, the others end it; CANCELLED (its client went away)
    is set by the detokenizer and travels only to ingest."""

    NONE = 0
    EOS = 1
    LENGTH = 2
    STOP = 3
    NEED_IDS = 4
    ERROR = 5       # the worker cannot run this sequence at all (bad ids, too long)
    CANCELLED = 100

    @property
    def reason(self) -> str:
        """The text reason the detokenizer prints ("" for a code that ends nothing)."""
        return _REASONS.get(self, "")

    @classmethod
    def from_reason(cls, reason: str) -> "Finish":
        """The code of a text reason; an unknown reason is an ERROR."""
        return _BY_REASON.get(reason, cls.ERROR)

    @property
    def openai_reason(self) -> str | None:
        """The OpenAI API's finish_reason, or None where the request did not end well."""
        return _OPENAI_REASONS.get(self)

    @property
    def is_finished(self) -> bool:
        return self in _REASONS


_REASONS = {Finish.EOS: "eos", Finish.LENGTH: "length", Finish.STOP: "stop", Finish.ERROR: "error",
            Finish.CANCELLED: "cancelled"}
_BY_REASON = {text: code for code, text in _REASONS.items()}
_OPENAI_REASONS = {Finish.EOS: "stop", Finish.LENGTH: "length", Finish.STOP: "stop"}
_STEP_CODES = frozenset(int(f) for f in Finish if f is not Finish.CANCELLED)   # a worker's results
_IS_STEP_CODE = np.isin(np.arange(256), sorted(_STEP_CODES))   # by uint8 value: one lookup per row
_REPLY_CODES = frozenset(int(f) for f in Finish if f is not Finish.NEED_IDS)   # detokenizer to ingest


def _step_codes_ok(codes: np.ndarray) -> bool:
    return bool(_IS_STEP_CODE[codes].all())


# --- messages ----------------------------------------------------------------------------

_BY_TYPE: dict[int, type] = {}


def message(msg_type: MsgType):
    def register(cls):
        cls = dataclass(frozen=True, slots=True)(cls)
        cls.TYPE = msg_type
        cls._fields = _field_table(cls)
        _BY_TYPE[int(msg_type)] = cls
        return cls
    return register


def _field_table(cls) -> tuple:
    """(name, type, has a default) per field, in wire order."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name], f.default is not dataclasses.MISSING
                  or f.default_factory is not dataclasses.MISSING) for f in dataclasses.fields(cls))


@dataclass(frozen=True, slots=True)
class SeqSpec:
    """Everything a worker needs to run a sequence it has never seen (the full form)."""

    seq_id: int
    token_ids: bytes          # int32: prompt followed by every token generated so far
    prompt_len: int
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = -1            # -1: no seed (a router-assigned one is used for sampling)
    stop_ids: list[list[int]] = field(default_factory=list)
    eos_ids: list[int] = field(default_factory=list)
    kv_from: str = ""         # endpoint of the worker shipping this sequence's KV, if any
    transfer_id: int = 0
    resend_from: int = -1     # >= 0: send the detokenizer generated tokens from this index on
    min_new_tokens: int = 0   # neither EOS nor a stop sequence ends it before this many tokens
    cache_salt: str = ""      # its KV prefix is shared only with sequences of the same salt
    # Sampling controls (engine/controls.py); the neutral values cost a step nothing.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    bias_ids: list[int] = field(default_factory=list)      # logit_bias: token ids and what each adds
    bias_values: list[float] = field(default_factory=list)
    # Logprobs (engine/logprobs.py): >= 0 asks for them with that many alternatives; -1: none
    num_logprobs: int = -1          # of every generated token
    num_prompt_logprobs: int = -1   # of the prompt's tokens, once, with the first generated token
    grammar: str = ""         # structured output: an llguidance grammar text (hub/grammars.py); "" none

    @property
    def ids(self) -> np.ndarray:
        return unpack_ids(self.token_ids, "seq.token_ids")

    @property
    def is_valid(self) -> bool:
        """Runnable: a prompt of at least one id, within its ids, and at least one token to
        generate. Decoding accepts the rest; the router refuses what fails this."""
        return 0 < self.prompt_len <= len(self.token_ids) // 4 and self.max_new_tokens >= 1

    def validate(self) -> None:
        if not 0 <= self.min_new_tokens <= max(0, self.max_new_tokens):
            raise ProtocolError("min_new_tokens out of range")
        if len(self.stop_ids) > MAX_STOP_SEQS:
            raise ProtocolError(f"more than {MAX_STOP_SEQS} stop sequences")
        for ids in self.stop_ids + [self.eos_ids]:
            if len(ids) > MAX_STOP_LEN or any(not 0 <= t <= MAX_ID for t in ids):
                raise ProtocolError("stop or eos ids out of range")
        if len(self.bias_ids) != len(self.bias_values) or len(self.bias_ids) > MAX_LOGIT_BIAS \
                or any(not 0 <= t <= MAX_ID for t in self.bias_ids) \
                or any(not -MAX_BIAS <= v <= MAX_BIAS for v in self.bias_values):
            raise ProtocolError("logit bias: ids and values differ in number or are out of range")
        if not (-1 <= self.num_logprobs <= MAX_LOGPROBS and -1 <= self.num_prompt_logprobs <= MAX_LOGPROBS):
            raise ProtocolError(f"logprobs: -1 (none) to {MAX_LOGPROBS} alternatives")


SeqSpec._fields = _field_table(SeqSpec)


def submit_count(specs) -> int:
    """How many of `specs`, taken in order, go in the next Submit: at most SUBMIT_MAX_SEQS
    and SUBMIT_MAX_IDS ids together, and never none while any wait."""
    n = ids = 0
    for spec in specs:
        ids += len(spec.token_ids) // 4
        if n and (n >= SUBMIT_MAX_SEQS or ids > SUBMIT_MAX_IDS):
            break
        n += 1
    return n


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


@message(MsgType.PULSE)
class Pulse:
    """Worker to router, from a thread beside the worker's loop on a socket of its own: this
    process is alive, and its loop last came between two steps (or two prefill chunks)
    loop_age_ms ago. It keeps a worker whose step outlasts heartbeat_timeout_s alive; it
    renews no lease, so a step stuck past lease_timeout_s still loses them (and the worker)."""

    name: str                 # the worker it speaks for (its socket's identity is its own)
    loop_age_ms: int = 0


@message(MsgType.WORK_REQUEST)
class WorkRequest:
    request_no: int
    max_seqs: int
    max_tokens: int
    free_kv_tokens: int = -1


@message(MsgType.LEASE)
class Lease:
    """A batch. Row i runs sequence seq_ids[i] whose total length after this step's input is
    lengths[i]. Rows named in `full` carry their ids; every other row is a diff: the worker
    already holds KV for lengths[i] - 1 tokens and feeds last_tokens[i]. A length of
    CONTINUE (-1) chains the row to the step this worker is running for it now: it feeds the
    token that step samples."""

    lease_id: int
    request_no: int
    timeout_s: float
    seq_ids: bytes            # int64
    lengths: bytes            # int32
    last_tokens: bytes        # int32
    full: list[SeqSpec] = field(default_factory=list)
    drop_ids: bytes = b""     # int64: sequences whose KV this worker may free
    num_steps: int = 1


@message(MsgType.STEP_RESULT)
class StepResult:
    """Row i produced counts[i] tokens (taken in order from tokens) and ended with status[i]."""

    lease_id: int
    seq_ids: bytes            # int64
    counts: bytes             # int32
    tokens: bytes             # int32
    status: bytes             # uint8 Finish
    free_kv_tokens: int = -1
    evicted_ids: bytes = b""  # int64: sequences whose KV this worker evicted to make room
    prefix_events: bytes = b""   # int64: keys of KV blocks cached (key) or evicted (~key), in order
    cached_tokens: bytes = b""   # int32 per row: positions found cached when it started here (-1: it did not)
    tier_events: bytes = b""     # int64: keys of KV blocks its host tier took (key) or dropped (~key), in order
    tier_stats: bytes = b""      # int64 per TIER_STATS name, totals so far (empty: no host tier)

    def validate(self) -> None:
        if self.cached_tokens and (len(self.cached_tokens) != len(self.seq_ids) // 2
                                   or unpack_i32(self.cached_tokens, "StepResult.cached_tokens").min() < -1):
            raise ProtocolError("StepResult.cached_tokens: one count (>= -1) per row")
        unpack_i64(self.prefix_events, "StepResult.prefix_events")
        unpack_i64(self.tier_events, "StepResult.tier_events")
        if self.tier_stats and (len(self.tier_stats) != 8 * len(TIER_STATS)
                                or unpack_i64(self.tier_stats, "StepResult.tier_stats").min() < 0):
            raise ProtocolError(f"StepResult.tier_stats: {len(TIER_STATS)} counts >= 0 ({', '.join(TIER_STATS)})")
        _rows_agree("StepResult", self.seq_ids, self.counts, self.status, self.tokens)
        status = unpack_u8(self.status, "StepResult.status")
        if not _step_codes_ok(status):
            raise ProtocolError("StepResult.status: unknown status code")


@message(MsgType.TOKENS)
class Tokens:
    """New tokens for the detokenizer: seq_ids[i] gets counts[i] tokens starting at
    generated-token index start[i]; finish[i] is a Finish code (0: still running)."""

    seq_ids: bytes            # int64
    start: bytes              # int32
    counts: bytes             # int32
    tokens: bytes             # int32
    finish: bytes             # uint8
    cached_tokens: bytes = b""   # int32 per row: prompt positions found cached where it started (-1: unknown)
    # Logprobs of rows that asked for them (lp_width -1: none in this message). Every token of
    # the message has a row of lp_values: its logprob (NaN: none), then lp_width alternatives'
    # (ids in lp_top_ids, -1 past what its request asked).
    lp_width: int = -1
    lp_values: bytes = b""       # float32 [tokens, 1 + lp_width]
    lp_top_ids: bytes = b""      # int32 [tokens, lp_width]
    # Prompt logprobs, with a request's first token: prompt_counts[i] positions (1 .. prompt
    # length - 1) for row i, each its token's logprob, rank, then prompt_width alternatives'.
    prompt_counts: bytes = b""   # int32 per row
    prompt_width: int = -1
    prompt_values: bytes = b""   # float32 [positions, 2 + prompt_width]
    prompt_top_ids: bytes = b""  # int32 [positions, prompt_width]

    def validate(self) -> None:
        if self.cached_tokens and len(self.cached_tokens) != len(self.seq_ids) // 2:
            raise ProtocolError("Tokens.cached_tokens: one count per row")
        _rows_agree("Tokens", self.seq_ids, self.counts, self.finish, self.tokens, self.start)
        check_logprobs(self, len(self.tokens) // 4, len(self.seq_ids) // 8, "Tokens")
        finish = unpack_u8(self.finish, "Tokens.finish")
        if not _step_codes_ok(finish):
            raise ProtocolError("Tokens.finish: unknown finish code")


@message(MsgType.SUBMIT)
class Submit:
    """Ingest to router, resent until acknowledged. req_ids[i] names seqs[i] in the output;
    `errors` are [req_id, message] pairs of requests refused at ingest, error_ids[i] the
    unique number of errors[i] (-1 or absent: known by its req_id, which may repeat);
    num_requests >= 0 says the input is closed after that many requests (the detokenizer's
    end condition)."""

    seqs: list[SeqSpec]
    req_ids: list[str] = field(default_factory=list)
    errors: list[list[str]] = field(default_factory=list)
    num_requests: int = -1
    routes: bytes = b""       # uint8: RequestMeta.route of seqs[i] (none: stdout)
    notes: list[str] = field(default_factory=list)   # RequestMeta.note of seqs[i]
    error_ids: bytes = b""    # int64: error_ids[i] numbers errors[i]

    def validate(self) -> None:
        if len(self.error_ids) // 8 > len(self.errors):
            raise ProtocolError("error_ids: more than errors")
        if any(len(pair) != 2 for pair in self.errors):
            raise ProtocolError("errors: expected [req_id, message] pairs")
        if any(len(r) > MAX_REQ_ID for r in self.req_ids) or any(len(n) > MAX_NOTE for n in self.notes) \
                or any(len(r) > MAX_REQ_ID or len(m) > MAX_NOTE for r, m in self.errors):
            raise ProtocolError(f"a request id over {MAX_REQ_ID} or a note over {MAX_NOTE} characters")


@message(MsgType.SUBMIT_ACK)
class SubmitAck:
    num_accepted: int
    num_free: int
    is_deferred: bool = False  # nothing of the Submit was taken, errors and end included: send it later


@message(MsgType.REQUEST_META)
class RequestMeta:
    seq_id: int
    req_id: str
    prompt_ids: bytes         # int32, for priming the incremental decoder
    route: int = ROUTE_STDOUT  # where the text goes: stdout, or back to the ingest node (HTTP)
    note: str = ""            # for the final record, e.g. that max_new_tokens was clamped

    def validate(self) -> None:
        if self.route not in (ROUTE_STDOUT, ROUTE_INGEST):
            raise ProtocolError(f"RequestMeta.route: unknown route {self.route}")


@message(MsgType.REQUEST_ERROR)
class RequestError:
    req_id: str
    message: str
    seq_id: int = -1          # the error's unique number (-1: none; known by req_id)


@message(MsgType.INPUT_CLOSED)
class InputClosed:
    num_requests: int


@message(MsgType.SHIP_KV)
class ShipKV:
    seq_id: int
    dest: str                 # KV endpoint of the receiving worker
    transfer_id: int
    num_tokens: int
    start: int = 0            # ship positions [start, num_tokens): the receiver has the rest cached
    # int64: the keys of the blocks of [start, num_tokens), which the sender holds cached (on
    # either tier) for a sequence it does not run: a prefix pull. Empty: the sender runs seq_id.
    keys: bytes = b""

    def validate(self) -> None:
        keys = unpack_i64(self.keys, "ShipKV.keys")
        if len(keys) and (self.start < 0 or self.num_tokens <= self.start):
            raise ProtocolError("ShipKV: a prefix pull ships positions [start, num_tokens), start >= 0")


@message(MsgType.KV_HEADER)
class KVHeader:
    """Followed by one raw frame: the KV of num_tokens positions, shape given, dtype given."""

    transfer_id: int
    seq_id: int
    num_tokens: int           # positions in the frame
    dtype: str
    shape: list[int]
    start: int = 0            # the first one's position (the receiver holds [0, start) cached)

    def validate(self) -> None:
        if len(self.shape) > 8 or any(not 0 <= d <= MAX_ID for d in self.shape):
            raise ProtocolError("shape: out of range")


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


@message(MsgType.REVOKE)
class Revoke:
    """Router to worker: end this lease at its next step boundary and answer it as usual (a
    lease not yet started runs one step; a chain not yet started, whose every row goes on from
    the lease before it, runs none: it is answered at once, each row with no token, and its
    place is asked for again). seq_ids names the rows the router wants back."""

    lease_id: int
    seq_ids: bytes = b""      # int64


@message(MsgType.CANCEL)
class Cancel:
    """Ingest to router and detokenizer: these sequences are no longer wanted. The router
    forgets them (and has their KV freed), the detokenizer ends their output."""

    seq_ids: bytes            # int64

    def validate(self) -> None:
        unpack_i64(self.seq_ids, "Cancel.seq_ids")


@message(MsgType.REPLIES)
class Replies:
    """Detokenizer to ingest: text for requests routed back to it, and the end of every
    request (so ingest knows which ids are live). Row i: texts[i] is new text of seq_ids[i]
    (may be ""); num_tokens[i] tokens are generated so far; finish[i] is a Finish code
    (NONE: still running), never NEED_IDS."""

    seq_ids: bytes            # int64
    finish: bytes             # uint8
    num_tokens: bytes         # int32
    texts: list[str]
    cached_tokens: bytes = b""   # int32 per row: prompt tokens found cached (-1: not said), on a finish row
    # Logprobs as in Tokens, for the lp_counts[i] tokens of row i (ids in lp_token_ids)
    lp_width: int = -1
    lp_values: bytes = b""
    lp_top_ids: bytes = b""
    prompt_counts: bytes = b""
    prompt_width: int = -1
    prompt_values: bytes = b""
    prompt_top_ids: bytes = b""
    lp_counts: bytes = b""       # int32 per row
    lp_token_ids: bytes = b""    # int32

    def validate(self) -> None:
        n = len(unpack_i64(self.seq_ids, "Replies.seq_ids"))
        if self.lp_width >= 0:
            counts = unpack_i32(self.lp_counts, "Replies.lp_counts")
            if len(counts) != n or (n and counts.min() < 0) or int(counts.sum()) != len(self.lp_token_ids) // 4:
                raise ProtocolError("Replies.lp_counts: one count (>= 0) per row, adding up to lp_token_ids")
            unpack_i32(self.lp_token_ids, "Replies.lp_token_ids")
        check_logprobs(self, len(self.lp_token_ids) // 4, n, "Replies")
        if self.cached_tokens and len(self.cached_tokens) != 4 * n:
            raise ProtocolError("Replies.cached_tokens: one count per row")
        finish, counts = unpack_u8(self.finish, "Replies.finish"), unpack_i32(self.num_tokens, "Replies.num_tokens")
        if not n == len(finish) == len(counts) == len(self.texts):
            raise ProtocolError("Replies: arrays differ in length")
        if n and (counts.min() < 0 or any(int(f) not in _REPLY_CODES for f in finish)):
            raise ProtocolError("Replies: negative count or unknown finish code")
        if sum(len(t) for t in self.texts) > MAX_REPLY_TEXT * max(1, n):
            raise ProtocolError("Replies: text too long")



@message(MsgType.RESYNC)
class Resync:
    """Detokenizer to router, when it starts: send me every request not yet printed to its end
    (metas, tokens so far, errors, the input's end); what was printed already is skipped."""

    pid: int = 0


@message(MsgType.PRINTED)
class Printed:
    """Detokenizer to router: these sequences are printed to their end (and journaled), so
    the router may forget them."""

    seq_ids: bytes            # int64


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


def check_logprobs(msg, num_tokens: int, num_rows: int, name: str) -> None:
    """The logprob arrays of a Tokens or Replies: widths in [-1, MAX_LOGPROBS], and each array
    of the size its width and the tokens (or prompt positions) say."""
    for width, values, ids, extra, num, what in (
            (msg.lp_width, msg.lp_values, msg.lp_top_ids, 1, num_tokens, "lp"),
            (msg.prompt_width, msg.prompt_values, msg.prompt_top_ids, 2, None, "prompt")):
        if not -1 <= width <= MAX_LOGPROBS:
            raise ProtocolError(f"{name}.{what}_width: -1 to {MAX_LOGPROBS}")
        if width < 0:
            if values or ids or (what == "prompt" and msg.prompt_counts):
                raise ProtocolError(f"{name}: {what} logprob arrays without a width")
            continue
        if num is None:
            counts = unpack_i32(msg.prompt_counts, f"{name}.prompt_counts")
            if len(counts) != num_rows or (num_rows and counts.min() < 0):
                raise ProtocolError(f"{name}.prompt_counts: one count (>= 0) per row")
            num = int(counts.sum())
        unpack_f32(values, f"{name}.{what}_values")
        unpack_i32(ids, f"{name}.{what}_top_ids")
        if len(values) != 4 * num * (extra + width) or len(ids) != 4 * num * width:
            raise ProtocolError(f"{name}: {what} logprob arrays of the wrong size")


def _rows_agree(name: str, seq_ids: bytes, counts: bytes, codes: bytes, tokens: bytes, *more: bytes) -> None:
    """Row arrays of one length; counts (already checked non-negative) add up to the tokens."""
    n = len(seq_ids) // 8
    if not (n == len(counts) // 4 == len(codes) and all(len(m) // 4 == n for m in more)):
        raise ProtocolError(f"{name}: row arrays differ in length")
    if int(unpack_i32(counts, f"{name}.counts").sum()) != len(tokens) // 4:
        raise ProtocolError(f"{name}: counts do not add up to the tokens")

