"""Output formatting for the detokenizer role (pure: no zmq).

`TextSink` and `JsonlSink` take the detokenizer's events (start, tokens, finish, error), turn
each request's tokens into text with an `IncrementalDecoder` (decoder.py), and hand finished
output strings to a writer callable; the role owns stdout. This module holds what both do
(`Sink`: each request's decoding, order, logprobs and end); formats.py holds how each writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from qmigrate.detokenizer.decoder import IncrementalDecoder
from qmigrate.wire.protocol import ROUTE_INGEST_IDS, Finish

MAX_OUT_OF_ORDER = 1 << 16
MAX_UNSTARTED = 256          # sequences with tokens but no start yet (normally none): the oldest go
MAX_DONE_KEPT = 1 << 17      # ended requests remembered, so one sent again prints nothing
MAX_UNSTARTED_TOKENS = 4096  # tokens held for each of them


class Recent:
    """A set that keeps only its `max_len` most recently added members (oldest leave first):
    what a long-lived role remembers of ended requests."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self._items: dict = {}

    def add(self, item) -> None:
        self._items[item] = None
        if len(self._items) > self.max_len:
            del self._items[next(iter(self._items))]

    def __contains__(self, item) -> bool:
        return item in self._items

    def __len__(self) -> int:
        return len(self._items)


# (seq_id, new text, finish code or 0, tokens so far[, cached, logprobs, prompt logprobs, token ids])
Reply = Callable[..., None]


@dataclass(slots=True)
class SinkSeq:
    req_id: str | None
    seq_id: int = -1
    route: int = 0     # 0: this sink prints it; else its text goes to `reply` (with its ids: ROUTE_INGEST_IDS)
    decoder: IncrementalDecoder | None = None
    token_ids: list[int] = field(default_factory=list)
    waiting: dict[int, int] = field(default_factory=dict)  # index -> id, after a gap
    text: list[str] = field(default_factory=list)
    pending: str = ""  # text mode: printable text not yet on a line
    pending_since: float = 0.0
    finish_reason: str | None = None
    num_tokens_expected: int | None = None
    note: str = ""
    cached_tokens: int = -1   # prompt positions found in a prefix cache where it first started (-1: none said)
    lp_waiting: dict = field(default_factory=dict)   # index -> logprobs of a waiting token (wire/packed.py)
    prompt_lps: tuple | None = None   # its prompt's logprobs (values, top ids), until they are sent on
    logprobs: list = field(default_factory=list)     # printed requests: each token's (id, logprobs)


