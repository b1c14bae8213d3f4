"""How the rows of a request's text become its HTTP answer: the rows that wait (those that
arrived together leave together, up to a finish or a shutdown), a whole reply, an SSE stream,
and both for a request of several choices. Run on the HTTP server's loop (ingest/http.py),
which pushes each row to the request's `Updates`; its watchdog fails a wait that lasts
past `http_timeout_s`."""

from __future__ import annotations

import time

from aiohttp import web

from qmigrate.ingest.logprobs_api import ChoiceExtras
from qmigrate.ingest.openai_api import ApiError
from qmigrate.ingest.openai_replies import Choices, StopTrimmer, chunk, reply, tool_chunk, usage_chunk
from qmigrate.ingest.streams import DONE, MARK, SHUTDOWN, SSE_HEADERS, Frame, LogprobsFrame, Updates, sse
from qmigrate.ingest.tools import CallStream, delta_calls
from qmigrate.wire import protocol as P


async def next_row(loop, updates: Updates) -> tuple:
    if not updates.rows:
        updates.since = loop.time()
        updates.waiter = loop.create_future()
        try:
            await updates.waiter  # woken by a row, or failed by the watchdog
        finally:
            updates.waiter = None
    row = updates.rows.popleft()
    if row is SHUTDOWN:
        raise ApiError(503, "the server is shutting down; retry on another server or later",
                       type="server_error", code="shutdown")
    return row


async def next_all(loop, updates: Updates, extra=None) -> tuple[str, int, int, int]:
    """(text, finish code, tokens so far, cached) of every row waiting (at least one): what
    arrived together leaves together, in one event. Stops at a finish, which ends the stream.
    `extra` (logprobs_api.ChoiceExtras) takes the rows' logprobs."""
    row = await next_row(loop, updates)
    rows, text = updates.rows, row[1]
    if extra is not None:
        extra.push_row(row)
    if rows and not row[2]:
        parts = [text]
        while rows and not row[2] and rows[0] is not SHUTDOWN:  # a shutdown ends the stream next call
            row = rows.popleft()
            parts.append(row[1])
            if extra is not None:
                extra.push_row(row)
        text = "".join(parts)
    return text, row[2], row[3], row[4] if len(row) > 4 else -1


async def next_rows(loop, updates: Updates) -> list[tuple]:
    """Every row waiting (at least one), up to a shutdown, which the next call raises."""
    out = [await next_row(loop, updates)]
    rows = updates.rows
    while rows and rows[0] is not SHUTDOWN:
        out.append(rows.popleft())
    return out


async def collect(loop, req, rid: str, updates: Updates, token_text):
    trim, parts, created = StopTrimmer(req.stop), [], int(time.time())
    extra = ChoiceExtras(req, 0, token_text) if req.has_extras else None
    while True:
        text, code, num_tokens, cached = await next_all(loop, updates, extra)
        parts.append(trim.push(text))
        if code:
            break
    reason = P.Finish(code).openai_reason
    if reason is None:
        raise ApiError(500, "the worker could not run this request", type="server_error")
    parts.append(trim.finish(code == P.Finish.STOP))
    return web.json_response(reply(req, rid, created, [("".join(parts), reason, num_tokens, cached)],
                                   [extra] if extra is not None else None))


