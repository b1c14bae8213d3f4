"""What an HTTP request's answer is made of, apart from the server that writes it: the rows the
detokenizer sends for it as they wait for its handler (`Updates`), and the server-sent events
they become (`sse`, `Frame`, `DONE`)."""

from __future__ import annotations

import asyncio
import json
from collections import deque

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SHUTDOWN = (0, "", 0, 0, -1)  # put on every open request's updates when the server stops
MARK = "\ue000text\ue000"  # where the text goes in a frame's template; private-use characters


class Frame:
    """The SSE event of a stream's middle chunks as two fixed halves around the JSON string of
    the text, so that each chunk costs one json.dumps of a short string, not of a whole dict."""

    def __init__(self, obj: dict):
        head, _, tail = sse(obj).partition(json.dumps(MARK, ensure_ascii=False).encode())
        self.head, self.tail = head, tail

    def __call__(self, text: str) -> bytes:
        return self.head + json.dumps(text, ensure_ascii=False).encode() + self.tail


LOGPROBS_MARK = "\ue000logprobs\ue000"   # where a frame's logprobs go (LogprobsFrame)


class LogprobsFrame:
    """A middle chunk's SSE event with logprobs: fixed parts around the JSON string of the text
    and the logprobs' JSON text (logprobs_api.ChoiceExtras.fresh_json)."""

    def __init__(self, obj: dict):
        """`obj`: a chunk of one choice with MARK as its text (its logprobs are set here)."""
        obj["choices"][0]["logprobs"] = LOGPROBS_MARK
        head, _, rest = sse(obj).partition(json.dumps(MARK, ensure_ascii=False).encode())
        mid, found, tail = rest.partition(json.dumps(LOGPROBS_MARK, ensure_ascii=False).encode())
        if not found:
            raise ValueError("the frame's logprobs come before its text")
        self.head, self.mid, self.tail = head, mid, tail

    def __call__(self, text: str, logprobs: str) -> bytes:
        return self.head + json.dumps(text, ensure_ascii=False).encode() + self.mid + logprobs.encode() + self.tail


class Updates:
    """One request's rows from the detokenizer, (seq_id, text, finish code, tokens so far[,
    prompt tokens found cached]), in order, and the future its handler waits on while there
    are none (`since`: when that wait began)."""

    __slots__ = ("rows", "waiter", "since", "admitted")

    def __init__(self) -> None:
        self.rows: deque = deque()
        self.waiter: asyncio.Future | None = None
        self.since = 0.0
        self.admitted: asyncio.Future | None = None  # with admission: whether ingest took it

    def push(self, row) -> None:
        self.rows.append(row)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)
