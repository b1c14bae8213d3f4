"""The messages that carry sequences: a sequence's full form (`SeqSpec`), ingest's Submits,
the router's leases and a worker's results, tokens to the detokenizer and its replies to
ingest, cancels, and KV shipments between workers."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qmigrate.wire.finish import REPLY_CODES, step_codes_ok
from qmigrate.wire.limits import (
    INGEST_ROUTES, MAX_BIAS, MAX_ID, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_NOTE, MAX_REPLY_TEXT, MAX_REQ_ID,
    MAX_STOP_LEN, MAX_STOP_SEQS, ROUTE_STDOUT, SUBMIT_MAX_IDS, SUBMIT_MAX_SEQS, TIER_STATS,
)
from qmigrate.wire.packed import ProtocolError, unpack_f32, unpack_i32, unpack_i64, unpack_ids, unpack_u8
from qmigrate.wire.registry import MsgType, field_table, message


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


SeqSpec._fields = field_table(SeqSpec)


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
        rows_agree("StepResult", self.seq_ids, self.counts, self.status, self.tokens)
        status = unpack_u8(self.status, "StepResult.status")
        if not step_codes_ok(status):
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
        rows_agree("Tokens", self.seq_ids, self.counts, self.finish, self.tokens, self.start)
        check_logprobs(self, len(self.tokens) // 4, len(self.seq_ids) // 8, "Tokens")
        finish = unpack_u8(self.finish, "Tokens.finish")
        if not step_codes_ok(finish):
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
    incarnation: int = 0       # the router's (Stats.incarnation)


@message(MsgType.REQUEST_META)
class RequestMeta:
    seq_id: int
    req_id: str
    prompt_ids: bytes         # int32, for priming the incremental decoder
    # where the text goes: stdout, or back to the ingest node (HTTP), there with its ids or not
    route: int = ROUTE_STDOUT
    note: str = ""            # for the final record, e.g. that max_new_tokens was clamped

    def validate(self) -> None:
        if self.route != ROUTE_STDOUT and self.route not in INGEST_ROUTES:
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
    # The ids of rows whose request asked for them (RequestMeta.route ROUTE_INGEST_IDS):
    # id_counts[i] of token_ids for row i, the tokens its text was made of (empty: no row's)
    id_counts: bytes = b""       # int32 per row
    token_ids: bytes = b""       # int32

    def validate(self) -> None:
        n = len(unpack_i64(self.seq_ids, "Replies.seq_ids"))
        if self.id_counts or self.token_ids:
            counts = unpack_i32(self.id_counts, "Replies.id_counts")
            if len(counts) != n or (n and counts.min() < 0) or int(counts.sum()) != len(self.token_ids) // 4:
                raise ProtocolError("Replies.id_counts: one count (>= 0) per row, adding up to token_ids")
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
        if n and (counts.min() < 0 or any(int(f) not in REPLY_CODES for f in finish)):
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


def rows_agree(name: str, seq_ids: bytes, counts: bytes, codes: bytes, tokens: bytes, *more: bytes) -> None:
    """Row arrays of one length; counts (already checked non-negative) add up to the tokens."""
    n = len(seq_ids) // 8
    if not (n == len(counts) // 4 == len(codes) and all(len(m) // 4 == n for m in more)):
        raise ProtocolError(f"{name}: row arrays differ in length")
    if int(unpack_i32(counts, f"{name}.counts").sum()) != len(tokens) // 4:
        raise ProtocolError(f"{name}: counts do not add up to the tokens")