async def stream(loop, request, req, rid: str, updates: Updates, token_text):
    """SSE; returns (response, whether the request ended)."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    trim, created, first, shown = StopTrimmer(req.stop), int(time.time()), True, 0
    frame, lp_frame = Frame(chunk(req, rid, created, MARK)), None
    extra = ChoiceExtras(req, 0, token_text) if req.has_extras else None
    held = CallStream(req.tools) if req.tools is not None and req.tools.calls_expected else None
    calls = []
    try:
        while True:
            try:
                text, code, num_tokens, cached = await next_all(loop, updates, extra)
            except ApiError as exc:
                await response.write(sse(exc.body()) + DONE)
                return response, False
            out = trim.push(text)
            if code:
                reason = P.Finish(code).openai_reason
                if reason is None:
                    await response.write(sse(ApiError(500, "the worker could not run this request",
                                                       type="server_error").body()) + DONE)
                    return response, True
                out += trim.finish(code == P.Finish.STOP)
            if held is not None:   # tool calls are held back, and sent whole at the end
                out = held.push(out)
                if code:
                    rest, calls = held.finish()
                    out += rest
                    reason = "tool_calls" if calls and reason == "stop" else reason
            # An event for every step that made tokens, its text empty where they complete
            # no character yet (or may begin a stop string), as vLLM's streams have: a
            # client times each token, not each character. Ids asked for leave before the end.
            if out or (first and req.kind == "chat") or (num_tokens > shown and not code) \
                    or (extra is not None and extra.ids_due):
                if not (first or req.continuous_usage) and extra is not None \
                        and (lps := extra.fresh_json()) is not None:
                    if lp_frame is None:
                        lp_frame = LogprobsFrame(chunk(req, rid, created, MARK))
                    await response.write(lp_frame(out, lps))
                elif first or req.continuous_usage or extra is not None:
                    await response.write(sse(chunk(req, rid, created, out, first=first, num_tokens=num_tokens,
                                                   extra=extra)))
                else:
                    await response.write(frame(out))
                first = False
            shown = num_tokens
            if code:
                tail = b"".join(sse(tool_chunk(req, rid, created, d)) for d in delta_calls(calls))
                tail += sse(chunk(req, rid, created, None, reason, num_tokens=num_tokens))
                if req.include_usage:
                    tail += sse(usage_chunk(req, rid, created, [(num_tokens, cached)]))
                await response.write(tail + DONE)
                await response.write_eof()
                return response, True
    except ConnectionResetError:  # the client went away mid-stream
        return response, False

# --- requests of several choices --------------------------------------------------------
async def collect_choices(loop, req, rid: str, updates: Updates, live: dict[int, int], token_text):
    """The whole answer of every choice; `live` loses each choice as it ends."""
    choices, created = Choices(req, live, token_text), int(time.time())
    parts: list[list[str]] = [[] for _ in choices.ends]
    while live:
        texts, _ = choices.take(await next_rows(loop, updates))
        for i, text in texts.items():
            parts[i].append(text)
    outcomes = [("".join(p), *end) for p, end in zip(parts, choices.ends)]
    return web.json_response(reply(req, rid, created, outcomes, choices.extras))


async def stream_choices(loop, request, req, rid: str, updates: Updates, live: dict[int, int],
                         token_text):
    """SSE of every choice, interleaved as their text comes, each chunk naming its choice's
    index and each choice ending with its own finish chunk; one usage chunk (if asked for)
    and one `[DONE]` after all. `live` loses each choice as it ends."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    choices, created = Choices(req, live, token_text), int(time.time())
    extras = choices.extras or [None] * len(live)
    frames = [Frame(chunk(req, rid, created, MARK, index=i)) for i in range(len(choices.ends))]
    try:
        if req.kind == "chat":  # each choice opens with the assistant's role, as vLLM's do
            await response.write(b"".join(sse(_opening(req, rid, created, i, extras[i])) for i in range(len(frames))))
        while live:
            try:
                texts, ended = choices.take(await next_rows(loop, updates))
            except ApiError as exc:  # timeout, shutdown, or a choice a worker could not run
                await response.write(sse(exc.body()) + DONE)
                return response
            if req.continuous_usage or choices.extras:   # (ids asked for leave before a choice's end)
                out = [sse(chunk(req, rid, created, text, index=i, num_tokens=choices.num_tokens[i],
                                 extra=extras[i]))
                       for i, text in texts.items()
                       if text or i not in ended or (req.return_token_ids and extras[i].ids_due)]
            else:
                out = [frames[i](text) for i, text in texts.items() if text or i not in ended]
            out += [sse(chunk(req, rid, created, None, choices.ends[i][0], index=i,
                              num_tokens=choices.num_tokens[i])) for i in ended]
            if out:
                await response.write(b"".join(out))
        tail = sse(usage_chunk(req, rid, created, choices.counts())) if req.include_usage else b""
        await response.write(tail + DONE)
        await response.write_eof()
        return response
    except ConnectionResetError:  # the client went away mid-stream: its choices are cancelled
        return response


def _opening(req, rid: str, created: int, index: int, extra) -> dict:
    """A chat stream's first event of a choice: the assistant's role (and the prompt's ids)."""
    out = chunk(req, rid, created, "", first=True, index=index)
    if req.return_token_ids:
        out["prompt_token_ids"] = extra.take_prompt_ids()
    return out
