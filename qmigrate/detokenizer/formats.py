"""The detokenizer's two output formats over `Sink` (sinks.py), and `make_sink` to choose one.

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
from collections.abc import Callable

from qmigrate.detokenizer.sinks import Reply, Sink, SinkSeq
from qmigrate.wire import protocol as P


class JsonlSink(Sink):
    """One JSON object per line: deltas, a final record per request, error records."""

    def _put(self, record: dict) -> None:
        self._write(json.dumps(record, ensure_ascii=False) + "\n")

    def _on_delta(self, seq: SinkSeq, delta: str) -> None:
        self._put({"id": seq.req_id, "delta": delta, "done": False})

    def _on_finish(self, seq: SinkSeq) -> None:
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
    [[id, logprob], ...]} (a prompt position's has its rank and no token id), each value as
    the HTTP API writes it (wire/packed.py's logprob_value: minus infinity as -9999.0)."""
    extra = 1 if token_id is not None else 2
    out = {"token_id": token_id} if token_id is not None else {}
    out["logprob"] = P.logprob_value(values[0])
    if extra == 2:
        out["rank"] = int(values[1])
    out["top_logprobs"] = [[int(t), P.logprob_value(v)] for t, v in zip(top_ids.tolist(), values[extra:].tolist())
                           if t >= 0]
    return out


class TextSink(Sink):
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

    def _on_delta(self, seq: SinkSeq, delta: str) -> None:
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

    def _on_finish(self, seq: SinkSeq) -> None:
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
              whole_lines: bool = False) -> Sink:
    """The sink for `--output text|jsonl`; `reply` takes the requests routed elsewhere;
    `whole_lines`: text output not cut for a terminal (see TextSink)."""
    if mode == "jsonl":
        return JsonlSink(tokenizer, write, clock, reply)
    if mode == "text":
        return TextSink(tokenizer, write, clock, reply=reply, whole_lines=whole_lines)
    raise ValueError(f"unknown output mode {mode!r}; expected 'text' or 'jsonl'")