class Sink:
    """Per-request bookkeeping shared by the text and JSONL formats.

    Token `i` of a sequence is printed once: indexes already seen are ignored, and ids after
    a missing index wait until the gap fills. Tokens may arrive before `start`; they wait
    for it. A finish that names `num_tokens` waits for tokens 0..num_tokens-1 and drops any
    past them.
    """

    def __init__(self, tokenizer, write: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, reply: Reply | None = None,
                 max_done: int = MAX_DONE_KEPT) -> None:
        self._tokenizer = tokenizer
        self._write = write
        self._clock = clock
        self._reply = reply
        self._seqs: dict[int, SinkSeq] = {}
        self._finished = Recent(max_done)
        self._errored = Recent(max_done)
        self._unstarted: dict[int, None] = {}  # seq ids with tokens and no start, oldest first
        self.newly_done: list[int] = []  # finished (or seen again after finishing) since taken
        self.num_done = 0         # requests this sink printed the end of
        self.num_replied = 0      # requests routed elsewhere that ended
        self.num_errors = 0
        self.num_failed = 0       # requests printed that did not run to an end: refused, or a worker's error
        self.num_dropped_tokens = 0

    @property
    def num_active(self) -> int:
        return len(self._seqs)

    @property
    def num_started(self) -> int:
        """Requests started and not yet finished."""
        return len(self._seqs) - len(self._unstarted)

    @property
    def sizes(self) -> dict[str, int]:
        """What this sink holds, per structure (bounded: see MAX_DONE_KEPT, MAX_UNSTARTED)."""
        return {"active": len(self._seqs), "finished": len(self._finished), "errored": len(self._errored),
                "unstarted": len(self._unstarted), "newly_done": len(self.newly_done)}

    def _seq(self, seq_id: int) -> SinkSeq | None:
        seq = self._seqs.get(seq_id)
        if seq is None:
            if len(self._unstarted) >= MAX_UNSTARTED:  # the oldest never got its start: forget it
                oldest = next(iter(self._unstarted))
                del self._unstarted[oldest]
                self.num_dropped_tokens += len(self._seqs.pop(oldest).waiting)
            seq = self._seqs[seq_id] = SinkSeq(req_id=None)
            self._unstarted[seq_id] = None
        return seq

    def is_done(self, seq_id: int) -> bool:
        return seq_id in self._finished

    def start(self, seq_id: int, req_id: str, prompt_ids: Sequence[int] | None = None,
              route: int = 0, note: str = "") -> None:
        """`route` other than 0: the request's text and end go to `reply`, not to the writer.
        `note` is said in the final record."""
        if seq_id in self._finished:
            self.newly_done.append(seq_id)
            return
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = SinkSeq(req_id=req_id)
        elif seq.decoder is not None:
            return
        else:
            del self._unstarted[seq_id]
        seq.req_id, seq.seq_id, seq.route, seq.note = req_id, seq_id, route, note
        seq.decoder = IncrementalDecoder(self._tokenizer, prompt_ids)
        self._advance(seq_id, seq)

    def cached(self, seq_id: int, num_tokens: int) -> None:
        """Where seq_id first started, num_tokens of its prompt were found cached."""
        seq = self._seqs.get(seq_id)
        if seq is not None and seq.cached_tokens < 0:
            seq.cached_tokens = num_tokens

    def prompt_logprobs(self, seq_id: int, entries: tuple) -> None:
        """The logprobs of seq_id's prompt (positions 1 on: values, top ids; engine/logprobs.py),
        sent on with its text."""
        if seq_id in self._finished:
            return
        seq = self._seq(seq_id)
        if seq.prompt_lps is None and not seq.token_ids:
            seq.prompt_lps = entries

    def tokens(self, seq_id: int, start_index: int, token_ids: Sequence[int], logprobs=None) -> None:
        """`logprobs`: each token's (a reference: wire/packed.py) or None, for a request that asked."""
        if seq_id in self._finished:
            self.num_dropped_tokens += len(token_ids)
            self.newly_done.append(seq_id)
            return
        seq = self._seq(seq_id)
        if seq is None:
            self.num_dropped_tokens += len(token_ids)
            return
        next_index = len(seq.token_ids)
        end_index = seq.num_tokens_expected
        limit = MAX_OUT_OF_ORDER if seq.decoder is not None else MAX_UNSTARTED_TOKENS
        for index, token_id in enumerate(token_ids, start_index):
            if index < next_index or index in seq.waiting:
                continue
            if end_index is not None and index >= end_index:
                self.num_dropped_tokens += 1
                continue
            if len(seq.waiting) >= limit or index - next_index >= MAX_OUT_OF_ORDER:
                self.num_dropped_tokens += 1
                continue
            seq.waiting[index] = int(token_id)
            if logprobs is not None and logprobs[index - start_index] is not None:
                seq.lp_waiting[index] = logprobs[index - start_index]
        self._advance(seq_id, seq)

    def finish(self, seq_id: int, finish_reason: str, num_tokens: int | None = None) -> None:
        if seq_id in self._finished:
            return
        seq = self._seq(seq_id)
        if seq is None:
            return
        seq.finish_reason = finish_reason
        seq.num_tokens_expected = num_tokens
        self._advance(seq_id, seq)

    def cancel(self, seq_id: int) -> None:
        """End a request now: its held-back text, then a "cancelled" end; later tokens are dropped."""
        seq = self._seqs.get(seq_id)
        if seq_id in self._finished or seq is None or seq.decoder is None:
            return
        seq.finish_reason, seq.num_tokens_expected = Finish.CANCELLED.reason, len(seq.token_ids)
        seq.waiting.clear()
        self._advance(seq_id, seq)

    def error(self, req_id: str, message: str, number: int = -1) -> None:
        """A request refused before it ran. `number` (>= 0) tells it from other errors under
        the same request id; it is confirmed in `newly_done` as a finished request is."""
        key = number if number >= 0 else req_id
        if number >= 0:
            self.newly_done.append(number)
        if key in self._errored:
            return  # sent again after a restart
        self._errored.add(key)
        self.num_done += 1
        self.num_errors += 1
        self.num_failed += 1
        self._on_error(req_id, message)

    def flush_idle(self, now: float | None = None) -> None:
        """Text mode prints buffered text older than max_idle_s; JSONL has nothing held."""

    def is_idle_due(self, now: float) -> bool:
        """Whether flush_idle(now) would print anything."""
        return False

    def _advance(self, seq_id: int, seq: SinkSeq) -> None:
        if seq.decoder is None:
            return
        ready = []
        index = len(seq.token_ids)
        end_index = seq.num_tokens_expected
        while index in seq.waiting and (end_index is None or index < end_index):
            ready.append(seq.waiting.pop(index))
            index += 1
        if ready:
            first = len(seq.token_ids)
            seq.token_ids.extend(ready)
            lps = None
            if seq.lp_waiting:
                lps = [(t, seq.lp_waiting.pop(i, None)) for i, t in enumerate(ready, first)]
                if not seq.route:
                    seq.logprobs += lps
            self._emit(seq, seq.decoder.push(ready), advanced=True, logprobs=lps,
                       ids=ready if seq.route == ROUTE_INGEST_IDS else None)
        if seq.finish_reason is None:
            return
        if seq.num_tokens_expected is not None and len(seq.token_ids) < seq.num_tokens_expected:
            return
        self._emit(seq, seq.decoder.finish())
        self.num_dropped_tokens += len(seq.waiting)
        del self._seqs[seq_id]
        self._finished.add(seq_id)
        self.newly_done.append(seq_id)
        if seq.route:
            self.num_replied += 1
        else:
            self.num_done += 1
            self.num_failed += Finish.from_reason(seq.finish_reason) is Finish.ERROR
            self._on_finish(seq)
        if self._reply is not None:  # for a printed request: "it ended", so its id is free again
            self._reply(seq_id, "", Finish.from_reason(seq.finish_reason), len(seq.token_ids), seq.cached_tokens)

    def _emit(self, seq: SinkSeq, delta: str, advanced: bool = False, logprobs=None, ids=None) -> None:
        """New text of seq. A request answered elsewhere hears of every step that `advanced`
        its tokens, text or none (a token may complete no character yet): a stream sends an
        event per step, as vLLM's does, so its client sees every token's time. `logprobs`:
        the advanced tokens' (id, logprobs or None); a prompt's go with its first reply.
        `ids`: the advanced tokens' ids, for a request that asked for them."""
        if seq.route:
            if delta or advanced:
                if logprobs is None and seq.prompt_lps is None and ids is None:
                    self._reply(seq.seq_id, delta, 0, len(seq.token_ids))
                else:
                    prompt, seq.prompt_lps = seq.prompt_lps, None
                    self._reply(seq.seq_id, delta, 0, len(seq.token_ids), -1, logprobs, prompt, ids)
        elif delta:
            seq.text.append(delta)
            self._on_delta(seq, delta)

    def _on_delta(self, seq: SinkSeq, delta: str) -> None:
        raise NotImplementedError

    def _on_finish(self, seq: SinkSeq) -> None:
        raise NotImplementedError

    def _on_error(self, req_id: str, message: str) -> None:
        raise NotImplementedError
