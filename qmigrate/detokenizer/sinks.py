"""Output formatting for the detokenizer role (pure: no zmq).

`TextSink` and `JsonlSink` take the detokenizer's events (start, tokens, finish, error), turn
each request's tokens into text with an `IncrementalDecoder` (decoder.py), and hand finished
output strings to a writer callable; the role owns stdout.

JSONL output (`--output jsonl`), one object per line:
    {"id": "7", "delta": " Hello", "done": false}          each non-empty text delta
    {"id": "7", "text": " Hello world", "token_ids": [..], "finish_reason": "length", "done": true}
    {"id": "8", "error": "empty prompt", "done": true}      a request that failed
The deltas of a request joined together equal its final "text"; "token_ids" holds the
generated ids only.

Text output, readable with many requests streaming at once. Every line starts with the
request id in brackets, so lines of different requests can interleave:
    [7] Once upon a time there was a small model that told short
    [8] 東京は日本の首都です。
    [7] stories.
    [7] <done: length, 32 tokens>
    [9] error: prompt is 900 tokens; the model's context is 512
A request's text is buffered and printed as a chunk when it holds a newline (each newline
of the generated text starts a new line), when it passes `line_chars` characters (cut at
the next space, which is not printed; a word longer than `max_line_chars` is cut), when
`flush_idle` finds it older than `max_idle_s` (cut after the last whole word if there is
one), and at the end. An empty generated line prints as a bare `[7]`.
With `whole_lines` (stdout is a pipe or a file, not a terminal) nothing is cut for the eye:
a request's text is printed one whole generated line at a time, at its newlines and its end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from qmigrate.detokenizer.decoder import IncrementalDecoder
from qmigrate.wire.protocol import Finish

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


Reply = Callable[[int, str, int, int], None]  # (seq_id, new text, finish code or 0, tokens so far)


@dataclass(slots=True)
class _Seq:
    req_id: str | None
    seq_id: int = -1
    route: int = 0     # 0: this sink prints it; else its text goes to `reply`
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


class _Sink:
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
        self._seqs: dict[int, _Seq] = {}
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

    def _seq(self, seq_id: int) -> _Seq | None:
        seq = self._seqs.get(seq_id)
        if seq is None:
            if len(self._unstarted) >= MAX_UNSTARTED:  # the oldest never got its start: forget it
                oldest = next(iter(self._unstarted))
                del self._unstarted[oldest]
                self.num_dropped_tokens += len(self._seqs.pop(oldest).waiting)
            seq = self._seqs[seq_id] = _Seq(req_id=None)
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
            seq = self._seqs[seq_id] = _Seq(req_id=req_id)
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

    def _advance(self, seq_id: int, seq: _Seq) -> None:
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
            self._emit(seq, seq.decoder.push(ready), advanced=True, logprobs=lps)
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

    def _emit(self, seq: _Seq, delta: str, advanced: bool = False, logprobs=None) -> None:
        """New text of seq. A request answered elsewhere hears of every step that `advanced`
        its tokens, text or none (a token may complete no character yet): a stream sends an
        event per step, as vLLM's does, so its client sees every token's time. `logprobs`:
        the advanced tokens' (id, logprobs or None); a prompt's go with its first reply."""
        if seq.route:
            if delta or advanced:
                if logprobs is None and seq.prompt_lps is None:
                    self._reply(seq.seq_id, delta, 0, len(seq.token_ids))
                else:
                    prompt, seq.prompt_lps = seq.prompt_lps, None
                    self._reply(seq.seq_id, delta, 0, len(seq.token_ids), -1, logprobs, prompt)
        elif delta:
            seq.text.append(delta)
            self._on_delta(seq, delta)

    def _on_delta(self, seq: _Seq, delta: str) -> None:
        raise NotImplementedError

    def _on_finish(self, seq: _Seq) -> None:
        raise NotImplementedError

    def _on_error(self, req_id: str, message: str) -> None:
        raise NotImplementedError


class JsonlSink(_Sink):
    """One JSON object per line: deltas, a final record per request, error records."""

    def _put(self, record: dict) -> None:
        self._write(json.dumps(record, ensure_ascii=False) + "\n")

    def _on_delta(self, seq: _Seq, delta: str) -> None:
        self._put({"id": seq.req_id, "delta": delta, "done": False})

    def _on_finish(self, seq: _Seq) -> None:
        record = {
            "id": seq.req_id,
            "text": "".join(seq.text),
            "token_ids": seq.token_ids,
            "finish_reason": seq.finish_reason,
            "done": True,
        }
        if seq.note:
            record["note"] = seq.note
        if seq.cached_tokens >= 0:
            record["cached_tokens"] = seq.cached_tokens
        if seq.logprobs:
            record["logprobs"] = [None if ref is None else _logprob_record(t, ref[0][ref[2]], ref[1][ref[2]])
                                  for t, ref in seq.logprobs]
        if seq.prompt_lps is not None:
            record["prompt_logprobs"] = [None] + [_logprob_record(None, v, t) for v, t in zip(*seq.prompt_lps)]
        self._put(record)

    def _on_error(self, req_id: str, message: str) -> None:
        self._put({"id": req_id, "error": message, "done": True})


def _logprob_record(token_id, values, top_ids) -> dict:
    """A token's logprobs in a JSONL final record: {"token_id", "logprob", ["rank",] "top_logprobs":
    [[id, logprob], ...]} (a prompt position's has its rank and no token id)."""
    extra = 1 if token_id is not None else 2
    out = {"token_id": token_id} if token_id is not None else {}
    out["logprob"] = float(values[0])
    if extra == 2:
        out["rank"] = int(values[1])
    out["top_logprobs"] = [[int(t), float(v)] for t, v in zip(top_ids.tolist(), values[extra:].tolist()) if t >= 0]
    return out


class TextSink(_Sink):
    """Readable `[req_id] chunk` lines; the format is in the module docstring."""

    def __init__(self, tokenizer, write: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic,
                 line_chars: int = 60, max_line_chars: int = 120,
                 max_idle_s: float = 0.3, reply: Reply | None = None, whole_lines: bool = False) -> None:
        super().__init__(tokenizer, write, clock, reply)
        self.line_chars = line_chars
        self.max_line_chars = max_line_chars
        self.max_idle_s = max_idle_s
        self.whole_lines = whole_lines

    def _line(self, req_id: str | None, chunk: str) -> None:
        self._write(f"[{req_id}] {chunk}\n" if chunk else f"[{req_id}]\n")

    def _on_delta(self, seq: _Seq, delta: str) -> None:
        if not seq.pending:
            seq.pending_since = self._clock()
        seq.pending += delta
        *lines, seq.pending = seq.pending.split("\n")
        for line in lines:
            self._line(seq.req_id, line)
        while not self.whole_lines and len(seq.pending) > self.line_chars:
            # Break at the first space past line_chars; past max_line_chars, at the last
            # space before it, or mid-word when there is none.
            cut = seq.pending.find(" ", self.line_chars, self.max_line_chars + 1)
            if cut < 0 and len(seq.pending) > self.max_line_chars:
                cut = seq.pending.rfind(" ", 1, self.max_line_chars + 1)
                if cut < 0:
                    self._line(seq.req_id, seq.pending[: self.max_line_chars])
                    seq.pending = seq.pending[self.max_line_chars :]
                    continue
            if cut < 0:
                break
            self._line(seq.req_id, seq.pending[:cut])
            seq.pending = seq.pending[cut + 1 :]
        if lines or not seq.pending:
            seq.pending_since = self._clock()

    def is_idle_due(self, now: float) -> bool:
        return not self.whole_lines and any(seq.pending and now - seq.pending_since >= self.max_idle_s for seq in self._seqs.values())

    def flush_idle(self, now: float | None = None) -> None:
        if self.whole_lines:
            return
        now = self._clock() if now is None else now
        for seq in self._seqs.values():
            if not seq.pending or now - seq.pending_since < self.max_idle_s:
                continue
            # Keep a trailing partial word for the next line if there is a whole word to print.
            cut = seq.pending.rfind(" ", 1)
            if cut < 0:
                self._line(seq.req_id, seq.pending)
                seq.pending = ""
            else:
                self._line(seq.req_id, seq.pending[:cut])
                seq.pending = seq.pending[cut + 1 :]
            seq.pending_since = now

    def _on_finish(self, seq: _Seq) -> None:
        if seq.pending:
            self._line(seq.req_id, seq.pending)
            seq.pending = ""
        num = len(seq.token_ids)
        note = f"; {seq.note}" if seq.note else ""
        self._line(seq.req_id, f"<done: {seq.finish_reason}, {num} token{'s' * (num != 1)}{note}>")

    def _on_error(self, req_id: str, message: str) -> None:
        self._line(req_id, f"error: {message}")


def make_sink(mode: str, tokenizer, write: Callable[[str], None],
              clock: Callable[[], float] = time.monotonic, reply: Reply | None = None,
              whole_lines: bool = False) -> _Sink:
    """The sink for `--output text|jsonl`; `reply` takes the requests routed elsewhere;
    `whole_lines`: text output not cut for a terminal (see TextSink)."""
    if mode == "jsonl":
        return JsonlSink(tokenizer, write, clock, reply)
    if mode == "text":
        return TextSink(tokenizer, write, clock, reply=reply, whole_lines=whole_lines)
    raise ValueError(f"unknown output mode {mode!r}; expected 'text' or 'jsonl'")
